"""A decode step's attention metadata (one new token per sequence), written into host buffers
that one model runner reuses every step.

A decode step's metadata is a few small arrays: positions, sequence lengths, the query starts
(a range), each group's block-table rows and new-token slots. Built as fresh numpy arrays they
cost a dozen array calls a step, each several microseconds right after the forward has evicted
numpy from the CPU caches. Here one native call (`_core.decode_inputs_cpu`) writes all of them
into buffers that live as long as their owner, and the step's tensors are views of their
prefixes (fresh tensor objects each step, `torch.from_numpy` of numpy slices, so per-step
caches keyed on them stay per step).

Contract: a step's metadata is valid until the same buffers build the next one. The engine runs
its steps one after another and no backend keeps a step's tensors past its forward (a copy to
a device is made during the step); `build_decode_metadata` builds into buffers of its own for a
caller that keeps its metadata. Backends may write to their tables: the tables are copies, the
core's grouped table is only read.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from hybrid_cache import _core
from hybrid_cache.attention.metadata import AttentionMetadata, GroupMetadata


class DecodeInputBuffers:
    """Reused host buffers for the decode steps of KV-cache groups of `block_sizes`; they grow
    (doubling) when a step needs more sequences or table entries than they hold."""

    def __init__(self, block_sizes: Sequence[int]) -> None:
        self.block_sizes = [int(size) for size in block_sizes]
        self.num_groups = len(self.block_sizes)
        self._seq_capacity = -1
        self._table_capacity = -1
        self._reserve(0, 0)

    def build(
        self, num_computed_tokens: Sequence[int], rows: Sequence[int], block_table: np.ndarray
    ) -> tuple[AttentionMetadata, torch.Tensor]:
        """The metadata and positions of a decode step: sequence i is row `rows[i]` of the
        grouped block table `block_table` [groups, rows, width] (int32, C-contiguous: the
        core's memory) with its new token at `num_computed_tokens[i]`. Lists are read
        without conversion; a new token on the null block is an `InvalidBlockError`."""
        num_seqs = len(rows)
        max_seq_len = max(num_computed_tokens) + 1 if num_seqs else 0
        sizes = self.block_sizes
        columns = [-(-max_seq_len // size) for size in sizes]
        self._reserve(num_seqs, num_seqs * sum(columns))
        _core.decode_inputs_cpu(
            block_table,
            rows,
            num_computed_tokens,
            sizes,
            self._positions,
            self._seq_lens,
            self._tables,
            self._slots,
        )
        # Tensors over numpy views: `torch.from_numpy` of a slice costs about half a torch
        # slice, and a third of a torch `unbind`.
        from_numpy, slots, tables = torch.from_numpy, self._slots, self._tables
        groups_metadata, start = [], 0
        for group, (width, size) in enumerate(zip(columns, sizes)):
            end = start + num_seqs * width
            groups_metadata.append(
                GroupMetadata(
                    block_table=from_numpy(tables[start:end].reshape(num_seqs, width)),
                    slot_mapping=from_numpy(slots[group * num_seqs : (group + 1) * num_seqs]),
                    block_size=size,
                )
            )
            start = end
        metadata = AttentionMetadata(
            query_start_loc=from_numpy(self._query_starts[: num_seqs + 1]),
            seq_lens=from_numpy(self._seq_lens[:num_seqs]),
            groups=groups_metadata,
            max_query_len=1 if num_seqs else 0,
            max_seq_len=max_seq_len,
        )
        return metadata, from_numpy(self._positions[:num_seqs])

    def _reserve(self, num_seqs: int, table_items: int) -> None:
        if num_seqs > self._seq_capacity:
            capacity = max(num_seqs, 2 * self._seq_capacity, 8)
            self._seq_capacity = capacity
            self._positions = np.empty(capacity, dtype=np.int64)
            self._seq_lens = np.empty(capacity, dtype=np.int32)
            self._slots = np.empty(self.num_groups * capacity, dtype=np.int64)
            self._query_starts = np.arange(capacity + 1, dtype=np.int32)
        if table_items > self._table_capacity:
            capacity = max(table_items, 2 * self._table_capacity, 64)
            self._table_capacity = capacity
            self._tables = np.empty(capacity, dtype=np.int32)


def build_decode_metadata(
    num_computed_tokens: Sequence[int],
    rows: Sequence[int],
    block_table: np.ndarray,
    block_sizes: Sequence[int],
) -> tuple[AttentionMetadata, torch.Tensor]:
    """`build_attention_metadata` for a step whose every sequence computes one token, in
    buffers of its own (kept as long as the metadata is): see `DecodeInputBuffers.build`."""
    return DecodeInputBuffers(block_sizes).build(
        num_computed_tokens, rows, np.ascontiguousarray(block_table)
    )
