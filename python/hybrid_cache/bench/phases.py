"""Where a run's time went, by kind of step: steps that compute prompt tokens ("prefill",
alone or with decodes riding along) and pure decode steps, each split into the model forward,
the LM head and the rest (the engine's own work). `scripts/bench_hybrid_cost.py` compares
hybrid with a uniform engine that runs the same schedule phase by phase.

A step counts as decode when it computes no more tokens than it has running requests (one
token each); any step with more tokens than requests computes prompt tokens.
"""

from __future__ import annotations

from dataclasses import dataclass

from hybrid_cache.bench.metrics import RunResult


@dataclass(frozen=True)
class PhaseTimes:
    """The sums over one kind of step (seconds)."""

    steps: int
    step_s: float
    forward_s: float
    logits_s: float

    @property
    def engine_s(self) -> float:
        """Step time outside the model forward and the LM head."""
        return self.step_s - self.forward_s - self.logits_s


def phase_times(result: RunResult) -> dict[str, PhaseTimes]:
    """{"prefill": ..., "decode": ...} of a measured run (per-step series of equal length)."""
    series = (
        result.tokens_per_step,
        result.running_per_step,
        result.step_time_s,
        result.forward_time_s,
        result.logits_time_s,
    )
    if len({len(values) for values in series}) != 1:
        raise ValueError(
            "phase_times needs a measured run: every per-step series of the same length, got "
            f"{[len(values) for values in series]}"
        )
    sums = {kind: [0, 0.0, 0.0, 0.0] for kind in ("prefill", "decode")}
    for tokens, running, step_s, forward_s, logits_s in zip(*series):
        total = sums["prefill" if tokens > running else "decode"]
        total[0] += 1
        total[1] += step_s
        total[2] += forward_s
        total[3] += logits_s
    return {kind: PhaseTimes(*values) for kind, values in sums.items()}
