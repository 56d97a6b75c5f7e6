"""Window-aware KV splits of the Triton attention kernel, on the CPU under TRITON_INTERPRET=1.

Each tile's splits share out only its visible keys (window or chunk start to its position). The
batches come from `test_kernels.make_batch`: every cache slot a sequence may not read is NaN,
block 0 (the null block) included, and the table entries left of each window are 0, so a split
that loaded a page left of its row's window would put NaN in the output. The split rule and the
variant bookkeeping (what the engine's warm-up compiles) are checked as plain functions.
"""

import os

os.environ["TRITON_INTERPRET"] = "1"  # before Triton decorates the kernels

import random

import pytest
import torch
from hybrid_cache.kernels.paged_attention import (
    MAX_KV_SPLITS,
    _combine_splits_kernel,
    _unified_attention_kernel,
    choose_num_kv_splits,
    compile_variants,
    layer_variants,
    plan_launch,
    visible_keys_bound,
)
from hybrid_cache.kernels.reference import visible_key_begin
from test_kernels import check_against_reference, fresh_seed, make_batch


def window_batch(seed, query_lens, context_lens, *, window=None, chunk=None, **shape):
    generator = torch.Generator().manual_seed(seed)
    options = dict(num_query_heads=4, num_kv_heads=2, head_dim=32, block_size=16)
    options.update(shape)
    batch = make_batch(
        generator,
        query_lens,
        context_lens,
        dtype=options.pop("dtype", torch.float32),
        sliding_window=window,
        chunk_size=chunk,
        **options,
    )
    assert torch.isnan(batch.key_cache[0]).all() and torch.isnan(batch.value_cache[0]).all()
    return batch


def test_window_far_shorter_than_context_many_splits():
    # Contexts of 10-20 windows; 16 splits of one 16-key tile each, most rows' pages null.
    seed = fresh_seed()
    draw = random.Random(seed)
    window = 24
    context_lens = [draw.randint(240, 400) for _ in range(5)]
    batch = window_batch(seed, [1] * 5, context_lens, window=window)
    assert batch.num_null_entries >= 5 * (240 - window) // 16, batch.block_table.tolist()
    for splits in (4, 16):
        check_against_reference(
            batch, seed, torch.float32, sliding_window=window, tile_n=16, num_kv_splits=splits
        )


@pytest.mark.parametrize("offset", [1, 7, 15])
def test_visible_range_starting_mid_block(offset):
    # The window's first key sits `offset` slots into a page: the rest of that page left of it
    # is NaN, and the pages before it are the null block.
    seed = fresh_seed()
    window, block_size = 40, 16
    seq_len = 10 * block_size + offset + window  # first visible key: 10 * 16 + offset
    batch = window_batch(seed, [1, 1], [seq_len - 1, seq_len + 16], window=window)
    begin = visible_key_begin(seq_len - 1, window, None)
    assert begin % block_size == offset
    assert (batch.block_table[0, : begin // block_size] == 0).all()
    assert torch.isnan(batch.key_cache[batch.block_table[0, begin // block_size], 0]).all()
    for splits in (2, 8):
        check_against_reference(
            batch, seed, torch.float32, sliding_window=window, tile_n=16, num_kv_splits=splits
        )


def test_chunked_local_attention_with_splits():
    seed = fresh_seed()
    draw = random.Random(seed)
    chunk = 48
    query_lens = [1, 1, draw.randint(2, 9), 1]
    context_lens = [draw.randint(150, 260), 47, draw.randint(100, 200), 96]  # 96: chunk's first
    batch = window_batch(seed, query_lens, context_lens, chunk=chunk)
    assert batch.num_null_entries > 0
    for splits in (2, 16):
        check_against_reference(
            batch, seed, torch.float32, chunk_size=chunk, tile_n=16, num_kv_splits=splits
        )


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_sinks_and_softcap_with_window_splits(dtype):
    seed = fresh_seed()
    draw = random.Random(seed)
    batch = window_batch(
        seed,
        [1, 1, 1],
        [draw.randint(150, 300), draw.randint(0, 5), draw.randint(30, 60)],
        window=33,
        dtype=dtype,
        num_query_heads=8,
        num_kv_heads=2,
    )
    sinks = torch.randn(8, generator=torch.Generator().manual_seed(seed)) * 2
    check_against_reference(
        batch,
        seed,
        dtype,
        sliding_window=33,
        softcap=10.0,
        sinks=sinks,
        tile_n=16,
        num_kv_splits=8,
    )


def test_mixed_batch_with_window_splits():
    # Prefill chunks (a tile of several queries spans window + queries - 1 keys) next to
    # decode rows with long contexts, all split.
    seed = fresh_seed()
    draw = random.Random(seed)
    query_lens = [1, draw.randint(10, 20), 1, draw.randint(2, 6), 1]
    context_lens = [draw.randint(200, 300), draw.randint(100, 180), 0, 0, draw.randint(17, 40)]
    batch = window_batch(seed, query_lens, context_lens, window=20)
    for splits in (2, 8):
        check_against_reference(
            batch,
            seed,
            torch.float32,
            sliding_window=20,
            tile_n=16,
            block_q=4,
            num_kv_splits=splits,
        )


def test_more_splits_than_visible_tiles():
    # Window 5: one or two key tiles per row, so most of the 16 splits are empty.
    seed = fresh_seed()
    batch = window_batch(seed, [1, 1, 1], [100, 3, 0], window=5)
    check_against_reference(
        batch, seed, torch.float32, sliding_window=5, tile_n=16, num_kv_splits=MAX_KV_SPLITS
    )


def test_per_step_arguments_are_not_specialised():
    # A new batch size, split count or table width must not compile a new variant.
    assert {"num_seqs", "num_splits", "stride_block_table_seq"} <= set(
        _unified_attention_kernel.kwargs["do_not_specialize"]
    )
    assert "num_splits" in _combine_splits_kernel.kwargs["do_not_specialize"]


def splits(**overrides):
    arguments = dict(
        num_tokens=16,
        num_seqs=16,
        num_query_heads=32,
        num_kv_heads=4,
        head_dim_padded=128,
        block_q=2,
        tile_n=64,
        visible_keys=None,
        multiprocessors=132,
    )
    arguments.update(overrides)
    return choose_num_kv_splits(**arguments)


def test_split_rule():
    # 16 x 4 = 64 programs against 264 wanted: 8 splits while the visible range is long.
    assert splits() == 8
    assert splits(visible_keys=16384) == 8
    assert splits(visible_keys=4096) == 8
    # Short windows: at least 4 key tiles a split, none at all for a 128-key window.
    assert splits(visible_keys=1024) == 4
    assert splits(visible_keys=512) == 2
    assert splits(visible_keys=128) == 1
    # A batch that fills the GPU alone, the CPU, an empty batch: one split.
    assert splits(num_tokens=128, num_seqs=128) == 1
    assert splits(multiprocessors=None) == 1
    assert splits(num_seqs=0, num_tokens=0) == 1
    # One sequence: capped at MAX_KV_SPLITS.
    assert splits(num_tokens=1, num_seqs=1) == MAX_KV_SPLITS
    # Mixed batches count query tiles; the partials' memory caps the count.
    assert splits(num_tokens=256, num_seqs=4, block_q=8) == 4  # 32 tiles x 4 heads
    assert splits(num_tokens=2048, num_seqs=2, block_q=8, num_kv_heads=1) == 1
    big = splits(num_tokens=1000, num_seqs=1, block_q=64, num_kv_heads=1, num_query_heads=64)
    assert big * 1000 * 64 * 130 * 4 <= 64 << 20 and big >= 1


def test_visible_keys_bound():
    assert visible_keys_bound(None, None, None, 1) is None
    assert visible_keys_bound(16384, None, None, 1) == 16384
    assert visible_keys_bound(16384, 4096, None, 1) == 4096
    assert visible_keys_bound(100, 4096, None, 8) == 100
    assert visible_keys_bound(None, 4096, None, 8) == 4096 + 7
    assert visible_keys_bound(None, None, 8192, 1) == 8192


def test_default_splits_follow_the_window_not_the_context():
    def default(window, seq_len, num_seqs=16):
        return plan_launch(
            dtype=torch.bfloat16,
            num_tokens=num_seqs,
            num_seqs=num_seqs,
            num_query_heads=32,
            num_kv_heads=4,
            head_dim=128,
            block_size=16,
            sliding_window=window,
            chunk_size=None,
            softcap=None,
            has_sinks=False,
            interpreted=False,
            multiprocessors=132,
            max_seq_len=seq_len,
        ).num_kv_splits

    assert default(None, 16384) == 8
    assert default(128, 16384) == 1  # gpt-oss's window: no split, no combine launch
    assert default(512, 16384) == 2
    # Short full-attention contexts, known from max_seq_len.
    assert default(None, 1000) == 4
    assert default(None, 300) == 1
    assert default(None, None) == 8


LAYERS = [
    dict(num_query_heads=8, num_kv_heads=2, head_dim=32, block_size=16),
    dict(num_query_heads=16, num_kv_heads=8, head_dim=256, block_size=80),
    dict(num_query_heads=4, num_kv_heads=4, head_dim=80, block_size=16),
]


@pytest.mark.parametrize("layer", LAYERS)
@pytest.mark.parametrize(
    "window, chunk, softcap, sinks", [(None, None, None, False), (128, None, 30.0, True)]
)
def test_layer_variants_cover_every_step_a_run_can_make(layer, window, chunk, softcap, sinks):
    # What the warm-up compiles holds the variant of every step shape, whatever its batch size,
    # lengths and the GPU's size (the split count follows those, the variant does not).
    common = dict(
        dtype=torch.bfloat16,
        sliding_window=window,
        chunk_size=chunk,
        softcap=softcap,
        has_sinks=sinks,
        interpreted=False,
        **layer,
    )
    compiled = layer_variants(**common)
    assert len(compiled) == 4
    seen = set()
    draw = random.Random(0)
    for _ in range(300):
        num_seqs = draw.choice([1, 2, 3, 8, 31, 64, 256])
        decode = draw.random() < 0.5
        num_tokens = num_seqs if decode else num_seqs + draw.randint(1, 2048)
        plan = plan_launch(
            num_tokens=num_tokens,
            num_seqs=num_seqs,
            multiprocessors=draw.choice([None, 16, 132]),
            max_seq_len=draw.choice([None, 1, 100, 5000, 131072]),
            **common,
        )
        assert plan.variant in compiled, (num_tokens, num_seqs, plan)
        seen.add(plan.variant)
    # The draws met decode and mixed variants, split ones too unless a 128-key window keeps
    # every row under two splits' worth of key tiles.
    assert len(seen) == (2 if window == 128 else 4)


def test_compile_variants_launches_each_variant():
    key_cache = torch.randn(3, 16, 2, 32)
    value_cache = torch.randn_like(key_cache)
    before = key_cache.clone()
    variants = compile_variants(
        key_cache, value_cache, 8, sliding_window=20, softcap=5.0, sinks=torch.zeros(8)
    )
    expected = layer_variants(
        dtype=torch.float32,
        num_query_heads=8,
        num_kv_heads=2,
        head_dim=32,
        block_size=16,
        sliding_window=20,
        chunk_size=None,
        softcap=5.0,
        has_sinks=True,
        interpreted=True,
    )
    assert variants == list(expected)
    assert {dict(variant)["USE_SPLITS"] for variant in variants} == {False, True}
    # Tiles of 16 (decode) and 64 (mixed) rows over 4 query heads per kv head.
    assert {dict(variant)["BLOCK_Q"] for variant in variants} == {4, 16}
    assert torch.equal(key_cache, before)
