"""The `"reference"` attention backend: the one torch oracle (`kernels/reference.py`'s
`reference_unified_attention`, dense gather per sequence plus an explicit mask) over the engine's
per-step metadata, the oracle for the other backends.

Which keys a query sees is `visibility.py`'s rule (re-exported here as `first_visible_position` and
`visibility_mask`). Per sequence, only the blocks holding positions `lo .. seq_len-1` are read,
where `lo` is the first position any of its queries can see; table entries left of
`lo // block_size` may be the null block (id 0) and are never touched (checked here: a visible
position in the null block is a bug upstream). Logits: `scale * q.k`, then the softcap
`cap * tanh(s / cap)`, then the mask; gpt-oss sinks add one per-head logit to the softmax
denominator and carry no value.
"""

from __future__ import annotations

import torch

from hybrid_cache.attention.metadata import NULL_BLOCK, AttentionMetadata, GroupMetadata
from hybrid_cache.attention.params import AttentionParams
from hybrid_cache.attention.visibility import first_visible_position, visibility_mask
from hybrid_cache.kernels.reference import reference_unified_attention

__all__ = ["first_visible_position", "paged_attention", "visibility_mask", "write_kv"]


def write_kv(
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Stores the new tokens' keys/values ([num_tokens, kv_heads, head_dim]) at their slots.

    Indexes by (block, offset) rather than flattening, so `k_cache` may be a strided view of a
    tensor shared with other groups.
    """
    block_size = k_cache.shape[1]
    slots = slot_mapping.to(k_cache.device).long()
    blocks, offsets = slots // block_size, slots % block_size
    k_cache[blocks, offsets] = k.to(k_cache.dtype)
    v_cache[blocks, offsets] = v.to(v_cache.dtype)


def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    metadata: AttentionMetadata,
    group: GroupMetadata,
    params: AttentionParams,
) -> torch.Tensor:
    """Attention of the flattened queries q [num_tokens, Hq, D] over the paged cache.

    `k_cache`/`v_cache` are [num_blocks, block_size, Hkv, D] and already hold this step's keys
    (`write_kv` runs first); `params` are the layer's score options. Returns [num_tokens, Hq, D].
    """
    sliding_window, chunk = params.sliding_window, params.chunk
    block_size = group.block_size
    assert k_cache.shape[1] == block_size, "cache block size differs from the group's"
    block_table = group.block_table.to(q.device)
    starts = metadata.query_start_loc.tolist()
    for seq, seq_len in enumerate(metadata.seq_lens.tolist()):
        num_queries = starts[seq + 1] - starts[seq]
        if num_queries == 0:
            continue
        low = first_visible_position(seq_len - num_queries, sliding_window, chunk)
        block_ids = block_table[seq, low // block_size : (seq_len - 1) // block_size + 1]
        assert bool((block_ids != NULL_BLOCK).all()), (
            f"sequence {seq} needs the null block for visible positions {low}..{seq_len - 1}"
        )
    return reference_unified_attention(
        q,
        k_cache,
        v_cache,
        block_table,
        metadata.query_start_loc,
        metadata.seq_lens,
        scale=params.scale,
        sliding_window=sliding_window,
        chunk_size=chunk,
        softcap=params.softcap,
        sinks=params.sinks,
    )
