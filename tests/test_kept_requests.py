"""Requests given back to wait again (preempted, or not admitted this step) keep their tokens and
block hashes in the core, over the real core and scheduler: they come back without hashing
again, and a kept request that is aborted or fails is forgotten."""

from __future__ import annotations

from hybrid_cache._core import GroupSpec
from hybrid_cache.engine.kv_cache import KVCacheManager
from hybrid_cache.engine.request import Request
from hybrid_cache.engine.sampling_params import SamplingParams
from hybrid_cache.engine.scheduler import Scheduler

BLOCK = 4


def make_kv(num_blocks: int) -> KVCacheManager:
    return KVCacheManager(
        num_blocks,
        [GroupSpec("full", BLOCK), GroupSpec("sliding_window", BLOCK, window=8)],
        max_num_seqs=4,
        max_model_len=64,
        max_num_batched_tokens=64,
    )


def make_request(request_id: str, prompt: list[int], max_tokens: int) -> Request:
    return Request(
        request_id=request_id,
        prompt_token_ids=prompt,
        sampling_params=SamplingParams(max_tokens=max_tokens, temperature=0.0),
        arrival_index=int(request_id),
        max_total_tokens=len(prompt) + max_tokens,
        eos_token_ids=(),
    )


def step(scheduler: Scheduler) -> None:
    output = scheduler.schedule()
    sampled = [7 for item in output.scheduled if item.samples]
    scheduler.update_from_output(output, sampled)


def test_a_re_added_request_reuses_its_hashes_and_every_kept_one_is_let_go():
    kv = make_kv(num_blocks=13)
    request = make_request("0", list(range(1, 17)), max_tokens=3)
    assert kv.add(request) >= 0
    assert kv.find_cache_hit(request) == 0
    assert kv.allocate(request, 0, 16)
    hashed = kv.stats()["hashed_blocks"]
    assert hashed >= 4
    kv.free(request, keep=True)
    assert kv.stats()["parked_requests"] == 1
    assert kv.num_free_blocks == kv.num_blocks - 1, "its blocks came back"

    kv.add(request)
    assert kv.stats()["parked_requests"] == 0
    assert kv.find_cache_hit(request) == 12
    assert kv.stats()["hashed_blocks"] == hashed, "nothing hashed again"
    kv.free(request)

    # Added anew (no keep): hashed again.
    kv.add(request)
    kv.find_cache_hit(request)
    assert kv.stats()["hashed_blocks"] >= hashed + 4
    kv.free(request, keep=True)
    kv.forget(request)
    assert kv.stats()["parked_requests"] == 0


def crowded() -> tuple[KVCacheManager, Scheduler, list[Request]]:
    """Full + window groups over 24 usable blocks: four 12-token prompts growing to 24 tokens
    cannot all run at once, so the scheduler preempts and re-admits."""
    kv = make_kv(num_blocks=25)
    scheduler = Scheduler(kv, max_num_seqs=4, max_num_batched_tokens=64)
    requests = [make_request(str(i), list(range(10 * i, 10 * i + 12)), 12) for i in range(4)]
    for request in requests:
        scheduler.add_request(request)
    return kv, scheduler, requests


def test_preemptions_under_a_small_pool_finish_every_request_and_keep_nothing():
    kv, scheduler, requests = crowded()
    for _ in range(200):
        if not scheduler.has_unfinished_requests():
            break
        step(scheduler)
    assert not scheduler.has_unfinished_requests()
    assert scheduler.num_preemptions > 0
    assert all(len(request.output_token_ids) == 12 for request in requests)
    assert kv.stats()["parked_requests"] == 0 and not kv.parked
    assert kv.num_free_blocks == kv.num_blocks - 1


def test_an_aborted_waiting_request_is_forgotten():
    kv, scheduler, _ = crowded()
    for _ in range(200):
        step(scheduler)
        if kv.parked:
            break
    assert kv.parked, "a request was given back to wait"
    for request_id in list(kv.parked):
        assert scheduler.abort_request(request_id) is not None
    assert kv.stats()["parked_requests"] == 0 and not kv.parked
