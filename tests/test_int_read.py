"""Python ints reach the core with their exact values, whichever way the binding reads them: in
place from the object (one-digit non-negative ints, where the interpreter's layout was
confirmed at import) or through the interpreter (everything else)."""

import enum
import sys
import sysconfig

import numpy as np
import pytest
from hybrid_cache import Coordinator, GroupSpec, _core, errors

BLOCK = 4
# One-digit values at both ends, the first two-digit ones, and the top of the token range.
EDGES = [0, 1, 2, 255, 256, 2**30 - 1, 2**30, 2**30 + 5, 2**31, 2**32 - 1]


class Token(enum.IntEnum):
    """An int subclass: never read in place."""

    SEVEN = 7


class RequestId(int):
    """An int subclass for ids: never read in place."""


def test_the_layout_read_in_place_is_the_one_this_interpreter_has():
    free_threaded = bool(sysconfig.get_config_var("Py_GIL_DISABLED"))
    digits = (sys.int_info.bits_per_digit, sys.int_info.sizeof_digit)
    expected = "call"
    if sys.implementation.name == "cpython" and digits == (30, 4) and not free_threaded:
        if (3, 9) <= sys.version_info[:2] <= (3, 11):
            expected = "signed-size"
        elif (3, 12) <= sys.version_info[:2] <= (3, 13):
            expected = "tag"
    assert _core._int_read == expected


def cached_hashes(tokens):
    """The (group, hash) of every block a one-request run caches for `tokens`."""
    coordinator = Coordinator(64, [GroupSpec("full", BLOCK)], 2, 256, 64)
    coordinator.add_request(1, tokens)
    assert coordinator.allocate(1, 0, len(tokens))
    coordinator.free_request(1)
    return sorted((group, block_hash) for _, group, block_hash in coordinator.cached_blocks())


def test_token_ids_from_a_list_hash_as_the_same_ids_from_an_array():
    # Each edge value in every position of a block, so a misread value changes some hash.
    tokens = [value for shift in range(BLOCK) for value in EDGES[shift:] + EDGES[:shift]]
    tokens += [9]  # a last token that is never cached (the hit must leave one to compute)
    from_array = cached_hashes(np.array(tokens, dtype=np.int64))
    assert len(from_array) == (len(tokens) - 1) // BLOCK
    assert cached_hashes(tokens) == from_array
    assert cached_hashes(tuple(tokens)) == from_array
    changed = list(tokens)
    changed[3] = 2**30 - 2
    assert cached_hashes(changed)[0] != from_array[0]


def test_int_subclasses_and_big_values_take_the_interpreters_path():
    tokens = [Token.SEVEN, True, 2**31 + 3, np.int64(8), 9]
    assert cached_hashes(tokens) == cached_hashes([7, 1, 2**31 + 3, 8, 9])
    coordinator = Coordinator(64, [GroupSpec("full", BLOCK)], 2, 256, 64)
    for bad in (-1, -(2**40), 2**32, 2**70):
        with pytest.raises(errors.InvalidArgumentError):
            coordinator.add_request(1, [1, 2, bad])
    coordinator.add_request(1, [1, 2, 3])  # the refused adds left no request behind


def test_request_ids_and_counts_past_one_digit_are_read_exactly():
    coordinator = Coordinator(64, [GroupSpec("full", BLOCK)], 2, 256, 64)
    big_id, small_id = 2**40 + 3, 2**30 - 1
    coordinator.add_request(big_id, list(range(12)))
    coordinator.add_request(small_id, list(range(8)))
    coordinator.allocate_batch([big_id, small_id], [0, 0], [12, 8])
    assert len(coordinator.request_blocks(big_id, 0)) == 3
    assert len(coordinator.request_blocks(small_id, 0)) == 2
    coordinator.append_token_ids_batch([big_id, small_id], [2**30, 0])
    assert coordinator.num_tokens(big_id) == 13
    assert coordinator.num_tokens(small_id) == 9
    # Ids the in-place read declines (a subclass, a numpy int, an array) take the other path.
    coordinator.append_token_ids_batch([np.int64(big_id), RequestId(small_id)], [1, 2])
    coordinator.append_token_ids_batch(np.array([big_id, small_id]), [3, 4])
    assert (coordinator.num_tokens(big_id), coordinator.num_tokens(small_id)) == (15, 11)


def test_a_prompt_read_into_a_freed_requests_storage_hashes_as_on_a_fresh_coordinator():
    long_prompt = list(range(1000, 1041))
    short_prompt = [5, 2**30 + 1, 7, 8, 9, 10, 11, 12, 13]
    coordinator = Coordinator(64, [GroupSpec("full", BLOCK)], 2, 256, 64)
    coordinator.add_request(1, long_prompt)
    assert coordinator.allocate(1, 0, len(long_prompt))
    coordinator.free_request(1)
    first = set(coordinator.cached_blocks())
    # A refused prompt (a bad id at its end) read into the freed storage leaves nothing behind.
    with pytest.raises(errors.InvalidArgumentError):
        coordinator.add_request(2, [*short_prompt, -1])
    coordinator.add_request(2, short_prompt)
    assert coordinator.num_tokens(2) == len(short_prompt)
    assert coordinator.find_cache_hit(2) == 0
    assert coordinator.allocate(2, 0, len(short_prompt))
    coordinator.free_request(2)
    added = sorted((group, h) for _, group, h in set(coordinator.cached_blocks()) - first)
    assert added == cached_hashes(short_prompt)
    coordinator.add_request(3, long_prompt)
    assert coordinator.find_cache_hit(3) == 40


def test_a_prompt_the_in_place_read_declines_still_lands_whole_in_a_freed_requests_storage():
    long_prompt = list(range(1000, 1041))
    # An int subclass midway: the in-place read stops there and hands the storage back.
    mixed = [5, 6, Token.SEVEN, 8, 9, 10, 11, 12, 13]
    plain = [int(token) for token in mixed]
    coordinator = Coordinator(64, [GroupSpec("full", BLOCK)], 2, 256, 64)
    coordinator.add_request(1, long_prompt)
    assert coordinator.allocate(1, 0, len(long_prompt))
    coordinator.free_request(1)
    first = set(coordinator.cached_blocks())
    coordinator.add_request(2, mixed)
    assert coordinator.num_tokens(2) == len(plain)
    assert coordinator.allocate(2, 0, len(plain))
    coordinator.free_request(2)
    added = sorted((group, h) for _, group, h in set(coordinator.cached_blocks()) - first)
    assert added == cached_hashes(plain)


class Shrinking:
    """An item whose conversion empties the list being read."""

    def __init__(self, tokens: list) -> None:
        self.tokens = tokens

    def __index__(self) -> int:
        self.tokens.clear()
        return 5


def test_a_list_read_in_pieces_refuses_a_list_that_changes_and_a_bad_item_past_the_first_piece():
    coordinator = Coordinator(64, [GroupSpec("full", BLOCK)], 2, 256, 64)
    prompt = list(range(100, 164))
    prompt[52] = Shrinking(prompt)
    with pytest.raises(errors.InvalidArgumentError, match="changed while read"):
        coordinator.add_request(1, prompt)
    bad = list(range(100, 164))
    bad[56] = -3  # past the first piece (48 tokens), after its blocks were hashed
    with pytest.raises(errors.InvalidArgumentError, match="token id -3 is outside"):
        coordinator.add_request(1, bad)
    with pytest.raises(errors.UnknownRequestError):
        coordinator.num_tokens(1)  # nothing was added
    good = list(range(100, 164))
    coordinator.add_request(1, good)  # the id and the row are free
    assert coordinator.find_cache_hit(1) == 0
    assert coordinator.allocate(1, 0, len(good))
    coordinator.free_request(1)
    assert sorted(h for _, _, h in coordinator.cached_blocks()) == sorted(
        h for _, h in cached_hashes(good)
    )


@pytest.mark.parametrize("length", [47, 48, 49, 95, 96, 97, 150, 257])
def test_a_list_read_in_pieces_hashes_as_the_same_ids_from_an_array(length):
    """Around and across the reader's pieces (48 tokens), with every edge value and an int
    subclass at random positions: the list's blocks are those of the same ids as an array."""
    rng = np.random.default_rng(length)
    values = rng.choice(np.array(EDGES, dtype=np.int64), size=length)
    as_list = [int(value) for value in values]
    as_list[length // 2] = Token.SEVEN
    values[length // 2] = 7

    def cached(prompt):
        coordinator = Coordinator(512, [GroupSpec("full", BLOCK)], 2, 512, 512)
        coordinator.add_request(1, prompt)
        assert coordinator.find_cache_hit(1) == 0
        assert coordinator.allocate(1, 0, length)
        hashed = coordinator.stats()["hashed_blocks"]
        coordinator.free_request(1)
        return hashed, sorted(h for _, _, h in coordinator.cached_blocks())

    assert cached(as_list) == cached(values)
    assert cached(as_list)[0] == length // BLOCK
