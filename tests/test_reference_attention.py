"""The torch reference backend against a naive dense attention written from the definitions."""

from __future__ import annotations

import math

import pytest
import torch
from hybrid_cache.attention import (
    Attention,
    build_attention_metadata,
    compute_positions,
    compute_slot_mapping,
    get_attention_backend,
    register_attention_backend,
    set_forward_context,
)
from hybrid_cache.attention.params import AttentionParams
from hybrid_cache.attention.reference import paged_attention, visibility_mask, write_kv
from hybrid_cache.attention.selector import UnknownAttentionBackendError
from hybrid_cache.errors import HybridCacheError
from transformers import masking_utils

NUM_HEADS, NUM_KV_HEADS, HEAD_DIM = 4, 2, 8


def naive_attention(q, k, v, query_positions, scale, window, chunk, softcap, sinks):
    """One query row at a time, scalar loops over keys: the definition, nothing clever."""
    out = torch.zeros_like(q)
    group = NUM_HEADS // NUM_KV_HEADS
    for row, p in enumerate(query_positions):
        for head in range(NUM_HEADS):
            logits, values = [], []
            for key in range(p + 1):
                if window is not None and not key > p - window:
                    continue
                if chunk is not None and key // chunk != p // chunk:
                    continue
                s = float(q[row, head] @ k[key, head // group]) * scale
                if softcap is not None:
                    s = softcap * math.tanh(s / softcap)
                logits.append(s)
                values.append(v[key, head // group])
            extra = [float(sinks[head])] if sinks is not None else []
            top = max(logits + extra)
            weights = [math.exp(s - top) for s in logits]
            denominator = sum(weights) + sum(math.exp(s - top) for s in extra)
            out[row, head] = sum(w * value for w, value in zip(weights, values)) / denominator
    return out


def paged_setup(seq_lens, query_lens, block_size, window, chunk, seed=0):
    """Random K/V for whole sequences in a shuffled paged cache, null blocks left of the window
    (and NaN in their pages and in block 0), plus this step's queries and metadata."""
    generator = torch.Generator().manual_seed(seed)
    num_seqs = len(seq_lens)
    max_blocks = max(-(-n // block_size) for n in seq_lens)
    num_blocks = 1 + num_seqs * max_blocks
    order = 1 + torch.randperm(num_blocks - 1, generator=generator)
    table = order.view(num_seqs, max_blocks).to(torch.int32)
    k_cache = torch.full((num_blocks, block_size, NUM_KV_HEADS, HEAD_DIM), float("nan"))
    v_cache = torch.full_like(k_cache, float("nan"))
    keys = [torch.randn(n, NUM_KV_HEADS, HEAD_DIM, generator=generator) for n in seq_lens]
    values = [torch.randn(n, NUM_KV_HEADS, HEAD_DIM, generator=generator) for n in seq_lens]
    computed = [n - q for n, q in zip(seq_lens, query_lens)]
    metadata, positions = build_attention_metadata(query_lens, computed, [table], [block_size])
    for seq in range(num_seqs):
        # Cached tokens were written by earlier steps; this step's tokens go through write_kv.
        for position in range(computed[seq]):
            block = table[seq, position // block_size]
            k_cache[block, position % block_size] = keys[seq][position]
            v_cache[block, position % block_size] = values[seq][position]
        skipped = 0
        if window is not None:
            skipped = max(skipped, computed[seq] - window + 1)
        if chunk is not None:
            skipped = max(skipped, computed[seq] // chunk * chunk)
        released = table[seq, : skipped // block_size].long()
        k_cache[released] = float("nan")
        v_cache[released] = float("nan")
        table[seq, : skipped // block_size] = 0
    new_k = torch.cat([keys[s][computed[s] :] for s in range(num_seqs)])
    new_v = torch.cat([values[s][computed[s] :] for s in range(num_seqs)])
    metadata.groups[0].slot_mapping = compute_slot_mapping(
        table, metadata.query_start_loc, positions, block_size
    )
    metadata.groups[0].block_table = table
    write_kv(k_cache, v_cache, new_k, new_v, metadata.groups[0].slot_mapping)
    q = torch.randn(sum(query_lens), NUM_HEADS, HEAD_DIM, generator=generator)
    return q, k_cache, v_cache, metadata, keys, values, positions


CASES = [
    # (window, chunk, softcap, sinks)
    (None, None, None, False),
    (5, None, None, False),
    (5, None, 2.0, False),
    (4, None, None, True),
    (None, 6, None, False),
    (None, None, 1.5, True),
]


@pytest.mark.parametrize("window,chunk,softcap,use_sinks", CASES)
def test_paged_matches_naive(window, chunk, softcap, use_sinks) -> None:
    # A decode row, a prefill chunk on top of context, a whole prompt, a 1-token prompt.
    seq_lens, query_lens = [19, 23, 11, 1], [1, 6, 11, 1]
    block_size = 4
    q, k_cache, v_cache, metadata, keys, values, positions = paged_setup(
        seq_lens, query_lens, block_size, window, chunk
    )
    sinks = torch.randn(NUM_HEADS) if use_sinks else None
    scale = HEAD_DIM**-0.5
    params = AttentionParams(scale, window, softcap, sinks, chunk)
    out = paged_attention(q, k_cache, v_cache, metadata, metadata.groups[0], params)
    assert torch.isfinite(out).all(), "a null or released page was read"
    starts = metadata.query_start_loc.tolist()
    for seq in range(len(seq_lens)):
        rows = slice(starts[seq], starts[seq + 1])
        expected = naive_attention(
            q[rows],
            keys[seq],
            values[seq],
            positions[rows].tolist(),
            scale,
            window,
            chunk,
            softcap,
            sinks,
        )
        torch.testing.assert_close(out[rows], expected, rtol=1e-5, atol=1e-5)


def test_window_releases_blocks_in_setup() -> None:
    """The window case really puts null blocks in the table (else the NaN check is vacuous)."""
    _, _, _, metadata, *_ = paged_setup([19, 23], [1, 6], 4, window=5, chunk=None)
    assert int((metadata.groups[0].block_table == 0).sum()) >= 4


def test_null_block_in_visible_range_is_refused() -> None:
    q, k_cache, v_cache, metadata, *_ = paged_setup([9], [1], 4, window=None, chunk=None)
    metadata.groups[0].block_table[0, 0] = 0
    with pytest.raises(AssertionError, match="null block"):
        paged_attention(q, k_cache, v_cache, metadata, metadata.groups[0], AttentionParams(1.0))


@pytest.mark.parametrize("window", [1, 3, 8])
def test_window_convention_matches_transformers(window: int) -> None:
    positions = torch.arange(20)
    ours = visibility_mask(positions, positions, window, None)
    causal = masking_utils.causal_mask_function
    overlay = masking_utils.sliding_window_overlay(window)
    theirs = torch.tensor(
        [
            [bool(causal(0, 0, q, k)) and bool(overlay(0, 0, q, k)) for k in range(20)]
            for q in range(20)
        ]
    )
    assert torch.equal(ours, theirs)
    assert int(ours[10].sum()) == window  # W keys including the query itself


def test_chunk_convention_matches_transformers() -> None:
    positions = torch.arange(20)
    ours = visibility_mask(positions, positions, None, 6)
    overlay = masking_utils.chunked_overlay(6, torch.zeros(1, dtype=torch.long))
    theirs = torch.tensor(
        [
            [k <= q and bool(overlay(0, 0, torch.tensor(q), torch.tensor(k))) for k in range(20)]
            for q in range(20)
        ]
    )
    assert torch.equal(ours, theirs)


def test_slot_mapping_matches_per_token_loop() -> None:
    table = torch.tensor([[3, 7, 9, 0], [5, 2, 8, 4]], dtype=torch.int32)
    query_start_loc = torch.tensor([0, 2, 7], dtype=torch.int32)
    seq_lens = torch.tensor([10, 13], dtype=torch.int32)
    positions = compute_positions(query_start_loc, seq_lens)
    assert positions.tolist() == [8, 9, 8, 9, 10, 11, 12]
    slots = compute_slot_mapping(table, query_start_loc, positions, block_size=4)
    seqs = [0, 0, 1, 1, 1, 1, 1]
    expected = [int(table[s, p // 4]) * 4 + p % 4 for s, p in zip(seqs, positions.tolist())]
    assert slots.tolist() == expected
    assert slots.dtype == torch.int64


def test_write_kv_stores_at_slots_in_a_strided_view() -> None:
    shared = torch.zeros(6, 4, 2 * NUM_KV_HEADS, HEAD_DIM)
    k_cache, v_cache = shared[:, :, :NUM_KV_HEADS], shared[:, :, NUM_KV_HEADS:]
    k, v = torch.randn(3, NUM_KV_HEADS, HEAD_DIM), torch.randn(3, NUM_KV_HEADS, HEAD_DIM)
    write_kv(k_cache, v_cache, k, v, torch.tensor([5, 6, 22]))
    assert torch.equal(k_cache[1, 1], k[0]) and torch.equal(k_cache[1, 2], k[1])
    assert torch.equal(v_cache[5, 2], v[2])
    # 3 tokens x (2 key heads + 2 value heads) rows written, nothing else touched
    assert int((shared != 0).any(-1).sum()) == 3 * 2 * NUM_KV_HEADS


def test_unknown_backend_is_a_typed_error() -> None:
    assert get_attention_backend("reference").paged_attention is paged_attention
    with pytest.raises(UnknownAttentionBackendError, match="reference") as error:
        get_attention_backend("no-such-backend")
    assert isinstance(error.value, HybridCacheError)


def test_the_layer_builds_its_params_once_and_hands_them_to_the_backend() -> None:
    """`Attention` builds its `AttentionParams` at construction and when an option is set, not
    per step; the model's sinks join them once; the backend gets them as its last argument."""
    seen = []

    class Recording:
        write_kv = staticmethod(write_kv)

        @staticmethod
        def paged_attention(q, k_cache, v_cache, metadata, group, params):
            seen.append(params)
            return paged_attention(q, k_cache, v_cache, metadata, group, params)

    register_attention_backend("test-recording", Recording)
    options = dict(sliding_window=5, softcap=2.0, backend="test-recording")
    layer = Attention(0, NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, 0.5, **options)
    built = layer.params
    assert isinstance(built, AttentionParams)
    assert (built.scale, built.sliding_window, built.softcap) == (0.5, 5, 2.0)
    assert built.sinks is None and built.chunk is None
    q, k_cache, v_cache, metadata, keys, values, _ = paged_setup([19, 6], [1, 6], 4, 5, None)
    computed = [18, 0]
    new_k = torch.cat([keys[0][computed[0] :], keys[1]])
    new_v = torch.cat([values[0][computed[0] :], values[1]])
    sinks = torch.randn(NUM_HEADS)
    with set_forward_context(metadata, [(k_cache, v_cache)]):
        plain = [layer(q, new_k, new_v) for _ in range(2)]
        with_sinks = [layer(q, new_k, new_v, sinks) for _ in range(2)]
    assert seen[0] is built and seen[1] is built
    assert seen[2] is seen[3] is layer.params and seen[2].sinks is sinks
    assert (seen[2].scale, seen[2].sliding_window, seen[2].softcap) == (0.5, 5, 2.0)
    expected = paged_attention(q, k_cache, v_cache, metadata, metadata.groups[0], built)
    torch.testing.assert_close(plain[0], expected)
    torch.testing.assert_close(
        with_sinks[0],
        paged_attention(q, k_cache, v_cache, metadata, metadata.groups[0], seen[2]),
    )
    assert not torch.allclose(with_sinks[0], plain[0])
    # Setting an option rebuilds the (frozen) params; the others, sinks included, stay.
    layer.sliding_window = None
    layer.chunk = 6
    assert (layer.sliding_window, layer.chunk, layer.params.sliding_window) == (None, 6, None)
    assert layer.params.chunk == 6 and layer.params.sinks is sinks and layer.softcap == 2.0
    assert layer.kind == "chunked_local" and layer.reach == 6
