"""The torch backend's per-step row plan: which keys each query row reads, as positions
(`StepGeometry`, shared by every group with the same visibility options) and as pages of one
group (`StepPlan`).

Per step, a `StepGeometry` lays every sequence's visible keys out on a padded row, in token
positions (built by the first layer and cached on the step's metadata, so every group with the
same window reuses it, as `triton_backend` does with its step tensors):

    sequence s, visible positions low[s] .. seq_len[s]-1  (low: first position its first query
                                                           can see, as in the reference)
    row s:   [ low  low+1  ...  seq_len-1 | pad pad pad ]   max_visible columns
                                            pad = seq_len-1 again (a real, visible slot), masked

so a windowed group gathers about W + query_len keys per sequence, never the whole context;
per group, a `StepPlan` only looks the positions up in that group's block table.
Padding repeats a visible slot instead of pointing at the null block: the padded keys are
masked out of the softmax and their values are finite, so NaN in released or null pages can never
reach the output (no NaN * 0). Sequences are split once per step into decode rows (one query:
every gathered key is visible, the mask is just the padding) and prefill rows (several queries,
padded to the longest, with a per-query causal / window / chunk mask). With a sliding window of
at most `TILED_MAX_WINDOW` tokens, a sequence's queries are first cut into tiles of W tokens,
each its own row over its 2W - 1 keys, so a prefill chunk costs about num_tokens x 2W, not
query_len x (W + query_len). Rows the CPU kernel takes (`KERNEL_DECODE`: one-query rows,
`KERNEL_ALL`: every query token) are kept as visible ranges only (`cpu_kernel.RowSpans`, placed in each group's block table as `cpu_kernel.KernelRows`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import numpy as np
import torch

from hybrid_cache.attention import cpu_kernel
from hybrid_cache.attention.metadata import NULL_BLOCK, AttentionMetadata, GroupMetadata
from hybrid_cache.attention.visibility import first_visible_position, is_visible
from hybrid_cache.step_cache import cached_on

__all__ = [
    "KERNEL_ALL",
    "KERNEL_DECODE",
    "KERNEL_NONE",
    "TILED_MAX_WINDOW",
    "KernelBatch",
    "RowBatch",
    "StepPlan",
    "step_plan",
]

# Attribute names of the per-step caches: the geometry on the step's AttentionMetadata (shared
# by every group with the same visibility options), the plan on each GroupMetadata.
_GEOMETRY_CACHE = "_row_plan_geometry"
_PLAN_CACHE = "_row_plan_plans"
# Sliding windows up to this size cut prefill rows into tiles of W queries over their 2W - 1
# keys (cheap for small windows; for W = 4096 the tiles would be as long as the prompts, so
# larger windows pad each sequence's queries on one row instead).
TILED_MAX_WINDOW = 128
# Prefill rows whose keys all start at position 0 (full attention) put each query at its own
# position, padding the queries up to the keys' length, when that is at most this many times
# the longest row's queries: a prompt continued from an earlier step then needs no mask.
ALIGNED_MAX_PADDING = 2
# Which rows `step_plan` leaves to the CPU kernel (`cpu_kernel`): none, one-query rows, or every
# query token as its own row.
KERNEL_NONE, KERNEL_DECODE, KERNEL_ALL = "none", "decode", "all"


@dataclass(frozen=True)
class RowGeometry:
    """Sequences of one kind (decode or prefill) laid out on padded rows, in token positions:
    everything about a row batch that does not depend on a group's block table."""

    sequences: torch.Tensor  # [num_rows] int64: the sequence (block-table row) of each row
    # [num_rows, max_visible] int64: the token position each gathered key is read from (padding
    # repeats the row's last visible position)
    gather_positions: torch.Tensor
    # [num_rows, 1, max_queries, 1, max_visible] bool: key visible to query (padded keys: False)
    mask: torch.Tensor
    # [num_rows, max_queries] int64: flattened query row of each padded query (padding repeats
    # the row's last query, so every padded query has a visible key and a finite softmax)
    query_rows: torch.Tensor
    # [num_tokens_of_these_rows] int64: index into the flattened [num_rows * max_queries] output
    # of each real query, in the order of `token_rows`
    output_index: torch.Tensor
    token_rows: torch.Tensor  # [num_tokens_of_these_rows] int64: their rows in q / the output
    # Every row's keys are exactly its queries' positions and the mask of its real queries is
    # plain causal (query i sees keys 0..=i): whole prompts with no window or chunk cutting them.
    # Fused attention can then skip the masked half instead of reading a mask.
    causal: bool = False


@dataclass(frozen=True)
class StepGeometry:
    """One step's row layout for one set of visibility options; `decode`/`prefill` None when
    absent. Built once per step and reused by every group with these options."""

    # one query per row (with a small window: every one-token tile)
    decode: Optional[RowGeometry | cpu_kernel.RowSpans]
    prefill: Optional[RowGeometry]


@dataclass(frozen=True)
class RowBatch:
    """A row geometry placed in one group's pages."""

    geometry: RowGeometry
    key_blocks: torch.Tensor  # [num_rows, max_visible] int64: block id of each gathered key
    key_offsets: torch.Tensor  # [num_rows, max_visible] int64: offset in that block

    @property
    def mask(self) -> torch.Tensor:
        return self.geometry.mask

    @property
    def query_rows(self) -> torch.Tensor:
        return self.geometry.query_rows


KernelBatch = cpu_kernel.KernelRows  # kernel rows with the group's block table


@dataclass(frozen=True)
class StepPlan:
    """One group's gather indices and masks for one step; `decode`/`prefill` None when absent."""

    decode: Optional[RowBatch | KernelBatch]
    prefill: Optional[RowBatch]


def _kernel_rows(
    sequences: torch.Tensor,
    query_start: torch.Tensor,
    seq_lens: torch.Tensor,
    sliding_window: Optional[int],
    chunk: Optional[int],
    num_tokens: int,
) -> cpu_kernel.RowSpans:
    """One-query rows as visible ranges, for the CPU kernel."""
    positions = seq_lens - 1
    return cpu_kernel.row_spans(
        query_start,
        num_tokens,
        sequences,
        positions,
        first_visible_position(positions, sliding_window, chunk),
    )


def _position_aligned(
    low: torch.Tensor,
    seq_lens: torch.Tensor,
    sliding_window: Optional[int],
    chunk: Optional[int],
    max_queries: int,
    max_visible: int,
) -> bool:
    """Whether prefill rows can be laid out with query column = position (see `_row_geometry`):
    every row sees its keys from position 0 and no window or chunk cuts any of them, and padding
    the queries up to the keys' length costs at most ALIGNED_MAX_PADDING times the queries
    (fused causal attention skips the upper triangle, which pays back about 2x)."""
    if bool((low != 0).any()) or max_visible > ALIGNED_MAX_PADDING * max_queries:
        return False
    longest = int(seq_lens.max())
    if sliding_window is not None and longest > sliding_window:
        return False
    return chunk is None or longest <= chunk


def _row_geometry(
    sequences: torch.Tensor,
    query_start: torch.Tensor,
    query_lens: torch.Tensor,
    seq_lens: torch.Tensor,
    sliding_window: Optional[int],
    chunk: Optional[int],
    device: torch.device,
) -> RowGeometry:
    """Padded key positions and masks for the sequences given (all with query_len >= 1)."""
    first_query = seq_lens - query_lens
    low = first_visible_position(first_query, sliding_window, chunk)
    num_visible = seq_lens - low
    max_visible = int(num_visible.max())
    columns = torch.arange(max_visible)
    key_positions = low[:, None] + columns[None, :]
    # Padding repeats the last visible slot: real, written, finite.
    gather_positions = torch.minimum(key_positions, (seq_lens - 1)[:, None])

    max_queries = int(query_lens.max())
    if _position_aligned(low, seq_lens, sliding_window, chunk, max_queries, max_visible):
        # Every row's keys start at position 0 and nothing but causality cuts them: put query
        # column c at position c (columns left of a row's first query, and right of its last,
        # are padding) so the mask is the plain lower triangle even for a prompt continued
        # from an earlier step, and fused attention runs causal without reading a mask.
        max_queries = max_visible
        query_columns = torch.arange(max_queries)
        relative = query_columns[None, :] - first_query[:, None]
        query_valid = (relative >= 0) & (relative < query_lens[:, None])
        query_offsets = relative.clamp(min=0).minimum((query_lens - 1)[:, None])
        causal = True
    else:
        query_columns = torch.arange(max_queries)
        query_valid = query_columns[None, :] < query_lens[:, None]
        last_query = (query_lens - 1)[:, None]
        query_offsets = torch.minimum(query_columns[None, :], last_query)
        causal = bool((low == first_query).all())
        if sliding_window is not None:
            causal &= max_queries <= sliding_window
        if chunk is not None:
            causal &= bool(((seq_lens - 1) // chunk == first_query // chunk).all())
    if causal:
        # Key column k is position low + k and query column i position first_query + i with
        # low == first_query: the lower triangle, shared by every row (padded keys sit past
        # every real query of their row; padded queries see at least key 0).
        mask = torch.ones(max_queries, max_visible, dtype=torch.bool).tril()[None]
        mask = mask.expand(len(query_lens), max_queries, max_visible)
    else:
        key_valid = columns[None, :] < num_visible[:, None]
        query = (first_query[:, None] + query_offsets)[:, :, None]  # positions [rows, Q, 1]
        key = key_positions[:, None, :]
        mask = key_valid[:, None, :] & is_visible(query, key, sliding_window, chunk)

    query_rows = query_start[:, None] + query_offsets
    output_index = (torch.arange(len(query_lens))[:, None] * max_queries + query_columns[None, :])[
        query_valid
    ]
    token_rows = query_rows[query_valid]
    return RowGeometry(
        sequences=sequences,
        gather_positions=gather_positions,
        mask=mask[:, None, :, None, :].to(device),
        query_rows=query_rows.to(device),
        output_index=output_index.to(device),
        token_rows=token_rows.to(device),
        causal=causal,
    )


def _tiles(
    query_start: torch.Tensor, query_lens: torch.Tensor, seq_lens: torch.Tensor, tile: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Every sequence's query tokens cut into tiles of at most `tile` consecutive tokens, each
    tile a sequence of its own that ends at its last query: (sequence of each tile, first query
    row, query count, seq_len)."""
    tiles_per_seq = -(-query_lens // tile)  # 0 for a sequence with no query
    tile_seq = torch.repeat_interleave(torch.arange(len(query_lens)), tiles_per_seq)
    first_tile = torch.cumsum(tiles_per_seq, 0) - tiles_per_seq
    offset = (torch.arange(len(tile_seq)) - first_tile[tile_seq]) * tile
    tile_lens = torch.minimum(query_lens[tile_seq] - offset, torch.tensor(tile))
    tile_seq_lens = (seq_lens - query_lens)[tile_seq] + offset + tile_lens
    return tile_seq, query_start[tile_seq] + offset, tile_lens, tile_seq_lens


def _decode_only_spans(
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    sliding_window: Optional[int],
    chunk: Optional[int],
) -> Optional[cpu_kernel.RowSpans]:
    """For a step where every sequence has exactly one query (pure decode, the common step),
    the kernel rows straight from the step's arrays in numpy (a dozen small torch ops cost
    ~0.2 ms per geometry here); None for any other step."""
    starts = query_start_loc.numpy()
    num_seqs = len(starts) - 1
    if num_seqs == 0 or starts[-1] != num_seqs or not (np.diff(starts) == 1).all():
        return None
    positions = seq_lens.numpy() - 1
    low = first_visible_position(positions, sliding_window, chunk)
    return cpu_kernel.RowSpans(
        token_rows=torch.arange(num_seqs),
        every_token=True,
        sequences=np.arange(num_seqs, dtype=np.int64),
        positions=np.ascontiguousarray(positions, dtype=np.int64),
        low=np.ascontiguousarray(low, dtype=np.int64),
    )


def _build_geometry(
    metadata: AttentionMetadata,
    sliding_window: Optional[int],
    chunk: Optional[int],
    device: torch.device,
    kernel: str,
) -> StepGeometry:
    query_start_loc = metadata.query_start_loc.cpu().long()
    seq_lens = metadata.seq_lens.cpu().long()
    if kernel != KERNEL_NONE:
        decode_only = _decode_only_spans(query_start_loc, seq_lens, sliding_window, chunk)
        if decode_only is not None:
            return StepGeometry(decode=decode_only, prefill=None)
    query_start = query_start_loc[:-1]
    query_lens = query_start_loc[1:] - query_start
    sequences = torch.arange(len(query_lens))
    tile = None
    if kernel == KERNEL_ALL:
        tile = 1  # every query token is a one-query row of the kernel
    elif sliding_window is not None and sliding_window <= TILED_MAX_WINDOW:
        # Tiles of W queries over their 2W - 1 keys: a prefill chunk costs about 2 W scores and
        # 2 gathered keys per token, instead of (W + query_len) each on one padded row.
        tile = sliding_window
    if tile is not None:
        sequences, query_start, query_lens, seq_lens = _tiles(
            query_start, query_lens, seq_lens, tile
        )
    kinds: list = []
    one_query = query_lens == 1
    for selected in (one_query, query_lens > 1):  # sequences with no query are skipped
        rows = selected.nonzero().flatten()
        if len(rows) == 0:
            kinds.append(None)
            continue
        if kernel != KERNEL_NONE and selected is one_query:  # the kernel reads K/V in place
            kinds.append(
                _kernel_rows(
                    sequences[rows],
                    query_start[rows],
                    seq_lens[rows],
                    sliding_window,
                    chunk,
                    int(query_start_loc[-1]),
                )
            )
            continue
        kinds.append(
            _row_geometry(
                sequences[rows],
                query_start[rows],
                query_lens[rows],
                seq_lens[rows],
                sliding_window,
                chunk,
                device,
            )
        )
    return StepGeometry(decode=kinds[0], prefill=kinds[1])


def _place(geometry: RowGeometry, block_table: torch.Tensor, block_size: int, device) -> RowBatch:
    """The geometry's keys in the group's pages: block ids and offsets."""
    positions = geometry.gather_positions
    key_blocks = torch.gather(block_table[geometry.sequences].long(), 1, positions // block_size)
    assert bool((key_blocks != NULL_BLOCK).all()), (
        "a sequence needs the null block for one of its visible positions"
    )
    return RowBatch(
        geometry=geometry,
        key_blocks=key_blocks.to(device),
        key_offsets=(positions % block_size).to(device),
    )


def _build_plan(
    metadata: AttentionMetadata,
    group: GroupMetadata,
    sliding_window: Optional[int],
    chunk: Optional[int],
    device: torch.device,
    kernel: str,
) -> StepPlan:
    geometry = cached_on(
        metadata,
        _GEOMETRY_CACHE,
        (sliding_window, chunk, device, kernel),
        (metadata.query_start_loc, metadata.seq_lens),
        lambda: _build_geometry(metadata, sliding_window, chunk, device, kernel),
    )
    block_table = group.block_table.cpu()
    decode: Optional[RowBatch | KernelBatch] = None
    if isinstance(geometry.decode, cpu_kernel.RowSpans):
        decode = cpu_kernel.kernel_rows(geometry.decode, block_table)
    elif geometry.decode is not None:
        decode = _place(geometry.decode, block_table, group.block_size, device)
    return StepPlan(
        decode=decode,
        prefill=None
        if geometry.prefill is None
        else _place(geometry.prefill, block_table, group.block_size, device),
    )


def step_plan(
    metadata: AttentionMetadata,
    group: GroupMetadata,
    sliding_window: Optional[int],
    chunk: Optional[int],
    device: torch.device,
    kernel: str = KERNEL_NONE,
) -> StepPlan:
    """The group's plan for this step: built by the step's first layer with these visibility
    options, reused by the others (cached on `group`, keyed by the source tensors' identity).
    The row geometry under it is shared by every group of the step with the same options
    (cached on `metadata`): only the block ids differ between groups. `kernel` says which rows
    the CPU kernel takes (`KernelBatch`: visible ranges, no gather indices): `KERNEL_NONE`,
    `KERNEL_DECODE` (one-query rows) or `KERNEL_ALL` (every query token as its own row)."""
    device = torch.device(device)
    return cached_on(
        group,
        _PLAN_CACHE,
        (sliding_window, chunk, device, kernel),
        (metadata.query_start_loc, metadata.seq_lens, group.block_table),
        lambda: _build_plan(metadata, group, sliding_window, chunk, device, kernel),
    )
