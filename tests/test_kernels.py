"""The Triton kernels against their torch references, on the CPU under TRITON_INTERPRET=1.

Every test draws fresh random inputs (the seed is in each failure message; set
HYBRID_CACHE_TEST_SEED to replay one) and poisons output buffers with NaN before the launch.
Caches start as NaN everywhere and get finite values only where a sequence may read, so a
kernel that reads a null page, a page left of the window or a slot past the context fails.
"""

import os

# Must be set before Triton decorates the kernels (i.e. before hybrid_cache.kernels' launchers
# are imported anywhere in this process).
os.environ["TRITON_INTERPRET"] = "1"

import math
import random
from dataclasses import dataclass
from typing import List, Optional

import pytest
import torch
from hybrid_cache.errors import HybridCacheError, KernelArgumentError
from hybrid_cache.kernels import (
    reference_unified_attention,
    reference_write_kv_cache,
    unified_attention,
    write_kv_cache,
)
from hybrid_cache.kernels._launch import is_interpreted
from hybrid_cache.kernels.paged_attention import _unified_attention_kernel
from hybrid_cache.kernels.reference import visible_key_begin

# fp32 and fp16 are computed the GPU way (fp16 probabilities feed the second dot), bf16 in
# fp32 under the interpreter; the bounds are a few output roundings of each dtype.
TOLERANCES = {
    torch.float32: dict(atol=2e-5, rtol=2e-5),
    torch.float16: dict(atol=4e-3, rtol=4e-3),
    torch.bfloat16: dict(atol=2e-2, rtol=2e-2),
}


def fresh_seed() -> int:
    override = os.environ.get("HYBRID_CACHE_TEST_SEED")
    return int(override) if override else random.SystemRandom().randrange(2**31)


@dataclass
class Batch:
    query: torch.Tensor
    key_cache: torch.Tensor
    value_cache: torch.Tensor
    block_table: torch.Tensor
    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    num_null_entries: int


def make_batch(
    generator: torch.Generator,
    query_lens: List[int],
    context_lens: List[int],
    *,
    num_query_heads: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    dtype: torch.dtype,
    sliding_window: Optional[int] = None,
    chunk_size: Optional[int] = None,
) -> Batch:
    """Random pages per sequence; pages left of the visible range are the null block 0."""
    seq_lens = [q + c for q, c in zip(query_lens, context_lens)]
    pages_per_seq = [math.ceil(length / block_size) for length in seq_lens]
    max_blocks = max(pages_per_seq) + 1  # a spare entry past every sequence's end
    num_blocks = sum(pages_per_seq) + 3  # the null block plus two never-used pages
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    key_cache = torch.full(shape, float("nan"), dtype=dtype)
    value_cache = torch.full(shape, float("nan"), dtype=dtype)
    block_table = torch.zeros(len(seq_lens), max_blocks, dtype=torch.int32)
    free_pages = (torch.randperm(num_blocks - 1, generator=generator) + 1).tolist()
    num_null_entries = 0
    for seq, (query_len, seq_len) in enumerate(zip(query_lens, seq_lens)):
        begin = visible_key_begin(seq_len - query_len, sliding_window, chunk_size)
        for page_index in range(pages_per_seq[seq]):
            if (page_index + 1) * block_size <= begin:
                num_null_entries += 1  # released by the window: stays the null block
                continue
            page = free_pages.pop()
            block_table[seq, page_index] = page
            # Only the readable slots get numbers; the rest of the page stays NaN.
            first = max(begin - page_index * block_size, 0)
            last = min(seq_len - page_index * block_size, block_size)
            for cache in (key_cache, value_cache):
                values = torch.randn(last - first, num_kv_heads, head_dim, generator=generator)
                cache[page, first:last] = values.to(dtype)
    starts = [0]
    for query_len in query_lens:
        starts.append(starts[-1] + query_len)
    query = torch.randn(starts[-1], num_query_heads, head_dim, generator=generator).to(dtype)
    return Batch(
        query=query,
        key_cache=key_cache,
        value_cache=value_cache,
        block_table=block_table,
        query_start_loc=torch.tensor(starts, dtype=torch.int32),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        num_null_entries=num_null_entries,
    )


def check_against_reference(batch: Batch, seed: int, dtype: torch.dtype, **options) -> None:
    out = torch.full_like(batch.query, float("nan"))
    args = (
        batch.key_cache,
        batch.value_cache,
        batch.block_table,
        batch.query_start_loc,
        batch.seq_lens,
    )
    kernel_options = {
        k: v for k, v in options.items() if k in ("block_q", "tile_n", "num_kv_splits")
    }
    semantics = {k: v for k, v in options.items() if k not in kernel_options}
    unified_attention(batch.query, *args, out=out, **kernel_options, **semantics)
    # The oracle in float32 on the same (already rounded) inputs.
    expected = reference_unified_attention(
        batch.query.float(),
        batch.key_cache.float(),
        batch.value_cache.float(),
        *args[2:],
        **semantics,
    )
    message = (
        f"seed={seed} seq_lens={batch.seq_lens.tolist()} "
        f"query_start_loc={batch.query_start_loc.tolist()} options={options}"
    )
    assert torch.isfinite(out).all(), f"NaN/inf in the kernel output ({message})"
    torch.testing.assert_close(
        out.float(), expected, **TOLERANCES[dtype], msg=lambda text: f"{text}\n{message}"
    )


def test_kernels_run_under_the_interpreter():
    assert is_interpreted(_unified_attention_kernel), (
        "Triton was imported before this module set TRITON_INTERPRET=1 (another test module "
        "imported it first); run this file on its own or set TRITON_INTERPRET=1 for the session"
    )


# (queries per kv head, kv heads, head dim, block size, dtype, window, chunk, softcap, sinks)
CASES = [
    pytest.param(1, 2, 32, 16, torch.float32, None, None, None, False, id="full-mha-fp32"),
    pytest.param(2, 2, 16, 16, torch.float32, 5, None, None, False, id="window5-gqa2"),
    pytest.param(4, 1, 32, 32, torch.float32, 20, None, None, True, id="window20-gqa4-sinks"),
    pytest.param(8, 1, 16, 16, torch.float32, 1000, None, None, False, id="window>context-gqa8"),
    pytest.param(3, 2, 16, 16, torch.float32, 7, None, None, False, id="window7-gqa3-padded"),
    pytest.param(2, 2, 32, 16, torch.float32, None, 8, None, False, id="chunk8"),
    pytest.param(1, 2, 32, 16, torch.float32, None, 24, 5.0, False, id="chunk24-softcap"),
    pytest.param(4, 2, 64, 16, torch.float32, 13, None, 30.0, True, id="softcap-sinks-window13"),
    pytest.param(2, 2, 64, 32, torch.float16, 19, None, None, False, id="fp16-window19"),
    pytest.param(4, 2, 64, 16, torch.bfloat16, None, None, 20.0, True, id="bf16-softcap-sinks"),
    pytest.param(1, 2, 128, 16, torch.bfloat16, 33, None, None, False, id="bf16-hd128"),
    pytest.param(8, 1, 256, 256, torch.float16, 40, None, None, True, id="fp16-hd256-block256"),
    pytest.param(2, 1, 80, 64, torch.float32, 9, None, None, False, id="hd80-padded"),
    # Blocks that are not a power of two: the per-type layout's longer blocks (Gemma-3: 80).
    pytest.param(4, 1, 32, 80, torch.float32, None, None, None, False, id="block80-full"),
    pytest.param(2, 1, 32, 12, torch.float32, 7, None, None, False, id="block12-window7"),
]


@pytest.mark.parametrize(
    "queries_per_kv, num_kv_heads, head_dim, block_size, dtype, window, chunk, softcap, sinks",
    CASES,
)
def test_unified_attention_matches_reference(
    queries_per_kv, num_kv_heads, head_dim, block_size, dtype, window, chunk, softcap, sinks
):
    seed = fresh_seed()
    generator = torch.Generator().manual_seed(seed)
    draw = random.Random(seed)
    # Mixed rows: decode tokens with long and empty contexts, a first prefill chunk, a later one.
    query_lens = [1, draw.randint(2, 24), 1, draw.randint(2, 24)]
    context_lens = [draw.randint(20, 40), 0, draw.randint(0, 3), draw.randint(1, 40)]
    num_query_heads = queries_per_kv * num_kv_heads
    batch = make_batch(
        generator,
        query_lens,
        context_lens,
        num_query_heads=num_query_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        block_size=block_size,
        dtype=dtype,
        sliding_window=window,
        chunk_size=chunk,
    )
    options = dict(sliding_window=window, chunk_size=chunk, softcap=softcap)
    if sinks:
        options["sinks"] = torch.randn(num_query_heads, generator=generator) * 2
    check_against_reference(batch, seed, dtype, **options)


def test_null_pages_are_left_of_the_window():
    # Guards the NaN-page construction the other tests rely on: a window shorter than the
    # context must really put null entries in the table.
    seed = fresh_seed()
    batch = make_batch(
        torch.Generator().manual_seed(seed),
        [1, 4],
        [60, 50],
        num_query_heads=2,
        num_kv_heads=1,
        head_dim=16,
        block_size=16,
        dtype=torch.float32,
        sliding_window=10,
    )
    assert batch.num_null_entries == 3 + 2, f"seed={seed} table={batch.block_table.tolist()}"
    assert torch.isnan(batch.key_cache[0]).all()
    check_against_reference(batch, seed, torch.float32, sliding_window=10)


@pytest.mark.parametrize(
    "block_size, block_q, tile_n",
    [(32, 2, 16), (16, 16, 64), (16, 1, 32)],
    ids=["tile<page", "tile>page", "one-query-per-program"],
)
def test_tile_shapes_do_not_change_results(block_size, block_q, tile_n):
    seed = fresh_seed()
    generator = torch.Generator().manual_seed(seed)
    batch = make_batch(
        generator,
        [5, 1, 17, 0, 1],  # includes a sequence with no query this step
        [30, 44, 9, 12, 0],
        num_query_heads=4,
        num_kv_heads=2,
        head_dim=32,
        block_size=block_size,
        dtype=torch.float32,
        sliding_window=11,
    )
    check_against_reference(
        batch, seed, torch.float32, sliding_window=11, block_q=block_q, tile_n=tile_n
    )


@pytest.mark.parametrize(
    "num_kv_splits, dtype", [(2, torch.float32), (8, torch.float32), (4, torch.bfloat16)]
)
def test_split_kv_matches_reference(num_kv_splits, dtype):
    # Splits the key range over programs and merges partial softmaxes (sinks in the merge).
    seed = fresh_seed()
    draw = random.Random(seed)
    batch = make_batch(
        torch.Generator().manual_seed(seed),
        [1, 1, draw.randint(2, 12), 1],
        [draw.randint(30, 60), 0, draw.randint(0, 30), draw.randint(1, 8)],
        num_query_heads=8,
        num_kv_heads=2,
        head_dim=32,
        block_size=16,
        dtype=dtype,
        sliding_window=23,
    )
    sinks = torch.randn(8, generator=torch.Generator().manual_seed(seed))
    check_against_reference(
        batch,
        seed,
        dtype,
        sliding_window=23,
        softcap=15.0,
        sinks=sinks,
        tile_n=16,
        num_kv_splits=num_kv_splits,
    )


def test_decode_only_batch():
    seed = fresh_seed()
    draw = random.Random(seed)
    context_lens = [draw.randint(0, 60) for _ in range(6)]
    batch = make_batch(
        torch.Generator().manual_seed(seed),
        [1] * 6,
        context_lens,
        num_query_heads=8,
        num_kv_heads=1,
        head_dim=32,
        block_size=16,
        dtype=torch.float16,
        sliding_window=17,
    )
    check_against_reference(batch, seed, torch.float16, sliding_window=17)


def test_write_then_attend_equals_dense_causal_attention():
    # An oracle independent of ours: torch's SDPA on the dense sequence, with a window mask.
    seed = fresh_seed()
    generator = torch.Generator().manual_seed(seed)
    seq_len, num_query_heads, num_kv_heads, head_dim, block_size, window = 37, 4, 2, 32, 16, 9
    keys = torch.randn(seq_len, num_kv_heads, head_dim, generator=generator)
    values = torch.randn(seq_len, num_kv_heads, head_dim, generator=generator)
    queries = torch.randn(seq_len, num_query_heads, head_dim, generator=generator)
    key_cache = torch.full((5, block_size, num_kv_heads, head_dim), float("nan"))
    value_cache = torch.full_like(key_cache, float("nan"))
    pages = [4, 1, 3]
    slots = torch.tensor([pages[i // block_size] * block_size + i % block_size for i in range(37)])
    write_kv_cache(keys, values, key_cache, value_cache, slots)
    out = unified_attention(
        queries,
        key_cache,
        value_cache,
        torch.tensor([pages], dtype=torch.int32),
        torch.tensor([0, seq_len], dtype=torch.int32),
        torch.tensor([seq_len], dtype=torch.int32),
        sliding_window=window,
    )
    positions = torch.arange(seq_len)
    allowed = (positions[None, :] <= positions[:, None]) & (
        positions[None, :] > positions[:, None] - window
    )
    expected = torch.nn.functional.scaled_dot_product_attention(
        queries.transpose(0, 1),
        keys.repeat_interleave(2, dim=1).transpose(0, 1),
        values.repeat_interleave(2, dim=1).transpose(0, 1),
        attn_mask=allowed,
    ).transpose(0, 1)
    torch.testing.assert_close(
        out, expected, atol=1e-5, rtol=1e-5, msg=lambda t: f"{t} seed={seed}"
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_write_kv_cache_matches_reference_and_skips_negative_slots(dtype):
    seed = fresh_seed()
    generator = torch.Generator().manual_seed(seed)
    num_blocks, block_size, num_kv_heads, head_dim, num_tokens = 6, 16, 3, 24, 20
    key = torch.randn(num_tokens, num_kv_heads, head_dim, generator=generator).to(dtype)
    value = torch.randn(num_tokens, num_kv_heads, head_dim, generator=generator).to(dtype)
    slots = torch.randperm(num_blocks * block_size, generator=generator)[:num_tokens]
    skipped = torch.randperm(num_tokens, generator=generator)[:5]
    slots[skipped] = -1
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    key_cache = torch.randn(shape, generator=generator).to(dtype)
    value_cache = torch.randn(shape, generator=generator).to(dtype)
    expected_key, expected_value = key_cache.clone(), value_cache.clone()
    reference_write_kv_cache(key, value, expected_key, expected_value, slots)
    write_kv_cache(key, value, key_cache, value_cache, slots.to(torch.int32))
    message = f"seed={seed} dtype={dtype} slots={slots.tolist()}"
    # Bit-exact: a copy, not arithmetic; untouched slots keep their old contents.
    assert torch.equal(key_cache, expected_key), message
    assert torch.equal(value_cache, expected_value), message
    assert not torch.equal(key_cache, key_cache.new_zeros(shape)), message


def _valid_attention_args():
    return dict(
        query=torch.zeros(3, 4, 16),
        key_cache=torch.zeros(4, 16, 2, 16),
        value_cache=torch.zeros(4, 16, 2, 16),
        block_table=torch.ones(2, 2, dtype=torch.int32),
        query_start_loc=torch.tensor([0, 1, 3], dtype=torch.int32),
        seq_lens=torch.tensor([5, 2], dtype=torch.int32),
    )


@pytest.mark.parametrize(
    "change, fragment",
    [
        (dict(query=torch.zeros(3, 4)), "query must have 3 dimensions"),
        (dict(query=torch.zeros(3, 4, 16, dtype=torch.float64)), "use one of"),
        (dict(key_cache=torch.zeros(4, 16, 2, 16, dtype=torch.float16)), "key_cache has dtype"),
        (dict(key_cache=torch.zeros(4, 16, 2, 32)), "dimension 3 must be 16"),
        (dict(value_cache=torch.zeros(4, 8, 2, 16)), "value_cache has shape"),
        (dict(query=torch.zeros(3, 3, 16)), "not a multiple"),
        (dict(block_table=torch.ones(2, 2, dtype=torch.int64)), "block_table has dtype"),
        (dict(query_start_loc=torch.tensor([0, 3], dtype=torch.int32)), "query_start_loc"),
        (dict(seq_lens=torch.tensor([5], dtype=torch.int32)), "seq_lens has shape"),
        (dict(query=torch.zeros(3, 16, 4).transpose(1, 2)), "stride 1"),
        (dict(out=torch.zeros(3, 4, 8)), "out has shape"),
        (dict(sinks=torch.zeros(2)), "sinks has shape"),
        (dict(sliding_window=0), "sliding_window must be positive"),
        (dict(softcap=-1.0), "softcap must be positive"),
        (dict(chunk_size=2.5), "chunk_size must be a positive int"),
        (dict(tile_n=48), "tile_n must be a power of two"),
        (dict(tile_n=8), "tile_n must be at least 16"),
        (dict(num_kv_splits=3), "num_kv_splits must be a power of two"),
        (dict(seq_lens=torch.tensor([5, 2], dtype=torch.int32, device="meta")), "meta"),
    ],
)
def test_unified_attention_rejects_bad_arguments(change, fragment):
    args = _valid_attention_args()
    args.update(change)
    with pytest.raises(KernelArgumentError, match=fragment) as error:
        unified_attention(**args)
    assert isinstance(error.value, HybridCacheError) and isinstance(error.value, ValueError)


@pytest.mark.parametrize(
    "change, fragment",
    [
        (dict(slot_mapping=torch.zeros(4, dtype=torch.float32)), "slot_mapping has dtype"),
        (dict(slot_mapping=torch.zeros(3, dtype=torch.int64)), "slot_mapping has shape"),
        (dict(key=torch.zeros(4, 3, 16)), "key has shape"),
        (dict(value=torch.zeros(4, 2, 16, dtype=torch.bfloat16)), "value has dtype"),
        (dict(value_cache=torch.zeros(8, 16, 2, 16).transpose(0, 1)), "value_cache has shape"),
    ],
)
def test_write_kv_cache_rejects_bad_arguments(change, fragment):
    args = dict(
        key=torch.zeros(4, 2, 16),
        value=torch.zeros(4, 2, 16),
        key_cache=torch.zeros(8, 16, 2, 16),
        value_cache=torch.zeros(8, 16, 2, 16),
        slot_mapping=torch.zeros(4, dtype=torch.int64),
    )
    args.update(change)
    with pytest.raises(KernelArgumentError, match=fragment):
        write_kv_cache(**args)
