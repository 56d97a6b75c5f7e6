"""What `LLM` (and each tensor-parallel worker) derives from its (already validated)
`EngineConfig`: the device (a rank's device), the dtype, the model, the end-of-sequence ids, the
check that one `max_model_len` request fits the plan, and the plan summary the engine logs."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterable, Union

import torch
from torch import nn

from hybrid_cache.config import ModelSpec, normalize_dtype
from hybrid_cache.errors import (
    BudgetTooSmallError,
    DeviceUnavailableError,
    TensorParallelConfigError,
)
from hybrid_cache.models import load_model
from hybrid_cache.models.parallel_layers import NO_SHARD, TensorShard
from hybrid_cache.planner import KVCacheLayout, report_plan
from hybrid_cache.sizes import format_memory_size

if TYPE_CHECKING:
    from hybrid_cache.engine.engine_config import EngineConfig

logger = logging.getLogger("hybrid_cache.engine.llm")


def resolve_device(device: Union[str, torch.device, None]) -> torch.device:
    """The engine's device: as given, else CUDA when available, else the CPU. A device this
    machine lacks (CUDA without a GPU, an index past the last GPU) or a name that is not a
    device raises `DeviceUnavailableError` before anything is loaded."""
    if device is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        resolved = torch.device(device)
    except (RuntimeError, TypeError) as error:
        raise DeviceUnavailableError(
            f"--device {device!r} is not a device: use cpu, cuda or cuda:N, or leave it unset "
            "(LLM argument device)"
        ) from error
    if resolved.type == "cpu":
        return resolved
    if resolved.type != "cuda":
        raise DeviceUnavailableError(
            f"--device {device!r}: the engine runs on cpu or cuda (LLM argument device)"
        )
    if not torch.cuda.is_available():
        built = f"built with CUDA {torch.version.cuda}" if torch.version.cuda else "a CPU build"
        raise DeviceUnavailableError(
            f"--device {device!r}: this machine has no usable CUDA device (torch "
            f"{torch.__version__}, {built}, sees none); use --device cpu or leave --device "
            "unset (LLM argument device)"
        )
    count = torch.cuda.device_count()
    if resolved.index is not None and resolved.index >= count:
        raise DeviceUnavailableError(
            f"--device {device!r}: this machine has {count} CUDA device(s), cuda:0 to "
            f"cuda:{count - 1} (LLM argument device)"
        )
    return resolved


def rank_device(
    device: torch.device, rank: int, tensor_parallel_size: int, local_rank: int | None = None
) -> torch.device:
    """The device of tensor-parallel `rank`: the CPU for every rank, or on CUDA the `rank`-th
    GPU from `device`'s index (`TensorParallelConfigError` when the machine has too few); under
    torchrun (`local_rank` given) the GPU of the rank's index on its host."""
    if device.type != "cuda" or tensor_parallel_size == 1:
        return device
    if local_rank is not None:
        return torch.device("cuda", local_rank)
    first = device.index or 0
    count = torch.cuda.device_count()
    if first + tensor_parallel_size > count:
        raise TensorParallelConfigError(
            f"--tensor-parallel-size {tensor_parallel_size} needs one GPU per rank, "
            f"cuda:{first} to cuda:{first + tensor_parallel_size - 1}, and this machine has "
            f"{count}; lower it (LLM argument tensor_parallel_size) or run on --device cpu"
        )
    return torch.device("cuda", first + rank)


def needs_profile(config: EngineConfig, device: torch.device) -> bool:
    """Whether the KV budget comes from a profile run (CUDA without `kv_cache_memory`)."""
    return config.kv_cache_memory is None and device.type == "cuda"


def load_engine_model(
    config: EngineConfig,
    spec: ModelSpec,
    dtype: torch.dtype,
    device: torch.device,
    shard: TensorShard = NO_SHARD,
) -> nn.Module:
    """The model of `config` (its `shard`): the folder's weights, or seeded random ones for
    `load_format="dummy"` and for a preset (which has none; logged on rank 0)."""
    is_folder = Path(config.model).is_dir()
    if config.load_format == "auto" and not is_folder and shard.rank == 0:
        logger.info("%s is a preset without weights: using random (dummy) weights", config.model)
    return load_model(
        config.model if is_folder else None,
        spec=spec,
        load_format=config.load_format if is_folder else "dummy",
        dtype=dtype,
        device=device,
        seed=config.seed,
        shard=shard,
    )


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


def eos_token_ids(
    hf_config: Mapping[str, Any], tokenizer: Any, generation_eos: Iterable[int] = ()
) -> tuple[int, ...]:
    """End-of-sequence ids, in order, each once: config.json's `eos_token_id` (an int or a
    list), the generation config's (`generation_eos`), and the tokenizer's."""
    ids: list[int] = []
    for value in (
        hf_config.get("eos_token_id"),
        list(generation_eos),
        None if tokenizer is None else getattr(tokenizer, "eos_token_id", None),
    ):
        for item in value if isinstance(value, (list, tuple)) else [value]:
            if item is not None and int(item) not in ids:
                ids.append(int(item))
    return tuple(ids)


def check_one_request_fits(layout: KVCacheLayout, spec: ModelSpec, budget: int) -> None:
    """`BudgetTooSmallError` when the pool cannot hold one request of `max_model_len` tokens
    (the core's worst case, what admission checks), naming the budget that would and the
    longest `max_model_len` that fits."""
    report = report_plan(layout, spec)
    if report.max_concurrency >= 1:
        return
    usable = layout.num_blocks - 1
    low, high = 0, report.context_len  # the longest length that fits is in [low, high)
    while high - low > 1:
        middle = (low + high) // 2
        if report_plan(layout, spec, middle).blocks_per_request <= usable:
            low = middle
        else:
            high = middle
    block_bytes = layout.page_bytes * layout.layers_per_group
    needed = (report.blocks_per_request + 1) * block_bytes  # + the null block
    fits = f"at most {low}" if low > 0 else "nothing: not even one token fits"
    raise BudgetTooSmallError(
        f"the KV cache ({format_memory_size(budget)}: {usable} blocks) cannot hold one request "
        f"of max_model_len={report.context_len} tokens, which needs {report.blocks_per_request} "
        f"blocks; raise --kv-cache-memory to at least {format_memory_size(needed)} (LLM "
        "argument kv_cache_memory; a profiled CUDA budget grows with --gpu-memory-utilization) "
        f"or lower --max-model-len to {fits} (LLM argument max_model_len)"
    )


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
