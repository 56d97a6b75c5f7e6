"""The torch reference attention backend: clear, vectorised per sequence, the oracle for the others.

Visibility of key position k to a query at position p (all rules combine with AND):

    causal          k <= p
    sliding window  k >  p - W          (W keys including the query itself; transformers'
                                         `sliding_window_overlay` for Mistral, Gemma-2/3, gpt-oss)
    chunked local   k // C == p // C    (same chunk)

    positions:  0 1 2 3 4 5 6 7 8 9
    W=4, p=7:           . . . x x x x .     keys 4..7
    C=4, p=7:           . . . . x x x x     keys 4..7 (chunk 1)

Per sequence, only the blocks holding positions `lo .. seq_len-1` are gathered, where `lo` is the
first position any of its queries can see; table entries left of `lo // block_size` may be the null
block (id 0) and are never touched. Logits: `scale * q.k`, then the softcap `cap * tanh(s / cap)`,
then the mask; gpt-oss sinks add one per-head logit to the softmax denominator and carry no value.
"""

from __future__ import annotations

import torch

from hybrid_cache.attention.metadata import NULL_BLOCK, AttentionMetadata, GroupMetadata
from hybrid_cache.attention.params import AttentionParams


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


def first_visible_position(
    first_query_position: int, sliding_window: int | None, chunk: int | None
) -> int:
    """The lowest key position any query at or after `first_query_position` can see."""
    low = 0
    if sliding_window is not None:
        low = max(low, first_query_position - sliding_window + 1)
    if chunk is not None:
        low = max(low, (first_query_position // chunk) * chunk)
    return low


def visibility_mask(
    query_positions: torch.Tensor,
    key_positions: torch.Tensor,
    sliding_window: int | None,
    chunk: int | None,
) -> torch.Tensor:
    """[num_queries, num_keys] bool: which keys each query attends to."""
    query = query_positions[:, None]
    key = key_positions[None, :]
    mask = key <= query
    if sliding_window is not None:
        mask &= key > query - sliding_window
    if chunk is not None:
        mask &= (key // chunk) == (query // chunk)
    return mask


def attend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor,
    scale: float,
    softcap: float | None,
    sinks: torch.Tensor | None,
) -> torch.Tensor:
    """Dense masked attention of q [nq, Hq, D] over k/v [nk, Hkv, D] (GQA by head repetition)."""
    num_heads, num_kv_heads = q.shape[1], k.shape[1]
    assert num_heads % num_kv_heads == 0, "query heads must be a multiple of kv heads"
    repeat = num_heads // num_kv_heads
    k = k.repeat_interleave(repeat, dim=1).float()
    v = v.repeat_interleave(repeat, dim=1).float()
    scores = torch.einsum("qhd,khd->hqk", q.float(), k) * scale
    if softcap is not None:
        scores = softcap * torch.tanh(scores / softcap)
    scores = scores.masked_fill(~mask[None], float("-inf"))
    if sinks is not None:
        sink_logits = sinks.float().reshape(num_heads, 1, 1).expand(num_heads, scores.shape[1], 1)
        probs = torch.softmax(torch.cat([scores, sink_logits], dim=-1), dim=-1)[..., :-1]
    else:
        probs = torch.softmax(scores, dim=-1)
    return torch.einsum("hqk,khd->qhd", probs, v).to(q.dtype)


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
    output = torch.empty_like(q)
    starts = metadata.query_start_loc.tolist()
    seq_lens = metadata.seq_lens.tolist()
    for seq, seq_len in enumerate(seq_lens):
        start, end = starts[seq], starts[seq + 1]
        if end == start:
            continue
        first_query = seq_len - (end - start)
        low = first_visible_position(first_query, sliding_window, chunk)
        first_block, last_block = low // block_size, (seq_len - 1) // block_size
        block_ids = group.block_table[seq, first_block : last_block + 1].long().to(k_cache.device)
        assert bool((block_ids != NULL_BLOCK).all()), (
            f"sequence {seq} needs the null block for visible positions {low}..{seq_len - 1}"
        )
        skip = low - first_block * block_size
        keys = k_cache[block_ids].flatten(0, 1)[skip : skip + seq_len - low]
        values = v_cache[block_ids].flatten(0, 1)[skip : skip + seq_len - low]
        query_positions = torch.arange(first_query, seq_len, device=q.device)
        key_positions = torch.arange(low, seq_len, device=q.device)
        mask = visibility_mask(query_positions, key_positions, sliding_window, chunk)
        output[start:end] = attend(
            q[start:end], keys, values, mask, params.scale, params.softcap, params.sinks
        )
    return output
