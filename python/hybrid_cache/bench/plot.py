"""`--plot FILE.png`: KV blocks in use per group over engine steps, and running requests over
steps, for every mode of the run on one figure (matplotlib, Agg backend: no display needed).

Blocks are drawn as a share of the pool's usable blocks: a hybrid block and a uniform block
hold different numbers of layers (the planner's `layers_per_group`), so raw block counts of two
modes are not comparable, while shares of the same KV budget are."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path

from hybrid_cache.bench.metrics import RunResult
from hybrid_cache.sizes import parse_memory_size

MODE_STYLES = {"hybrid": "-", "uniform": "--"}


def groups_by_kind(group_kinds: list[str]) -> dict[str, list[int]]:
    """Group ids by attention kind (`sliding_window(W=16) x2` -> `sliding_window(W=16)`), so a
    model with many identical groups draws one line per kind."""
    kinds: dict[str, list[int]] = {}
    for group, name in enumerate(group_kinds):
        kinds.setdefault(name.split(" x")[0], []).append(group)
    return kinds


def plot_runs(results: Mapping[str, RunResult], path: str, title: str) -> None:
    """Writes a two-panel PNG: top, blocks in use per attention kind (% of the pool; groups of
    one kind summed) and all groups together; bottom, requests in the batch per step."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, (blocks_axis, running_axis) = plt.subplots(
        2, 1, figsize=(11, 7.5), sharex=True, constrained_layout=True
    )
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    color_index = 0
    for mode, result in results.items():
        style = MODE_STYLES.get(mode, ":")
        steps = range(result.num_steps)
        percent = 100.0 / max(result.num_blocks - 1, 1)
        for kind, groups in groups_by_kind(result.group_kinds).items():
            series = [
                sum(per_group[g] for g in groups) * percent
                for per_group in result.blocks_per_group_per_step
            ]
            color = colors[color_index % len(colors)]
            color_index += 1
            label = f"{mode}: {kind}" + (f" ({len(groups)} groups)" if len(groups) > 1 else "")
            blocks_axis.plot(steps, series, style, color=color, label=label)
        if len(result.group_kinds) > 1:
            total = [sum(per_group) * percent for per_group in result.blocks_per_group_per_step]
            blocks_axis.plot(steps, total, style, color="black", label=f"{mode}: all groups")
        running_axis.plot(
            steps,
            result.running_per_step,
            style,
            label=f"{mode} (mean {result.mean_running:.1f}, {result.total_tokens_per_s:.0f} tok/s)",
        )
    blocks_axis.set_ylabel("KV blocks in use (% of pool)")
    blocks_axis.set_ylim(0, 105)
    blocks_axis.set_title(title)
    blocks_axis.legend(fontsize=8, loc="center right")
    blocks_axis.grid(alpha=0.3)
    running_axis.set_ylabel("requests in the batch")
    running_axis.set_xlabel("engine step")
    running_axis.legend(fontsize=8, loc="upper right")
    running_axis.grid(alpha=0.3)
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=110)
    plt.close(figure)


def plot_sweep(
    points: Sequence[tuple[str, Mapping[str, RunResult]]], path: str, title: str
) -> None:
    """Writes a two-panel PNG of a budget sweep: top, each mode's reusable-token hit rate
    (multi-turn) against the budget; bottom, total tokens/s against the budget."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, (hit_axis, speed_axis) = plt.subplots(
        2, 1, figsize=(8, 7), sharex=True, constrained_layout=True
    )
    budgets_mib = [parse_memory_size(budget) / 2**20 for budget, _ in points]
    modes = list(points[0][1]) if points else []
    for mode in modes:
        style = MODE_STYLES.get(mode, ":")
        rates = []
        for _, results in points:
            reuse = results[mode].reuse
            rate = None if reuse is None else reuse.hit_rate
            rates.append(float("nan") if rate is None else 100.0 * rate)
        hit_axis.plot(budgets_mib, rates, style, marker="o", label=mode)
        speeds = [results[mode].total_tokens_per_s for _, results in points]
        speed_axis.plot(budgets_mib, speeds, style, marker="o", label=mode)
    hit_axis.set_ylabel("reusable-token hit rate (%)")
    hit_axis.set_ylim(0, 100)
    hit_axis.legend()
    hit_axis.grid(alpha=0.3)
    speed_axis.set_ylabel("total tokens/s")
    speed_axis.set_xlabel("KV cache budget (MiB)")
    speed_axis.grid(alpha=0.3)
    hit_axis.set_title(title)
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=110)
    plt.close(figure)
