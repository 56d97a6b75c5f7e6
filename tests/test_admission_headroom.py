"""Admission headroom (`Scheduler(admission_headroom=True)`), over the real core: while requests
run and waiting requests hold hits, an admission leaves free the blocks the running requests take
at their next token.

One full-attention group of 4-token blocks, 9 usable blocks. P leaves 3 cached blocks. R runs
(16-token prompt); when it has 20 tokens, its next one needs a 6th block. W (P's prompt and one
token) arrives then and holds P's 3 blocks: 1 block is free, and W needs it. Admitted, W is
preempted by R's growth at the very next step (it is the newest) after its prefill; with the
headroom it waits for R instead and runs once, hitting all 12 of P's tokens.
"""

from __future__ import annotations

import pytest
from hybrid_cache._core import Coordinator, GroupSpec
from hybrid_cache.engine.request import FinishReason
from hybrid_cache.engine.scheduler import Scheduler
from test_scheduler_holds import P_PROMPT, drain, make_kv, make_request, step


def run(headroom: bool):
    kv = make_kv(num_blocks=10)
    scheduler = Scheduler(
        kv, max_num_seqs=4, max_num_batched_tokens=64, policy="lpm", admission_headroom=headroom
    )
    scheduler.add_request(make_request("P0", P_PROMPT))
    drain(scheduler)
    runner = make_request("R1", list(range(30, 46)), max_tokens=8)
    scheduler.add_request(runner)
    for _ in range(4):  # the prefill and three decode steps: 20 tokens, 5 blocks
        assert step(scheduler) == ["R1"]
    assert runner.num_tokens == 20
    waiting = make_request("W2", P_PROMPT + [7], max_tokens=2)
    scheduler.add_request(waiting)
    assert scheduler.held == {"W2": 12} and kv.num_free_blocks == 1
    admitted = step(scheduler)
    return kv, scheduler, runner, waiting, admitted


def test_without_headroom_the_newcomer_is_preempted_at_the_next_step():
    kv, scheduler, runner, waiting, admitted = run(headroom=False)
    assert admitted == ["R1", "W2"] and kv.num_free_blocks == 0
    step(scheduler)  # R1's 21st token takes the last block: W2, the newest, gives way
    assert scheduler.num_preemptions == 1 and waiting.num_preemptions == 1
    drain(scheduler)
    assert waiting.finish_reason is runner.finish_reason is FinishReason.LENGTH
    assert kv.num_free_blocks == kv.num_blocks - 1, "every block comes back"


def test_with_headroom_the_newcomer_waits_and_runs_once():
    kv, scheduler, runner, waiting, admitted = run(headroom=True)
    assert admitted == ["R1"] and kv.num_free_blocks == 1
    assert scheduler.held == {"W2": 12}, "it keeps holding its hit while it waits"
    drain(scheduler)
    assert scheduler.num_preemptions == 0
    assert waiting.finish_reason is runner.finish_reason is FinishReason.LENGTH
    assert waiting.num_cached_tokens == 12
    assert kv.num_free_blocks == kv.num_blocks - 1, "every block comes back"


def test_no_headroom_is_kept_when_nothing_holds():
    # The same scene without holds: W2 is admitted (the reserve applies only while waiting
    # requests hold hits, where a preempted newcomer's blocks are the only free ones).
    kv = make_kv(num_blocks=10)
    scheduler = Scheduler(
        kv,
        max_num_seqs=4,
        max_num_batched_tokens=64,
        policy="lpm",
        hold_waiting_prefixes=False,
        admission_headroom=True,
    )
    scheduler.add_request(make_request("P0", P_PROMPT))
    drain(scheduler)
    scheduler.add_request(make_request("R1", list(range(30, 46)), max_tokens=8))
    for _ in range(4):
        step(scheduler)
    scheduler.add_request(make_request("W2", P_PROMPT + [7], max_tokens=2))
    assert step(scheduler) == ["R1", "W2"]


def test_the_core_keeps_the_reserve_or_changes_nothing():
    coordinator = Coordinator(9, [GroupSpec("full", 4)], 4, 64, 64)
    for request_id in (0, 1):
        coordinator.add_request(request_id, list(range(8 * request_id, 8 * request_id + 8)))
    assert coordinator.allocate(0, 0, 8)  # 2 of the 8 usable blocks
    free = coordinator.num_free_blocks
    assert not coordinator.allocate(1, 0, 8, reserve=free - 1)  # 2 needed, 1 would be left
    assert coordinator.num_free_blocks == free, "a refused allocate changes nothing"
    assert coordinator.allocate(1, 0, 8, reserve=free - 2)
    assert coordinator.num_free_blocks == free - 2
    with pytest.raises(Exception, match="reserve must be non-negative"):
        coordinator.allocate(1, 8, 0, reserve=-1)
