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
    weight = {mode: (expected_s or {}).get(mode, 1.0) for mode in modes}
    if any(w <= 0 for w in weight.values()):
        raise ValueError(f"expected times must be positive, got {dict(weight)}")
    runs: dict[str, ModeRun] = {}
    spent = {mode: 0.0 for mode in modes}
    cpu = {mode: 0.0 for mode in modes}
    try:
        for mode in modes:
            runs[mode] = ModeRun(settings, mode, progress)
        while True:
            active = [mode for mode in modes if not runs[mode].done]
            if not active:
                break
            mode = min(active, key=lambda m: spent[m] / weight[m])
            run = runs[mode]
            started, started_cpu = clock(), time.process_time()
            while not run.done and clock() - started < SLICE_S:
                run.step()
            spent[mode] += clock() - started
            cpu[mode] += time.process_time() - started_cpu
    finally:
        for run in runs.values():
            run.close()
    return {mode: runs[mode].finish(spent[mode], cpu[mode]) for mode in modes}
