"""What hybrid's own costs take from its gain: hybrid against uniform with enough memory to run
hybrid's schedule, side by side with the uniform engine of the real budget.

Four engines run side by side in one process (`bench/interleaved.py`, time slices by turns):
hybrid and uniform on the budget of the benchmark, "hybrid-equal", hybrid with vLLM's
equal-size groups instead of the planner's default (`--kv-group-layout equal`: for Gemma-3, six
one-layer groups instead of one group per layer type), and "uniform-oracle", a uniform engine whose
budget (`--oracle-kv-cache-memory`) holds as many requests as hybrid does. The oracle runs the
same steps with the same batches as hybrid (checked, step by step) but with the uniform
layout's per-step costs: one group, one block table, every layer's blocks in a tensor of its
own. So uniform/oracle is the ratio hybrid would reach if grouping cost nothing, and
hybrid/oracle - 1 is what grouping costs (per-group bookkeeping, allocation and release of
window blocks, the kernel on blocks recycled from the windows). Each run's steps are split
into prefill and decode steps, and those into forward and engine time (`RunResult.phase_times`).

    python scripts/bench_hybrid_cost.py [--model tiny-gemma3] [--kv-cache-memory 15.25MiB] \\
        [--oracle-kv-cache-memory 64MiB] [--repeat 4]
"""

from __future__ import annotations

import argparse
import statistics

import torch
from hybrid_cache.bench.interleaved import run_labelled
from hybrid_cache.bench.settings import BenchSettings

LABELS = ("hybrid", "hybrid-equal", "uniform", "uniform-oracle")


def one_round(settings: dict[str, BenchSettings], expected: dict | None) -> dict:
    """The RunResult of each label, from one side-by-side run of the four."""
    modes = {
        "hybrid": "hybrid",
        "hybrid-equal": "hybrid",
        "uniform": "uniform",
        "uniform-oracle": "uniform",
    }
    return run_labelled({label: (settings[label], modes[label]) for label in LABELS}, expected)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="tiny-gemma3")
    parser.add_argument("--kv-cache-memory", default="15.25MiB")
    parser.add_argument("--oracle-kv-cache-memory", default="64MiB")
    parser.add_argument("--input-len", type=int, default=512)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--repeat", type=int, default=4)
    args = parser.parse_args()
    torch.set_num_threads(1)

    def settings_for(memory: str, group_layout: str = "auto") -> BenchSettings:
        return BenchSettings(
            args.model,
            args.input_len,
            args.output_len,
            args.num_prompts,
            kv_cache_memory=memory,
            kv_group_layout=group_layout,
        )

    settings = {
        "hybrid": settings_for(args.kv_cache_memory),
        "hybrid-equal": settings_for(args.kv_cache_memory, "equal"),
        "uniform": settings_for(args.kv_cache_memory),
        "uniform-oracle": settings_for(args.oracle_kv_cache_memory),
    }
    gain, equal_gain, oracle_gain, cost = [], [], [], []
    expected = None
    for repeat in range(args.repeat):
        results = one_round(settings, expected)
        spent = {label: result.elapsed_s for label, result in results.items()}
        expected = spent
        hybrid, oracle = results["hybrid"], results["uniform-oracle"]
        if oracle.running_per_step != hybrid.running_per_step:
            raise SystemExit(
                f"uniform-oracle did not run hybrid's schedule ({len(oracle.running_per_step)} "
                f"vs {len(hybrid.running_per_step)} steps): raise --oracle-kv-cache-memory"
            )
        gain.append(spent["uniform"] / spent["hybrid"])
        equal_gain.append(spent["uniform"] / spent["hybrid-equal"])
        oracle_gain.append(spent["uniform"] / spent["uniform-oracle"])
        cost.append(spent["hybrid"] / spent["uniform-oracle"] - 1)
        seconds = ", ".join(f"{label} {spent[label]:.3f} s" for label in LABELS)
        print(
            f"run {repeat + 1}: {seconds}; hybrid/uniform {gain[-1]:.3f}x, "
            f"hybrid-equal/uniform {equal_gain[-1]:.3f}x, oracle/uniform {oracle_gain[-1]:.3f}x, hybrid's own cost {100 * cost[-1]:+.1f}%"
        )
        ours, theirs = hybrid.phase_times(), oracle.phase_times()
        for kind in ("prefill", "decode"):
            a, b = ours[kind], theirs[kind]
            print(
                f"  {kind} ({a.steps} steps): hybrid {a.step_s:.3f} s vs oracle {b.step_s:.3f} s "
                f"(forward {a.forward_s:.3f} vs {b.forward_s:.3f}, LM head {a.logits_s:.3f} vs "
                f"{b.logits_s:.3f}, engine {a.engine_s:.3f} vs {b.engine_s:.3f})"
            )
    print(
        f"{args.model}, {args.repeat} runs side by side (medians): hybrid/uniform "
        f"{statistics.median(gain):.3f}x, hybrid-equal/uniform {statistics.median(equal_gain):.3f}x, "
        f"oracle/uniform {statistics.median(oracle_gain):.3f}x, "
        f"hybrid's own cost {100 * statistics.median(cost):+.1f}% of the oracle's time "
        f"(from {100 * min(cost):+.1f}% to {100 * max(cost):+.1f}%)"
    )


if __name__ == "__main__":
    main()
