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
    table = np.ones((1, 2, 4), dtype=np.int32)
    table[0, 1, 2] = 0
    with pytest.raises(AssertionError, match="null block"):
        build_decode_metadata([9], [1], table, [4])
