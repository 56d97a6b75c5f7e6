"""Per-step attention metadata for a flattened batch of variable-length query rows.

One engine step runs prefill chunks and decode tokens of several requests in one forward: their
tokens are concatenated into one token dimension of length `num_tokens`. Sequence `i` owns the
query rows `query_start_loc[i]:query_start_loc[i + 1]`; after the step its context holds
`seq_lens[i]` tokens, so its queries sit at positions `seq_lens[i] - query_len .. seq_lens[i] - 1`.

Each KV-cache group (layers sharing an attention type and block table) has its own block table
and block size, hence its own slot mapping:

    position p of sequence i  ->  block_table[i, p // B] * B + p % B

Block id 0 is the null block: a sliding-window (or chunked-local) group replaces the blocks that
fell out of every future query's view by 0. Those entries may sit left of the window in a table
row and must never be read or written; every backend gathers only visible blocks.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

NULL_BLOCK = 0


@dataclass
class GroupMetadata:
    """Paging data of one KV-cache group for one step."""

    block_table: torch.Tensor  # [num_seqs, max_blocks] int32, rows of the scheduled requests
    slot_mapping: torch.Tensor  # [num_tokens] int64, where each new token's K/V is written
    block_size: int


@dataclass
class AttentionMetadata:
    """Everything an attention layer needs to know about the current step's batch."""

    query_start_loc: torch.Tensor  # [num_seqs + 1] int32, prefix sums of the query lengths
    seq_lens: torch.Tensor  # [num_seqs] int32, context length of each sequence after this step
    groups: list[GroupMetadata]  # indexed by KV-cache group id
    max_query_len: int
    max_seq_len: int

    @property
    def num_seqs(self) -> int:
        return int(self.seq_lens.shape[0])

    @property
    def num_tokens(self) -> int:
        return int(self.query_start_loc[-1].item())


def compute_positions(query_start_loc: torch.Tensor, seq_lens: torch.Tensor) -> torch.Tensor:
    """Absolute position of every flattened query token, [num_tokens] int64 (no Python loop)."""
    seq_of_token = _sequence_of_token(query_start_loc, query_start_loc.device)
    return _positions(query_start_loc, seq_lens, seq_of_token)


def _positions(
    query_start_loc: torch.Tensor, seq_lens: torch.Tensor, seq_of_token: torch.Tensor
) -> torch.Tensor:
    """`compute_positions`, given each token's sequence (`_sequence_of_token`)."""
    device = query_start_loc.device
    query_lens = (query_start_loc[1:] - query_start_loc[:-1]).long()
    first_positions = seq_lens.long().to(device) - query_lens
    offset_in_seq = (
        torch.arange(len(seq_of_token), device=device) - query_start_loc[:-1].long()[seq_of_token]
    )
    return first_positions[seq_of_token] + offset_in_seq


def compute_slot_mapping(
    block_table: torch.Tensor,
    query_start_loc: torch.Tensor,
    positions: torch.Tensor,
    block_size: int,
) -> torch.Tensor:
    """Slots `block_id * block_size + offset` for every query token, [num_tokens] int64.

    `block_table` holds one row per scheduled sequence; `positions` are the tokens' absolute
    positions (see `compute_positions`). Vectorised: one gather, no per-token loop.
    """
    seq_of_token = _sequence_of_token(query_start_loc, block_table.device)
    return _slots(block_table[None], seq_of_token, positions, block_size)[0]


def _sequence_of_token(query_start_loc: torch.Tensor, device: torch.device) -> torch.Tensor:
    query_lens = (query_start_loc[1:] - query_start_loc[:-1]).long().to(device)
    return torch.repeat_interleave(torch.arange(len(query_lens), device=device), query_lens)


def _slots(
    block_tables: torch.Tensor, seq_of_token: torch.Tensor, positions: torch.Tensor, block_size
) -> torch.Tensor:
    """`compute_slot_mapping` for several groups' tables at once: [groups, seqs, width] ->
    [groups, num_tokens]."""
    positions = positions.to(block_tables.device).long()
    block_ids = block_tables[:, seq_of_token, positions // block_size].long()
    assert bool((block_ids != NULL_BLOCK).all()), "a new token maps to the null block"
    return block_ids * block_size + positions % block_size


def build_attention_metadata(
    query_lens: Sequence[int] | torch.Tensor,
    num_computed_tokens: Sequence[int] | torch.Tensor,
    block_tables: Sequence[torch.Tensor],
    block_sizes: Sequence[int],
) -> tuple[AttentionMetadata, torch.Tensor]:
    """Metadata and token positions for one step.

    `query_lens[i]` tokens of sequence `i` are computed this step on top of its
    `num_computed_tokens[i]` cached ones; `block_tables[g]` is group g's table, one row per
    sequence in the same order.
    """
    query_lens = torch.as_tensor(query_lens, dtype=torch.int32)
    computed = torch.as_tensor(num_computed_tokens, dtype=torch.int32)
    query_start_loc = torch.zeros(len(query_lens) + 1, dtype=torch.int32)
    query_start_loc[1:] = torch.cumsum(query_lens, 0)
    seq_lens = computed + query_lens
    seq_of_token = _sequence_of_token(query_start_loc, query_start_loc.device)
    positions = _positions(query_start_loc, seq_lens, seq_of_token)
    # Groups with the same block size and table shape get their slots in one gather.
    slot_mappings: list[torch.Tensor | None] = [None] * len(block_tables)
    batches: dict[tuple, list[int]] = {}
    for index, (table, size) in enumerate(zip(block_tables, block_sizes)):
        batches.setdefault((size, tuple(table.shape), table.device), []).append(index)
    for (size, _, device), indices in batches.items():
        tables = torch.stack([block_tables[index] for index in indices])
        slots = _slots(tables, seq_of_token.to(device), positions, size)
        for row, index in enumerate(indices):
            slot_mappings[index] = slots[row]
    groups = [
        GroupMetadata(block_table=table, slot_mapping=slots, block_size=size)
        for table, slots, size in zip(block_tables, slot_mappings, block_sizes)
    ]
    metadata = AttentionMetadata(
        query_start_loc=query_start_loc,
        seq_lens=seq_lens,
        groups=groups,
        max_query_len=int(query_lens.max().item()) if len(query_lens) else 0,
        max_seq_len=int(seq_lens.max().item()) if len(seq_lens) else 0,
    )
    return metadata, positions
