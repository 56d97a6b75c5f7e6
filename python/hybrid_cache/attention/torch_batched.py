"""The vectorised torch attention backend: every sequence of the step in one batched attention.

Same interface and semantics as `reference.paged_attention` / `reference.write_kv` (causal, GQA,
sliding window, chunked-local, softcap, sinks; the visibility rules are in `reference`), but with
no Python loop over sequences, so a step costs a fixed number of torch ops per layer whatever the
batch size. Registered as "torch" in `selector` (the CPU engine's backend); the per-sequence
reference is registered as "reference" and stays the test oracle.

Per step and per group (cached on the group's metadata, so the other layers of the step reuse it,
as `triton_backend` does), a `StepPlan` lays every sequence's visible keys out on a padded row:

    sequence s, visible positions low[s] .. seq_len[s]-1  (low: first position its first query
                                                           can see, as in the reference)
    row s:   [ low  low+1  ...  seq_len-1 | pad pad pad ]   max_visible columns
                                            pad = seq_len-1 again (a real, visible slot), masked

so a windowed group gathers about W + query_len keys per sequence, never the whole context.
Padding repeats a visible slot instead of pointing at the null block: the padded keys are
masked out of the softmax and their values are finite, so NaN in released or null pages can never
reach the output (no NaN * 0). Sequences are split once per step into decode rows (one query:
every gathered key is visible, the mask is just the padding) and prefill rows (several queries,
padded to the longest, with a per-query causal / window / chunk mask). With a sliding window of
at most `BAND_MAX_WINDOW` tokens, every query token (decode or prefill) is its own one-query row
over its own W keys instead, so a prefill chunk costs num_tokens x W, not query_len x (W +
query_len). Per layer that is one gather of K and V and one batched masked attention per kind
present; the plan (indices, masks) is built once per step and group.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from hybrid_cache.attention.metadata import NULL_BLOCK, AttentionMetadata, GroupMetadata
from hybrid_cache.attention.reference import write_kv
from hybrid_cache.attention.triton_backend import cached_on

__all__ = ["StepPlan", "paged_attention", "step_plan", "write_kv"]

# Attribute name of the per-step plan cache stored on each GroupMetadata.
_PLAN_CACHE = "_torch_batched_plans"
# Sliding windows up to this size run every query token as its own row over its W keys (the
# gather copies num_tokens x W keys: cheap for small windows, too much memory for W = 4096, where
# prefill rows are padded instead).
BAND_MAX_WINDOW = 128


@dataclass(frozen=True)
class RowBatch:
    """Sequences of one kind (decode or prefill) laid out on padded rows."""

    key_blocks: torch.Tensor  # [num_rows, max_visible] int64: block id of each gathered key
    key_offsets: torch.Tensor  # [num_rows, max_visible] int64: offset in that block
    key_slots: torch.Tensor  # [num_rows * max_visible] int64: block * block_size + offset
    # [num_rows, 1, max_queries, 1, max_visible] bool: key visible to query (padded keys: False)
    mask: torch.Tensor
    # [num_rows, max_queries] int64: flattened query row of each padded query (padding repeats
    # the row's last query, so every padded query has a visible key and a finite softmax)
    query_rows: torch.Tensor
    # [num_tokens_of_these_rows] int64: index into the flattened [num_rows * max_queries] output
    # of each real query, in the order of `token_rows`
    output_index: torch.Tensor
    token_rows: torch.Tensor  # [num_tokens_of_these_rows] int64: their rows in q / the output


@dataclass(frozen=True)
class StepPlan:
    """One group's gather indices and masks for one step; `decode`/`prefill` None when absent."""

    decode: Optional[RowBatch]  # one query per row (with a small window: every query token)
    prefill: Optional[RowBatch]


def _row_batch(
    block_table: torch.Tensor,
    block_size: int,
    query_start: torch.Tensor,
    query_lens: torch.Tensor,
    seq_lens: torch.Tensor,
    sliding_window: Optional[int],
    chunk: Optional[int],
    device: torch.device,
) -> RowBatch:
    """Padded gather indices and masks for the sequences given (all with query_len >= 1)."""
    first_query = seq_lens - query_lens
    low = torch.zeros_like(first_query)
    if sliding_window is not None:
        low = torch.maximum(low, first_query - sliding_window + 1)
    if chunk is not None:
        low = torch.maximum(low, (first_query // chunk) * chunk)
    num_visible = seq_lens - low
    max_visible = int(num_visible.max())
    columns = torch.arange(max_visible)
    key_positions = low[:, None] + columns[None, :]
    key_valid = columns[None, :] < num_visible[:, None]
    # Padding repeats the last visible slot: real, written, finite.
    gather_positions = torch.minimum(key_positions, (seq_lens - 1)[:, None])
    key_blocks = torch.gather(block_table.long(), 1, gather_positions // block_size)
    assert bool((key_blocks != NULL_BLOCK).all()), (
        "a sequence needs the null block for one of its visible positions"
    )
    key_offsets = gather_positions % block_size

    max_queries = int(query_lens.max())
    query_columns = torch.arange(max_queries)
    query_valid = query_columns[None, :] < query_lens[:, None]
    last_query = (query_lens - 1)[:, None]
    query_offsets = torch.minimum(query_columns[None, :], last_query)
    query_positions = first_query[:, None] + query_offsets  # [rows, max_queries]

    query = query_positions[:, :, None]
    key = key_positions[:, None, :]
    mask = key_valid[:, None, :] & (key <= query)
    if sliding_window is not None:
        mask &= key > query - sliding_window
    if chunk is not None:
        mask &= (key // chunk) == (query // chunk)

    query_rows = query_start[:, None] + query_offsets
    output_index = (torch.arange(len(query_lens))[:, None] * max_queries + query_columns[None, :])[
        query_valid
    ]
    token_rows = query_rows[query_valid]
    return RowBatch(
        key_blocks=key_blocks.to(device),
        key_offsets=key_offsets.to(device),
        key_slots=(key_blocks * block_size + key_offsets).flatten().to(device),
        mask=mask[:, None, :, None, :].to(device),
        query_rows=query_rows.to(device),
        output_index=output_index.to(device),
        token_rows=token_rows.to(device),
    )


def _build_plan(
    metadata: AttentionMetadata,
    group: GroupMetadata,
    sliding_window: Optional[int],
    chunk: Optional[int],
    device: torch.device,
) -> StepPlan:
    query_start_loc = metadata.query_start_loc.cpu().long()
    seq_lens = metadata.seq_lens.cpu().long()
    block_table = group.block_table.cpu()
    query_start = query_start_loc[:-1]
    query_lens = query_start_loc[1:] - query_start
    if sliding_window is not None and sliding_window <= BAND_MAX_WINDOW:
        # Every query token becomes a one-query row over its own window: prefill chunks cost
        # num_tokens x W scores instead of query_len x (W + query_len) per sequence.
        seq_of_token = torch.repeat_interleave(torch.arange(len(query_lens)), query_lens)
        num_tokens = len(seq_of_token)
        positions = (seq_lens - query_lens)[seq_of_token] + (
            torch.arange(num_tokens) - query_start[seq_of_token]
        )
        tokens = _row_batch(
            block_table[seq_of_token],
            group.block_size,
            torch.arange(num_tokens),
            torch.ones(num_tokens, dtype=torch.long),
            positions + 1,
            sliding_window,
            chunk,
            device,
        )
        return StepPlan(decode=tokens, prefill=None)
    batches = []
    for selected in (query_lens == 1, query_lens > 1):  # sequences with no query are skipped
        rows = selected.nonzero().flatten()
        if len(rows) == 0:
            batches.append(None)
            continue
        batches.append(
            _row_batch(
                block_table[rows],
                group.block_size,
                query_start[rows],
                query_lens[rows],
                seq_lens[rows],
                sliding_window,
                chunk,
                device,
            )
        )
    return StepPlan(decode=batches[0], prefill=batches[1])


def step_plan(
    metadata: AttentionMetadata,
    group: GroupMetadata,
    sliding_window: Optional[int],
    chunk: Optional[int],
    device: torch.device,
) -> StepPlan:
    """The group's plan for this step: built by the step's first layer with these visibility
    options, reused by the others (cached on `group`, keyed by the source tensors' identity)."""
    device = torch.device(device)
    return cached_on(
        group,
        _PLAN_CACHE,
        (sliding_window, chunk, device),
        (metadata.query_start_loc, metadata.seq_lens, group.block_table),
        lambda: _build_plan(metadata, group, sliding_window, chunk, device),
    )


def _gather_keys(cache: torch.Tensor, batch: RowBatch) -> torch.Tensor:
    """cache [num_blocks, block_size, Hkv, D] at the batch's keys: [rows, max_visible, Hkv, D].

    One `index_select` over the (block, offset) dimensions viewed as one, which a shared-slot view
    allows (its block stride is block_size times its token stride); several times faster on the
    CPU than indexing with two tensors, which remains the fallback for other strides."""
    num_blocks, block_size = cache.shape[0], cache.shape[1]
    try:
        slots = cache.view(num_blocks * block_size, *cache.shape[2:])
    except RuntimeError:  # (block, offset) not mergeable into one dimension without a copy
        return cache[batch.key_blocks, batch.key_offsets]
    return slots.index_select(0, batch.key_slots).view(*batch.key_blocks.shape, *cache.shape[2:])


def _attend_rows(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    batch: RowBatch,
    scale: float,
    softcap: Optional[float],
    sinks: Optional[torch.Tensor],
) -> torch.Tensor:
    """Masked attention of one row batch; returns [num_tokens_of_these_rows, Hq, D] float32."""
    num_heads, head_dim = q.shape[1], q.shape[2]
    num_kv_heads = k_cache.shape[2]
    assert num_heads % num_kv_heads == 0, "query heads must be a multiple of kv heads"
    group_size = num_heads // num_kv_heads
    num_rows, max_queries = batch.query_rows.shape
    # [rows, max_visible, Hkv, D] -> [rows, Hkv, max_visible, D]
    keys = _gather_keys(k_cache, batch).float().transpose(1, 2)
    values = _gather_keys(v_cache, batch).float().transpose(1, 2)
    # Query head h reads kv head h // group_size (the reference's repeat_interleave).
    queries = q[batch.query_rows].float()  # [rows, max_queries, Hq, D]
    queries = queries.view(num_rows, max_queries, num_kv_heads, group_size, head_dim)
    queries = queries.permute(0, 2, 1, 3, 4).reshape(
        num_rows, num_kv_heads, max_queries * group_size, head_dim
    )
    scores = torch.matmul(queries, keys.transpose(-1, -2)) * scale
    if softcap is not None:
        scores = softcap * torch.tanh(scores / softcap)
    scores = scores.view(num_rows, num_kv_heads, max_queries, group_size, -1)
    scores = scores.masked_fill(~batch.mask, float("-inf"))
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
    return out[batch.output_index]


def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    metadata: AttentionMetadata,
    group: GroupMetadata,
    scale: float,
    sliding_window: Optional[int] = None,
    softcap: Optional[float] = None,
    sinks: Optional[torch.Tensor] = None,
    chunk: Optional[int] = None,
) -> torch.Tensor:
    """Attention of the flattened queries q [num_tokens, Hq, D] over the group's paged cache
    (already holding this step's keys); returns [num_tokens, Hq, D]. Same contract and results
    as `reference.paged_attention`."""
    assert k_cache.shape[1] == group.block_size, "cache block size differs from the group's"
    plan = step_plan(metadata, group, sliding_window, chunk, q.device)
    output = torch.empty_like(q)
    for batch in (plan.decode, plan.prefill):
        if batch is not None:
            rows = _attend_rows(q, k_cache, v_cache, batch, scale, softcap, sinks)
            output[batch.token_rows] = rows.to(q.dtype)
    return output
