"""The model runner's decode-only metadata matches the general builder field for field."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hybrid_cache.attention.metadata import build_attention_metadata, build_decode_metadata


@pytest.mark.parametrize("block_sizes", [[16], [16, 16, 16], [16, 32], [8, 16, 8]])
def test_decode_metadata_matches_general_builder(block_sizes: list[int]) -> None:
    rng = np.random.default_rng(0)
    num_rows, width = 12, 40
    # Non-null block ids everywhere a token can land (block 0 is the null block).
    table = rng.integers(1, 1000, size=(len(block_sizes), num_rows, width), dtype=np.int32)
    rows = [7, 2, 11, 0, 5]
    num_computed = [int(n) for n in rng.integers(0, 8 * width, size=len(rows))]
    max_seq_len = max(num_computed) + 1
    general_tables = [
        torch.from_numpy(table[group, rows, : -(-max_seq_len // size)])
        for group, size in enumerate(block_sizes)
    ]
    expected, expected_positions = build_attention_metadata(
        [1] * len(rows), num_computed, general_tables, block_sizes
    )
    metadata, positions = build_decode_metadata(num_computed, rows, table, block_sizes)

    assert torch.equal(positions, expected_positions) and positions.dtype == torch.int64
    for name in ("query_start_loc", "seq_lens"):
        got, want = getattr(metadata, name), getattr(expected, name)
        assert torch.equal(got, want) and got.dtype == want.dtype, name
    assert (metadata.max_query_len, metadata.max_seq_len) == (1, max_seq_len)
    assert expected.max_query_len == 1 and expected.max_seq_len == max_seq_len
    for got, want in zip(metadata.groups, expected.groups, strict=True):
        assert got.block_size == want.block_size
        assert torch.equal(got.block_table, want.block_table)
        assert got.block_table.dtype == want.block_table.dtype
        assert torch.equal(got.slot_mapping, want.slot_mapping)
        assert got.slot_mapping.dtype == want.slot_mapping.dtype


def test_decode_metadata_tables_are_copies() -> None:
    """Backends may write to their table: the core's table must not change."""
    table = np.arange(1, 2 * 4 * 6 + 1, dtype=np.int32).reshape(2, 4, 6)
    before = table.copy()
    metadata, _ = build_decode_metadata([3, 9], [1, 3], table, [4, 4])
    for group in metadata.groups:
        group.block_table.fill_(0)
    assert np.array_equal(table, before)


def test_decode_metadata_rejects_a_null_slot() -> None:
    from hybrid_cache.errors import InvalidBlockError

    table = np.ones((1, 2, 4), dtype=np.int32)
    table[0, 1, 2] = 0
    with pytest.raises(InvalidBlockError, match="group 0, block 2\\) maps to the null block"):
        build_decode_metadata([9], [1], table, [4])


def test_the_native_decode_tables_refuse_bad_input_and_write_nothing() -> None:
    from hybrid_cache._core import decode_tables_cpu
    from hybrid_cache.errors import InvalidArgumentError

    table = np.arange(1, 2 * 3 * 4 + 1, dtype=np.int32).reshape(2, 3, 4)
    tables, slots = np.full((2, 2, 3), -1, np.int32), np.full((2, 2), -1, np.int64)
    rows, positions = np.array([2, 0]), np.array([9, 0])
    decode_tables_cpu(table, rows, positions, 4, tables, slots)
    assert tables.tolist() == table[:, [2, 0], :3].tolist()
    assert slots.tolist() == (table[:, [2, 0], [2, 0]] * 4 + [1, 0]).tolist()
    for bad_rows, bad_positions, match in [
        ([3, 0], [9, 0], "row 3 of sequence 0 is outside the table's 3 rows"),
        ([2, 0], [9, 16], "position 16 of sequence 1 is outside a row of 4 blocks"),
        ([2, 0], [9, -1], "position -1 of sequence 1"),
    ]:
        fresh_tables, fresh_slots = np.full_like(tables, -1), np.full_like(slots, -1)
        with pytest.raises(InvalidArgumentError, match=match):
            decode_tables_cpu(
                table, np.array(bad_rows), np.array(bad_positions), 4, fresh_tables, fresh_slots
            )
        assert (fresh_tables == -1).all() and (fresh_slots == -1).all()
    backing = np.array([2, 0, 0, 0])  # slots viewing the rows' memory: refused
    with pytest.raises(InvalidArgumentError, match="slots_out overlaps"):
        decode_tables_cpu(table, backing[:2], positions, 4, tables, backing.reshape(2, 2))
    with pytest.raises(InvalidArgumentError, match="tables_out must be a writable"):
        decode_tables_cpu(table, rows, positions, 4, np.empty((2, 3, 3), np.int32), slots)
    with pytest.raises(InvalidArgumentError, match="must hold groups x seqs x columns"):
        decode_tables_cpu(table, rows, positions, 4, np.empty((2, 2, 5), np.int32), slots)
