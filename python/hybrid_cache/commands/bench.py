"""`hybrid-cache bench`: throughput of the engine with a hybrid and/or a uniform KV cache.

    hybrid-cache bench --model tiny-gemma3 --input-len 512 --output-len 128 --num-prompts 64 \
        --kv-cache-memory 30.5MiB --num-threads 1 --plot bench.png --output-json bench.json
    hybrid-cache bench --simulate --model gemma-2-27b --input-len 6144 --output-len 1024 \
        --num-prompts 50 --kv-cache-mode both
    hybrid-cache bench --model tiny-gemma3 --input-len 64 --output-len 64 --num-prompts 64 \
        --kv-cache-mode hybrid --num-threads 1 --tensor-parallel-size 2   # and on one rank
    hybrid-cache bench --model tiny-gemma3 --workload multi-turn --num-sessions 12 \
        --num-turns 4 --system-len 64 --turn-input-len 96 --output-len 32 \
        --kv-cache-memory 2MiB,3MiB,4MiB --plot reuse.png

Flags follow vLLM's throughput benchmark where they overlap. The workload is `--num-prompts`
seeded random token-id prompts of `--input-len` (the first `--prefix-len` shared), greedy,
EOS ignored, exactly `--output-len` tokens each; or (`--workload multi-turn`) chat sessions whose
every turn resends the history (`bench/multi_turn.py`), reporting the reusable-token hit rate.
A comma-separated `--kv-cache-memory` runs every budget and prints the hit rate and throughput
against the budget. See `hybrid_cache.bench` for the parts.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any, Optional

from hybrid_cache.bench.errors import BenchConfigError
from hybrid_cache.bench.settings import WORKLOADS
from hybrid_cache.engine.engine_config import (
    BOTH_MODES,
    add_engine_arguments,
    engine_config_from_args,
    modes_of,
)


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "bench",
        help="throughput benchmark: hybrid vs uniform KV cache (real engine or --simulate); "
        "`bench serve`: load on a running server over HTTP",
        description="Runs a fixed random workload and prints requests/s and tokens/s per mode. "
        "`hybrid-cache bench serve --help`: the serving benchmark (a running server, over HTTP).",
    )
    add_engine_arguments(
        parser,
        both_modes=True,
        help_texts={
            "max_model_len": "default: the longest request",
            "kv_cache_memory": "KV budget, e.g. 28MiB or 40GB; a comma-separated list runs each "
            "(a budget sweep)",
        },
        load_format="dummy",
        kv_cache_mode=BOTH_MODES,
    )
    parser.add_argument(
        "--workload",
        choices=WORKLOADS,
        default="random",
        help="random: --num-prompts prompts at once; multi-turn: chat sessions resending their "
        "history every turn (--num-sessions, --num-turns, --system-len, --turn-input-len)",
    )
    parser.add_argument("--input-len", type=int, help="random: prompt tokens per request")
    parser.add_argument("--output-len", type=int, required=True, help="generated tokens each")
    parser.add_argument("--num-prompts", type=int, help="random: number of requests")
    parser.add_argument("--prefix-len", type=int, default=0, help="shared prefix of every prompt")
    parser.add_argument("--num-sessions", type=int, default=12, help="multi-turn: chat sessions")
    parser.add_argument("--num-turns", type=int, default=4, help="multi-turn: turns per session")
    parser.add_argument(
        "--system-len", type=int, default=0, help="multi-turn: system prompt shared by sessions"
    )
    parser.add_argument("--turn-input-len", type=int, help="multi-turn: new user tokens per turn")
    parser.add_argument("--num-threads", type=int, help="torch CPU threads (default: torch's)")
    parser.add_argument(
        "--logprobs",
        type=int,
        help="every request also asks for its sampled tokens' logprobs and this many top ones",
    )
    parser.add_argument(
        "--stop",
        action="append",
        default=[],
        help="a stop string every request checks (repeat; needs --tokenizer with a preset)",
    )
    parser.add_argument(
        "--repeat",
        type=int,
        default=1,
        help="run the modes alternately (ABBA order) this many times and keep each mode's fastest run "
        "(for noisy shared machines)",
    )
    parser.add_argument(
        "--interleave",
        action="store_true",
        help="build both modes' engines and step them by turns in 50 ms slices, so both run "
        "through the same stretch of a noisy machine; a mode's time is the sum of its own slices",
    )
    parser.add_argument("--output-json", help="write settings, figures and per-step series here")
    parser.add_argument("--plot", help="write a PNG of blocks in use and running requests")
    parser.add_argument(
        "--simulate",
        action="store_true",
        help="no model: real scheduler + allocator, step times from the cost model",
    )
    parser.add_argument("--gpu-memory", default="80GB", help="--simulate: modelled GPU memory")
    parser.add_argument(
        "--compare-hf",
        action="store_true",
        help="also run transformers' generate_batch on the same weights and prompts",
    )
    parser.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    check_flags(args)
    budgets = split_budgets(args.kv_cache_memory)
    if args.num_threads is not None:
        import torch

        torch.set_num_threads(args.num_threads)
    if len(budgets) > 1:
        return run_sweep(args, budgets)
    settings = settings_from_args(args, budgets[0])
    print_workload(settings)
    results, elapsed_all = run_modes(args, settings)

    from hybrid_cache.bench.report import (
        format_hf_comparison,
        format_pair_ratios,
        format_report,
        json_document,
        pair_ratios,
    )

    how = "interleaved" if args.interleave else "alternating"
    print(format_report(results, args.repeat, how))
    extra: dict[str, Any] = {
        "repeat": args.repeat,
        "interleave": args.interleave,
        "elapsed_s_of_every_run": elapsed_all,
    }
    ratios_of_pairs = pair_ratios(elapsed_all, minimum=1 if args.interleave else 2)
    if ratios_of_pairs is not None:
        print(format_pair_ratios(ratios_of_pairs, how))
        extra["ratio_total_tokens_per_s_of_each_pair"] = ratios_of_pairs
    if args.simulate:
        extra["cost_model"] = cost_model_description(args, settings)
    if args.compare_hf:
        from hybrid_cache.bench.hf_compare import compare_with_hf

        comparison = compare_with_hf(settings, make_progress("ours vs hf", settings))
        print(format_hf_comparison(comparison))
        extra["compare_hf"] = {
            **{k: v for k, v in comparison.items() if k != "ours"},
            "ours": comparison["ours"].summary(),
        }
    if args.output_json:
        document = json_document(settings, results, extra)
        Path(args.output_json).write_text(json.dumps(document, indent=2) + "\n", encoding="utf-8")
    if args.plot:
        from hybrid_cache.bench.plot import plot_runs

        kind = "simulated" if args.simulate else "measured"
        title = (
            f"{args.model}: {settings.num_prompts} prompts, {settings.input_len} in / "
            f"{settings.output_len} out ({kind})"
        )
        plot_runs(results, args.plot, title)
    return 0


def run_sweep(args: argparse.Namespace, budgets: list[str]) -> int:
    """Every mode at every budget: each budget's report, then one table of the reusable-token
    hit rate (multi-turn) and throughput against the budget; `--plot` draws that curve."""
    from hybrid_cache.bench.report import format_report, format_sweep, json_document

    print_workload(settings_from_args(args, budgets[0]))
    how = "interleaved" if args.interleave else "alternating"
    points: list[tuple[str, dict[str, Any]]] = []
    documents = []
    for budget in budgets:
        settings = settings_from_args(args, budget)
        print(f"=== --kv-cache-memory {budget} ===")
        results, elapsed_all = run_modes(args, settings)
        print(format_report(results, args.repeat, how))
        points.append((budget, results))
        documents.append(json_document(settings, results, {"elapsed_s_of_every_run": elapsed_all}))
    print(format_sweep(points))
    if args.output_json:
        Path(args.output_json).write_text(
            json.dumps({"sweep": documents}, indent=2) + "\n", encoding="utf-8"
        )
    if args.plot:
        from hybrid_cache.bench.plot import plot_sweep

        plot_sweep(points, args.plot, f"{args.model}: {args.workload} workload, budget sweep")
    return 0


def split_budgets(text: Optional[str]) -> list[Optional[str]]:
    """`--kv-cache-memory` as a list of budgets (`[None]` when not given); each is parsed here,
    so a bad size is a typed `MemorySizeError` before any work."""
    from hybrid_cache.sizes import parse_memory_size

    if text is None:
        return [None]
    budgets = [part.strip() for part in text.split(",")]
    if any(not budget for budget in budgets):
        raise BenchConfigError(
            f"--kv-cache-memory {text!r} has an empty entry; give sizes separated by commas, "
            "e.g. 2MiB,4MiB,8MiB"
        )
    for budget in budgets:
        parse_memory_size(budget)
    return budgets


def print_workload(settings: Any) -> None:
    """For the multi-turn workload: its size and what uniform would need to keep every history
    (the yardstick budgets are read against)."""
    if settings.multi_turn is None:
        return
    from hybrid_cache.bench.multi_turn import uniform_history_bytes
    from hybrid_cache.config import load_model_spec
    from hybrid_cache.sizes import format_memory_size

    shape = settings.multi_turn
    spec = load_model_spec(settings.model, settings.hf_overrides)
    print(
        f"Multi-turn workload: {shape.num_sessions} sessions x {shape.num_turns} turns, system "
        f"prompt {shape.system_len}, {shape.turn_input_len} user + {shape.output_len} generated "
        f"tokens per turn (last turn {shape.max_total_tokens} tokens); a uniform cache keeping "
        f"every history needs {format_memory_size(uniform_history_bytes(spec, shape))}"
    )


def run_modes(args: argparse.Namespace, settings: Any) -> tuple[dict[str, Any], dict[str, list]]:
    """Each mode `--repeat` times, alternating in ABBA order (hybrid, uniform, uniform, hybrid,
    ...) so both see the same background load and neither always runs first after a pause, or
    (`--interleave`) both side by side each repeat, leading by turns; keeps each mode's fastest
    run, and every run's seconds (in each mode's run order). With `--tensor-parallel-size` N > 1
    every mode also runs on one rank ("<mode> tp1"), next to its N-rank run."""
    results: dict[str, Any] = {}
    runs_of = labelled_runs(settings, modes_of(args))
    elapsed_all: dict[str, list] = {label: [] for label in runs_of}
    for repeat in range(args.repeat):
        labels = list(runs_of) if repeat % 2 == 0 else list(reversed(runs_of))
        if args.interleave:
            expected = {label: times[-1] for label, times in elapsed_all.items() if times}
            runs = run_side_by_side({label: runs_of[label] for label in labels}, expected)
        else:
            runs = {label: run_mode(args, *runs_of[label]) for label in labels}
        for label, result in runs.items():
            elapsed_all[label].append(result.elapsed_s)
            if label not in results or result.elapsed_s < results[label].elapsed_s:
                results[label] = result
    return results, elapsed_all


def labelled_runs(settings: Any, modes: tuple[str, ...]) -> dict[str, tuple[Any, str]]:
    """The runs of one repeat by label: (settings, mode) per mode and, under tensor
    parallelism, the same mode on one rank."""
    import dataclasses

    from hybrid_cache.bench.report import TP1_SUFFIX

    runs = {mode: (settings, mode) for mode in modes}
    if settings is not None and settings.tensor_parallel_size > 1:
        one_rank = dataclasses.replace(settings, tensor_parallel_size=1)
        runs.update({f"{mode}{TP1_SUFFIX}": (one_rank, mode) for mode in modes})
    return runs


def run_side_by_side(
    runs: dict[str, tuple[Any, str]], expected: dict[str, float]
) -> dict[str, Any]:
    from hybrid_cache.bench.interleaved import run_labelled

    settings = next(iter(runs.values()))[0]
    progress = make_progress(f"bench {' + '.join(runs)} (interleaved)", settings, len(runs))
    try:
        return run_labelled(runs, expected or None, progress)
    finally:
        progress.close()


def run_mode(args: argparse.Namespace, settings: Any, mode: str) -> Any:
    progress = make_progress(f"bench {mode}", settings)
    try:
        if args.simulate:
            from hybrid_cache.bench.simulate import simulate_mode

            return simulate_mode(settings, mode, hardware_from_args(args), progress)
        from hybrid_cache.bench.engine_run import run_engine_mode

        return run_engine_mode(settings, mode, progress)
    finally:
        progress.close()


def settings_from_args(args: argparse.Namespace, kv_cache_memory: Optional[str]) -> Any:
    from hybrid_cache.bench.multi_turn import MultiTurnShape
    from hybrid_cache.bench.settings import BenchSettings, engine_errors_as_bench_errors

    with engine_errors_as_bench_errors():
        config = engine_config_from_args(args, kv_cache_memory=kv_cache_memory)
    flags = {
        **BenchSettings.engine_flags(config),
        "kv_cache_memory": kv_cache_memory,
        "logprobs": args.logprobs,
        "stop": tuple(args.stop),
    }
    if args.workload == "multi-turn":
        shape = MultiTurnShape(
            num_sessions=args.num_sessions,
            num_turns=args.num_turns,
            system_len=args.system_len,
            turn_input_len=args.turn_input_len,
            output_len=args.output_len,
        )
        return BenchSettings.for_multi_turn(args.model, shape, **flags)
    return BenchSettings(
        model=args.model,
        input_len=args.input_len,
        output_len=args.output_len,
        num_prompts=args.num_prompts,
        prefix_len=args.prefix_len,
        **flags,
    )


def check_flags(args: argparse.Namespace) -> None:
    check_workload_flags(args)
    if args.simulate and args.compare_hf:
        raise BenchConfigError("--compare-hf runs real models; it cannot be used with --simulate")
    if args.plot is not None and not args.plot.lower().endswith(".png"):
        raise BenchConfigError(f"--plot writes a PNG: give a path ending in .png, got {args.plot}")
    two_runs = args.kv_cache_mode == "both" or (args.tensor_parallel_size or 1) > 1
    if args.interleave and (args.simulate or not two_runs):
        raise BenchConfigError(
            "--interleave runs engines side by side: it needs --kv-cache-mode both (or "
            "--tensor-parallel-size N > 1, run next to one rank) and the real engine (not "
            "--simulate)"
        )
    if args.simulate and args.tensor_parallel_size > 1:
        raise BenchConfigError(
            "--simulate models one device: drop --tensor-parallel-size (or --simulate)"
        )
    if args.simulate and (args.stop or args.logprobs is not None):
        raise BenchConfigError("--stop and --logprobs need the real engine, not --simulate")
    if args.repeat <= 0:
        raise BenchConfigError(f"--repeat must be positive, got {args.repeat}")
    if args.num_threads is not None and args.num_threads <= 0:
        raise BenchConfigError(f"--num-threads must be positive, got {args.num_threads}")
    if args.simulate:
        hardware_from_args(args)


def check_workload_flags(args: argparse.Namespace) -> None:
    """Each workload's own flags are given, and the other's are not."""
    if args.workload == "random":
        for flag in ("input_len", "num_prompts"):
            if getattr(args, flag) is None:
                raise BenchConfigError(f"--{flag.replace('_', '-')} is required (random workload)")
        if args.turn_input_len is not None:
            raise BenchConfigError(
                "--turn-input-len belongs to the multi-turn workload: add --workload multi-turn"
            )
        return
    if args.turn_input_len is None:
        raise BenchConfigError("--workload multi-turn needs --turn-input-len (user tokens a turn)")
    for flag in ("input_len", "num_prompts"):
        if getattr(args, flag) is not None:
            raise BenchConfigError(
                f"--{flag.replace('_', '-')} belongs to the random workload; the multi-turn one "
                "is sized by --num-sessions, --num-turns, --system-len and --turn-input-len"
            )
    if args.prefix_len:
        raise BenchConfigError(
            "--prefix-len belongs to the random workload; the multi-turn one shares --system-len"
        )
    if args.compare_hf:
        raise BenchConfigError("--compare-hf runs the random workload only; drop it")


def hardware_from_args(args: argparse.Namespace) -> Any:
    from hybrid_cache.bench.cost_model import Hardware
    from hybrid_cache.sizes import parse_memory_size

    return Hardware(
        memory_bytes=parse_memory_size(args.gpu_memory),
        memory_utilization=args.gpu_memory_utilization,
    )


def cost_model_description(args: argparse.Namespace, settings: Any) -> dict[str, Any]:
    from hybrid_cache.bench.cost_model import CostModel
    from hybrid_cache.config import load_model_spec

    spec = load_model_spec(settings.model, settings.hf_overrides)
    return dict(CostModel(spec, hardware_from_args(args)).describe())


def make_progress(description: str, settings: Any, num_modes: int = 1) -> Any:
    from tqdm.auto import tqdm

    return tqdm(total=settings.num_prompts * num_modes, desc=description, unit="req")
