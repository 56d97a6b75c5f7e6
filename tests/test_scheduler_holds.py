"""Waiting requests hold their prefix-cache hit (`hold_waiting_prefixes`), over the real core.

One full-attention group of 4-token blocks, 8 usable blocks. A finished request P leaves 3
cached blocks; then B1 and B2 (no hit, 4 blocks each) and C (P's prompt and 4 more tokens)
arrive together. First come first served admits B1 (4 never-used blocks), then B2 needs 4 of
the 4 free blocks: without holds it evicts P's cached blocks and C misses; with holds C took
them on arrival, so B2 waits for B1's blocks and C hits all of P's 12 tokens.
"""

from __future__ import annotations

import pytest
from hybrid_cache._core import GroupSpec
from hybrid_cache.engine.kv_cache import KVCacheManager
from hybrid_cache.engine.request import FinishReason, Request, RequestStatus
from hybrid_cache.engine.sampling_params import SamplingParams
from hybrid_cache.engine.scheduler import Scheduler

BLOCK = 4


def make_kv(num_blocks: int = 9, max_num_seqs: int = 4) -> KVCacheManager:
    return KVCacheManager(
        num_blocks,
        [GroupSpec("full", BLOCK)],
        max_num_seqs=max_num_seqs,
        max_model_len=64,
        max_num_batched_tokens=64,
    )


def make_request(request_id: str, prompt: list[int], max_tokens: int = 1) -> Request:
    return Request(
        request_id=request_id,
        prompt_token_ids=prompt,
        sampling_params=SamplingParams(max_tokens=max_tokens, temperature=0.0),
        arrival_index=int(request_id[1:] or 0),
        max_total_tokens=len(prompt) + max_tokens,
        eos_token_ids=(),
    )


def step(scheduler: Scheduler) -> list[str]:
    """One step with token 1 sampled for every request that samples; the admitted ids."""
    output = scheduler.schedule()
    sampled = [1 for item in output.scheduled if item.samples]
    scheduler.update_from_output(output, sampled)
    return [item.request.request_id for item in output.scheduled]


def drain(scheduler: Scheduler) -> None:
    for _ in range(100):
        if not scheduler.has_unfinished_requests():
            return
        step(scheduler)
    raise AssertionError("the scheduler did not finish its requests")


P_PROMPT = list(range(10, 22))  # 12 tokens: 3 full blocks once computed


def run_wave(hold: bool) -> tuple[Request, KVCacheManager, Scheduler]:
    kv = make_kv()
    scheduler = Scheduler(kv, max_num_seqs=4, max_num_batched_tokens=64, hold_waiting_prefixes=hold)
    scheduler.add_request(make_request("P0", P_PROMPT))
    drain(scheduler)
    b1 = make_request("B1", list(range(30, 46)))
    b2 = make_request("B2", list(range(50, 66)))
    c = make_request("C3", P_PROMPT + [1, 2, 3, 4])
    for request in (b1, b2, c):
        scheduler.add_request(request)
    assert (c.request_id in scheduler.held) == hold
    drain(scheduler)
    return c, kv, scheduler


@pytest.mark.parametrize("hold", [True, False])
def test_a_held_prefix_survives_the_admissions_before_it(hold):
    c, kv, scheduler = run_wave(hold)
    assert c.finish_reason is FinishReason.LENGTH
    assert c.num_cached_tokens == (12 if hold else 0)
    assert not scheduler.held
    assert kv.num_free_blocks == kv.num_blocks - 1, "every block comes back"


def test_holds_go_before_any_preemption():
    # R runs and grows; W arrives while R runs and holds P's 3 blocks, the last free ones.
    # When R's next token needs a block, W's hold is released (W keeps waiting) and nobody is
    # preempted.
    kv = make_kv(num_blocks=9)
    scheduler = Scheduler(kv, max_num_seqs=4, max_num_batched_tokens=64)
    scheduler.add_request(make_request("P0", P_PROMPT))
    drain(scheduler)
    running = make_request("R1", list(range(30, 50)), max_tokens=8)  # 20 + 8 tokens: 7 blocks
    scheduler.add_request(running)
    assert step(scheduler) == ["R1"]  # 5 never-used blocks; P's 3 cached blocks stay free
    waiting = make_request("W2", P_PROMPT + [7])
    scheduler.add_request(waiting)
    assert scheduler.held == {"W2": 12} and kv.num_free_blocks == 0
    assert step(scheduler) == ["R1"]  # token 21 needs a 6th block
    assert scheduler.num_preemptions == 0, "a hold is released before anyone is preempted"
    assert not scheduler.held and waiting.status is RequestStatus.WAITING
    drain(scheduler)
    assert scheduler.num_preemptions == 0
    assert running.finish_reason is FinishReason.LENGTH
    assert waiting.finish_reason is FinishReason.LENGTH
    assert kv.num_free_blocks == kv.num_blocks - 1


def test_a_head_that_needs_the_held_blocks_gets_them_when_nothing_runs():
    # Nothing runs and the head needs every block: the hold behind it is released (no
    # deadlock), the head runs, then the released request is looked up again.
    kv = make_kv(num_blocks=9)
    scheduler = Scheduler(kv, max_num_seqs=4, max_num_batched_tokens=64)
    scheduler.add_request(make_request("P0", P_PROMPT))
    drain(scheduler)
    big = make_request("B1", list(range(30, 61)))  # 31 tokens of KV: all 8 blocks
    held = make_request("C2", P_PROMPT + [5])
    scheduler.add_request(big)
    scheduler.add_request(held)
    assert scheduler.held == {"C2": 12}
    assert step(scheduler) == ["B1"]
    assert not scheduler.held
    drain(scheduler)
    assert big.finish_reason is FinishReason.LENGTH
    assert held.finish_reason is FinishReason.LENGTH
    assert kv.num_free_blocks == kv.num_blocks - 1


def test_aborting_a_held_request_returns_its_blocks():
    kv = make_kv()
    scheduler = Scheduler(kv, max_num_seqs=4, max_num_batched_tokens=64)
    scheduler.add_request(make_request("P0", P_PROMPT))
    drain(scheduler)
    held = make_request("C1", P_PROMPT + [5])
    scheduler.add_request(held)
    assert kv.num_free_blocks == kv.num_blocks - 1 - 3
    assert scheduler.abort_request("C1") is held
    assert held.finish_reason is FinishReason.ABORT and not scheduler.held
    assert kv.num_free_blocks == kv.num_blocks - 1


def test_a_new_request_without_a_hit_holds_nothing():
    kv = make_kv()
    scheduler = Scheduler(kv, max_num_seqs=4, max_num_batched_tokens=64)
    scheduler.add_request(make_request("X1", list(range(30, 40))))
    assert not scheduler.held and kv.num_free_blocks == kv.num_blocks - 1


def test_a_held_request_starts_while_the_one_before_it_waits_for_blocks():
    # R runs; B (no hit, 3 blocks) is next in line but only 1 block is free; C behind it holds
    # P's 3 blocks and needs 1 more for its last token: C starts, B keeps its place.
    kv = make_kv(num_blocks=9)
    scheduler = Scheduler(kv, max_num_seqs=4, max_num_batched_tokens=64)
    scheduler.add_request(make_request("P0", P_PROMPT))
    drain(scheduler)
    running = make_request("R1", list(range(30, 44)), max_tokens=2)  # 14 + 2 tokens: 4 blocks
    scheduler.add_request(running)
    assert step(scheduler) == ["R1"]
    blocked = make_request("B2", list(range(50, 62)))  # 12 tokens: 3 blocks
    held = make_request("C3", P_PROMPT + [5])  # P's 12 tokens held, 1 block for the 13th
    scheduler.add_request(blocked)
    scheduler.add_request(held)
    assert scheduler.held == {"C3": 12} and kv.num_free_blocks == 1
    assert step(scheduler) == ["R1", "C3"]
    assert scheduler.head_blocked and list(scheduler.waiting) == [blocked]
    drain(scheduler)
    assert held.num_cached_tokens == 12
    assert blocked.finish_reason is FinishReason.LENGTH
    assert kv.num_free_blocks == kv.num_blocks - 1


@pytest.mark.parametrize("policy", ["fcfs", "lpm"])
def test_under_lpm_newer_running_requests_give_way_before_a_hold(policy):
    # R1 (5 blocks) and R2 (1 block) run; W arrives and holds P's 3 cached blocks, the last
    # free ones. When R1's next token needs a block, "fcfs" releases W's hold (nobody is
    # preempted, and R1's block evicts part of P's prefix); "lpm" preempts R2, the newest
    # running request, keeps the hold, and W hits all of P's 12 tokens.
    kv = make_kv(num_blocks=10)
    scheduler = Scheduler(kv, max_num_seqs=4, max_num_batched_tokens=64, policy=policy)
    scheduler.add_request(make_request("P0", P_PROMPT))
    drain(scheduler)
    first = make_request("R1", list(range(30, 50)), max_tokens=4)  # 5 blocks, then a 6th
    second = make_request("R2", list(range(60, 64)), max_tokens=8)  # 4 tokens: 1 block
    scheduler.add_request(first)
    scheduler.add_request(second)
    assert step(scheduler) == ["R1", "R2"]
    waiting = make_request("W3", P_PROMPT + [7])
    scheduler.add_request(waiting)
    assert scheduler.held == {"W3": 12} and kv.num_free_blocks == 0
    scheduled = step(scheduler)  # each one's next token needs a new block
    if policy == "lpm":
        assert scheduled == ["R1"] and scheduler.num_preemptions == 1
        assert scheduler.held == {"W3": 12} and second.status is RequestStatus.PREEMPTED
    else:
        assert scheduled[0] == "R1" and scheduler.num_preemptions == 0
        assert not scheduler.held
    drain(scheduler)
    for request in (first, second, waiting):
        assert request.finish_reason is FinishReason.LENGTH
    assert (waiting.num_cached_tokens == 12) == (policy == "lpm")
    assert kv.num_free_blocks == kv.num_blocks - 1, "every block comes back"


def test_lpm_weighs_a_held_request_by_its_hold():
    # P0 computes 10 tokens and leaves a token tail (tokens 8-9, `token_tails`). D1 shares P's
    # first 8 tokens, C2 all 10: both hold their hits on arrival, and C2 takes the tail block
    # for itself, so a probe of C2 no longer sees it (8, like D1's). "lpm" must still put C2
    # first: it holds 10.
    kv = KVCacheManager(
        17,
        [GroupSpec("full", BLOCK)],
        max_num_seqs=4,
        max_model_len=64,
        max_num_batched_tokens=64,
        token_tails=True,
    )
    scheduler = Scheduler(kv, max_num_seqs=4, max_num_batched_tokens=64, policy="lpm")
    prompt = list(range(10, 20))
    scheduler.add_request(make_request("P0", prompt))
    drain(scheduler)
    d1 = make_request("D1", prompt[:8] + list(range(90, 98)))
    c2 = make_request("C2", prompt + [1, 2, 3, 4])
    scheduler.add_request(d1)
    scheduler.add_request(c2)
    assert scheduler.held == {"D1": 8, "C2": 10}
    assert kv.probe_cache_hit(c2) == 8, "the held tail is no hit for a probe"
    assert [r.request_id for r in scheduler._lpm_order()] == ["C2", "D1"]
    drain(scheduler)
    assert c2.num_cached_tokens == 10 and d1.num_cached_tokens == 8
    assert kv.num_free_blocks == kv.num_blocks - 1, "every block comes back"
