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
from typing import Optional, Sequence

import numpy as np
import torch

from hybrid_cache import _core

NULL_BLOCK: int = _core.NULL_BLOCK  # the core's null block id (0), as the core exports it


@dataclass
class GroupMetadata:
    """Paging data of one KV-cache group for one step."""

    block_table: torch.Tensor  # [num_seqs, max_blocks] int32, rows of the scheduled requests
    slot_mapping: torch.Tensor  # [num_tokens] int64, where each new token's K/V is written
    block_size: int
    # The step's tokens whose K/V is written, [written] int64, when not all are (a tail replay:
    # full-attention KV below the replay's frontier is read from the cache, not rewritten);
    # `slot_mapping` then holds the slots of those tokens only.
    write_rows: Optional[torch.Tensor] = None


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
    starts = query_start_loc.cpu().numpy()
    seq_of_token = _sequence_of_token(np.diff(starts))
    positions = _positions(starts, seq_lens.cpu().numpy(), seq_of_token)
    return torch.from_numpy(positions).to(query_start_loc.device)


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
    seq_of_token = _sequence_of_token(np.diff(query_start_loc.cpu().numpy()))
    table = block_table.cpu().numpy()[None]
    slots = _slots(table, seq_of_token, positions.cpu().numpy(), block_size)[0]
    return torch.from_numpy(slots).to(block_table.device)


# The metadata is built with numpy on the host: a step's arrays are small (one entry per
# sequence or token), so the cost is the number of array operations, not their size; a numpy
# op costs less than a torch op, and fewer ops (a decode-only path, in-place updates) matter
# most when the model's forward has just evicted the engine's code and data from the caches.


def _sequence_of_token(query_lens: np.ndarray) -> np.ndarray:
    """The sequence index of every flattened token."""
    return np.repeat(np.arange(len(query_lens)), query_lens)


def _positions(
    query_start_loc: np.ndarray, seq_lens: np.ndarray, seq_of_token: np.ndarray
) -> np.ndarray:
    """`compute_positions` on host arrays, given each token's sequence; int64.

    Token t of sequence i sits at `seq_lens[i] - (query_start_loc[i + 1] - t)`.
    """
    shift = seq_lens.astype(np.int64) - query_start_loc[1:]
    return np.arange(len(seq_of_token), dtype=np.int64) + shift[seq_of_token]


def _tokens(
    query_lens: np.ndarray, query_start_loc: np.ndarray, seq_lens: np.ndarray, max_query_len: int
) -> tuple[np.ndarray, np.ndarray]:
    """Each flattened token's sequence and absolute position (int64)."""
    num_seqs = len(query_lens)
    if max_query_len == 1 and query_start_loc[-1] == num_seqs:
        # Decode only (every query length is 1): token i is sequence i's last position.
        positions = seq_lens.astype(np.int64)
        positions -= 1
        return np.arange(num_seqs), positions
    seq_of_token = _sequence_of_token(query_lens)
    return seq_of_token, _positions(query_start_loc, seq_lens, seq_of_token)


def _slots(
    block_tables: np.ndarray, seq_of_token: np.ndarray, positions: np.ndarray, block_size: int
) -> np.ndarray:
    """`compute_slot_mapping` for several groups' tables at once: [groups, seqs, width] ->
    [groups, num_tokens] int64."""
    block_index, offset = np.divmod(positions.astype(np.int64, copy=False), block_size)
    block_ids = block_tables[:, seq_of_token, block_index]
    assert NULL_BLOCK == 0 and block_ids.all(), "a new token maps to the null block"
    slots = block_ids.astype(np.int64)
    slots *= block_size
    slots += offset
    return slots


def build_attention_metadata(
    query_lens: Sequence[int] | torch.Tensor,
    num_computed_tokens: Sequence[int] | torch.Tensor,
    block_tables: Sequence[torch.Tensor],
    block_sizes: Sequence[int],
    write_from: Optional[Sequence[int]] = None,
    read_only_groups: Sequence[int] = (),
) -> tuple[AttentionMetadata, torch.Tensor]:
    """Metadata and token positions for one step.

    `query_lens[i]` tokens of sequence `i` are computed this step on top of its
    `num_computed_tokens[i]` cached ones; `block_tables[g]` is group g's table, one row per
    sequence in the same order. Everything but the tables and slot mappings (on their
    tables' device) is on the CPU. `write_from[i]` (a tail replay's frontier, 0 for none):
    the groups in `read_only_groups` write no K/V for sequence i's positions below it.
    """
    query_lens = np.asarray(query_lens, dtype=np.int32)
    num_seqs = len(query_lens)
    query_start_loc = np.zeros(num_seqs + 1, dtype=np.int32)
    np.cumsum(query_lens, out=query_start_loc[1:])
    seq_lens = np.array(num_computed_tokens, dtype=np.int32)  # a copy: updated in place
    seq_lens += query_lens
    max_query_len = int(query_lens.max()) if num_seqs else 0
    seq_of_token, positions = _tokens(query_lens, query_start_loc, seq_lens, max_query_len)
    slot_mappings = _slot_mappings(block_tables, block_sizes, seq_of_token, positions)
    groups = [
        GroupMetadata(block_table=table, slot_mapping=slots, block_size=size)
        for table, slots, size in zip(block_tables, slot_mappings, block_sizes)
    ]
    if write_from is not None and read_only_groups:
        written = positions >= np.asarray(write_from, dtype=np.int64)[seq_of_token]
        if not written.all():
            rows = torch.from_numpy(np.flatnonzero(written))
            for index in read_only_groups:
                group = groups[index]
                group.write_rows = _on_device(rows, group.slot_mapping.device)
                group.slot_mapping = group.slot_mapping[group.write_rows]
    metadata = AttentionMetadata(
        query_start_loc=torch.from_numpy(query_start_loc),
        seq_lens=torch.from_numpy(seq_lens),
        groups=groups,
        max_query_len=max_query_len,
        max_seq_len=int(seq_lens.max()) if num_seqs else 0,
    )
    return metadata, torch.from_numpy(positions)


def _slot_mappings(
    block_tables: Sequence[torch.Tensor],
    block_sizes: Sequence[int],
    seq_of_token: np.ndarray,
    positions: np.ndarray,
) -> list[torch.Tensor]:
    """Every group's slot mapping, on its table's device. Groups with the same block size and
    table shape get their slots in one gather."""
    slot_mappings: list[torch.Tensor] = [torch.empty(0)] * len(block_tables)
    batches: dict[tuple, list[int]] = {}
    for index, (table, size) in enumerate(zip(block_tables, block_sizes)):
        batches.setdefault((size, tuple(table.shape), table.device), []).append(index)
    for (size, _, device), indices in batches.items():
        if len(indices) == 1:
            tables = _host_array(block_tables[indices[0]])[None]
        else:
            tables = np.stack([_host_array(block_tables[index]) for index in indices])
        slots = _slots(tables, seq_of_token, positions, size)
        for row, index in zip(slots, indices):
            slot_mappings[index] = _on_device(torch.from_numpy(row), device)
    return slot_mappings


def _host_array(tensor: torch.Tensor) -> np.ndarray:
    return tensor.numpy() if tensor.device.type == "cpu" else tensor.cpu().numpy()


def _on_device(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    return tensor if device.type == "cpu" else tensor.to(device)
