"""Scheduler logic against a test double of the KV-cache manager (one full-attention group)."""

from __future__ import annotations

import pytest
from hybrid_cache.engine import scheduler as scheduler_module
from hybrid_cache.engine.errors import InsufficientKVCacheError
from hybrid_cache.engine.request import FinishReason, Request, RequestStatus
from hybrid_cache.engine.sampling_params import SamplingParams
from hybrid_cache.engine.scheduler import Scheduler


class FakeKVCacheManager:
    """Test double: counts full-attention blocks of `block_size` tokens in a pool of
    `num_blocks` (block 0 is null); prefix hits come from a fixed table of prompts."""

    def __init__(self, num_blocks: int, block_size: int = 4, max_num_seqs: int = 8) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.max_num_seqs = max_num_seqs
        self.held: dict[str, int] = {}
        self.rows: dict[str, int] = {}
        self.hits: dict[str, int] = {}
        self.appended: dict[str, list[int]] = {}
        self.events: list[tuple[str, str]] = []
        # Requests given back with `keep=True`: the real manager keeps their hashes until the
        # next `add` or a `forget`.
        self.kept: set[str] = set()

    @property
    def num_free_blocks(self) -> int:
        return self.num_blocks - 1 - sum(self.held.values())

    def add(self, request: Request) -> int:
        if -(-request.max_total_tokens // self.block_size) > self.num_blocks - 1:
            raise InsufficientKVCacheError("too large")
        assert request.request_id not in self.held
        row = min(set(range(self.max_num_seqs)) - set(self.rows.values()))
        self.held[request.request_id] = 0
        self.rows[request.request_id] = row
        self.events.append(("add", request.request_id))
        self.kept.discard(request.request_id)
        return row

    def find_cache_hit(self, request: Request) -> int:
        return self.hits.get(request.request_id, 0)

    def replay_frontier(self, request: Request) -> int:
        return 0  # no tail replays: every hit is a plain one

    def allocate(
        self, request: Request, num_computed_tokens: int, num_new_tokens: int, reserve: int = 0
    ) -> bool:
        needed = -(-(num_computed_tokens + num_new_tokens) // self.block_size)
        extra = needed - self.held[request.request_id]
        if extra > 0 and extra + reserve > self.num_free_blocks:
            return False
        self.held[request.request_id] = max(needed, self.held[request.request_id])
        return True

    def take_block_copies(self) -> list[tuple[int, int]]:
        return []

    def probe_cache_hit(self, request: Request) -> int:
        self.events.append(("probe", request.request_id))
        return self.hits.get(request.request_id, 0)

    def allocate_batch(
        self, requests: list[Request], num_computed_tokens: list[int], num_new_tokens: list[int]
    ) -> int:
        """`allocate` in order, stopping at the first that does not fit (as the core does)."""
        assert len(requests) == len(num_computed_tokens) == len(num_new_tokens)
        assert len({request.request_id for request in requests}) == len(requests)
        for done, args in enumerate(zip(requests, num_computed_tokens, num_new_tokens)):
            if not self.allocate(*args):
                return done
        return len(requests)

    def append_token_ids(self, requests: list[Request], token_ids: list[int]) -> None:
        assert len(requests) == len(token_ids), "one token per request"
        for request, token_id in zip(requests, token_ids):
            self.appended.setdefault(request.request_id, []).append(token_id)

    def free(self, request: Request, keep: bool = False) -> None:
        del self.held[request.request_id]
        del self.rows[request.request_id]
        self.events.append(("free", request.request_id))
        if keep:
            self.kept.add(request.request_id)

    def forget(self, request: Request) -> None:
        self.kept.discard(request.request_id)

    def row_of(self, request: Request) -> int:
        return self.rows[request.request_id]

    def rows_of(self, requests: list[Request]) -> list[int]:
        return [self.rows[request.request_id] for request in requests]


def make_request(index: int, num_prompt_tokens: int, max_tokens: int = 4) -> Request:
    return Request(
        request_id=str(index),
        prompt_token_ids=list(range(1, num_prompt_tokens + 1)),
        sampling_params=SamplingParams(max_tokens=max_tokens, temperature=0.0),
        arrival_index=index,
        max_total_tokens=num_prompt_tokens + max_tokens,
        eos_token_ids=(),
    )


def run_step(scheduler: Scheduler, token: int = 7):
    output = scheduler.schedule()
    sampled = [token for item in output.scheduled if item.samples]
    finished = scheduler.update_from_output(output, sampled)
    return output, finished


def test_budget_and_chunked_prefill():
    kv = FakeKVCacheManager(num_blocks=100)
    scheduler = Scheduler(kv, max_num_seqs=4, max_num_batched_tokens=10)
    long_request, short_request = make_request(0, 25), make_request(1, 3)
    scheduler.add_request(long_request)
    scheduler.add_request(short_request)

    output, _ = run_step(scheduler)
    assert [(s.request.request_id, s.num_new_tokens) for s in output.scheduled] == [("0", 10)]
    assert not output.scheduled[0].samples
    output, _ = run_step(scheduler)
    assert [(s.request.request_id, s.num_new_tokens) for s in output.scheduled] == [("0", 10)]
    output, _ = run_step(scheduler)
    # 5 prompt tokens finish the long prefill (and sample), the short prompt fits in the rest.
    assert [(s.request.request_id, s.num_new_tokens) for s in output.scheduled] == [
        ("0", 5),
        ("1", 3),
    ]
    assert all(s.samples for s in output.scheduled)
    assert long_request.output_token_ids == [7] and short_request.output_token_ids == [7]
    assert kv.appended == {"0": [7], "1": [7]}
    output, _ = run_step(scheduler)
    assert [s.num_new_tokens for s in output.scheduled] == [1, 1]
    assert output.num_scheduled_tokens == 2


def test_max_num_seqs_caps_running_requests_and_fcfs():
    kv = FakeKVCacheManager(num_blocks=100)
    scheduler = Scheduler(kv, max_num_seqs=2, max_num_batched_tokens=100)
    requests = [make_request(i, 3, max_tokens=2) for i in range(3)]
    for request in requests:
        scheduler.add_request(request)
    output, _ = run_step(scheduler)
    assert [s.request.request_id for s in output.scheduled] == ["0", "1"]
    assert requests[2].status is RequestStatus.WAITING
    output, finished = run_step(scheduler)
    assert {r.request_id for r in finished} == {"0", "1"}
    assert all(r.finish_reason is FinishReason.LENGTH for r in finished)
    output, _ = run_step(scheduler)
    assert [s.request.request_id for s in output.scheduled] == ["2"]
    run_step(scheduler)
    assert not scheduler.has_unfinished_requests()
    assert kv.num_free_blocks == kv.num_blocks - 1


def test_preemption_takes_newest_first_and_resumes_with_all_tokens():
    # 4-token blocks, 4 usable blocks: 8 + 4 + 4 prompt tokens fill the pool. The next step the
    # oldest needs a third block (the newest is preempted), then the middle one needs a second
    # block and is now the newest: it preempts itself.
    kv = FakeKVCacheManager(num_blocks=5)
    scheduler = Scheduler(kv, max_num_seqs=4, max_num_batched_tokens=100)
    requests = [make_request(0, 8, max_tokens=6), make_request(1, 4), make_request(2, 4)]
    for request in requests:
        scheduler.add_request(request)
    output, _ = run_step(scheduler)
    assert len(output.scheduled) == 3 and kv.num_free_blocks == 0

    output, _ = run_step(scheduler)
    assert output.num_preemptions == 2
    assert [s.request.request_id for s in output.scheduled] == ["0"]
    assert [r.request_id for r in scheduler.waiting] == ["1", "2"]  # arrival order kept
    assert kv.events[-2:] == [("free", "2"), ("free", "1")]  # newest first
    assert kv.kept == {"1", "2"}, "preempted requests keep their hashes until re-added"
    assert requests[1].num_computed_tokens == 0 and requests[1].num_preemptions == 1

    resumed_sizes = []
    while scheduler.has_unfinished_requests():
        output, _ = run_step(scheduler)
        resumed_sizes += [
            (s.request.request_id, s.num_new_tokens)
            for s in output.scheduled
            if s.request.request_id != "0" and s.num_computed_tokens == 0
        ]
    # Re-admitted with prompt + the output token they had: 5 tokens recomputed.
    assert resumed_sizes == [("1", 5), ("2", 5)]
    assert [r.output_token_ids for r in requests] == [[7] * 6, [7] * 4, [7] * 4]
    assert kv.num_free_blocks == kv.num_blocks - 1
    assert scheduler.num_preemptions >= 2
    assert kv.kept == set(), "every kept request was re-added"


def test_running_request_preempts_itself_when_newest():
    kv = FakeKVCacheManager(num_blocks=5)  # 4 usable blocks
    scheduler = Scheduler(kv, max_num_seqs=4, max_num_batched_tokens=100)
    first, second = make_request(0, 8, max_tokens=4), make_request(1, 4, max_tokens=4)
    scheduler.add_request(first)
    scheduler.add_request(second)
    run_step(scheduler)  # 2 + 1 blocks
    kv.held["0"] += 1  # someone else's growth: nothing free for the second request's next token
    output, _ = run_step(scheduler)
    assert output.num_preemptions == 1
    assert [s.request.request_id for s in output.scheduled] == ["0"]
    assert second.status is RequestStatus.PREEMPTED and list(scheduler.waiting) == [second]


def test_prefix_hit_is_skipped_and_recorded():
    kv = FakeKVCacheManager(num_blocks=100)
    kv.hits["0"] = 8
    scheduler = Scheduler(kv, max_num_seqs=4, max_num_batched_tokens=100)
    request = make_request(0, 10)
    scheduler.add_request(request)
    output, _ = run_step(scheduler)
    assert output.scheduled[0].num_computed_tokens == 8
    assert output.scheduled[0].num_new_tokens == 2
    assert request.num_cached_tokens == 8


def admitted_order(scheduler: Scheduler) -> list[str]:
    """Request ids in the order the scheduler first admits them, one step at a time."""
    order: list[str] = []
    while scheduler.has_unfinished_requests():
        output, _ = run_step(scheduler)
        order += [s.request.request_id for s in output.scheduled if s.num_computed_tokens == 0]
        order += [
            s.request.request_id
            for s in output.scheduled
            if s.num_computed_tokens > 0 and s.request.request_id not in order
        ]
    return order


@pytest.mark.parametrize("policy", ["fcfs", "lpm"])
def test_lpm_admits_the_longest_cached_prefix_first(policy):
    # One admission per step (max_num_seqs=1): fcfs takes arrival order, lpm the longest hit
    # first, ties (no hit) in arrival order.
    kv = FakeKVCacheManager(num_blocks=100)
    kv.hits.update({"1": 4, "2": 8})
    scheduler = Scheduler(
        kv, max_num_seqs=1, max_num_batched_tokens=100, policy=policy, hold_waiting_prefixes=False
    )
    for index in range(4):
        scheduler.add_request(make_request(index, 10, max_tokens=1))
    expected = ["0", "1", "2", "3"] if policy == "fcfs" else ["2", "1", "0", "3"]
    assert admitted_order(scheduler) == expected
    assert not scheduler.overtaken, "no overtake count is left behind"
    probes = [event for event in kv.events if event[0] == "probe"]
    assert bool(probes) == (policy == "lpm"), "fcfs without holds never probes the cache"


def test_lpm_admits_a_request_overtaken_too_often(monkeypatch):
    # With at most 2 overtakes, the request without a hit goes first once two later requests
    # with hits were admitted before it.
    monkeypatch.setattr(scheduler_module, "LPM_MAX_OVERTAKES", 2)
    kv = FakeKVCacheManager(num_blocks=100)
    kv.hits.update({"1": 8, "2": 8, "3": 8})
    scheduler = Scheduler(kv, max_num_seqs=1, max_num_batched_tokens=100, policy="lpm")
    for index in range(4):
        scheduler.add_request(make_request(index, 10, max_tokens=1))
    assert admitted_order(scheduler) == ["1", "2", "0", "3"]


def test_lpm_preemption_keeps_the_waiting_queue_in_arrival_order():
    # One running request at a time: lpm admits 2 (its hit) before the older 0 and 1. When it
    # cannot grow it preempts itself and goes back behind them (arrival order), not in front.
    kv = FakeKVCacheManager(num_blocks=5)  # 4 usable blocks of 4 tokens
    kv.hits["2"] = 4
    scheduler = Scheduler(kv, max_num_seqs=1, max_num_batched_tokens=100, policy="lpm")
    requests = [make_request(index, 8) for index in range(3)]
    for request in requests:
        scheduler.add_request(request)
    output, _ = run_step(scheduler)
    assert [s.request.request_id for s in output.scheduled] == ["2"]
    kv.held["elsewhere"] = 2  # the rest of the pool is taken: request 2 cannot grow
    output, _ = run_step(scheduler)
    assert output.num_preemptions == 1
    assert [r.request_id for r in scheduler.waiting] == ["0", "1", "2"]
    del kv.held["elsewhere"]
    while scheduler.has_unfinished_requests():
        run_step(scheduler)
    assert [len(r.output_token_ids) for r in requests] == [4, 4, 4]


def test_abort_running_and_waiting_returns_blocks():
    kv = FakeKVCacheManager(num_blocks=100)
    scheduler = Scheduler(kv, max_num_seqs=1, max_num_batched_tokens=100)
    running, waiting = make_request(0, 6), make_request(1, 6)
    scheduler.add_request(running)
    scheduler.add_request(waiting)
    run_step(scheduler)
    assert kv.num_free_blocks < kv.num_blocks - 1
    assert scheduler.abort_request("0") is running
    assert scheduler.abort_request("1") is waiting
    assert scheduler.abort_request("missing") is None
    assert (
        running.finish_reason is FinishReason.ABORT and waiting.finish_reason is FinishReason.ABORT
    )
    assert not scheduler.has_unfinished_requests()
    assert kv.num_free_blocks == kv.num_blocks - 1


def test_request_that_can_never_fit_fails_alone():
    kv = FakeKVCacheManager(num_blocks=5)  # 16 tokens of KV
    scheduler = Scheduler(kv, max_num_seqs=4, max_num_batched_tokens=100)
    too_big, fine = make_request(0, 30), make_request(1, 4, max_tokens=2)
    scheduler.add_request(too_big)
    scheduler.add_request(fine)
    output, _ = run_step(scheduler)
    assert output.failed == [too_big]
    assert too_big.finish_reason is FinishReason.ERROR
    assert isinstance(too_big.error, InsufficientKVCacheError)
    assert [s.request.request_id for s in output.scheduled] == ["1"]
    while scheduler.has_unfinished_requests():
        run_step(scheduler)
    assert fine.output_token_ids == [7, 7]
    assert kv.num_free_blocks == kv.num_blocks - 1


@pytest.mark.parametrize("stop", ["eos", "stop_token"])
def test_stop_tokens_finish_with_stop(stop):
    kv = FakeKVCacheManager(num_blocks=100)
    scheduler = Scheduler(kv, max_num_seqs=4, max_num_batched_tokens=100)
    params = SamplingParams(
        max_tokens=10, temperature=0.0, stop_token_ids=[9] if stop != "eos" else []
    )
    request = Request("0", [1, 2], params, 0, 12, eos_token_ids=(9,) if stop == "eos" else ())
    scheduler.add_request(request)
    run_step(scheduler, token=5)
    _, finished = run_step(scheduler, token=9)
    assert finished == [request]
    assert request.finish_reason is FinishReason.STOP and request.output_token_ids == [5, 9]
