"""Every core error kind reaches Python as its own HybridCacheError subclass, and a rejected
call leaves the coordinator unchanged."""

import re

import hybrid_cache
import numpy as np
import pytest
from hybrid_cache import Coordinator, GroupSpec, errors

ERROR_NAMES = [
    "InvalidArgumentError",
    "NoFreeBlocksError",
    "InvalidBlockError",
    "DoubleFreeError",
    "UnknownRequestError",
    "DuplicateRequestError",
    "InvalidGroupError",
    "RequestTooLargeError",
    "TooManyRequestsError",
]


@pytest.mark.parametrize("name", ERROR_NAMES)
def test_each_error_is_a_distinct_subclass(name):
    cls = getattr(errors, name)
    assert issubclass(cls, errors.HybridCacheError)
    assert getattr(hybrid_cache, name) is cls
    others = [getattr(errors, other) for other in ERROR_NAMES if other != name]
    assert not any(issubclass(cls, other) for other in others)


def make(num_blocks=16, max_num_reqs=2):
    groups = [GroupSpec("full", 2), GroupSpec("sliding_window", 2, window=4)]
    return Coordinator(num_blocks, groups, max_num_reqs, 64, 8)


def snapshot(coordinator):
    return (
        coordinator.num_free_blocks,
        coordinator.block_table().copy(),
        coordinator.num_blocks_per_row().copy(),
        coordinator.num_used_blocks_per_group(),
        coordinator.num_tokens(1),
        coordinator.pending_hit_tokens(1),
    )


def assert_unchanged(before, coordinator):
    after = snapshot(coordinator)
    assert before[0] == after[0]
    np.testing.assert_array_equal(before[1], after[1])
    np.testing.assert_array_equal(before[2], after[2])
    assert before[3:] == after[3:]


@pytest.fixture
def busy():
    coordinator = make()
    coordinator.add_request(1, list(range(6)))
    assert coordinator.allocate(1, 0, 4)
    assert coordinator.allocate(1, 4, 2)
    return coordinator


@pytest.mark.parametrize(
    ("call", "error"),
    [
        (lambda c: c.allocate(1, 2, 1), errors.InvalidArgumentError),  # computed goes back
        (lambda c: c.allocate(1, 7, 1), errors.InvalidArgumentError),  # beyond known tokens
        (lambda c: c.allocate(1, 6, 9), errors.InvalidArgumentError),  # above the batch limit
        (lambda c: c.allocate(1, -1, 1), errors.InvalidArgumentError),
        (lambda c: c.allocate(7, 0, 1), errors.UnknownRequestError),
        (lambda c: c.add_request(1, [1, 2]), errors.DuplicateRequestError),
        (lambda c: c.add_request(2, []), errors.InvalidArgumentError),
        (lambda c: c.add_request(2, [-1]), errors.InvalidArgumentError),
        (lambda c: c.add_request(2, [1], max_total_tokens=65), errors.RequestTooLargeError),
        (lambda c: c.add_request(2, [1], mm_hashes=[(0, 5, 1)]), errors.InvalidArgumentError),
        (lambda c: c.add_request(-2, [1]), errors.InvalidArgumentError),
        (lambda c: c.free_request(9), errors.UnknownRequestError),
        (lambda c: c.find_cache_hit(1), errors.InvalidArgumentError),  # already allocated
        (lambda c: c.append_token_ids(1, [0] * 100), errors.InvalidArgumentError),
        (lambda c: c.row_of(5), errors.UnknownRequestError),
        (lambda c: c.allocate_batch([1, 1], [6, 6], [1, 1]), errors.InvalidArgumentError),
        (lambda c: c.allocate_batch([1], [6, 6], [1]), errors.InvalidArgumentError),
        (lambda c: c.allocate_batch([1, 3], [6, 0], [1, 1]), errors.UnknownRequestError),
        (lambda c: c.max_blocks_needed(-1), errors.InvalidArgumentError),
        (lambda c: c.request_blocks(1, 2), errors.InvalidGroupError),
        (lambda c: c.append_token_ids_batch([1, 1], [5, 5]), errors.InvalidArgumentError),
        (lambda c: c.append_token_ids_batch([1, 4], [5, 5]), errors.UnknownRequestError),
        (lambda c: c.append_token_ids_batch([1], [5, 5]), errors.InvalidArgumentError),
        (lambda c: c.append_token_ids_batch([1], [-5]), errors.InvalidArgumentError),
        (lambda c: c.append_token_ids_batch([-1], [5]), errors.InvalidArgumentError),
        (lambda c: c.append_token_ids_batch(["1"], [5]), errors.InvalidArgumentError),
        (lambda c: c.allocate_batch([-1], [6], [1]), errors.InvalidArgumentError),
        (lambda c: c.request_blocks(1, -1), errors.InvalidArgumentError),
    ],
)
def test_rejected_calls_change_nothing(busy, call, error):
    before = snapshot(busy)
    with pytest.raises(error):
        call(busy)
    assert_unchanged(before, busy)


@pytest.mark.parametrize(
    ("tokens", "message"),
    [
        ([3, -1], "token id -1 is outside 0..2^32"),
        ([3, 2**32], "token id 4294967296 is outside 0..2^32"),
        ([3, 2**63], "token ids must be a 1-d sequence of ints"),
        ([3, "4"], "token ids must be a 1-d sequence of ints"),
        ([3, 4.0], "token ids must be a 1-d sequence of ints"),
    ],
)
def test_bad_token_ids_say_what_is_wrong_as_a_list_or_a_tuple(busy, tokens, message):
    """A list is read in one pass straight into token ids; whatever that pass refuses takes
    the item-by-item path, so a list, a tuple and an array name the same fault."""
    for given in (tokens, tuple(tokens)):
        before = snapshot(busy)
        with pytest.raises(errors.InvalidArgumentError, match=re.escape(message)):
            busy.add_request(2, given)
        assert_unchanged(before, busy)
        with pytest.raises(errors.InvalidArgumentError, match=re.escape(message)):
            busy.append_token_ids(1, given)
        assert_unchanged(before, busy)


def test_too_many_requests(busy):
    busy.add_request(2, [1])
    before = snapshot(busy)
    with pytest.raises(errors.TooManyRequestsError):
        busy.add_request(3, [1])
    assert_unchanged(before, busy)


def test_request_that_can_never_fit_the_pool():
    coordinator = make(num_blocks=8)
    with pytest.raises(errors.RequestTooLargeError, match="give the pool more blocks"):
        coordinator.add_request(1, list(range(20)))
    assert coordinator.num_free_blocks == 7


@pytest.mark.parametrize(
    "build",
    [
        lambda: GroupSpec("full", 0),
        lambda: GroupSpec("full", -2),
        lambda: GroupSpec("sliding_window", 16, window=0),
        lambda: GroupSpec("sliding_window", 16),
        lambda: GroupSpec("chunked_local", 16, chunk=24),
        lambda: GroupSpec("mamba", 16),
        lambda: Coordinator(1, [GroupSpec("full", 2)], 2, 64, 8),
        lambda: Coordinator(16, [], 2, 64, 8),
        lambda: Coordinator(16, [GroupSpec("full", 2)], 0, 64, 8),
        lambda: Coordinator(16, [GroupSpec("full", 2)], 2, -64, 8),
        lambda: Coordinator(16, [GroupSpec("full", 2)], 2, 64, 0),
        lambda: Coordinator(16, [GroupSpec("full", 2)], 2, 64, 8, hash_algo="md5"),
    ],
)
def test_bad_configuration(build):
    with pytest.raises(errors.InvalidArgumentError):
        build()


@pytest.mark.parametrize(
    ("ids", "computed", "new", "message"),
    [
        ([1], [-6], [1], "num_computed_tokens must be non-negative, got -6"),
        ([1], [6], [-1], "num_new_tokens must be non-negative, got -1"),
        ([-1], [6], [1], "request ids must be non-negative, got -1"),
        ([1], [6], [1.0], "num_new_tokens must be a 1-d sequence of ints"),
        ([1], [6], [2**63], "num_new_tokens must be a 1-d sequence of ints"),
        ([1], [6, 6], [1], "must have one length, got 1, 2 and 1"),
    ],
)
def test_bad_allocate_batch_lists_say_what_is_wrong(busy, ids, computed, new, message):
    """Three lists of non-negative ints are read together in one pass; whatever that pass
    refuses takes the list-by-list path, so lists and tuples name the same fault."""
    for given in ((ids, computed, new), (tuple(ids), tuple(computed), tuple(new))):
        before = snapshot(busy)
        with pytest.raises(errors.InvalidArgumentError, match=re.escape(message)):
            busy.allocate_batch(*given)
        assert_unchanged(before, busy)
