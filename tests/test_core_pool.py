"""BlockPool through the binding: each operation and its error kinds."""

import pytest
from hybrid_cache import BlockPool, DoubleFreeError, InvalidBlockError, NoFreeBlocksError


def test_allocates_from_the_front_and_frees_to_the_tail():
    pool = BlockPool(5)
    assert pool.num_blocks == 5
    assert pool.num_free_blocks == 4
    blocks = pool.get_new_blocks(3)
    assert blocks == [1, 2, 3]
    assert [pool.ref_count(b) for b in blocks] == [1, 1, 1]
    pool.free_blocks(list(reversed(blocks)))
    assert pool.free_queue_order() == [4, 3, 2, 1]
    assert pool.num_free_blocks == 4


def test_cache_touch_and_lazy_eviction():
    pool = BlockPool(3)
    (block,) = pool.get_new_blocks(1)
    assert pool.cache_block(block, group=0, block_hash=2**127 + 5)
    assert not pool.cache_block(block, group=1, block_hash=7), "a block carries one key"
    pool.free_blocks([block])
    assert pool.cached_block(0, 2**127 + 5) == block
    assert pool.cached_block(1, 2**127 + 5) is None, "keys are tagged with the group"
    assert pool.touch_cached(block, 0, 2**127 + 5)
    assert pool.ref_count(block) == 1
    assert pool.free_queue_order() == [2]
    pool.free_blocks([block])
    assert pool.get_new_blocks(2) == [2, block]
    assert pool.cached_block(0, 2**127 + 5) is None, "reuse evicts the key"
    assert not pool.touch_cached(block, 0, 2**127 + 5)


def test_negative_hashes_are_accepted_as_bits():
    pool = BlockPool(3)
    (block,) = pool.get_new_blocks(1)
    assert pool.cache_block(block, 0, hash("some tokens"))
    assert pool.cached_block(0, hash("some tokens")) == block


def test_reset_prefix_cache_only_when_idle():
    pool = BlockPool(3)
    (block,) = pool.get_new_blocks(1)
    pool.cache_block(block, 0, 1)
    assert not pool.reset_prefix_cache()
    pool.free_blocks([block])
    assert pool.reset_prefix_cache()
    assert pool.cached_block(0, 1) is None


def test_errors_leave_the_pool_unchanged():
    pool = BlockPool(3)
    (block,) = pool.get_new_blocks(1)
    with pytest.raises(NoFreeBlocksError):
        pool.get_new_blocks(2)
    with pytest.raises(DoubleFreeError):
        pool.free_blocks([block, block])
    with pytest.raises(InvalidBlockError):
        pool.free_blocks([0])
    with pytest.raises(InvalidBlockError):
        pool.free_blocks([99])
    with pytest.raises(InvalidBlockError):
        pool.cache_block(2, 0, 1)  # block 2 is free
    assert pool.num_free_blocks == 1
    assert pool.ref_count(block) == 1
    assert pool.free_queue_order() == [2]
