"""The scheduler's batched allocation makes exactly the decisions of one allocation at a time.

`Scheduler` allocates its running requests with one `allocate_batch` call and records sampled
tokens in one pass. `OneAtATimeScheduler` below is the scheduler as it was before that: one
`allocate` per running request, newest-first preemption inside the loop, `list.remove` per
finished request. Both run the same workloads over their own real core (`KVCacheManager`, full
attention + sliding window, a pool small enough to preempt often, prefix hits, chunked prefill,
stop tokens), and every step must match: the batch, preemptions, failures, finishes, queues,
block tables and the core's figures.
"""

from __future__ import annotations

import random

import numpy as np
import pytest
from hybrid_cache._core import GroupSpec
from hybrid_cache.engine.errors import InsufficientKVCacheError
from hybrid_cache.engine.kv_cache import KVCacheManager
from hybrid_cache.engine.request import FinishReason, Request, RequestStatus
from hybrid_cache.engine.sampling_params import SamplingParams
from hybrid_cache.engine.scheduler import Scheduler, SchedulerOutput

VOCAB = 50
STOP_TOKEN = 3


class OneAtATimeScheduler(Scheduler):
    """The oracle: the running loop and output update allocating one request at a time."""

    def schedule(self) -> SchedulerOutput:
        output = SchedulerOutput()
        token_budget = self.max_num_batched_tokens
        index = 0
        while index < len(self.running) and token_budget > 0:
            request = self.running[index]
            num_new_tokens = min(request.num_uncomputed_tokens, token_budget)
            assert num_new_tokens > 0
            if not self._allocate_or_preempt(request, num_new_tokens, output):
                break
            output.add(
                request,
                self.kv_cache.row_of(request),
                request.num_computed_tokens,
                num_new_tokens,
            )
            token_budget -= num_new_tokens
            index += 1
        if output.num_preemptions == 0:
            self._admit_waiting(token_budget, output)
        return output

    def _allocate_or_preempt(
        self, request: Request, num_new_tokens: int, output: SchedulerOutput
    ) -> bool:
        while not self.kv_cache.allocate(request, request.num_computed_tokens, num_new_tokens):
            if self._release_held():  # waiting requests' holds go before any preemption
                continue
            victim = self.running.pop()
            self._preempt(victim)
            output.num_preemptions += 1
            if victim is request:
                return False
        return True

    def update_from_output(
        self, output: SchedulerOutput, sampled_token_ids: list[int]
    ) -> list[Request]:
        finished: list[Request] = []
        continuing: list[Request] = []
        continuing_token_ids: list[int] = []
        tokens = iter(sampled_token_ids)
        for item in output.scheduled:
            request = item.request
            request.num_computed_tokens = item.num_computed_tokens + item.num_new_tokens
            if not item.samples:
                continue
            token_id = next(tokens)
            request.output_token_ids.append(token_id)
            request.all_token_ids.append(token_id)
            params = request.sampling_params
            finish_reason = None
            if not params.ignore_eos and token_id in request.eos_token_ids:
                finish_reason = FinishReason.STOP
            elif token_id in params.stop_token_ids:
                finish_reason = FinishReason.STOP
            elif (
                request.num_output_tokens >= params.max_tokens
                or request.num_tokens >= request.max_total_tokens
            ):
                finish_reason = FinishReason.LENGTH
            if finish_reason is None:
                continuing.append(request)
                continuing_token_ids.append(token_id)
                continue
            self.running.remove(request)
            self.kv_cache.free(request)
            self._finish(request, finish_reason)
            finished.append(request)
        if continuing:
            self.kv_cache.append_token_ids(continuing, continuing_token_ids)
        return finished


def next_token(request: Request) -> int:
    """A deterministic 'model': the token depends only on the request and its position."""
    return random.Random(f"{request.request_id}:{request.num_tokens}").randrange(VOCAB)


def make_requests(seed: int, num_requests: int, max_model_len: int) -> list[Request]:
    rng = random.Random(seed)
    shared = [rng.randrange(VOCAB) for _ in range(48)]  # a common prefix: prefix-cache hits
    requests = []
    for index in range(num_requests):
        length = rng.randrange(4, 120)
        prompt = shared[: rng.choice([0, 16, 48])] + [rng.randrange(VOCAB) for _ in range(length)]
        params = SamplingParams(
            max_tokens=rng.randrange(1, 80),
            temperature=0.0,
            stop_token_ids=[STOP_TOKEN] if index % 3 == 0 else [],
            ignore_eos=index % 4 == 0,
        )
        requests.append(
            Request(
                str(index),
                prompt,
                params,
                arrival_index=index,
                max_total_tokens=min(len(prompt) + params.max_tokens, max_model_len),
                eos_token_ids=(7,),
            )
        )
    return requests


def make_scheduler(cls: type[Scheduler], num_blocks: int, max_num_batched_tokens: int):
    groups = [GroupSpec("full", 16), GroupSpec("sliding_window", 16, window=32)]
    kv_cache = KVCacheManager(
        num_blocks,
        groups,
        max_num_seqs=24,
        max_model_len=256,
        max_num_batched_tokens=max_num_batched_tokens,
    )
    return cls(kv_cache, max_num_seqs=24, max_num_batched_tokens=max_num_batched_tokens)


def step_record(scheduler: Scheduler, output: SchedulerOutput, finished: list[Request]):
    kv_cache = scheduler.kv_cache
    return (
        [
            (s.request.request_id, s.row, s.num_computed_tokens, s.num_new_tokens, s.samples)
            for s in output.scheduled
        ],
        output.num_preemptions,
        [(r.request_id, type(r.error).__name__) for r in output.failed],
        [(r.request_id, r.finish_reason) for r in finished],
        [r.request_id for r in scheduler.running],
        [r.request_id for r in scheduler.waiting],
        kv_cache.stats(),
        kv_cache.num_used_blocks_per_group(),
        np.asarray(kv_cache.block_table).tobytes(),
    )


def hashed_blocks(record: tuple) -> int:
    """Takes the hash count out of a step's record (its stats dict) and returns it."""
    stats = next(item for item in record if isinstance(item, dict))
    return stats.pop("hashed_blocks")


def run(cls: type[Scheduler], seed: int, num_blocks: int, max_num_batched_tokens: int):
    scheduler = make_scheduler(cls, num_blocks, max_num_batched_tokens)
    requests = make_requests(seed, 40, max_model_len=256)
    pending = list(requests)
    records = []
    step = 0
    while pending or scheduler.has_unfinished_requests():
        # Requests arrive over time, so admission and preemption interleave.
        for _ in range(min(len(pending), 3 if step % 2 == 0 else 0)):
            scheduler.add_request(pending.pop(0))
        output = scheduler.schedule()
        sampled = [next_token(s.request) for s in output.scheduled if s.samples]
        finished = scheduler.update_from_output(output, sampled)
        records.append(step_record(scheduler, output, finished))
        step += 1
        assert step < 5000, "the workload should finish"
    outcome = [(r.output_token_ids, r.finish_reason, r.num_preemptions) for r in requests]
    return records, outcome, scheduler.num_preemptions


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize(("num_blocks", "max_num_batched_tokens"), [(24, 64), (40, 256)])
def test_batched_scheduling_matches_one_at_a_time(seed, num_blocks, max_num_batched_tokens):
    expected = run(OneAtATimeScheduler, seed, num_blocks, max_num_batched_tokens)
    got = run(Scheduler, seed, num_blocks, max_num_batched_tokens)
    expected_records, expected_outcome, expected_preemptions = expected
    got_records, got_outcome, got_preemptions = got
    assert len(got_records) == len(expected_records)
    for step, (want, have) in enumerate(zip(expected_records, got_records)):
        # A batch hashes the blocks a step will cache a few requests ahead of the one it
        # applies (to prefetch where they go), so its hash count may run ahead; never behind.
        want_hashed, have_hashed = hashed_blocks(want), hashed_blocks(have)
        assert have == want, f"step {step} differs"
        assert have_hashed >= want_hashed, f"step {step}: fewer blocks hashed"
    # Every request here runs to its end, so each block hashed ahead is one it caches later:
    # after the last step the counts are equal.
    assert have_hashed == want_hashed, "blocks hashed ahead for nothing"
    assert got_outcome == expected_outcome
    assert got_preemptions == expected_preemptions
    assert expected_preemptions > 0, "the workload should preempt"


def test_workloads_fail_in_the_middle_of_a_batch(monkeypatch):
    """The equivalence above is not trivial: a request that does not fit has running requests
    after it in its batch (newest-first preemption, then another batch for the rest)."""
    calls: list[tuple[int, int]] = []
    allocate_batch = KVCacheManager.allocate_batch

    def recording(self, requests, num_computed_tokens, num_new_tokens):
        done = allocate_batch(self, requests, num_computed_tokens, num_new_tokens)
        calls.append((len(requests), done))
        return done

    monkeypatch.setattr(KVCacheManager, "allocate_batch", recording)
    run(Scheduler, 4, 40, 256)
    assert any(done < planned - 1 for planned, done in calls)
    assert any(0 < done < planned for planned, done in calls)


def test_finishing_many_requests_at_once_keeps_running_order():
    scheduler = make_scheduler(Scheduler, 200, 256)
    requests = [
        Request(str(i), [i + 1] * 5, SamplingParams(max_tokens=1 + i % 2), i, 5 + 1 + i % 2)
        for i in range(8)
    ]
    for request in requests:
        scheduler.add_request(request)
    output = scheduler.schedule()
    finished = scheduler.update_from_output(
        output, [1 for item in output.scheduled if item.samples]
    )
    assert [r.request_id for r in finished] == ["0", "2", "4", "6"]
    assert [r.request_id for r in scheduler.running] == ["1", "3", "5", "7"]
    assert all(r.status is RequestStatus.RUNNING for r in scheduler.running)


def test_request_too_large_still_fails_at_admission():
    scheduler = make_scheduler(Scheduler, 4, 64)
    request = Request("big", [1] * 200, SamplingParams(max_tokens=8), 0, 208)
    scheduler.add_request(request)
    output = scheduler.schedule()
    assert output.failed == [request]
    assert isinstance(request.error, InsufficientKVCacheError)
