"""The vectorised torch attention backend: every sequence of the step in one batched attention.

Same interface and semantics as `reference.paged_attention` / `reference.write_kv` (causal, GQA,
sliding window, chunked-local, softcap, sinks; the visibility rules are in `reference`), but with
no Python loop over sequences, so a step costs a fixed number of torch ops per layer whatever the
batch size. Registered as "torch" in `selector` (the CPU engine's backend); the per-sequence
reference is registered as "reference" and stays the test oracle.

Which keys each row reads comes from the step's plan (`row_plan`). Per layer that is one gather
of K and V and one batched attention per kind of row present: the Rust CPU kernel
(`cpu_kernel`) for one-query rows on float32 CPU caches (every row when softcap or sinks apply),
masked matmuls and softmax for the other decode rows and whenever softcap or sinks apply, and
torch's fused `scaled_dot_product_attention` for prefill rows of `FUSED_MIN_KEYS` keys or more.
"""

from __future__ import annotations

from typing import Optional

import torch

from hybrid_cache.attention import cpu_kernel
from hybrid_cache.attention.metadata import AttentionMetadata, GroupMetadata
from hybrid_cache.attention.params import AttentionParams
from hybrid_cache.attention.row_plan import (
    KERNEL_ALL,
    KERNEL_DECODE,
    KERNEL_NONE,
    KernelBatch,
    RowBatch,
    RowGeometry,
    StepPlan,
    step_plan,
)

__all__ = [
    "KERNEL_ALL",
    "KERNEL_DECODE",
    "KERNEL_NONE",
    "KernelBatch",
    "RowBatch",
    "StepPlan",
    "paged_attention",
    "step_plan",
    "write_kv",
]

# New keys and values go to the cache by the Rust copy on the CPU (torch indexing elsewhere).
write_kv = cpu_kernel.write_kv

# Prefill rows with at least this many keys use torch's fused attention; below it (a small
# window's tiles) the plain masked matmuls are faster on the CPU.
FUSED_MIN_KEYS = 64
# Windows up to this size send every query token to the CPU kernel (when it can run): a token's
# W keys are read in place, where the tiles would gather 2W - 1 keys per W queries and mask them.
KERNEL_ALL_MAX_WINDOW = 128
# With this many query heads per KV head or more, every query token goes to the CPU kernel also
# without a window: it scores a key once for up to 4 query heads side by side, which beats fused
# attention expanding the KV heads. Measured on prefill steps (one thread, 16-32 x 512-token
# prompts): 4 heads / 1 KV head, head_dim 32: 37.5 vs 41 ms per 2048-token step; 8 / 2, head_dim
# 64: 318-322 vs 332-360 ms; 4 / 2 (2 per KV head), head_dim 16: 48 vs 39 ms, so not below 4.
KERNEL_ALL_MIN_QUERIES_PER_KV = 4


def _token_rows(cache: torch.Tensor) -> Optional[tuple[torch.Tensor, int]]:
    """cache [num_blocks, block_size, Hkv, D] as one dimension of token rows, and the number of
    rows from one block to the next; None when the layout does not allow it.

    A layer's K (or V) is a view of its slot tensor [num_blocks, 2, block_size, Hkv, D], so
    consecutive blocks are 2 x block_size token rows apart (the other half being V or K) and the
    token at (block, offset) is row block * block_stride + offset of a strided view that starts
    at the cache's first element."""
    num_blocks, block_size, num_kv_heads, head_dim = cache.shape
    token_stride = cache.stride(1)
    dense_rows = cache.stride(3) == 1 and cache.stride(2) == head_dim
    if not dense_rows or token_stride != num_kv_heads * head_dim:
        return None
    if cache.stride(0) % token_stride != 0:
        return None
    block_stride = cache.stride(0) // token_stride
    num_rows = (num_blocks - 1) * block_stride + block_size
    rows = cache.as_strided((num_rows, num_kv_heads, head_dim), (token_stride, head_dim, 1))
    return rows, block_stride


def _gather_keys(cache: torch.Tensor, batch: RowBatch) -> torch.Tensor:
    """cache [num_blocks, block_size, Hkv, D] at the batch's keys: [rows, max_visible, Hkv, D].

    One `index_select` over the cache's token rows (`_token_rows`): several times faster on the
    CPU than indexing with two index tensors, which remains the fallback for layouts where a
    block is not a whole number of dense token rows."""
    flat = _token_rows(cache)
    if flat is None:
        return cache[batch.key_blocks, batch.key_offsets]
    rows, block_stride = flat
    slots = (batch.key_blocks * block_stride + batch.key_offsets).flatten()
    return rows.index_select(0, slots).view(*batch.key_blocks.shape, *cache.shape[2:])


def _attend_prefill_rows(
    queries: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, geometry: RowGeometry, scale
) -> torch.Tensor:
    """Rows of several queries without softcap or sinks: torch's fused attention (on the CPU a
    tiled kernel that never holds the whole [queries x keys] score matrix; with a plain causal
    geometry it also skips the key tiles above the diagonal instead of reading a mask).
    queries [rows, Q, Hq, D], keys/values [rows, Hkv, K, D] -> [rows * Q, Hq, D]."""
    num_rows, max_queries, num_heads, head_dim = queries.shape
    causal = geometry.causal
    out = torch.nn.functional.scaled_dot_product_attention(
        queries.transpose(1, 2),
        keys,
        values,
        attn_mask=None if causal else geometry.mask.squeeze(3),
        is_causal=causal,
        scale=scale,
        enable_gqa=keys.shape[1] != num_heads,
    )  # [rows, Hq, Q, D]
    return out.transpose(1, 2).reshape(num_rows * max_queries, num_heads, head_dim)


def _attend_rows(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    batch: RowBatch,
    params: AttentionParams,
) -> torch.Tensor:
    """Masked attention of one row batch; returns [num_tokens_of_these_rows, Hq, D] float32."""
    scale, softcap, sinks = params.scale, params.softcap, params.sinks
    geometry = batch.geometry
    num_heads, head_dim = q.shape[1], q.shape[2]
    num_kv_heads = k_cache.shape[2]
    assert num_heads % num_kv_heads == 0, "query heads must be a multiple of kv heads"
    group_size = num_heads // num_kv_heads
    num_rows, max_queries = geometry.query_rows.shape
    # [rows, max_visible, Hkv, D] -> [rows, Hkv, max_visible, D]
    keys = _gather_keys(k_cache, batch).float().transpose(1, 2)
    values = _gather_keys(v_cache, batch).float().transpose(1, 2)
    # index_select: several times faster on the CPU than indexing with an index tensor.
    queries = q.index_select(0, geometry.query_rows.flatten()).float()
    queries = queries.view(num_rows, max_queries, num_heads, head_dim)
    fused = max_queries > 1 and keys.shape[2] >= FUSED_MIN_KEYS
    if fused and softcap is None and sinks is None:
        out = _attend_prefill_rows(queries, keys, values, geometry, scale)
        return out.index_select(0, geometry.output_index)
    # Query head h reads kv head h // group_size (the reference's repeat_interleave).
    queries = queries.view(num_rows, max_queries, num_kv_heads, group_size, head_dim)
    queries = queries.permute(0, 2, 1, 3, 4).reshape(
        num_rows, num_kv_heads, max_queries * group_size, head_dim
    )
    scores = torch.matmul(queries, keys.transpose(-1, -2)) * scale
    if softcap is not None:
        scores = softcap * torch.tanh(scores / softcap)
    scores = scores.view(num_rows, num_kv_heads, max_queries, group_size, -1)
    scores = scores.masked_fill(~geometry.mask, float("-inf"))
    if sinks is not None:
        sink_logits = sinks.float().to(scores.device).view(1, num_kv_heads, 1, group_size, 1)
        sink_logits = sink_logits.expand(num_rows, num_kv_heads, max_queries, group_size, 1)
        probs = torch.softmax(torch.cat([scores, sink_logits], dim=-1), dim=-1)[..., :-1]
    else:
        probs = torch.softmax(scores, dim=-1)
    probs = probs.reshape(num_rows, num_kv_heads, max_queries * group_size, -1)
    out = torch.matmul(probs, values)  # [rows, Hkv, max_queries * G, D]
    out = out.view(num_rows, num_kv_heads, max_queries, group_size, head_dim)
    out = out.permute(0, 2, 1, 3, 4).reshape(num_rows * max_queries, num_heads, head_dim)
    return out.index_select(0, geometry.output_index)


def _kernel_rows(params: AttentionParams, queries_per_kv: int) -> str:
    """Which rows the CPU kernel takes when it can run: every query token when softcap or sinks
    keep prefill rows off the fused torch attention, when a small window makes each token's few
    keys cheaper to read in place than to gather into tiles and mask, or when enough query heads
    share a KV head (`KERNEL_ALL_MIN_QUERIES_PER_KV`); else one-query rows."""
    window = params.sliding_window
    if params.softcap is not None or params.sinks is not None:
        return KERNEL_ALL
    if window is not None and window <= KERNEL_ALL_MAX_WINDOW:
        return KERNEL_ALL
    if queries_per_kv >= KERNEL_ALL_MIN_QUERIES_PER_KV:
        return KERNEL_ALL
    return KERNEL_DECODE


def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    metadata: AttentionMetadata,
    group: GroupMetadata,
    params: AttentionParams,
) -> torch.Tensor:
    """Attention of the flattened queries q [num_tokens, Hq, D] over the group's paged cache
    (already holding this step's keys); returns [num_tokens, Hq, D]. Same contract and results
    as `reference.paged_attention`."""
    assert k_cache.shape[1] == group.block_size, "cache block size differs from the group's"
    usable = cpu_kernel.usable(q, k_cache, v_cache)
    kernel = _kernel_rows(params, q.shape[1] // k_cache.shape[2]) if usable else KERNEL_NONE
    plan = step_plan(metadata, group, params.sliding_window, params.chunk, q.device, kernel)
    if isinstance(plan.decode, KernelBatch):
        rows = cpu_kernel.attend(q, k_cache, v_cache, plan.decode, params)
        if plan.decode.every_token:  # every query token is a kernel row (no prefill rows)
            return rows.to(q.dtype)
        output = torch.empty_like(q)
        output[plan.decode.token_rows] = rows.to(q.dtype)
    else:
        output = torch.empty_like(q)
    if isinstance(plan.decode, RowBatch):
        rows = _attend_rows(q, k_cache, v_cache, plan.decode, params)
        output[plan.decode.geometry.token_rows] = rows.to(q.dtype)
    if plan.prefill is not None:
        rows = _attend_rows(q, k_cache, v_cache, plan.prefill, params)
        output[plan.prefill.geometry.token_rows] = rows.to(q.dtype)
    return output
