"""How many bytes the KV cache gets.

Order of precedence:
1. `kv_cache_memory` when the caller gives it (bytes or a size string like "4GiB").
2. On CUDA, a profile run: one forward at the largest batch the scheduler can form
   (`max_num_batched_tokens` tokens), then
   `budget = total_memory * gpu_memory_utilization - memory used by everything else at the peak`.
3. On the CPU, `engine_config.DEFAULT_CPU_KV_CACHE_MEMORY` (512 MiB): enough for the small models the CPU runs,
   and cheap to zero. Pass `kv_cache_memory` for anything larger.

`check_kv_cache_fits`: the planned KV tensors must fit the memory the device has free (the host's
available memory for the CPU), checked before they are allocated, so an impossible budget is a
typed error and not an out-of-memory kill.
"""

from __future__ import annotations

import torch
from torch import nn

from hybrid_cache.attention import attention_layers, build_attention_metadata, set_forward_context
from hybrid_cache.engine import host_memory
from hybrid_cache.engine.engine_config import DEFAULT_CPU_KV_CACHE_MEMORY
from hybrid_cache.engine.errors import EngineConfigError, KVCacheMemoryError
from hybrid_cache.engine.model_runner import metadata_to
from hybrid_cache.planner import DEFAULT_BLOCK_SIZE
from hybrid_cache.sizes import MemorySize, format_memory_size, parse_memory_size

PROFILE_BLOCK_SIZE = DEFAULT_BLOCK_SIZE  # the scratch run only measures activations


def kv_cache_budget(
    model: nn.Module,
    device: torch.device,
    kv_cache_memory: MemorySize | None,
    gpu_memory_utilization: float,
    max_num_batched_tokens: int,
    max_num_seqs: int,
) -> int:
    """Bytes for the KV cache (see the module docstring)."""
    if kv_cache_memory is not None:
        return parse_memory_size(kv_cache_memory)
    if device.type != "cuda":
        return DEFAULT_CPU_KV_CACHE_MEMORY
    return profile_cuda_budget(
        model, device, gpu_memory_utilization, max_num_batched_tokens, max_num_seqs
    )


def check_kv_cache_fits(num_bytes: int, device: torch.device) -> None:
    """`KVCacheMemoryError` when `num_bytes` of KV tensors exceed what `device` has free: the
    host's available memory for the CPU, free plus cached-but-unused memory for CUDA."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        cached = torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
        available, where = free + cached, f"is free on {device}"
    else:
        available, where = host_memory.available_bytes(), "of host memory is available"
    if available is None or num_bytes <= available:
        return
    raise KVCacheMemoryError(
        f"the KV cache needs {format_memory_size(num_bytes)} but only "
        f"{format_memory_size(available)} {where}; lower --kv-cache-memory to at most "
        f"{format_memory_size(available)} (LLM argument kv_cache_memory), or free memory"
    )


@torch.inference_mode()
def profile_cuda_budget(
    model: nn.Module,
    device: torch.device,
    gpu_memory_utilization: float,
    max_num_batched_tokens: int,
    max_num_seqs: int,
) -> int:
    """Runs one forward of `max_num_batched_tokens` tokens over a scratch cache and returns what
    `gpu_memory_utilization` of the device leaves after the peak."""
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    num_tokens = max_num_batched_tokens
    num_blocks = -(-num_tokens // PROFILE_BLOCK_SIZE) + 1
    dtype = next(model.parameters()).dtype
    kv_caches = []
    for layer in attention_layers(model):
        layer.group_id = 0  # the scratch run has one group; the runner assigns the real ones
        shape = (num_blocks, PROFILE_BLOCK_SIZE, layer.num_kv_heads, layer.head_dim)
        kv_caches.append(tuple(torch.zeros(shape, dtype=dtype, device=device) for _ in range(2)))
    table = torch.arange(1, num_blocks, dtype=torch.int32).unsqueeze(0)
    metadata, positions = build_attention_metadata([num_tokens], [0], [table], [PROFILE_BLOCK_SIZE])
    metadata = metadata_to(metadata, device)
    input_ids = torch.zeros(num_tokens, dtype=torch.long, device=device)
    with set_forward_context(metadata, kv_caches):
        hidden = model(input_ids, positions.to(device))
    model.compute_logits(hidden[: min(max_num_seqs, num_tokens)])
    torch.cuda.synchronize(device)

    peak_torch = torch.cuda.max_memory_allocated(device)
    free, total = torch.cuda.mem_get_info(device)
    outside_torch = total - free - torch.cuda.memory_reserved(device)
    scratch = sum(t.numel() * t.element_size() for pair in kv_caches for t in pair)
    del kv_caches, hidden
    torch.cuda.empty_cache()
    budget = int(total * gpu_memory_utilization) - outside_torch - (peak_torch - scratch)
    if budget <= 0:
        raise EngineConfigError(
            f"no memory left for the KV cache: the model and a {num_tokens}-token forward use "
            f"{peak_torch} B of {total} B; raise gpu_memory_utilization, lower "
            "max_num_batched_tokens, or pass kv_cache_memory"
        )
    return budget
