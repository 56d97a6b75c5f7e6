"""Torch references for the kernels: dense per-sequence gather plus an explicit mask.

Slow and simple on purpose; the kernel tests use them as the oracle, and `reference_unified_attention`
is also the engine's `"reference"` attention backend (`hybrid_cache.attention.reference` calls it),
so there is one torch oracle. They follow the kernels' contract exactly, including never touching
a cache page left of the visible range (those may be the null block, whose contents are
undefined). Which keys a query sees is `hybrid_cache.attention.visibility`'s rule.
"""

from typing import Optional

import torch
from hybrid_cache.attention.visibility import first_visible_position, is_visible


def visible_key_begin(
    first_query_position: int, sliding_window: Optional[int], chunk_size: Optional[int]
) -> int:
    """The first key position the query at `first_query_position` may see.

    Later queries of the same sequence see nothing further left, so no key left of this is
    ever read. With a window W the query at p sees keys p-W+1 .. p (W keys including itself);
    with chunk C it sees keys from the start of its chunk, floor(p / C) * C, up to p.
    """
    return first_visible_position(first_query_position, sliding_window, chunk_size)


def reference_unified_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_table: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    *,
    scale: Optional[float] = None,
    sliding_window: Optional[int] = None,
    chunk_size: Optional[int] = None,
    softcap: Optional[float] = None,
    sinks: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """Same contract as `unified_attention` (see there); computes in float32, returns query's dtype."""
    num_tokens, num_query_heads, head_dim = query.shape
    block_size, num_kv_heads = key_cache.shape[1], key_cache.shape[2]
    queries_per_kv = num_query_heads // num_kv_heads
    if scale is None:
        scale = head_dim**-0.5
    out = torch.zeros(
        num_tokens, num_query_heads, head_dim, dtype=torch.float32, device=query.device
    )
    starts = query_start_loc.tolist()
    for seq, seq_len in enumerate(seq_lens.tolist()):
        query_begin, query_end = starts[seq], starts[seq + 1]
        query_len = query_end - query_begin
        if query_len == 0:
            continue
        context_len = seq_len - query_len
        key_begin = visible_key_begin(context_len, sliding_window, chunk_size)
        key_positions = torch.arange(key_begin, seq_len, device=query.device)
        pages = block_table[seq, key_positions // block_size].long()
        slots = key_positions % block_size
        # [num_keys, num_kv_heads, head_dim] -> one key/value head per query head
        keys = key_cache[pages, slots].float().repeat_interleave(queries_per_kv, dim=1)
        values = value_cache[pages, slots].float().repeat_interleave(queries_per_kv, dim=1)
        queries = query[query_begin:query_end].float()
        scores = torch.einsum("qhd,khd->hqk", queries, keys) * scale
        if softcap is not None:
            scores = softcap * torch.tanh(scores / softcap)
        query_positions = torch.arange(context_len, seq_len, device=query.device)
        visible = is_visible(
            query_positions[:, None], key_positions[None, :], sliding_window, chunk_size
        )
        scores = scores.masked_fill(~visible[None], float("-inf"))
        if sinks is not None:
            # A sink is one more logit per head in the denominator, with no value.
            sink_column = sinks.float()[:, None, None].expand(num_query_heads, query_len, 1)
            probabilities = torch.softmax(torch.cat([scores, sink_column], dim=-1), dim=-1)[
                ..., :-1
            ]
        else:
            probabilities = torch.softmax(scores, dim=-1)
        out[query_begin:query_end] = torch.einsum("hqk,khd->qhd", probabilities, values)
    return out.to(query.dtype)


def reference_write_kv_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Same contract as `write_kv_cache`: token i goes to slot `slot_mapping[i]`, -1 skips it."""
    block_size = key_cache.shape[1]
    for token, slot in enumerate(slot_mapping.tolist()):
        if slot < 0:
            continue
        key_cache[slot // block_size, slot % block_size] = key[token]
        value_cache[slot // block_size, slot % block_size] = value[token]
