"""Both modes in one process, side by side (`hybrid-cache bench --interleave`).

On a shared machine the speed drifts by tens of percent over seconds (other tenants, clock
changes), so two modes timed one after the other can differ by more than the effect measured.
Here both engines are built first (untimed); then the driver gives time slices of `SLICE_S`
seconds to one engine at a time (steps until the slice is used up), always to the mode that
is furthest behind in its share of the expected time, so both modes run through the same
stretch of the machine's speed, in step with each other, until the faster one finishes. A
mode's time is the sum of its own slices (its steps and their bookkeeping; never the other
mode's steps), its CPU time likewise.

Expected times come from the previous repeat's figures (`expected_s`); without them both get
equal weight and the faster mode finishes first, running the last part of the slower mode
alone. A slice is long (50 ms: ~10-40 steps of the tiny presets) next to the cost of switching
engines (their working sets, ~1-10 MB, come back into the caches).
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from typing import Any, Callable, Optional

from hybrid_cache.bench.engine_run import ModeRun
from hybrid_cache.bench.metrics import RunResult
from hybrid_cache.bench.settings import BenchSettings

SLICE_S = 0.05


def run_interleaved(
    settings: BenchSettings,
    modes: Sequence[str],
    expected_s: Optional[Mapping[str, float]] = None,
    progress: Any = None,
    clock: Callable[[], float] = time.perf_counter,
) -> dict[str, RunResult]:
    """Runs `modes` (in this order when their shares tie) side by side; returns each mode's
    figures. `progress` (one bar for all modes) is advanced by every finished request."""
    return run_labelled({mode: (settings, mode) for mode in modes}, expected_s, progress, clock)


def run_labelled(
    engines: Mapping[str, tuple[BenchSettings, str]],
    expected_s: Optional[Mapping[str, float]] = None,
    progress: Any = None,
    clock: Callable[[], float] = time.perf_counter,
) -> dict[str, RunResult]:
    """`run_interleaved` for engines of any (settings, mode) under labels of their own, built
    in this order (`scripts/bench_hybrid_cost.py` runs two uniform engines of different
    budgets); returns each label's figures, `elapsed_s` the sum of its own slices."""
    runs: dict[str, ModeRun] = {}
    try:
        for label, (settings, mode) in engines.items():
            runs[label] = ModeRun(settings, mode, progress)
        spent, cpu = step_side_by_side(runs, expected_s, clock)
    finally:
        for run in runs.values():
            run.close()
    return {label: runs[label].finish(spent[label], cpu[label]) for label in engines}


def step_side_by_side(
    runs: Mapping[str, Any],
    expected_s: Optional[Mapping[str, float]] = None,
    clock: Callable[[], float] = time.perf_counter,
) -> tuple[dict[str, float], dict[str, float]]:
    """Steps every run (anything with `done` and `step()`, by label) to the end, a slice at a
    time to the one furthest behind; returns (wall seconds, CPU seconds) of each label's
    slices. `scripts/bench_noise_floor.py` runs the same mode under two labels."""
    weight = {label: (expected_s or {}).get(label, 1.0) for label in runs}
    if any(w <= 0 for w in weight.values()):
        raise ValueError(f"expected times must be positive, got {dict(weight)}")
    spent = {label: 0.0 for label in runs}
    cpu = {label: 0.0 for label in runs}
    while True:
        active = [label for label, run in runs.items() if not run.done]
        if not active:
            return spent, cpu
        label = min(active, key=lambda name: spent[name] / weight[name])
        run = runs[label]
        started, started_cpu = clock(), time.process_time()
        while not run.done and clock() - started < SLICE_S:
            run.step()
        spent[label] += clock() - started
        cpu[label] += time.process_time() - started_cpu
