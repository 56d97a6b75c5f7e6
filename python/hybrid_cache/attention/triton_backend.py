"""The Triton attention backend: `hybrid_cache.kernels` behind the reference backend's interface.

    write_kv(k_cache, v_cache, k, v, slot_mapping)         -> kernels.write_kv_cache
    paged_attention(q, k_cache, v_cache, metadata, group,  -> kernels.unified_attention over the
                    params)                                   group's block table, one launch for
                                                              the prefill chunks and decode tokens

Runs on CUDA, or on the CPU when TRITON_INTERPRET=1 was set before Triton was imported (slow;
for tests). `selector.resolve_attention_backend` checks that before selecting it; the launchers
raise `KernelArgumentError` otherwise.

Per step, not per layer: the kernels want int32 `query_start_loc` / `seq_lens` / block tables,
contiguous and on the query's device. `step_tensors` / `group_block_table` convert them once and
cache the result on the metadata objects (keyed by the source tensors' identity, so a runner that
replaces a field gets a fresh conversion), so the other layers of the step reuse them with no
copy and no host sync. Importing this module imports neither Triton nor the kernels.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from hybrid_cache import kernels
from hybrid_cache.attention.metadata import AttentionMetadata, GroupMetadata
from hybrid_cache.attention.params import AttentionParams
from hybrid_cache.step_cache import cached_on

# Attribute names of the per-step caches stored on the metadata objects.
_STEP_CACHE = "_backend_step_tensors"
_TABLE_CACHE = "_backend_block_table"


def as_kernel_int32(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """`tensor` as contiguous int32 on `device` (itself when it already is)."""
    return tensor.to(device=device, dtype=torch.int32, non_blocking=True).contiguous()


@dataclass(frozen=True)
class StepTensors:
    """The step's shared metadata in the kernels' form."""

    query_start_loc: torch.Tensor  # [num_seqs + 1] int32, on the device
    seq_lens: torch.Tensor  # [num_seqs] int32, on the device


def step_tensors(metadata: AttentionMetadata, device: torch.device) -> StepTensors:
    """`metadata`'s query_start_loc and seq_lens as the kernels take them; converted on the first
    layer of the step, reused by the others."""
    device = torch.device(device)
    return cached_on(
        metadata,
        _STEP_CACHE,
        ("kernel", device),
        (metadata.query_start_loc, metadata.seq_lens),
        lambda: StepTensors(
            query_start_loc=as_kernel_int32(metadata.query_start_loc, device),
            seq_lens=as_kernel_int32(metadata.seq_lens, device),
        ),
    )


def group_block_table(group: GroupMetadata, device: torch.device) -> torch.Tensor:
    """The group's block table as contiguous int32 on `device`, converted once per step."""
    device = torch.device(device)
    return cached_on(
        group,
        _TABLE_CACHE,
        ("kernel", device),
        (group.block_table,),
        lambda: as_kernel_int32(group.block_table, device),
    )


def write_kv(
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Stores the new tokens' keys/values ([num_tokens, kv_heads, head_dim]) at their slots."""
    if slot_mapping.device != k_cache.device or not slot_mapping.is_contiguous():
        # The runner normally moves slot mappings to the device once per step.
        slot_mapping = slot_mapping.to(k_cache.device).contiguous()
    kernels.write_kv_cache(k.to(k_cache.dtype), v.to(v_cache.dtype), k_cache, v_cache, slot_mapping)


def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    metadata: AttentionMetadata,
    group: GroupMetadata,
    params: AttentionParams,
) -> torch.Tensor:
    """Attention of the flattened queries q [num_tokens, Hq, D] over the group's paged cache
    (already holding this step's keys); returns [num_tokens, Hq, D]. Same contract as
    `reference.paged_attention`."""
    assert k_cache.shape[1] == group.block_size, "cache block size differs from the group's"
    device = q.device
    tensors = step_tensors(metadata, device)
    if q.stride(-1) != 1:
        q = q.contiguous()
    sinks = params.sinks
    if sinks is not None and (sinks.device != device or not sinks.is_contiguous()):
        sinks = sinks.to(device).contiguous()
    return kernels.unified_attention(
        q,
        k_cache,
        v_cache,
        group_block_table(group, device),
        tensors.query_start_loc,
        tensors.seq_lens,
        scale=params.scale,
        sliding_window=params.sliding_window,
        chunk_size=params.chunk,
        softcap=params.softcap,
        sinks=sinks,
        max_seq_len=metadata.max_seq_len or None,
    )


def compile_kernel_variants(model: torch.nn.Module, kv_caches: list) -> list:
    """Compiles every attention kernel variant the Triton layers of `model` can meet in a run
    (`kernels.paged_attention.compile_variants`, once per distinct layer shape), reading page 1
    of each layer's cache (`kv_caches[layer_index]`) and writing nothing. Call it after a first
    forward, so that the model's sinks have reached the layers' params. Returns the variants."""
    from hybrid_cache.attention.layer import attention_layers
    from hybrid_cache.kernels.paged_attention import compile_variants

    variants: list = []
    seen: set = set()
    for layer in attention_layers(model):
        if layer.backend != "triton":
            continue
        k_cache, v_cache = kv_caches[layer.layer_index]
        params = layer.params
        shape = (
            k_cache.dtype, k_cache.device, tuple(k_cache.shape[1:]), k_cache.stride(),
            layer.num_heads, params.sliding_window, params.chunk, params.softcap is not None,
            params.sinks is not None,
        )  # fmt: skip
        if shape in seen:
            continue
        seen.add(shape)
        sinks = params.sinks
        if sinks is not None:
            sinks = sinks.to(k_cache.device).contiguous()
        variants.extend(
            compile_variants(
                k_cache,
                v_cache,
                layer.num_heads,
                scale=params.scale,
                sliding_window=params.sliding_window,
                chunk_size=params.chunk,
                softcap=params.softcap,
                sinks=sinks,
            )
        )
    return variants
