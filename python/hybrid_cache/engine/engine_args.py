"""What `LLM` derives from its (already validated) `EngineConfig`: the dtype, the
end-of-sequence ids, and the plan summary the engine logs."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any, Union

import torch

from hybrid_cache.config import ModelSpec, normalize_dtype
from hybrid_cache.planner import KVCacheLayout, report_plan
from hybrid_cache.sizes import format_memory_size

logger = logging.getLogger("hybrid_cache.engine.llm")


def resolve_dtype(
    dtype: Union[str, torch.dtype, None], spec: ModelSpec, device: torch.device
) -> torch.dtype:
    """The model's dtype: as given; else float32 on the CPU and the config's dtype elsewhere."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype is None or dtype == "auto":
        name = "float32" if device.type == "cpu" else spec.dtype
    else:
        name = normalize_dtype(dtype)
    return getattr(torch, name)


def eos_token_ids(hf_config: Mapping[str, Any], tokenizer: Any) -> tuple[int, ...]:
    """End-of-sequence ids from the config (an int or a list), else the tokenizer's."""
    value = hf_config.get("eos_token_id")
    if value is None and tokenizer is not None:
        value = getattr(tokenizer, "eos_token_id", None)
    if value is None:
        return ()
    return tuple(value) if isinstance(value, (list, tuple)) else (int(value),)


def log_plan(layout: KVCacheLayout, spec: ModelSpec) -> None:
    """Logs groups, blocks, token capacity and concurrency of the plan (INFO)."""
    report = report_plan(layout, spec)
    groups = ", ".join(
        f"{g.kind}{'' if g.window is None else f'(W={g.window})'}"
        f"{'' if g.chunk is None else f'(C={g.chunk})'} x{len(g.layer_indices)} B={g.block_size}"
        for g in layout.groups
    )
    logger.info(
        "KV cache (%s): %d blocks of %d B x %d slots = %s; groups: %s; "
        "%d tokens of capacity, max concurrency %d at %d tokens",
        layout.mode,
        layout.num_blocks,
        layout.page_bytes,
        layout.layers_per_group,
        format_memory_size(layout.tensor_bytes * layout.layers_per_group),
        groups,
        report.token_capacity,
        report.max_concurrency,
        report.context_len,
    )
    for note in layout.notes:
        logger.info("plan note: %s", note)
