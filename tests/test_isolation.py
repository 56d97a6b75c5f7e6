"""Tenant isolation of the prefix cache through the binding.

Requests with different cache salts, or under different LoRA adapters, never share a cached
block (while identical keys do: the control); the same tokens in two groups are two blocks;
and a mixed-tenant workload never hands a request a hit block filled with other tokens.
Each property runs with the default hash (xxh3) and with sha256.
"""

from __future__ import annotations

import random

import pytest
from hybrid_cache import Coordinator, GroupSpec
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

HASHES = ["xxh3", "sha256"]
LAYOUTS = {
    "full": [GroupSpec("full", 4)],
    "window": [GroupSpec("sliding_window", 4, window=8)],
    "gemma2": [GroupSpec("full", 4), GroupSpec("sliding_window", 2, window=6)],
    "three": [
        GroupSpec("full", 2),
        GroupSpec("sliding_window", 4, window=9),
        GroupSpec("chunked_local", 2, chunk=8),
    ],
}
PROMPT = [(7 * i + 3) % 50 for i in range(48)]


def make(layout: str, hash_algo: str, num_blocks: int = 200) -> Coordinator:
    return Coordinator(num_blocks, LAYOUTS[layout], 8, 128, 128, hash_algo=hash_algo)


def held(coordinator: Coordinator, request_id: int) -> set[int]:
    return {
        block
        for group in range(coordinator.num_groups)
        for block in coordinator.request_blocks(request_id, group)
        if block != 0
    }


def prefill(coordinator: Coordinator, request_id: int, tokens: list[int], **keys) -> int:
    coordinator.add_request(request_id, tokens, **keys)
    hit = coordinator.find_cache_hit(request_id)
    assert coordinator.allocate(request_id, hit, len(tokens) - hit)
    return hit


def sharing(layout: str, hash_algo: str, first: dict, second: dict) -> tuple[int, bool, int]:
    """Request 2 (keys `second`) after request 1 (keys `first`), same tokens: its hit and
    whether it shares a block while request 1 runs; then its hit once request 1 finished."""
    coordinator = make(layout, hash_algo)
    assert prefill(coordinator, 1, PROMPT, **first) == 0
    hit_alive = prefill(coordinator, 2, PROMPT, **second)
    shared = bool(held(coordinator, 1) & held(coordinator, 2))
    assert (hit_alive > 0) == shared, "a hit is exactly a shared block"
    coordinator.free_request(1)
    coordinator.free_request(2)
    assert coordinator.num_free_blocks == coordinator.num_blocks - 1

    coordinator = make(layout, hash_algo)
    prefill(coordinator, 1, PROMPT, **first)
    coordinator.free_request(1)
    hit_after_free = prefill(coordinator, 2, PROMPT, **second)
    coordinator.free_request(2)
    return hit_alive, shared, hit_after_free


@pytest.mark.parametrize("hash_algo", HASHES)
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_different_salts_never_share(layout, hash_algo):
    pairs = [("tenant-a", "tenant-b"), (None, "tenant-a"), ("tenant-a", None), ("", None)]
    for salt_a, salt_b in pairs:
        hit, shared, hit_after = sharing(
            layout, hash_algo, {"cache_salt": salt_a}, {"cache_salt": salt_b}
        )
        assert (hit, shared, hit_after) == (0, False, 0), (salt_a, salt_b)
    # Control: the same salt shares, so the assertion above can fail.
    hit, shared, hit_after = sharing(
        layout, hash_algo, {"cache_salt": "tenant-a"}, {"cache_salt": "tenant-a"}
    )
    assert hit > 0 and shared and hit_after > 0


@pytest.mark.parametrize("hash_algo", HASHES)
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_different_adapters_never_share(layout, hash_algo):
    for lora_a, lora_b in [(1, 2), (None, 0), (7, None)]:
        hit, shared, hit_after = sharing(
            layout, hash_algo, {"lora_id": lora_a}, {"lora_id": lora_b}
        )
        assert (hit, shared, hit_after) == (0, False, 0), (lora_a, lora_b)
    hit, shared, hit_after = sharing(layout, hash_algo, {"lora_id": 3}, {"lora_id": 3})
    assert hit > 0 and shared and hit_after > 0


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    first=st.tuples(st.none() | st.text(max_size=6), st.none() | st.integers(0, 3)),
    second=st.tuples(st.none() | st.text(max_size=6), st.none() | st.integers(0, 3)),
    hash_algo=st.sampled_from(HASHES),
)
def test_any_two_key_sets_share_iff_equal(first, second, hash_algo):
    keys = [{"cache_salt": salt, "lora_id": lora} for salt, lora in (first, second)]
    hit, shared, hit_after = sharing("gemma2", hash_algo, keys[0], keys[1])
    if first == second:
        assert hit > 0 and shared and hit_after > 0
    else:
        assert (hit, shared, hit_after) == (0, False, 0)


@pytest.mark.parametrize("hash_algo", HASHES)
def test_same_tokens_in_two_groups_are_two_blocks(hash_algo):
    coordinator = Coordinator(
        13, [GroupSpec("full", 4), GroupSpec("full", 4)], 4, 64, 64, hash_algo=hash_algo
    )
    tokens = list(range(12))
    prefill(coordinator, 1, tokens)
    group0, group1 = (coordinator.request_blocks(1, group) for group in (0, 1))
    assert not set(group0) & set(group1)
    assert coordinator.stats()["num_cached_blocks"] == 6, "one key per group and block"
    coordinator.free_request(1)
    # 16 filler tokens take the 6 never-used blocks and 2 of the 6 cached ones: exactly two
    # keys go, one block at a time, whatever group each belonged to.
    prefill(coordinator, 2, list(range(1000, 1016)))
    stats = coordinator.stats()
    # 4 of request 1's keys are left, plus request 2's own 8 full blocks.
    assert stats["num_evictions"] == 2 and stats["num_cached_blocks"] == 4 + 8
    coordinator.free_request(2)
    hit = prefill(coordinator, 3, tokens)
    rows = [coordinator.request_blocks(3, group) for group in (0, 1)]
    assert not set(rows[0]) & set(rows[1]), "a group never gets the other group's block"
    assert hit % 4 == 0 and hit < len(tokens)
    coordinator.free_request(3)
    assert coordinator.num_free_blocks == 12


@pytest.mark.parametrize("hash_algo", HASHES)
def test_mixed_tenants_hits_hold_their_own_tokens(hash_algo):
    """Random short prompts over a 3-token alphabet from 6 tenants (salt x adapter): every hit
    block must have been filled with exactly this request's prefix and keys."""
    rng = random.Random(1234)
    coordinator = Coordinator(
        160,
        [GroupSpec("full", 2), GroupSpec("sliding_window", 2, window=5)],
        6,
        64,
        64,
        hash_algo=hash_algo,
    )
    filled: dict[int, tuple] = {}
    live: list[int] = []
    num_hit_blocks = 0
    for request_id in range(600):
        tokens = [rng.randrange(3) for _ in range(rng.randrange(3, 17))]
        keys = {"cache_salt": rng.choice([None, "a", "b"]), "lora_id": rng.choice([None, 1])}
        if len(live) == 6:
            coordinator.free_request(live.pop(rng.randrange(6)))
        hit = prefill(coordinator, request_id, tokens, **keys)
        live.append(request_id)
        table = coordinator.block_table()
        row = coordinator.row_of(request_id)
        for group in range(2):
            blocks = table[group, row, : coordinator.num_blocks_per_row()[group, row]]
            for index, block in enumerate(blocks.tolist()):
                if block == 0:
                    continue
                mine = (
                    group,
                    index,
                    tuple(tokens[: 2 * (index + 1)]),
                    keys["cache_salt"],
                    keys["lora_id"],
                )
                if 2 * (index + 1) <= hit:
                    num_hit_blocks += 1
                    assert filled.get(block) == mine, f"request {request_id} hit block {block}"
                else:
                    filled[block] = mine
    assert num_hit_blocks > 100, "the workload must produce hits"
    for request_id in live:
        coordinator.free_request(request_id)
    assert coordinator.num_free_blocks == coordinator.num_blocks - 1
