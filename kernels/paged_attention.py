"""Unified paged attention: prefill chunks and decode tokens of many sequences in one launch.

Layout of one launch (the vocabulary the kernel and launcher share)::

    query            [num_tokens, num_query_heads, head_dim]   the new tokens of every sequence,
                                                               sequence after sequence
    query_start_loc  [num_seqs + 1] int32    sequence s owns query rows qsl[s] .. qsl[s+1]-1
    seq_lens         [num_seqs] int32        context length of s *after* this step; its queries
                                             are its last q_len = qsl[s+1]-qsl[s] positions
    block_table      [num_seqs, max_blocks] int32   page of each block of keys; entries left of
                                             the visible range may be the null block 0
    key/value_cache  [num_blocks, block_size, num_kv_heads, head_dim]

Program grid: (query tiles, kv heads, kv splits). A query tile holds BLOCK_Q consecutive query
tokens of one sequence times the QUERIES_PER_KV query heads sharing one kv head, so the BLOCK_M
rows of the tile read every key once for the whole GQA group. Tiles are numbered without a host sync:
sequence s owns tile numbers `qsl[s] // BLOCK_Q + s` onwards (always enough of them), a program
finds its sequence by binary search and exits if its tile is past the sequence's queries.
With kv splits > 1, each program covers one contiguous run of its tile's key tiles and stores
its unnormalised (max, sum, accumulator); `_combine_splits_kernel` merges them.

KV splits follow each tile's visible range, never the whole sequence: a tile's keys run from
`begin` (the first query's window or chunk start; 0 for full attention) to its last query's
position, the TILE_N-aligned tiles from the one holding `begin` onwards are shared out in
contiguous runs of `cdiv(tiles, splits)`, and a split past the tile's last key is empty (it
stores max -inf, sum 0, which the combine weighs 0). So a 16384-token row with a 4096 window
spreads 4096 keys over its splits, and null pages left of the window are never loaded.

Split count (`choose_num_kv_splits`, when the caller gives none), from the batch size and the
visible length:

    programs   = query tiles x kv heads        (decode-only: one tile per sequence)
    wanted     = 2 x multiprocessors
    splits     = 1                                              if programs >= wanted
               = min(16, pow2ceil(wanted / programs),           fill the GPU,
                     pow2floor((cdiv(visible, TILE_N) + 1) / 4))  but >= 4 key tiles a split
    visible    = min(max_seq_len, W + queries per tile - 1, C)  (the bounds the host knows)

and halved while the float32 partials would pass 64 MiB. On the CPU interpreter: 1. The split
count is a runtime argument (as are the sequence count and the block table's row stride):
only "split or not" is compiled, so a step's batch size and lengths never compile a variant;
`plan_launch` names the variant of a call, `compile_variants` compiles every one a layer can
meet (the engine's warm-up).

Masks, for a query at position p and a key at position k (positions count from 0)::

    causal          k <= p
    sliding window  k >  p - W          (W keys including p: FlashAttention's window (W-1, 0))
    chunked local   k // C == p // C
                      key positions:  0 ...... begin ............ p_first ... p_last
                      pages:          [null][null][page][page][page]...
                                                 ^ first tile read: tiles wholly left of
                                                   `begin` (the first query's first visible
                                                   key) are skipped, and the key mask keeps
                                                   loads inside [begin, p_last] so the null
                                                   pages are never read.

Softmax is online in base 2 (scores scaled by log2 e). Logit softcap: cap * tanh(s / cap).
An attention sink (gpt-oss) is one more logit per query head in the denominator with no value:
the running max and sum start at (sink, 1) instead of (-inf, 0) (with kv splits, the combine
step adds it instead).
"""

from dataclasses import dataclass, field
from typing import Optional

import torch
import triton
import triton.language as tl

from ._launch import (
    CACHE_DTYPES,
    check_devices,
    check_tensor,
    is_interpreted,
    next_power_of_2,
)
from .errors import KernelArgumentError

LOG2_E: tl.constexpr = tl.constexpr(1.4426950408889634)


# `num_seqs` changes every engine step, and the block table's row stride with it (the engine
# passes only the columns the step's longest sequence reaches), and the split count with the
# batch size and lengths: all unspecialised, so a new batch, table width or split count never
# compiles a new variant (Triton would otherwise specialise an int argument on == 1 and on
# divisibility by 16).
@triton.jit(do_not_specialize=["num_seqs", "stride_block_table_seq", "num_splits"])
def _unified_attention_kernel(
    query_ptr,
    key_cache_ptr,
    value_cache_ptr,
    out_ptr,
    partial_out_ptr,
    partial_max_ptr,
    partial_sum_ptr,
    block_table_ptr,
    query_start_loc_ptr,
    seq_lens_ptr,
    sinks_ptr,
    scale,
    softcap,
    sliding_window,
    chunk_size,
    num_seqs,
    num_splits,
    stride_query_token,
    stride_query_head,
    stride_out_token,
    stride_out_head,
    stride_cache_block,
    stride_cache_slot,
    stride_cache_head,
    stride_block_table_seq,
    QUERIES_PER_KV: tl.constexpr,
    QUERIES_PER_KV_PADDED: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PADDED: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_M: tl.constexpr,  # >= BLOCK_Q * QUERIES_PER_KV_PADDED and >= 16
    TILE_N: tl.constexpr,
    USE_WINDOW: tl.constexpr,
    USE_CHUNK: tl.constexpr,
    USE_SOFTCAP: tl.constexpr,
    USE_SINKS: tl.constexpr,
    DOT_IN_FP32: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    USE_SPLITS: tl.constexpr,  # num_splits > 1: store partials for the combine kernel
):
    tile_number = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)

    # The sequence owning this tile: the last s with qsl[s] // BLOCK_Q + s <= tile_number.
    low = 0
    high = num_seqs
    while low < high:
        middle = (low + high) // 2
        first_tile = tl.load(query_start_loc_ptr + middle) // BLOCK_Q + middle
        if first_tile <= tile_number:
            low = middle + 1
        else:
            high = middle
    seq = low - 1
    query_begin = tl.load(query_start_loc_ptr + seq)
    query_len = tl.load(query_start_loc_ptr + seq + 1) - query_begin
    tile_in_seq = tile_number - (query_begin // BLOCK_Q + seq)
    if tile_in_seq * BLOCK_Q >= query_len:
        return
    seq_len = tl.load(seq_lens_ptr + seq)
    context_len = seq_len - query_len

    # Row m of the tile is query token m // QUERIES_PER_KV_PADDED of the tile, head m % that.
    rows = tl.arange(0, BLOCK_M)
    query_index = tile_in_seq * BLOCK_Q + rows // QUERIES_PER_KV_PADDED
    head_in_group = rows % QUERIES_PER_KV_PADDED
    query_head = kv_head * QUERIES_PER_KV + head_in_group
    # Rows past BLOCK_Q * QUERIES_PER_KV_PADDED only pad the tile to the 16 rows a dot needs.
    row_valid = (
        (rows < BLOCK_Q * QUERIES_PER_KV_PADDED)
        & (query_index < query_len)
        & (head_in_group < QUERIES_PER_KV)
    )
    query_position = context_len + query_index
    dims = tl.arange(0, HEAD_DIM_PADDED)
    dim_valid = dims < HEAD_DIM

    query_token = (query_begin + query_index).to(tl.int64)
    query_offsets = (
        query_token[:, None] * stride_query_token
        + query_head[:, None] * stride_query_head
        + dims[None, :]
    )
    query_tile = tl.load(
        query_ptr + query_offsets, mask=row_valid[:, None] & dim_valid[None, :], other=0.0
    )
    if DOT_IN_FP32:
        query_tile = query_tile.to(tl.float32)

    if USE_SINKS and not USE_SPLITS:  # with splits, the combine step adds the sink
        sink = tl.load(sinks_ptr + query_head, mask=row_valid, other=0.0).to(tl.float32)
        running_max = tl.where(row_valid, sink * LOG2_E, float("-inf"))
        running_sum = tl.where(row_valid, 1.0, 0.0)
    else:
        running_max = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
        running_sum = tl.zeros([BLOCK_M], dtype=tl.float32)
    accumulator = tl.zeros([BLOCK_M, HEAD_DIM_PADDED], dtype=tl.float32)

    # Keys this tile can see: [key_begin, key_end).
    first_position = context_len + tile_in_seq * BLOCK_Q
    key_end = tl.minimum(seq_len, first_position + BLOCK_Q)
    key_begin = 0
    if USE_WINDOW:
        key_begin = tl.maximum(key_begin, first_position - sliding_window + 1)
    if USE_CHUNK:
        key_begin = tl.maximum(key_begin, (first_position // chunk_size) * chunk_size)

    block_table_row = block_table_ptr + seq.to(tl.int64) * stride_block_table_seq
    # The tile's own key tiles, from the TILE_N-aligned tile holding key_begin up to key_end,
    # shared out in contiguous runs, one per split: a row whose window is far shorter than its
    # context spreads only its window over the splits. Keys left of key_begin in the first tile
    # are masked (their pages, maybe the null block, are never loaded).
    first_tile_start = (key_begin // TILE_N) * TILE_N
    split_begin = first_tile_start
    split_end = key_end
    if USE_SPLITS:
        tiles_per_split = tl.cdiv(tl.cdiv(key_end - first_tile_start, TILE_N), num_splits)
        split_begin = first_tile_start + split * tiles_per_split * TILE_N
        split_end = tl.minimum(key_end, split_begin + tiles_per_split * TILE_N)
    for tile_start in range(split_begin, split_end, TILE_N):
        key_position = tile_start + tl.arange(0, TILE_N)
        key_valid = (key_position >= key_begin) & (key_position < key_end)
        page = tl.load(block_table_row + key_position // BLOCK_SIZE, mask=key_valid, other=0)
        key_offsets = (
            page.to(tl.int64) * stride_cache_block
            + (key_position % BLOCK_SIZE) * stride_cache_slot
            + kv_head * stride_cache_head
        )
        load_mask = key_valid[None, :] & dim_valid[:, None]
        keys_transposed = tl.load(
            key_cache_ptr + key_offsets[None, :] + dims[:, None], mask=load_mask, other=0.0
        )
        if DOT_IN_FP32:
            keys_transposed = keys_transposed.to(tl.float32)
        scores = tl.dot(query_tile, keys_transposed, input_precision=DOT_PRECISION) * scale
        if USE_SOFTCAP:
            # tanh(x) = 1 - 2 / (exp(2x) + 1): portable (no libdevice), and exp overflowing
            # to inf still gives +-1.
            scores = softcap * (1.0 - 2.0 / (tl.exp(2.0 * scores / softcap) + 1.0))
        scores = scores * LOG2_E

        visible = key_valid[None, :] & (key_position[None, :] <= query_position[:, None])
        if USE_WINDOW:
            visible = visible & (key_position[None, :] > query_position[:, None] - sliding_window)
        if USE_CHUNK:
            visible = visible & (
                key_position[None, :] // chunk_size == query_position[:, None] // chunk_size
            )
        scores = tl.where(visible, scores, float("-inf"))

        new_max = tl.maximum(running_max, tl.max(scores, axis=1))
        # A row that has seen nothing yet keeps max -inf; subtract 0 there to avoid inf - inf.
        safe_max = tl.where(new_max == float("-inf"), 0.0, new_max)
        probabilities = tl.exp2(scores - safe_max[:, None])
        correction = tl.exp2(running_max - safe_max)
        running_sum = running_sum * correction + tl.sum(probabilities, axis=1)
        running_max = new_max

        values = tl.load(
            value_cache_ptr + key_offsets[:, None] + dims[None, :],
            mask=key_valid[:, None] & dim_valid[None, :],
            other=0.0,
        )
        if DOT_IN_FP32:
            values = values.to(tl.float32)
        accumulator = accumulator * correction[:, None]
        accumulator = tl.dot(
            probabilities.to(values.dtype), values, accumulator, input_precision=DOT_PRECISION
        )

    if not USE_SPLITS:
        # Every valid row saw at least its own key, so its sum is > 0; padding rows are not
        # stored.
        running_sum = tl.where(running_sum == 0.0, 1.0, running_sum)
        result = accumulator / running_sum[:, None]
        out_offsets = (
            query_token[:, None] * stride_out_token
            + query_head[:, None] * stride_out_head
            + dims[None, :]
        )
        tl.store(
            out_ptr + out_offsets,
            result.to(out_ptr.dtype.element_ty),
            mask=row_valid[:, None] & dim_valid[None, :],
        )
    else:
        # Partials [num_tokens, num_query_heads, num_splits] (+ HEAD_DIM_PADDED), contiguous.
        # Every split stores, an empty one (a row with fewer key tiles than splits) as
        # (max -inf, sum 0, acc 0), so the combine step never reads an unwritten entry.
        num_query_heads = tl.num_programs(1) * QUERIES_PER_KV
        partial_row = (query_token * num_query_heads + query_head) * num_splits + split
        tl.store(partial_max_ptr + partial_row, running_max, mask=row_valid)
        tl.store(partial_sum_ptr + partial_row, running_sum, mask=row_valid)
        tl.store(
            partial_out_ptr + partial_row[:, None] * HEAD_DIM_PADDED + dims[None, :],
            accumulator,
            mask=row_valid[:, None],
        )


# `num_splits` is a runtime argument: one compiled combine serves every split count.
@triton.jit(do_not_specialize=["num_splits"])
def _combine_splits_kernel(
    out_ptr,
    partial_out_ptr,
    partial_max_ptr,
    partial_sum_ptr,
    sinks_ptr,
    stride_out_token,
    stride_out_head,
    num_splits,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PADDED: tl.constexpr,
    USE_SINKS: tl.constexpr,
):
    """Merges the per-split (max, sum, accumulator) of one (token, query head) into its output."""
    token = tl.program_id(0).to(tl.int64)
    query_head = tl.program_id(1)
    first = (token * tl.num_programs(1) + query_head) * num_splits
    dims = tl.arange(0, HEAD_DIM_PADDED)
    overall_max = tl.load(partial_max_ptr + first)
    for split in range(1, num_splits):
        overall_max = tl.maximum(overall_max, tl.load(partial_max_ptr + first + split))
    if USE_SINKS:
        sink = tl.load(sinks_ptr + query_head).to(tl.float32) * LOG2_E
        overall_max = tl.maximum(overall_max, sink)
    # The row's own key lies in some split, so overall_max is finite; an empty split has
    # max -inf, hence weight 0 (and its accumulator is 0, never NaN).
    total = tl.zeros([1], dtype=tl.float32)
    result = tl.zeros([HEAD_DIM_PADDED], dtype=tl.float32)
    for split in range(num_splits):
        weight = tl.exp2(tl.load(partial_max_ptr + first + split) - overall_max)
        total += weight * tl.load(partial_sum_ptr + first + split)
        result += weight * tl.load(partial_out_ptr + (first + split) * HEAD_DIM_PADDED + dims)
    if USE_SINKS:
        total += tl.exp2(sink - overall_max)
    result = result / total
    tl.store(
        out_ptr + token * stride_out_token + query_head * stride_out_head + dims,
        result.to(out_ptr.dtype.element_ty),
        mask=dims < HEAD_DIM,
    )


def _optional_positive(name: str, value, kind: type):
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float) if kind is float else int):
        raise KernelArgumentError(
            f"{name} must be a positive {kind.__name__} or None, got {value!r}"
        )
    if value <= 0:
        raise KernelArgumentError(f"{name} must be positive, got {value}; pass None to turn it off")
    return kind(value)


def unified_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_table: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    *,
    out: Optional[torch.Tensor] = None,
    scale: Optional[float] = None,
    sliding_window: Optional[int] = None,
    chunk_size: Optional[int] = None,
    softcap: Optional[float] = None,
    sinks: Optional[torch.Tensor] = None,
    block_q: Optional[int] = None,
    tile_n: Optional[int] = None,
    num_kv_splits: Optional[int] = None,
    max_seq_len: Optional[int] = None,
) -> torch.Tensor:
    """Causal paged attention for the queries of many sequences in one launch.

    Args:
        query: [num_tokens, num_query_heads, head_dim], fp32/fp16/bf16; sequence s owns rows
            query_start_loc[s] .. query_start_loc[s+1]-1, its last positions.
        key_cache, value_cache: [num_blocks, block_size, num_kv_heads, head_dim], query's dtype.
        block_table: [num_seqs, max_blocks] int32; pages wholly left of a sequence's visible
            range (window / chunk) may be the null block and are never read.
        query_start_loc: [num_seqs + 1] int32, starts at 0, non-decreasing.
        seq_lens: [num_seqs] int32, context length after this step (>= the query length).
        out: optional output buffer shaped like query (written, also returned).
        scale: score scale, default head_dim ** -0.5.
        sliding_window: W, a query at p sees keys p-W+1 .. p; None for full attention.
        chunk_size: C, a query sees keys of its own chunk floor(p / C) only; None for off.
        softcap: cap, scores become cap * tanh(score / cap); None for off.
        sinks: [num_query_heads] per-head logit added to the softmax denominator (no value).
        block_q, tile_n: tuning knobs (query tokens per program, keys per inner step; powers
            of two, tile_n >= 16); chosen from the shapes when None.
        num_kv_splits: split each query tile's visible key range over this many programs
            and merge their partial softmaxes in a second small kernel (a power of two). Pays
            when there are too few (query tile, kv head) programs to fill the GPU and each
            split still has keys to read; None: the module docstring's rule on CUDA, 1 on the
            CPU interpreter.
        max_seq_len: an upper bound of `seq_lens` known on the host (the engine's metadata
            has it), so the split rule can see how many keys a full-attention row reads;
            None: unknown (only a window or chunk bounds it). Only the split count depends on
            it, never the compiled variant or the result.

    Returns `out`. Raises `KernelArgumentError` before launching on any bad argument. Not
    checked, as that would need a device sync: query_start_loc[-1] == num_tokens, every
    seq_len >= its query length, and the table covering every sequence's last page.
    """
    kernel = _unified_attention_kernel
    check_tensor("query", query, ndim=3, dtypes=CACHE_DTYPES)
    num_tokens, num_query_heads, head_dim = query.shape
    check_tensor(
        "key_cache", key_cache, ndim=4, dtypes=(query.dtype,), shape=(None, None, None, head_dim)
    )
    _, block_size, num_kv_heads, _ = key_cache.shape
    check_tensor("value_cache", value_cache, ndim=4, dtypes=(query.dtype,), shape=key_cache.shape)
    if value_cache.stride() != key_cache.stride():
        raise KernelArgumentError(
            f"value_cache strides {value_cache.stride()} differ from key_cache strides "
            f"{key_cache.stride()}; allocate both caches with the same layout"
        )
    if num_kv_heads == 0 or num_query_heads % num_kv_heads != 0:
        raise KernelArgumentError(
            f"query has {num_query_heads} heads, not a multiple of the caches' {num_kv_heads} "
            "kv heads"
        )
    check_tensor("block_table", block_table, ndim=2, dtypes=(torch.int32,))
    num_seqs = block_table.shape[0]
    check_tensor(
        "query_start_loc",
        query_start_loc,
        ndim=1,
        dtypes=(torch.int32,),
        shape=(num_seqs + 1,),
        contiguous=True,
    )
    check_tensor(
        "seq_lens", seq_lens, ndim=1, dtypes=(torch.int32,), shape=(num_seqs,), contiguous=True
    )
    if out is None:
        out = torch.empty_like(query)
    check_tensor("out", out, ndim=3, dtypes=(query.dtype,), shape=query.shape)
    if sinks is not None:
        check_tensor(
            "sinks", sinks, ndim=1, dtypes=CACHE_DTYPES, shape=(num_query_heads,), contiguous=True
        )
    check_devices(
        kernel,
        {
            "query": query,
            "key_cache": key_cache,
            "value_cache": value_cache,
            "block_table": block_table,
            "query_start_loc": query_start_loc,
            "seq_lens": seq_lens,
            "out": out,
            "sinks": sinks,
        },
    )
    scale = head_dim**-0.5 if scale is None else _optional_positive("scale", scale, float)
    sliding_window = _optional_positive("sliding_window", sliding_window, int)
    chunk_size = _optional_positive("chunk_size", chunk_size, int)
    softcap = _optional_positive("softcap", softcap, float)
    for name, value in (("block_q", block_q), ("tile_n", tile_n), ("num_kv_splits", num_kv_splits)):
        if value is not None and (value <= 0 or value & (value - 1)):
            raise KernelArgumentError(f"{name} must be a power of two, got {value}")
    if tile_n is not None and tile_n < 16:
        raise KernelArgumentError(f"tile_n must be at least 16 (a dot's minimum), got {tile_n}")
    max_seq_len = _optional_positive("max_seq_len", max_seq_len, int)
    if num_tokens == 0 or num_seqs == 0:
        return out

    plan = plan_launch(
        dtype=query.dtype,
        num_tokens=num_tokens,
        num_seqs=num_seqs,
        num_query_heads=num_query_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        block_size=block_size,
        sliding_window=sliding_window,
        chunk_size=chunk_size,
        softcap=softcap,
        has_sinks=sinks is not None,
        interpreted=is_interpreted(kernel),
        multiprocessors=_multiprocessors(query.device),
        max_seq_len=max_seq_len,
        block_q=block_q,
        tile_n=tile_n,
        num_kv_splits=num_kv_splits,
    )
    num_kv_splits = plan.num_kv_splits
    head_dim_padded = plan.constants["HEAD_DIM_PADDED"]
    if num_kv_splits > 1:
        partial_out = torch.empty(
            num_tokens, num_query_heads, num_kv_splits, head_dim_padded,
            dtype=torch.float32, device=query.device,
        )  # fmt: skip
        partial_max = torch.empty(
            num_tokens, num_query_heads, num_kv_splits, dtype=torch.float32, device=query.device
        )
        partial_sum = torch.empty_like(partial_max)
    else:
        partial_out = partial_max = partial_sum = out  # never touched with one split
    grid = (num_tokens // plan.block_q + num_seqs, num_kv_heads, num_kv_splits)
    kernel[grid](
        query,
        key_cache,
        value_cache,
        out,
        partial_out,
        partial_max,
        partial_sum,
        block_table,
        query_start_loc,
        seq_lens,
        sinks if sinks is not None else query,  # never read when USE_SINKS is off
        scale,
        softcap or 1.0,
        sliding_window or 0,
        chunk_size or 1,
        num_seqs,
        num_kv_splits,
        query.stride(0),
        query.stride(1),
        out.stride(0),
        out.stride(1),
        key_cache.stride(0),
        key_cache.stride(1),
        key_cache.stride(2),
        block_table.stride(0),
        **plan.constants,
        num_warps=plan.num_warps,
    )
    if num_kv_splits > 1:
        combine = _combine_splits_kernel
        combine[(num_tokens, num_query_heads)](
            out,
            partial_out,
            partial_max,
            partial_sum,
            sinks if sinks is not None else out,
            out.stride(0),
            out.stride(1),
            num_kv_splits,
            HEAD_DIM=head_dim,
            HEAD_DIM_PADDED=head_dim_padded,
            USE_SINKS=sinks is not None,
        )
    return out


# The split rule (see the module docstring).
MAX_KV_SPLITS = 16
MIN_TILES_PER_SPLIT = 4
PROGRAMS_PER_MULTIPROCESSOR = 2
MAX_PARTIAL_BYTES = 64 << 20


@dataclass(frozen=True)
class LaunchPlan:
    """How `unified_attention` launches one call: tile shapes, split count, compile constants.

    `variant` names the compiled kernels the call needs: the attention kernel's constexprs and
    warps, plus whether the combine kernel runs. Everything else the kernels take (sequence
    count, split count, strides, lengths) is a runtime argument, so two calls with the same
    variant share their compiled code."""

    block_q: int
    tile_n: int
    num_kv_splits: int
    num_warps: int
    constants: dict = field(hash=False)

    @property
    def variant(self) -> tuple:
        return (*sorted(self.constants.items()), ("num_warps", self.num_warps))


def visible_keys_bound(
    max_seq_len: Optional[int],
    sliding_window: Optional[int],
    chunk_size: Optional[int],
    queries_per_tile: int,
) -> Optional[int]:
    """Most keys one query tile can see: its sequence's length, a window W plus the tile's
    other queries (W + queries - 1), a chunk C; None when nothing bounds it (full attention and
    no `max_seq_len`)."""
    bounds = [max_seq_len]
    if sliding_window is not None:
        bounds.append(sliding_window + queries_per_tile - 1)
    if chunk_size is not None:
        bounds.append(chunk_size)
    known = [bound for bound in bounds if bound is not None]
    return min(known) if known else None


def choose_num_kv_splits(
    *,
    num_tokens: int,
    num_seqs: int,
    num_query_heads: int,
    num_kv_heads: int,
    head_dim_padded: int,
    block_q: int,
    tile_n: int,
    visible_keys: Optional[int],
    multiprocessors: Optional[int],
) -> int:
    """The default split count: the module docstring's rule. `multiprocessors` None (the CPU
    interpreter): 1."""
    if multiprocessors is None or num_seqs == 0:
        return 1
    tiles = num_seqs if num_tokens <= num_seqs else -(-num_tokens // block_q)
    programs = tiles * num_kv_heads
    wanted = PROGRAMS_PER_MULTIPROCESSOR * multiprocessors
    if programs >= wanted:
        return 1
    by_fill = next_power_of_2(-(-wanted // programs))
    by_length = MAX_KV_SPLITS
    if visible_keys is not None:
        # +1: the visible range need not start on a tile boundary.
        visible_tiles = -(-visible_keys // tile_n) + 1
        by_length = _previous_power_of_2(max(1, visible_tiles // MIN_TILES_PER_SPLIT))
    splits = min(MAX_KV_SPLITS, by_fill, by_length)
    row_bytes = num_tokens * num_query_heads * (head_dim_padded + 2) * 4
    while splits > 1 and splits * row_bytes > MAX_PARTIAL_BYTES:
        splits //= 2
    return splits


def _previous_power_of_2(value: int) -> int:
    return 1 << (max(1, value).bit_length() - 1)


def plan_launch(
    *,
    dtype: torch.dtype,
    num_tokens: int,
    num_seqs: int,
    num_query_heads: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    sliding_window: Optional[int],
    chunk_size: Optional[int],
    softcap: Optional[float],
    has_sinks: bool,
    interpreted: bool,
    multiprocessors: Optional[int],
    max_seq_len: Optional[int] = None,
    block_q: Optional[int] = None,
    tile_n: Optional[int] = None,
    num_kv_splits: Optional[int] = None,
) -> LaunchPlan:
    """The launch `unified_attention` makes for these (already checked) arguments, without
    launching: the engine's warm-up and the tests ask it which variants a run will use."""
    queries_per_kv = num_query_heads // num_kv_heads
    queries_per_kv_padded = next_power_of_2(queries_per_kv)
    decode_only = num_tokens <= num_seqs
    if block_q is None:
        # Decode-only batches get one token per program (plus GQA rows up to the 16 rows a
        # tensor-core dot wants); batches with prefill chunks get 64-row tiles.
        rows = 16 if decode_only else 64
        block_q = max(1, rows // queries_per_kv_padded)
    if tile_n is None:
        tile_n = 32 if head_dim > 128 else 64
    block_m = max(16, block_q * queries_per_kv_padded)
    head_dim_padded = max(16, next_power_of_2(head_dim))
    dot_in_fp32 = dtype == torch.float32 or (
        # The interpreter stores bf16 as raw uint16 and mis-multiplies it; cast first there.
        dtype == torch.bfloat16 and interpreted
    )
    if num_kv_splits is None:
        visible = visible_keys_bound(
            max_seq_len, sliding_window, chunk_size, 1 if decode_only else block_q
        )
        num_kv_splits = choose_num_kv_splits(
            num_tokens=num_tokens,
            num_seqs=num_seqs,
            num_query_heads=num_query_heads,
            num_kv_heads=num_kv_heads,
            head_dim_padded=head_dim_padded,
            block_q=block_q,
            tile_n=tile_n,
            visible_keys=visible,
            multiprocessors=multiprocessors,
        )
    constants = dict(
        QUERIES_PER_KV=queries_per_kv,
        QUERIES_PER_KV_PADDED=queries_per_kv_padded,
        HEAD_DIM=head_dim,
        HEAD_DIM_PADDED=head_dim_padded,
        BLOCK_SIZE=block_size,
        BLOCK_Q=block_q,
        BLOCK_M=block_m,
        TILE_N=tile_n,
        USE_WINDOW=sliding_window is not None,
        USE_CHUNK=chunk_size is not None,
        USE_SOFTCAP=softcap is not None,
        USE_SINKS=has_sinks,
        DOT_IN_FP32=dot_in_fp32,
        # fp32 caches ask for fp32 accuracy, not TF32; fp16/bf16 operands ignore this.
        DOT_PRECISION="ieee" if dot_in_fp32 else None,
        USE_SPLITS=num_kv_splits > 1,
    )
    return LaunchPlan(
        block_q=block_q,
        tile_n=tile_n,
        num_kv_splits=num_kv_splits,
        num_warps=8 if block_m > 16 and head_dim > 128 else 4,
        constants=constants,
    )


_MULTIPROCESSORS: dict = {}


def _multiprocessors(device: torch.device) -> Optional[int]:
    """The CUDA device's multiprocessor count (cached), None for any other device."""
    if device.type != "cuda":
        return None
    if device not in _MULTIPROCESSORS:
        _MULTIPROCESSORS[device] = torch.cuda.get_device_properties(device).multi_processor_count
    return _MULTIPROCESSORS[device]


def _default_num_splits(
    device: torch.device,
    num_tokens: int,
    num_seqs: int,
    num_kv_heads: int,
    *,
    num_query_heads: Optional[int] = None,
    head_dim: int = 128,
    sliding_window: Optional[int] = None,
    chunk_size: Optional[int] = None,
    max_seq_len: Optional[int] = None,
) -> int:
    """The split count `unified_attention` picks by default for such a batch on `device`."""
    num_query_heads = num_query_heads or num_kv_heads
    return plan_launch(
        dtype=torch.bfloat16,
        num_tokens=num_tokens,
        num_seqs=num_seqs,
        num_query_heads=num_query_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        block_size=16,
        sliding_window=sliding_window,
        chunk_size=chunk_size,
        softcap=None,
        has_sinks=False,
        interpreted=False,
        multiprocessors=_multiprocessors(torch.device(device)),
        max_seq_len=max_seq_len,
    ).num_kv_splits


def layer_variants(
    *,
    dtype: torch.dtype,
    num_query_heads: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    sliding_window: Optional[int],
    chunk_size: Optional[int],
    softcap: Optional[float],
    has_sinks: bool,
    interpreted: bool,
) -> dict:
    """{variant: (num_tokens, num_seqs, num_kv_splits) of a tiny call that compiles it}: every
    variant a layer with these shapes can meet with the default tile shapes, whatever its
    batches' sizes and lengths: a decode-only and a mixed batch, each without and with KV
    splits (two splits stand for any count, a runtime argument)."""
    variants = {}
    for num_tokens, num_seqs in ((1, 1), (2, 1)):
        for splits in (1, 2):
            plan = plan_launch(
                dtype=dtype,
                num_tokens=num_tokens,
                num_seqs=num_seqs,
                num_query_heads=num_query_heads,
                num_kv_heads=num_kv_heads,
                head_dim=head_dim,
                block_size=block_size,
                sliding_window=sliding_window,
                chunk_size=chunk_size,
                softcap=softcap,
                has_sinks=has_sinks,
                interpreted=interpreted,
                multiprocessors=None,
                num_kv_splits=splits,
            )
            variants[plan.variant] = (num_tokens, num_seqs, splits)
    return variants


def compile_variants(
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    num_query_heads: int,
    *,
    scale: Optional[float] = None,
    sliding_window: Optional[int] = None,
    chunk_size: Optional[int] = None,
    softcap: Optional[float] = None,
    sinks: Optional[torch.Tensor] = None,
) -> list:
    """Compiles (by launching once) every variant of `layer_variants` for a layer over these
    caches, so that no step of a run meets a compile. The calls read page 1 of the caches
    (which must have at least two pages) and write nothing there. Returns the variants."""
    num_blocks, block_size, num_kv_heads, head_dim = key_cache.shape
    if num_blocks < 2:
        raise KernelArgumentError(f"compile_variants needs 2 cache pages, got {num_blocks}")
    device = key_cache.device
    variants = layer_variants(
        dtype=key_cache.dtype,
        num_query_heads=num_query_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        block_size=block_size,
        sliding_window=sliding_window,
        chunk_size=chunk_size,
        softcap=softcap,
        has_sinks=sinks is not None,
        interpreted=is_interpreted(_unified_attention_kernel),
    )
    for num_tokens, num_seqs, splits in variants.values():
        query = torch.zeros(
            num_tokens, num_query_heads, head_dim, dtype=key_cache.dtype, device=device
        )
        unified_attention(
            query,
            key_cache,
            value_cache,
            torch.ones(num_seqs, 2, dtype=torch.int32, device=device),
            torch.tensor([0, num_tokens], dtype=torch.int32, device=device),
            torch.tensor([num_tokens], dtype=torch.int32, device=device),
            scale=scale,
            sliding_window=sliding_window,
            chunk_size=chunk_size,
            softcap=softcap,
            sinks=sinks,
            num_kv_splits=splits,
        )
    return list(variants)
