"""The printed summary of a benchmark and its JSON document."""

from __future__ import annotations

import dataclasses
import statistics
from collections.abc import Mapping, Sequence
from typing import Any, Optional

from hybrid_cache.bench.metrics import RunResult
from hybrid_cache.bench.settings import BenchSettings

# The label of a mode's one-rank baseline in a tensor-parallel run ("hybrid" + this).
TP1_SUFFIX = " tp1"


def ratios(results: Mapping[str, RunResult]) -> Optional[dict[str, Optional[float]]]:
    """Hybrid over uniform, when both ran: throughput, mean concurrency and steps."""
    hybrid, uniform = results.get("hybrid"), results.get("uniform")
    if hybrid is None or uniform is None:
        return None

    def divide(a: float, b: float) -> float:
        return a / b if b else float("nan")

    by_cpu = None
    if hybrid.total_tokens_per_cpu_s and uniform.total_tokens_per_cpu_s:
        by_cpu = divide(hybrid.total_tokens_per_cpu_s, uniform.total_tokens_per_cpu_s)
    return {
        "total_tokens_per_s": divide(hybrid.total_tokens_per_s, uniform.total_tokens_per_s),
        "total_tokens_per_cpu_s": by_cpu,
        "output_tokens_per_s": divide(hybrid.output_tokens_per_s, uniform.output_tokens_per_s),
        "mean_running": divide(hybrid.mean_running, uniform.mean_running),
        "num_steps": divide(hybrid.num_steps, uniform.num_steps),
    }


def format_mode(result: RunResult) -> list[str]:
    """The lines printed for one mode."""
    peaks = ", ".join(
        f"{name}: {peak}" if count == 1 else f"{count} groups {name}: {peak} each"
        for name, peak, count in collapse_runs(
            list(zip(result.group_kinds, result.peak_blocks_per_group))
        )
    )
    kind = "simulated" if result.simulated else "measured"
    ranks = result.tensor_parallel_size
    where = f"tensor parallel {ranks}, " if ranks > 1 else ""
    lines = [
        f"== {result.mode} ({where}{kind}; {result.num_blocks - 1} usable blocks) ==",
        result.throughput_line(),
        f"Steps: {result.num_steps}, mean running requests: {result.mean_running:.2f}, "
        f"preemptions: {result.num_preemptions}, "
        f"prefix-cache hit rate: {result.prefix_cache_hit_rate:.1%}",
        f"Peak blocks per group: {peaks}",
    ]
    if result.total_tokens_per_cpu_s is not None:
        lines.append(
            f"CPU-time throughput: {result.total_tokens_per_cpu_s:.2f} total tokens per CPU "
            f"second ({result.cpu_time_s:.2f} s of process CPU time, {result.elapsed_s:.2f} s wall)"
        )
    if result.warm_up_s is not None:
        lines.append(
            f"Warm-up (untimed, compiles included): {result.warm_up_s:.2f} s, apart from the "
            f"run's {result.elapsed_s:.2f} s"
        )
    share = result.overhead_share()
    if share is not None and not result.simulated:
        largest = max(result.running_per_step)
        at_largest = result.overhead_share(largest)
        head_as_engine = result.overhead_share(largest, lm_head_is_model=False)
        lines.append(
            f"Engine overhead (step time outside the model forward and LM head): {share:.1%} of "
            f"all steps, {at_largest:.1%} of steps with {largest} requests "
            f"({head_as_engine:.1%} counting the LM head as engine time)"
        )
    broadcast = result.broadcast_share()
    if broadcast is not None:
        largest = max(result.running_per_step)
        lines.append(
            f"Step broadcast (rank 0 to the other ranks): posting it {broadcast:.1%} of step "
            f"time ({result.broadcast_share(largest):.1%} at {largest} requests, median "
            f"{statistics.median(result.broadcast_time_s) * 1e6:.0f} us)"
            + format_latency(result, largest)
        )
    if result.reuse is not None:
        lines.append(format_reuse(result))
    misses = format_misses(result)
    if misses:
        lines.append(misses)
    fit = result.decode_step_cost()
    if fit is not None:
        lines.append(
            f"Decode step time fit: {fit[0] * 1e3:.2f} ms + {fit[1] * 1e3:.3f} ms per request"
        )
    return lines


MISS_REASONS = (
    ("prefix_miss_window_tail", "window tail missing"),
    ("prefix_miss_evicted", "evicted"),
    ("prefix_miss_never_cached", "never cached"),
    ("prefix_miss_alignment", "alignment and last token"),
)


def format_latency(result: RunResult, largest: int) -> str:
    """`; the workers had it ...`: the broadcast's latency, where it was measured."""
    share = result.broadcast_share(latency=True)
    if share is None or not any(result.broadcast_latency_s):
        return ""
    return (
        f"; the slowest worker had it {statistics.median(result.broadcast_latency_s) * 1e6:.0f} "
        f"us after (median), {share:.1%} of step time "
        f"({result.broadcast_share(largest, latency=True):.1%} at {largest} requests)"
    )


def format_misses(result: RunResult) -> str:
    """Where the looked-up prompt tokens went (hit or why not) and, per group, what that group
    alone would have hit; empty when nothing was looked up."""
    counters = result.cache_counters
    queries = counters.get("prefix_queries", 0)
    if not queries:
        return ""
    parts = [f"hit {counters.get('prefix_hits', 0) / queries:.1%}"]
    parts += [f"{label} {counters.get(name, 0) / queries:.1%}" for name, label in MISS_REASONS]
    alone = counters.get("prefix_alone_hits_per_group", [])
    names = result.group_kinds or [str(group) for group in range(len(alone))]
    per_group = ", ".join(f"{name} {tokens / queries:.1%}" for name, tokens in zip(names, alone))
    line = f"Prompt tokens looked up: {', '.join(parts)}"
    if len(alone) > 1:
        line += f"; each group alone would hit: {per_group}"
    extras = []
    if counters.get("prefix_tail_hits", 0):
        extras.append(
            f"{counters['prefix_tail_hits']} hits ended on token tails "
            f"(+{counters.get('prefix_tail_gain', 0)} tokens)"
        )
    if counters.get("prefix_replays", 0):
        extras.append(
            f"{counters['prefix_replays']} tail replays (+{counters.get('prefix_replay_gain', 0)}"
            f" tokens hit, {counters.get('prefix_replay_tokens', 0)} recomputed)"
        )
    if extras:
        line += "; " + ", ".join(extras)
    return line


def format_reuse(result: RunResult) -> str:
    """The multi-turn reuse line: overall reusable-token hit rate and per turn."""
    reuse = result.reuse
    assert reuse is not None
    per_turn = ", ".join(
        f"t{turn.turn} {turn.hit_rate:.0%}" for turn in reuse.turns if turn.hit_rate is not None
    )
    overall = "n/a (one turn)" if reuse.hit_rate is None else f"{reuse.hit_rate:.1%}"
    net = "" if reuse.net_hit_rate is None else f"{reuse.net_hit_rate:.1%}"
    first = reuse.turns[0].hit_tokens if reuse.turns else 0
    return (
        f"Reusable-token hit rate: {overall} ({reuse.hit_tokens} of {reuse.reusable_tokens} "
        f"tokens an earlier turn computed; per turn: {per_turn or '-'}); "
        + (f"{net} net of what preempted requests recomputed; " if net else "")
        + f"turn 0 hit {first} system-prompt tokens"
    )


def format_sweep(points: Sequence[tuple[str, Mapping[str, RunResult]]]) -> str:
    """One row per budget: each mode's reusable-token hit rate (multi-turn runs) and total
    tokens/s, and hybrid over uniform where both ran."""
    modes = list(points[0][1]) if points else []
    header = ["budget"]
    for mode in modes:
        header += [f"{mode} hit", f"{mode} tok/s"]
    if len(modes) == 2:
        header.append("tok/s ratio")
    rows = [header]
    for budget, results in points:
        row = [budget]
        for mode in modes:
            result = results[mode]
            rate = None if result.reuse is None else result.reuse.hit_rate
            row += ["-" if rate is None else f"{rate:.1%}", f"{result.total_tokens_per_s:.0f}"]
        ratio = ratios(results)
        if ratio is not None:
            row.append(f"{ratio['total_tokens_per_s']:.2f}x")
        rows.append(row)
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    lines = ["== budget sweep =="]
    lines += ["  ".join(cell.rjust(width) for cell, width in zip(row, widths)) for row in rows]
    return "\n".join(lines)


def collapse_runs(pairs: list[tuple[str, int]]) -> list[tuple[str, int, int]]:
    """Consecutive equal (group name, peak) pairs as (name, peak, count): Gemma-3 has dozens
    of identical sliding-window groups."""
    runs: list[tuple[str, int, int]] = []
    for name, peak in pairs:
        if runs and runs[-1][:2] == (name, peak):
            runs[-1] = (name, peak, runs[-1][2] + 1)
        else:
            runs.append((name, peak, 1))
    return runs


def format_report(
    results: Mapping[str, RunResult], repeat: int = 1, how: str = "alternating"
) -> str:
    """`how`: "alternating" (modes one after the other) or "interleaved" (side by side)."""
    lines: list[str] = []
    if how == "interleaved":
        lines.append(
            f"(both modes side by side in one process, time slices by turns; each mode: the "
            f"fastest of {repeat} runs, its time the sum of its own slices)"
        )
    elif repeat > 1:
        lines.append(f"(each mode: the fastest of {repeat} alternating runs)")
    for result in results.values():
        lines.extend(format_mode(result))
    for label, result in results.items():
        baseline = results.get(f"{label}{TP1_SUFFIX}")
        if baseline is not None and baseline.total_tokens_per_s:
            lines.append(
                f"{label}: tensor parallel {result.tensor_parallel_size} / 1: "
                f"{result.total_tokens_per_s / baseline.total_tokens_per_s:.2f}x total tokens/s"
            )
    ratio = ratios(results)
    if ratio is not None:
        by_cpu = ratio["total_tokens_per_cpu_s"]
        lines.append(
            f"Hybrid/uniform: {ratio['total_tokens_per_s']:.2f}x total tokens/s"
            + ("" if by_cpu is None else f" ({by_cpu:.2f}x per CPU second)")
            + f", {ratio['mean_running']:.2f}x mean running requests, "
            f"{ratio['num_steps']:.2f}x steps"
        )
    return "\n".join(lines)


def pair_ratios(elapsed_all: Mapping[str, list], minimum: int = 2) -> Optional[list[float]]:
    """Hybrid/uniform throughput of each repeat's pair of runs (uniform seconds over hybrid
    seconds: both modes do the same work), or None without both modes and `minimum` repeats.
    With the ABBA order the i-th runs of the two modes ran next to each other, so each pair saw
    about the same machine; their median is a second reading of the ratio beside the fastest
    runs'. Interleaved pairs ran side by side (one pair is already a reading)."""
    hybrid, uniform = elapsed_all.get("hybrid", []), elapsed_all.get("uniform", [])
    if len(hybrid) < minimum or len(hybrid) != len(uniform):
        return None
    return [u / h for h, u in zip(hybrid, uniform)]


def format_pair_ratios(ratios_of_pairs: Sequence[float], how: str = "alternating") -> str:
    ordered = sorted(ratios_of_pairs)
    pairs = "interleaved pair" if how == "interleaved" else "pair of neighbouring runs"
    return (
        f"Hybrid/uniform per {pairs}: median {statistics.median(ordered):.2f}x "
        f"(from {ordered[0]:.2f}x to {ordered[-1]:.2f}x over {len(ordered)} pairs)"
    )


def format_hf_comparison(comparison: Mapping[str, Any]) -> str:
    ours: RunResult = comparison["ours"]
    ratio = comparison["ratio"]
    return "\n".join(
        [
            "== ours vs transformers generate_batch (same weights, prompts, greedy) ==",
            f"ours:         {ours.throughput_line()}",
            f"transformers: {comparison['hf_total_tokens_per_s']:.2f} total tokens/s, "
            f"{comparison['hf_output_tokens_per_s']:.2f} output tokens/s "
            f"({comparison['hf_elapsed_s']:.2f} s)",
            f"Ours/transformers: {ratio:.2f}x total tokens/s; identical outputs: "
            f"{comparison['num_identical_outputs']}/{ours.num_requests}",
        ]
    )


def json_document(
    settings: BenchSettings,
    results: Mapping[str, RunResult],
    extra: Optional[Mapping[str, Any]] = None,
) -> dict[str, Any]:
    """Settings, per-mode figures (with per-step series) and the hybrid/uniform ratios."""
    document: dict[str, Any] = {
        "settings": dataclasses.asdict(settings),
        "results": {mode: result.to_dict() for mode, result in results.items()},
        "ratio": ratios(results),
    }
    if extra:
        document.update(extra)
    return document
