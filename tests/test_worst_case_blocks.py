"""The core's worst-case live blocks of a group (exported as `_core.worst_case_live_blocks` and
`GroupSpec.max_live_blocks`, what admission checks) is the planner's formula, on a sweep of
windows, chunks, block sizes, request lengths and step sizes."""

from __future__ import annotations

import itertools

import pytest
from hybrid_cache import _core
from hybrid_cache.errors import InvalidArgumentError
from hybrid_cache.planner import GroupLayout


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def planner_formula(block_size, reach, num_tokens, max_num_batched_tokens):
    """The planner's worst case as the docs state it: the reach plus one step of new tokens,
    plus one block of misalignment, at most all of the request's blocks."""
    all_blocks = cdiv(num_tokens, block_size)
    if reach is None:
        return all_blocks
    kept = min(reach - 1 + max_num_batched_tokens, num_tokens)
    return min(all_blocks, cdiv(kept, block_size) + 1)


SWEEP = list(
    itertools.product(
        [1, 4, 16, 80],  # block size
        [None, 1, 5, 16, 17, 64, 1000, 4096],  # reach
        [1, 15, 16, 17, 100, 4097, 32768],  # tokens
        [1, 16, 100, 2048],  # max_num_batched_tokens
    )
)


@pytest.mark.parametrize("kind", ["sliding_window", "chunked_local"])
def test_core_bound_equals_the_planner_formula(kind):
    for block_size, reach, num_tokens, batched in SWEEP:
        expected = planner_formula(block_size, reach, num_tokens, batched)
        assert _core.worst_case_live_blocks(block_size, reach, num_tokens, batched) == expected
        group_kind = "full" if reach is None else kind
        window = reach if group_kind == "sliding_window" else None
        chunk = reach if group_kind == "chunked_local" else None
        layout = GroupLayout(0, (0,), group_kind, window, chunk, block_size, 64, 64)
        assert layout.max_blocks_per_request(num_tokens, batched) == expected
        if chunk is not None and chunk % block_size:
            continue  # the coordinator takes chunks of whole blocks only
        spec = _core.GroupSpec(group_kind, block_size, window=window, chunk=chunk)
        assert spec.max_live_blocks(num_tokens, batched) == expected


def test_live_tokens_are_the_reach_plus_one_step():
    for _, reach, num_tokens, batched in SWEEP:
        expected = num_tokens if reach is None else min(reach - 1 + batched, num_tokens)
        assert _core.worst_case_live_tokens(reach, num_tokens, batched) == expected
    with pytest.raises(InvalidArgumentError):
        _core.worst_case_live_tokens(0, 10, 10)


def test_admission_uses_the_same_bound():
    specs = [_core.GroupSpec("full", 16), _core.GroupSpec("sliding_window", 16, window=64)]
    coordinator = _core.Coordinator(1000, specs, 2, 8192, 128)
    for num_tokens in (1, 63, 64, 65, 500, 8192):
        expected = sum(spec.max_live_blocks(num_tokens, 128) for spec in specs)
        assert coordinator.max_blocks_needed(num_tokens) == expected


def test_bad_arguments_are_typed_errors():
    for arguments in ((0, None, 10, 10), (16, 0, 10, 10), (16, None, -1, 10)):
        with pytest.raises(InvalidArgumentError):
            _core.worst_case_live_blocks(*arguments)


def test_null_block_is_the_cores():
    from hybrid_cache.attention.metadata import NULL_BLOCK

    assert _core.NULL_BLOCK == NULL_BLOCK == 0
