"""`RunResult.phase_times`: a run's step time split by kind of step and by where it went."""

from __future__ import annotations

import pytest
from hybrid_cache.bench.metrics import RunResult


def run_with(tokens, running, step, forward, logits) -> RunResult:
    result = RunResult.starting("hybrid", False, 8, ["full"])
    result.tokens_per_step, result.running_per_step = tokens, running
    result.step_time_s, result.forward_time_s, result.logits_time_s = step, forward, logits
    return result


def test_steps_with_prompt_tokens_are_prefill_the_rest_decode() -> None:
    # Two prompt steps (one with decodes riding along: 2048 tokens, 5 running), three decodes.
    result = run_with(
        tokens=[2048, 2048, 5, 5, 4],
        running=[4, 5, 5, 5, 4],
        step=[0.5, 0.25, 0.125, 0.125, 0.0625],
        forward=[0.25, 0.125, 0.0625, 0.0625, 0.03125],
        logits=[0.0, 0.0, 0.03125, 0.03125, 0.0],
    )
    phases = result.phase_times()
    assert phases["prefill"].steps == 2
    assert phases["prefill"].step_s == 0.75
    assert phases["prefill"].forward_s == 0.375
    assert phases["decode"].steps == 3
    assert phases["decode"].step_s == 0.3125
    assert phases["decode"].engine_s == 0.3125 - 0.15625 - 0.0625


def test_a_run_without_timings_is_refused() -> None:
    # A simulated run has no forward/LM-head series: nothing to split.
    result = run_with([4], [4], [0.1], [], [])
    with pytest.raises(ValueError, match="same length"):
        result.phase_times()
