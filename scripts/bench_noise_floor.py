"""The noise floor of `hybrid-cache bench --interleave`: the same mode against itself.

Two engines of one mode (same model, weights, workload) run side by side in one process exactly
as `--interleave` runs hybrid and uniform (`bench/interleaved.py`), `--repeat` times, leading by
turns. Their throughput ratio would be 1.00 on a quiet machine; the spread of the printed ratios
is how far apart two identical engines land here, the resolution of a hybrid/uniform ratio
measured the same way. The same pairs timed one after the other (`--sequential`) show the
spread of the alternating method for comparison.

    python scripts/bench_noise_floor.py [--model tiny-llama] [--kv-cache-memory 10.25MiB] \\
        [--mode uniform] [--repeat 8] [--sequential]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from hybrid_cache.bench.engine_run import ModeRun
from hybrid_cache.bench.interleaved import step_side_by_side
from hybrid_cache.bench.settings import BenchSettings


def one_pair(settings: BenchSettings, mode: str, first: str, sequential: bool) -> dict:
    """Seconds of engines "A" and "B" (both `mode`), built in the order `first` leads."""
    order = ("A", "B") if first == "A" else ("B", "A")
    runs = {label: ModeRun(settings, mode) for label in order}
    try:
        if not sequential:
            return step_side_by_side(runs)[0]
        spent = {}
        for label in order:
            started = time.perf_counter()
            while not runs[label].done:
                runs[label].step()
            spent[label] = time.perf_counter() - started
        return spent
    finally:
        for run in runs.values():
            run.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="tiny-llama")
    parser.add_argument("--kv-cache-memory", default="10.25MiB")
    parser.add_argument("--mode", choices=("hybrid", "uniform"), default="uniform")
    parser.add_argument("--input-len", type=int, default=512)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--repeat", type=int, default=8)
    parser.add_argument("--sequential", action="store_true", help="one engine after the other")
    args = parser.parse_args()
    torch.set_num_threads(1)
    settings = BenchSettings(
        args.model,
        args.input_len,
        args.output_len,
        args.num_prompts,
        kv_cache_memory=args.kv_cache_memory,
    )
    ratios = []
    for repeat in range(args.repeat):
        spent = one_pair(settings, args.mode, "A" if repeat % 2 == 0 else "B", args.sequential)
        ratios.append(spent["B"] / spent["A"])  # throughput of A over B
        print(
            f"pair {repeat + 1}: A {spent['A']:.3f} s, B {spent['B']:.3f} s, A/B {ratios[-1]:.3f}"
        )
    how = "one after the other" if args.sequential else "side by side"
    print(
        f"{args.mode} vs {args.mode} ({how}): median A/B {statistics.median(ratios):.3f}, "
        f"from {min(ratios):.3f} to {max(ratios):.3f} over {len(ratios)} pairs"
    )


if __name__ == "__main__":
    main()
