"""`hybrid-cache plan`: KV capacity and concurrency of a model on a memory budget, hybrid vs
uniform, without loading weights. Answers "how many requests fit?" before anyone buys a GPU.
With `--tensor-parallel-size N` the budget is one device's and the figures are one rank's: each
rank holds 1/N of the KV heads (or one replicated head), so the same budget holds more tokens.
The weight bytes a rank holds beside the budget (`weight_bytes.py`: its shard, the embedding and
LM head vocabulary-parallel unless `--no-vocab-parallel`) are shown too."""

from __future__ import annotations

import argparse
import json
from collections import Counter
from dataclasses import asdict
from typing import Any

from hybrid_cache.config import ModelSpec, check_tensor_parallel
from hybrid_cache.engine.engine_config import (
    BOTH_MODES,
    REQUIRED,
    add_engine_arguments,
    engine_config_from_args,
    modes_of,
)
from hybrid_cache.planner import (
    DEFAULT_MAX_PADDING_WASTE,
    KVCacheLayout,
    PlanOptions,
    PlanReport,
    plan_kv_cache,
    report_plan,
)
from hybrid_cache.sizes import format_memory_size
from hybrid_cache.weight_bytes import RankWeights, rank_weight_bytes

KV_CACHE_DTYPES = ("auto", "bf16", "fp16", "fp32", "fp8")


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "plan",
        help="plan the KV cache of a model on a memory budget (hybrid vs uniform)",
        description="Groups, page size, blocks, capacity and max concurrency of a model's KV "
        "cache, for the hybrid allocator and a uniform one side by side.",
    )
    add_engine_arguments(
        parser,
        plan_only=True,
        both_modes=True,
        help_texts={"kv_cache_memory": "KV budget: bytes or e.g. 40GiB, 512MB"},
        kv_cache_memory=REQUIRED,
        kv_cache_mode=BOTH_MODES,
    )
    parser.add_argument(
        "--kv-cache-dtype",
        choices=KV_CACHE_DTYPES,
        default="auto",
        help="dtype of the KV cache (auto: the model's dtype)",
    )
    parser.add_argument(
        "--max-padding-waste",
        type=float,
        default=DEFAULT_MAX_PADDING_WASTE,
        help="largest share of a max-length request's memory that group and page padding may "
        "cost when the planner sizes groups",
    )
    parser.add_argument(
        "--strict-windows",
        action="store_true",
        help="error on windows >= max model len instead of planning them as full attention",
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    config = engine_config_from_args(args)
    full_model = config.model_spec()
    ranks = config.tensor_parallel_size
    check_tensor_parallel(full_model, ranks)
    model = full_model.per_rank(ranks)
    weights = rank_weight_bytes(full_model, ranks, config.vocab_parallel)
    options = config.plan_options(
        config.kv_cache_memory,
        config.resolved_max_model_len(model),
        kv_cache_dtype=args.kv_cache_dtype,
        max_padding_waste=args.max_padding_waste,
        strict_windows=args.strict_windows,
    )
    plans = {}
    for mode in modes_of(args):
        layout = plan_kv_cache(model, options, mode)
        plans[mode] = (layout, report_plan(layout, model))
    if args.json:
        print(json.dumps(_as_json(model, options, plans, weights, config.vocab_parallel), indent=2))
    else:
        print(_as_text(model, options, plans, weights, config.vocab_parallel))
    return 0


def _layer_summary(model: ModelSpec) -> str:
    counts = Counter(
        layer.kind if layer.kind == "full" else f"{layer.kind}({layer.window or layer.chunk})"
        for layer in model.layers
    )
    return ", ".join(f"{count} {kind}" for kind, count in counts.items())


def _format_layers(layers: tuple[int, ...]) -> str:
    """`0-4` for a run, `1,3,5` otherwise."""
    if len(layers) > 2 and layers == tuple(range(layers[0], layers[-1] + 1)):
        return f"{layers[0]}-{layers[-1]}"
    return ",".join(map(str, layers))


def _as_text(
    model: ModelSpec,
    options: PlanOptions,
    plans: dict[str, tuple[KVCacheLayout, PlanReport]],
    weights: RankWeights,
    vocab_parallel: bool,
) -> str:
    any_layout = next(iter(plans.values()))[0]
    length = options.max_model_len
    lines = [
        f"model    {model.name} ({model.architecture}, {model.num_layers} layers: "
        f"{_layer_summary(model)})",
        f"budget   {format_memory_size(options.kv_cache_memory)} of {any_layout.kv_cache_dtype} "
        f"KV, block size {options.block_size}, max_model_len {length}, "
        f"max_num_batched_tokens {options.max_num_batched_tokens}",
        *_rank_lines(model, weights, vocab_parallel),
        "",
    ]
    rows = [
        ("groups", lambda lay, rep: lay.num_groups),
        ("layers per group", lambda lay, rep: _group_sizes(lay)),
        ("page bytes", lambda lay, rep: f"{lay.page_bytes} ({format_memory_size(lay.page_bytes)})"),
        ("num blocks", lambda lay, rep: lay.num_blocks),
        (f"blocks per request @{length}", lambda lay, rep: rep.blocks_per_request),
        (f"max concurrency @{length}", lambda lay, rep: rep.max_concurrency),
        (f"token capacity @{length}", lambda lay, rep: rep.token_capacity),
        (
            "bytes per request, exact",
            lambda lay, rep: format_memory_size(rep.exact_bytes_per_request),
        ),
        (
            "bytes per request, alloc",
            lambda lay, rep: format_memory_size(rep.allocated_bytes_per_request),
        ),
        ("memory efficiency", lambda lay, rep: f"{rep.efficiency:.2%}"),
    ]
    lines.append(f"{'':30}" + "".join(f"{mode:>22}" for mode in plans))
    for label, value in rows:
        cells = "".join(f"{value(lay, rep)!s:>22}" for lay, rep in plans.values())
        lines.append(f"{label:30}{cells}")
    for mode, (layout, _) in plans.items():
        lines += [
            "",
            f"{mode} groups",
            "  id  kind            window/chunk  block  page used  layers",
        ]
        for group in layout.groups:
            reach = group.window or group.chunk or "-"
            used = f"{group.used_page_bytes / group.page_bytes:.0%}"
            lines.append(
                f"  {group.group_id:<3} {group.kind:<15} {reach!s:<13} {group.block_size:<6} "
                f"{used:<10} {_format_layers(group.layer_indices)}"
            )
        lines += [f"  note: {note}" for note in layout.notes]
    return "\n".join(lines)


def _rank_lines(model: ModelSpec, weights: RankWeights, vocab_parallel: bool) -> list[str]:
    """The weights (one rank's) and, under tensor parallelism, what one rank holds (the
    figures below are one rank's)."""
    vocab = f"embedding and LM head {format_memory_size(weights.vocab)}"
    if model.tensor_parallel_size == 1:
        return [f"weights  {format_memory_size(weights.total)} besides the budget ({vocab})"]
    heads = sorted({layer.num_kv_heads for layer in model.layers})
    how = "vocabulary-parallel" if vocab_parallel else "replicated"
    return [
        f"ranks    {model.tensor_parallel_size} (tensor parallel): {'/'.join(map(str, heads))} "
        "KV heads per rank; the budget is one device's and every figure below one rank's",
        f"weights  {format_memory_size(weights.total)} per rank besides the budget ({vocab}, "
        f"{how})",
    ]


def _group_sizes(layout: KVCacheLayout) -> str:
    """`layers_per_group`, or each group's layer count where groups share pages per type."""
    if all(group.layers_per_page == 1 for group in layout.groups):
        return str(layout.layers_per_group)
    return "/".join(str(len(group.layer_indices)) for group in layout.groups) + " (per type)"


def _as_json(
    model: ModelSpec,
    options: PlanOptions,
    plans: dict[str, tuple[KVCacheLayout, PlanReport]],
    weights: RankWeights,
    vocab_parallel: bool,
) -> dict[str, Any]:
    result: dict[str, Any] = {
        "model": {
            "name": model.name,
            "architecture": model.architecture,
            "num_layers": model.num_layers,
            "dtype": model.dtype,
            "layer_kinds": [layer.kind for layer in model.layers],
            "tensor_parallel_size": model.tensor_parallel_size,
            "kv_heads_per_rank": [layer.num_kv_heads for layer in model.layers],
            "vocab_parallel": vocab_parallel,
            "weight_bytes_per_rank": weights.total,
            "vocab_weight_bytes_per_rank": weights.vocab,
        },
        "options": asdict(options),
    }
    for mode, (layout, report) in plans.items():
        result[mode] = {
            "groups": [asdict(group) for group in layout.groups],
            "page_bytes": layout.page_bytes,
            "num_blocks": layout.num_blocks,
            "layers_per_group": layout.layers_per_group,
            "tensor_slots": [list(slot) for slot in layout.tensor_slots],
            "kv_cache_dtype": layout.kv_cache_dtype,
            "notes": list(layout.notes),
            "report": asdict(report),
        }
    return result
