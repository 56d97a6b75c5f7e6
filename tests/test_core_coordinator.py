"""The Coordinator through the binding: operations, the zero-copy table view, a Gemma-2-shaped
scenario, window release and cache hits."""

import gc

import numpy as np
import pytest
from hybrid_cache import Coordinator, GroupSpec, InvalidArgumentError


def gemma2_like(num_blocks=256, max_num_reqs=4, **kwargs):
    """Full attention + sliding window (Gemma-2 alternates them), scaled down: block 4, window 8."""
    groups = [GroupSpec("full", 4), GroupSpec("sliding_window", 4, window=8)]
    return Coordinator(num_blocks, groups, max_num_reqs, 128, 32, **kwargs)


def test_group_spec_fields():
    spec = GroupSpec("sliding_window", 16, window=4096)
    assert (spec.kind, spec.block_size, spec.window, spec.chunk) == (
        "sliding_window",
        16,
        4096,
        None,
    )
    assert GroupSpec("chunked_local", 16, chunk=64).chunk == 64
    assert "window=4096" in repr(spec)


def test_properties_and_rows():
    coordinator = gemma2_like()
    assert coordinator.num_groups == 2
    assert coordinator.max_num_reqs == 4
    assert coordinator.max_blocks_per_req == 32
    assert coordinator.num_blocks == 256
    assert coordinator.num_free_blocks == 255
    assert coordinator.add_request(10, [1, 2, 3]) == 0
    assert coordinator.add_request(11, np.arange(5, dtype=np.int64)) == 1
    assert coordinator.row_of(11) == 1
    coordinator.free_request(10)
    assert coordinator.add_request(12, [4]) == 0, "freed rows are reused"


def test_table_is_a_zero_copy_view_that_sees_updates():
    coordinator = gemma2_like()
    table = coordinator.block_table()
    lengths = coordinator.num_blocks_per_row()
    assert table.shape == (2, 4, 32)
    assert table.dtype == np.int32
    assert lengths.shape == (2, 4)
    assert not table.flags.writeable
    assert not table.any()
    row = coordinator.add_request(1, list(range(10)))
    assert coordinator.allocate(1, 0, 10)
    # The same arrays, not re-fetched, show the allocation.
    assert lengths[0, row] == 3 and lengths[1, row] == 3
    assert (table[:, row, :3] > 0).all()
    assert (table[:, row, 3:] == 0).all()
    # A second view shares the memory with the first.
    again = coordinator.block_table()
    assert np.shares_memory(table, again)
    coordinator.free_request(1)
    assert lengths[0, row] == 0 and not table.any()


def test_view_keeps_the_coordinator_alive():
    coordinator = gemma2_like()
    coordinator.add_request(1, list(range(10)))
    coordinator.allocate(1, 0, 10)
    table = coordinator.block_table()
    expected = table.copy()
    del coordinator
    gc.collect()
    np.testing.assert_array_equal(table, expected)
    assert table.base is not None


def test_window_release_shows_null_blocks_in_the_table():
    coordinator = gemma2_like()
    row = coordinator.add_request(1, list(range(16)))
    assert coordinator.allocate(1, 0, 16)
    table = coordinator.block_table()
    full_before = table[0, row, :4].copy()
    # Decode to 24 tokens: skipped(c) = c - 7, so at c = 23, floor(16 / 4) = 4 windowed blocks
    # are released (null) and the full-attention row is untouched.
    for computed in range(16, 24):
        coordinator.append_token_ids(1, [7])
        assert coordinator.allocate(1, computed, 1)
    assert list(table[1, row, :4]) == [0, 0, 0, 0]
    assert coordinator.request_blocks(1, 1) == list(table[1, row, :6])
    assert (table[1, row, 4:6] > 0).all()
    np.testing.assert_array_equal(table[0, row, :4], full_before)
    assert coordinator.num_used_blocks_per_group() == [6, 2]


def test_gemma2_shaped_decode_holds_fewer_windowed_blocks():
    coordinator = gemma2_like()
    ids = np.array([1, 2, 3], dtype=np.int64)
    for request_id in ids:
        coordinator.add_request(int(request_id), list(range(20)), max_total_tokens=60)
    zeros = np.zeros(3, dtype=np.int64)
    assert coordinator.allocate_batch(ids, zeros, np.full(3, 20, dtype=np.int64)) == 3
    for computed in range(20, 60):
        coordinator.append_token_ids_batch(ids, np.full(3, 1, dtype=np.int64))
        computed_array = np.full(3, computed, dtype=np.int64)
        assert coordinator.allocate_batch(ids, computed_array, np.ones(3, dtype=np.int64)) == 3
    full_blocks, window_blocks = coordinator.num_used_blocks_per_group()
    assert full_blocks == 3 * 15  # 60 tokens / 4
    assert window_blocks <= 3 * 3  # cdiv(8 - 1 + 1, 4) + 1
    for request_id in ids:
        coordinator.free_request(int(request_id))
    assert coordinator.num_free_blocks == 255
    assert coordinator.num_used_blocks_per_group() == [0, 0]


def test_allocate_batch_accepts_sequences_and_stops_at_the_first_misfit():
    groups = [GroupSpec("full", 2)]
    coordinator = Coordinator(8, groups, 4, 64, 8)
    for request_id in (1, 2, 3):
        coordinator.add_request(request_id, list(range(6)))
    assert coordinator.allocate_batch([1, 2, 3], [0, 0, 0], [6, 6, 6]) == 2
    assert coordinator.num_blocks_per_row()[0, coordinator.row_of(3)] == 0
    assert not coordinator.allocate(3, 0, 6)
    assert coordinator.num_free_blocks == 1


def test_cache_hit_across_two_requests():
    coordinator = gemma2_like()
    prompt = list(range(100, 130))
    coordinator.add_request(1, prompt)
    assert coordinator.find_cache_hit(1) == 0
    assert coordinator.allocate(1, 0, 30)
    coordinator.free_request(1)
    coordinator.add_request(2, prompt)
    hit = coordinator.find_cache_hit(2)
    assert hit == 28, "at most 29 tokens, aligned to the block size 4"
    assert coordinator.pending_hit_tokens(2) == 28
    row = coordinator.row_of(2)
    free_before = coordinator.num_free_blocks
    assert coordinator.allocate(2, hit, 2)
    table = coordinator.block_table()
    # Full attention keeps all 7 hit blocks; the window only the last cdiv(7, 4) = 2.
    assert (table[0, row, :8] > 0).all()
    assert list(table[1, row, :5]) == [0] * 5
    assert (table[1, row, 5:8] > 0).all()
    # The hit blocks (7 + 2) leave the free queue, plus one new block per group.
    assert free_before - coordinator.num_free_blocks == 7 + 2 + 2
    stats = coordinator.stats()
    assert stats["prefix_queries"] == 60 and stats["prefix_hits"] == 28
    assert coordinator.num_prefix_queries == 60  # the same counter without the dict
    assert stats["num_cached_blocks"] > 0


def test_a_probe_reads_a_list_only_as_far_as_it_hashes():
    """A list prompt is converted only as far as the probe hashes (a few blocks when nothing
    further is cached): the answers equal the whole prompt's as an array, and a bad item
    within the probed part is a typed error, one past it is never read."""
    groups = [GroupSpec("full", 4), GroupSpec("sliding_window", 4, window=8)]
    coordinator = Coordinator(512, groups, 4, 2048, 256)
    history = list(range(100, 300))
    coordinator.add_request(1, history)
    coordinator.allocate(1, 0, len(history))
    coordinator.free_request(1)
    for prompt in (
        history + [7, 8, 9],  # cached past the first round: the probe reads on
        history[:40] + list(range(1000, 1600)),  # branches early: one short round
        list(range(2000, 2600)),  # nothing cached
        history[:3],
    ):
        array = np.array(prompt, dtype=np.int64)
        assert coordinator.probe_cache_hit(prompt) == coordinator.probe_cache_hit(array)
        assert coordinator.probe_cache_hit(tuple(prompt)) == coordinator.probe_cache_hit(array)
    assert coordinator.probe_cache_hit(history + [7]) == 200
    uncached = list(range(2000, 2600))
    with pytest.raises(InvalidArgumentError, match="outside 0..2"):
        coordinator.probe_cache_hit([-1] + uncached)
    with pytest.raises(InvalidArgumentError, match="sequence of ints"):
        coordinator.probe_cache_hit(["x"] + uncached)
    with pytest.raises(InvalidArgumentError, match="at least one token"):
        coordinator.probe_cache_hit([])
    # Past the probed part nothing is converted (adding the request checks every item).
    assert coordinator.probe_cache_hit(uncached + ["x"]) == 0
    with pytest.raises(InvalidArgumentError):
        coordinator.add_request(9, uncached + ["x"])


def test_salt_lora_and_multimodal_keys_separate_hits():
    coordinator = gemma2_like()
    prompt = list(range(20))
    coordinator.add_request(1, prompt, mm_hashes=[(4, 4, 0xABC)])
    coordinator.allocate(1, 0, 20)
    coordinator.free_request(1)
    for request_id, kwargs, expected in [
        (2, {"cache_salt": "tenant"}, 0),
        (3, {"lora_id": 3}, 0),
        (4, {"mm_hashes": [(4, 4, 0xDEF)]}, 4),  # blocks before the image still hit
        (5, {"mm_hashes": [(4, 4, 0xABC)]}, 16),
    ]:
        coordinator.add_request(request_id, prompt, **kwargs)
        assert coordinator.find_cache_hit(request_id) == expected, kwargs
        coordinator.free_request(request_id)


def test_sha256_and_disabled_prefix_caching():
    coordinator = gemma2_like(hash_algo="sha256", hash_seed=3)
    coordinator.add_request(1, list(range(12)))
    coordinator.allocate(1, 0, 12)
    coordinator.free_request(1)
    coordinator.add_request(2, list(range(12)))
    assert coordinator.find_cache_hit(2) == 8
    off = gemma2_like(enable_prefix_caching=False)
    off.add_request(1, list(range(12)))
    off.allocate(1, 0, 12)
    assert off.stats()["num_cached_blocks"] == 0
    assert off.reset_prefix_cache() is False
    off.free_request(1)
    assert off.reset_prefix_cache() is True


def test_max_blocks_needed():
    groups = [GroupSpec("full", 16), GroupSpec("sliding_window", 16, window=4096)]
    coordinator = Coordinator(4096, groups, 4, 8192, 512)
    # full: 8192 / 16; window: cdiv(4095 + 512, 16) + 1.
    assert coordinator.max_blocks_needed(8192) == 512 + 289


def test_demo_runs(capsys):
    from hybrid_cache import demo

    demo.run()
    out = capsys.readouterr().out
    assert "hybrid" in out and "Prefix cache" in out


def test_lists_tuples_and_arrays_are_read_alike():
    coordinator = gemma2_like()
    coordinator.add_request(1, (1, 2, 3, 4, 5))
    coordinator.add_request(2, np.array([1, 2, 3, 4, 5], dtype=np.int64))
    assert coordinator.allocate_batch((1, 2), [0, 0], np.array([5, 5], dtype=np.int64)) == 2
    coordinator.append_token_ids(1, [6])
    coordinator.append_token_ids(2, (6,))
    coordinator.append_token_ids_batch([1, 2], (7, 7))
    assert coordinator.num_tokens(1) == coordinator.num_tokens(2) == 7
    with pytest.raises(InvalidArgumentError, match="sequence of ints"):
        coordinator.append_token_ids(1, [1.5])
    with pytest.raises(InvalidArgumentError, match="sequence of ints"):
        coordinator.append_token_ids_batch((1, "x"), [1, 2])
    with pytest.raises(InvalidArgumentError, match="sequence of ints"):
        coordinator.append_token_ids(1, [2**70])
    with pytest.raises(InvalidArgumentError, match="outside 0..2"):
        coordinator.append_token_ids(1, [2**40])
    # Items that are not exactly int (numpy scalars, bools) take the item-by-item path.
    coordinator.append_token_ids_batch([np.int64(1), 2], [np.int64(8), True])
    assert coordinator.num_tokens(1) == coordinator.num_tokens(2) == 8


def test_a_shorter_hit_and_the_cache_views():
    coordinator = gemma2_like()
    history = list(range(100, 124))
    coordinator.add_request(0, history)
    assert coordinator.allocate(0, 0, 24)
    coordinator.free_request(0)
    cached = coordinator.cached_blocks()
    assert sum(1 for _, group, _ in cached if group == 0) == 6
    order = coordinator.free_queue_order()
    assert len(order) == coordinator.num_free_blocks
    assert {block for block, _, _ in cached} <= set(order)
    coordinator.add_request(1, history + [1, 2, 3])
    assert coordinator.find_cache_hit(1) == 24
    with pytest.raises(InvalidArgumentError, match="exactly 10"):
        coordinator.allocate(1, 10, 4)
    assert coordinator.pending_hit_tokens(1) == 24
    assert coordinator.allocate(1, 16, 11)
    full_hit = [b for b in coordinator.request_blocks(1, 0)[:4]]
    cached_full = {block for block, group, _ in cached if group == 0}
    assert set(full_hit) <= cached_full
