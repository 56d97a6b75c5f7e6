"""The vectorised torch backend ("torch") against the per-sequence reference ("reference").

Random paged steps (fresh seed each run, printed on failure): decode rows, prefill chunks on top
of context, whole prompts and sequences with no query this step, mixed in one batch; windows
that are not multiples of the block size and larger than the context; chunked-local attention;
softcap; sinks; GQA ratios 1/2/4; caches that are strided views of a shared tensor. Every page
that is not a visible token (block 0, released pages, the unwritten tail of last blocks) is NaN,
so a backend that lets one reach the softmax or the values fails the comparison.
"""

from __future__ import annotations

import random

import pytest
import torch
from hybrid_cache import _core
from hybrid_cache.attention import (
    attention_layers,
    build_attention_metadata,
    compute_slot_mapping,
    cpu_kernel,
    get_attention_backend,
    reference,
    row_plan,
    torch_batched,
)
from hybrid_cache.attention.params import AttentionParams
from hybrid_cache.attention.selector import (
    AttentionFeatures,
    attention_backends_by_group,
    resolve_attention_backend,
)

HEAD_DIM = 8


def fresh_seed() -> int:
    return random.SystemRandom().randrange(2**31)


KINDS = ("decode", "decode", "chunk", "prompt", "idle")


def random_step(seed, num_heads, num_kv_heads, block_size, window, chunk, num_seqs=7, kinds=KINDS):
    """A paged step of `num_seqs` sequences (kinds drawn at random from `kinds`) in a shuffled
    cache that is a strided view (the K and V halves of one tensor); non-visible pages are NaN.
    The first sequence decodes and the last has at least two queries."""
    generator = torch.Generator().manual_seed(seed)
    draw = random.Random(seed)
    seq_lens, query_lens = [], []
    for _ in range(num_seqs):
        kind = draw.choice(kinds)
        seq_len = draw.randint(1, 45)
        query_len = {
            "decode": 1,
            "chunk": draw.randint(1, seq_len),
            "prompt": seq_len,
            "idle": 0,
        }[kind]
        seq_lens.append(seq_len)
        query_lens.append(query_len)
    query_lens[0], seq_lens[0] = 1, max(seq_lens[0], 2)  # at least one decode row
    query_lens[-1] = max(query_lens[-1], 2)  # and one prefill row
    seq_lens[-1] = max(seq_lens[-1], query_lens[-1])
    max_blocks = max(-(-n // block_size) for n in seq_lens) + 1  # a spare column, left 0
    num_blocks = 1 + num_seqs * max_blocks
    table = torch.zeros(num_seqs, max_blocks, dtype=torch.int32)
    order = 1 + torch.randperm(num_blocks - 1, generator=generator)
    table[:, :-1] = order[: num_seqs * (max_blocks - 1)].view(num_seqs, max_blocks - 1)
    shared = torch.full((num_blocks, block_size, 2 * num_kv_heads, HEAD_DIM), float("nan"))
    k_cache, v_cache = shared[:, :, :num_kv_heads], shared[:, :, num_kv_heads:]
    computed = [n - q for n, q in zip(seq_lens, query_lens)]
    for seq in range(num_seqs):
        for position in range(computed[seq]):
            block = table[seq, position // block_size]
            k_cache[block, position % block_size] = torch.randn(
                num_kv_heads, HEAD_DIM, generator=generator
            )
            v_cache[block, position % block_size] = torch.randn(
                num_kv_heads, HEAD_DIM, generator=generator
            )
        skipped = 0
        if window is not None:
            skipped = max(skipped, computed[seq] - window + 1)
        if chunk is not None:
            skipped = max(skipped, computed[seq] // chunk * chunk)
        released = table[seq, : skipped // block_size].long()
        k_cache[released] = float("nan")
        v_cache[released] = float("nan")
        table[seq, : skipped // block_size] = 0
    metadata, positions = build_attention_metadata(query_lens, computed, [table], [block_size])
    metadata.groups[0].slot_mapping = compute_slot_mapping(
        table, metadata.query_start_loc, positions, block_size
    )
    num_tokens = sum(query_lens)
    new_k = torch.randn(num_tokens, num_kv_heads, HEAD_DIM, generator=generator)
    new_v = torch.randn(num_tokens, num_kv_heads, HEAD_DIM, generator=generator)
    torch_batched.write_kv(k_cache, v_cache, new_k, new_v, metadata.groups[0].slot_mapping)
    q = torch.randn(num_tokens, num_heads, HEAD_DIM, generator=generator) * 2.0
    return q, k_cache, v_cache, metadata


def assert_matches_reference(args, params, seed) -> torch.Tensor:
    """The torch backend's output for `args` / `params`, checked against the reference's."""
    got = torch_batched.paged_attention(*args, params)
    expected = reference.paged_attention(*args, params)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5, msg=f"seed {seed}")
    return got


CASES = [
    # (window, chunk, softcap, sinks)
    (None, None, None, False),
    (5, None, None, False),  # not a multiple of the block size
    (7, None, 3.0, True),
    (200, None, None, False),  # larger than every context
    (None, 6, None, False),
    (None, 8, 2.0, True),
    (None, None, 1.5, True),
]


@pytest.mark.parametrize("kernel", [True, False], ids=["cpu-kernel", "torch-decode"])
@pytest.mark.parametrize("tiled", [True, False], ids=["tiled", "padded"])
@pytest.mark.parametrize("group_ratio", [1, 2, 4])
@pytest.mark.parametrize("block_size", [4, 16])
@pytest.mark.parametrize("window,chunk,softcap,use_sinks", CASES)
def test_matches_the_reference(
    window, chunk, softcap, use_sinks, block_size, group_ratio, tiled, kernel, monkeypatch
):
    """Small windows cut prefill rows into tiles of W queries ("tiled"); larger ones pad each
    sequence's queries on one row ("padded"). One-query rows go to the Rust CPU kernel
    ("cpu-kernel") or through the batched torch ops ("torch-decode")."""
    monkeypatch.setattr(cpu_kernel, "ENABLED", kernel)
    if not tiled:
        monkeypatch.setattr(row_plan, "TILED_MAX_WINDOW", 0)
    seed = fresh_seed()
    num_kv_heads = 2
    num_heads = num_kv_heads * group_ratio
    q, k_cache, v_cache, metadata = random_step(
        seed, num_heads, num_kv_heads, block_size, window, chunk
    )
    sinks = (
        torch.randn(num_heads, generator=torch.Generator().manual_seed(seed)) if use_sinks else None
    )
    args = (q, k_cache, v_cache, metadata, metadata.groups[0])
    params = AttentionParams(
        HEAD_DIM**-0.5, sliding_window=window, softcap=softcap, sinks=sinks, chunk=chunk
    )
    got = assert_matches_reference(args, params, seed)
    assert torch.isfinite(got).all(), f"seed {seed}: a NaN page reached the output"


def test_decode_only_and_prefill_only_steps():
    """Batches with one kind of row only (the decode fast path alone, the padded path alone)."""
    seed = fresh_seed()
    for query_lens, seq_lens in (([1, 1, 1], [9, 30, 2]), ([5, 12], [5, 40])):
        generator = torch.Generator().manual_seed(seed)
        block_size, num_kv_heads, num_heads = 4, 1, 4
        max_blocks = max(-(-n // block_size) for n in seq_lens)
        num_blocks = 1 + len(seq_lens) * max_blocks
        table = (1 + torch.randperm(num_blocks - 1, generator=generator)).view(len(seq_lens), -1)
        table = table.to(torch.int32)
        k_cache = torch.randn(num_blocks, block_size, num_kv_heads, HEAD_DIM, generator=generator)
        v_cache = torch.randn(num_blocks, block_size, num_kv_heads, HEAD_DIM, generator=generator)
        k_cache[0] = v_cache[0] = float("nan")
        computed = [n - q for n, q in zip(seq_lens, query_lens)]
        metadata, _ = build_attention_metadata(query_lens, computed, [table], [block_size])
        q = torch.randn(sum(query_lens), num_heads, HEAD_DIM, generator=generator)
        args = (q, k_cache, v_cache, metadata, metadata.groups[0])
        plan = torch_batched.step_plan(metadata, metadata.groups[0], None, None, q.device)
        assert (plan.decode is None) == (max(query_lens) > 1), f"seed {seed}"
        assert (plan.prefill is None) == (max(query_lens) == 1), f"seed {seed}"
        # A small window: prefill rows are tiles of at most W = 6 queries over at most 2W - 1
        # keys; every query token is in exactly one of them.
        plan = torch_batched.step_plan(metadata, metadata.groups[0], 6, None, q.device)
        rows = [batch for batch in (plan.decode, plan.prefill) if batch is not None]
        assert all(batch.query_rows.shape[1] <= 6 for batch in rows), f"seed {seed}"
        assert all(batch.key_blocks.shape[1] <= 11 for batch in rows), f"seed {seed}"
        covered = torch.cat([batch.geometry.token_rows for batch in rows]).sort().values
        assert covered.tolist() == list(range(sum(query_lens))), f"seed {seed}"
        for window in (None, 6):
            params = AttentionParams(0.3, sliding_window=window)
            assert_matches_reference(args, params, seed)


@pytest.mark.parametrize("fused", [True, False], ids=["fused", "matmuls"])
@pytest.mark.parametrize("kernel", [True, False], ids=["cpu-kernel", "torch-decode"])
@pytest.mark.parametrize("kinds", [("prompt",), KINDS], ids=["prompts", "mixed"])
@pytest.mark.parametrize(
    "window,chunk", [(None, None), (50, None), (5, None), (None, 64), (None, 6)]
)
def test_prefill_rows_match_the_reference(window, chunk, kinds, kernel, fused, monkeypatch):
    """Prefill rows through torch's fused attention or the masked matmuls (every row, whatever
    its length): with a per-row mask, and with the shared causal triangle (fused: no mask at
    all) when every prefill row is a whole prompt that no window or chunk cuts (windows of 50
    and chunks of 64 are longer than every prompt here)."""
    monkeypatch.setattr(cpu_kernel, "ENABLED", kernel)
    monkeypatch.setattr(torch_batched, "FUSED_MIN_KEYS", 1 if fused else 10**9)
    seed = fresh_seed()
    q, k_cache, v_cache, metadata = random_step(seed, 4, 2, 4, window, chunk, kinds=kinds)
    group = metadata.groups[0]
    args = (q, k_cache, v_cache, metadata, group)
    params = AttentionParams(HEAD_DIM**-0.5, sliding_window=window, chunk=chunk)
    assert_matches_reference(args, params, seed)
    if kinds == ("prompt",) and window != 5:
        # Whole prompts (the first sequence decodes): plain causal unless a chunk of 6 cuts one.
        query_lens = metadata.query_start_loc.diff()
        prefill_lens = metadata.seq_lens[query_lens > 1]
        plan = torch_batched.step_plan(metadata, group, window, chunk, q.device)
        expected = chunk != 6 or bool((prefill_lens <= 6).all())
        assert plan.prefill.geometry.causal == expected, f"seed {seed}"


@pytest.mark.parametrize("fused", [True, False], ids=["fused", "matmuls"])
def test_continued_prompts_put_queries_at_their_positions(fused, monkeypatch):
    """Full-attention prefill rows that continue a prompt (keys from position 0, queries after
    earlier steps' tokens) are laid out with query column = position, so the plain causal
    triangle is their mask; once the padding would exceed ALIGNED_MAX_PADDING x the queries,
    they fall back to a per-row mask. Both match the reference."""
    monkeypatch.setattr(torch_batched, "FUSED_MIN_KEYS", 1 if fused else 10**9)
    for kinds in (("chunk", "prompt"), ("decode",)):  # the second: one short prefill row
        seed = fresh_seed()
        q, k_cache, v_cache, metadata = random_step(seed, 4, 2, 4, None, None, kinds=kinds)
        group = metadata.groups[0]
        args = (q, k_cache, v_cache, metadata, group)
        params = AttentionParams(HEAD_DIM**-0.5)
        assert_matches_reference(args, params, seed)
        query_lens = metadata.query_start_loc.diff()
        prefill = query_lens > 1
        plan = torch_batched.step_plan(metadata, group, None, None, q.device).prefill
        longest = int(metadata.seq_lens[prefill].max())
        aligned = longest <= row_plan.ALIGNED_MAX_PADDING * int(query_lens.max())
        assert plan.geometry.causal == aligned, f"seed {seed}"
        if aligned:
            assert plan.geometry.query_rows.shape[1] == longest, f"seed {seed}"


def test_step_plan_is_built_once_per_step_and_group():
    seed = fresh_seed()
    q, k_cache, v_cache, metadata = random_step(seed, 4, 2, 4, 5, None)
    group = metadata.groups[0]
    plan = torch_batched.step_plan(metadata, group, 5, None, q.device)
    # Another layer of the same group and step reuses it; other visibility options do not.
    assert torch_batched.step_plan(metadata, group, 5, None, q.device) is plan
    assert torch_batched.step_plan(metadata, group, 3, None, q.device) is not plan
    # A runner that replaces the block table (a new step's view) gets a fresh plan.
    group.block_table = group.block_table.clone()
    assert torch_batched.step_plan(metadata, group, 5, None, q.device) is not plan


def test_windowed_groups_gather_only_the_window():
    """Decode rows of a windowed group gather W keys, not the whole context."""
    seed = fresh_seed()
    q, k_cache, v_cache, metadata = random_step(seed, 2, 2, 4, 5, None, num_seqs=9)
    plan = torch_batched.step_plan(metadata, metadata.groups[0], 5, None, q.device)
    assert plan.decode is not None
    assert plan.decode.key_blocks.shape[1] <= 5, f"seed {seed}"


def test_registered_as_torch_and_chosen_by_auto_on_the_cpu():
    assert get_attention_backend("torch") is torch_batched
    assert get_attention_backend("reference") is reference
    features = AttentionFeatures(block_size=16, head_dim=64, dtype=torch.float32, sinks=True)
    assert resolve_attention_backend("auto", "cpu", features) == "torch"
    assert resolve_attention_backend("reference", "cpu", features) == "reference"


@pytest.mark.skipif(
    not hasattr(_core, "Coordinator"), reason="the Rust Coordinator binding is not built"
)
# Weight scales that make the greedy tokens vary (Gemma-2's logit softcaps saturate sooner).
@pytest.mark.parametrize("preset,weight_scale", [("tiny-gpt-oss", 12.0), ("tiny-gemma2", 1.0)])
def test_llm_generates_the_reference_tokens(preset, weight_scale):
    """Through the engine: `LLM(..., attention_backend="torch")` against "reference" with a
    6-token window over blocks of 4, crossed by prompts and generation, chunked prefill mixed
    with decode (sinks for gpt-oss, softcap for Gemma-2)."""
    from hybrid_cache import LLM, SamplingParams

    prompts = [[3, 17, 99, 4, 250, 31, 8, 77, 12, 5, 140, 66, 9], [42, 7, 300], [11, 2, 480, 95]]
    overrides = {
        "num_hidden_layers": 2,
        "layer_types": ["sliding_attention", "full_attention"],
        "sliding_window": 6,
    }
    params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    tokens = {}
    for backend in ("reference", "torch"):
        llm = LLM(
            preset,
            load_format="dummy",
            hf_overrides=overrides,
            kv_cache_memory="1MiB",
            max_model_len=64,
            block_size=4,
            max_num_batched_tokens=8,
            max_num_seqs=4,
            device="cpu",
            seed=0,
            attention_backend=backend,
        )
        assert attention_backends_by_group(llm.model) == {0: backend, 1: backend}
        assert {layer.backend for layer in attention_layers(llm.model)} == {backend}
        with torch.no_grad():
            for parameter in llm.model.parameters():
                parameter.mul_(weight_scale)
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        tokens[backend] = [output.token_ids for output in outputs]
    assert tokens["torch"] == tokens["reference"]
    assert all(len(generated) == 10 for generated in tokens["torch"])
    assert sum(len(set(generated)) > 1 for generated in tokens["torch"]) >= 2


def test_caches_whose_blocks_cannot_be_flattened():
    """A view whose block stride is not block_size token strides (padding between blocks) is
    gathered by (block, offset) indexing instead of one flat index_select: same result."""
    seed = fresh_seed()
    q, k_cache, v_cache, metadata = random_step(seed, 4, 2, 4, None, None)  # nothing released
    padded_k = torch.full((k_cache.shape[0], 5, *k_cache.shape[2:]), float("nan"))
    padded_v = torch.full_like(padded_k, float("nan"))
    padded_k[:, :4], padded_v[:, :4] = k_cache, v_cache
    strided_k, strided_v = padded_k[:, :4], padded_v[:, :4]
    with pytest.raises(RuntimeError):
        strided_k.view(-1, *strided_k.shape[2:])
    args = (q, strided_k, strided_v, metadata, metadata.groups[0])
    for window in (None, 7):
        params = AttentionParams(0.35, sliding_window=window)
        assert_matches_reference(args, params, seed)


def test_which_rows_the_cpu_kernel_takes():
    """Every query token goes to the kernel with softcap/sinks, a small window, or >= 4 query
    heads per KV head; otherwise only one-query rows (prefill rows use fused attention)."""
    full = AttentionParams(0.5)
    assert torch_batched._kernel_rows(full, 2) == row_plan.KERNEL_DECODE
    assert torch_batched._kernel_rows(full, 4) == row_plan.KERNEL_ALL
    assert torch_batched._kernel_rows(AttentionParams(0.5, sliding_window=16), 1) == (
        row_plan.KERNEL_ALL
    )
    assert torch_batched._kernel_rows(AttentionParams(0.5, sliding_window=4096), 2) == (
        row_plan.KERNEL_DECODE
    )
    assert torch_batched._kernel_rows(AttentionParams(0.5, softcap=30.0), 1) == row_plan.KERNEL_ALL
