"""The model runner's decode-only metadata (reused buffers, one native call) matches the general
builder field for field."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hybrid_cache.attention.decode_inputs import DecodeInputBuffers, build_decode_metadata
from hybrid_cache.attention.metadata import build_attention_metadata


@pytest.mark.parametrize("block_sizes", [[16], [16, 16, 16], [16, 32], [8, 16, 8]])
def test_decode_metadata_matches_general_builder(block_sizes: list[int]) -> None:
    rng = np.random.default_rng(0)
    num_rows, width = 12, 40
    # Non-null block ids everywhere a token can land (block 0 is the null block).
    table = rng.integers(1, 1000, size=(len(block_sizes), num_rows, width), dtype=np.int32)
    rows = [7, 2, 11, 0, 5]
    num_computed = [int(n) for n in rng.integers(0, 8 * width, size=len(rows))]
    max_seq_len = max(num_computed) + 1
    general_tables = [
        torch.from_numpy(table[group, rows, : -(-max_seq_len // size)])
        for group, size in enumerate(block_sizes)
    ]
    expected, expected_positions = build_attention_metadata(
        [1] * len(rows), num_computed, general_tables, block_sizes
    )
    metadata, positions = build_decode_metadata(num_computed, rows, table, block_sizes)

    assert torch.equal(positions, expected_positions) and positions.dtype == torch.int64
    for name in ("query_start_loc", "seq_lens"):
        got, want = getattr(metadata, name), getattr(expected, name)
        assert torch.equal(got, want) and got.dtype == want.dtype, name
    assert (metadata.max_query_len, metadata.max_seq_len) == (1, max_seq_len)
    assert expected.max_query_len == 1 and expected.max_seq_len == max_seq_len
    for got, want in zip(metadata.groups, expected.groups, strict=True):
        assert got.block_size == want.block_size
        assert torch.equal(got.block_table, want.block_table)
        assert got.block_table.dtype == want.block_table.dtype
        assert torch.equal(got.slot_mapping, want.slot_mapping)
        assert got.slot_mapping.dtype == want.slot_mapping.dtype


def test_decode_metadata_tables_are_copies() -> None:
    """Backends may write to their table: the core's table must not change."""
    table = np.arange(1, 2 * 4 * 6 + 1, dtype=np.int32).reshape(2, 4, 6)
    before = table.copy()
    metadata, _ = build_decode_metadata([3, 9], [1, 3], table, [4, 4])
    for group in metadata.groups:
        group.block_table.fill_(0)
    assert np.array_equal(table, before)


def test_decode_metadata_rejects_a_null_slot() -> None:
    from hybrid_cache.errors import InvalidBlockError

    table = np.ones((1, 2, 4), dtype=np.int32)
    table[0, 1, 2] = 0
    with pytest.raises(InvalidBlockError, match="group 0, block 2\\) maps to the null block"):
        build_decode_metadata([9], [1], table, [4])


def test_reused_buffers_give_each_step_its_own_metadata_and_grow() -> None:
    """One set of buffers over steps of different sizes (growing past its first capacity)
    gives what fresh buffers give; per-step tensors are new objects each step."""
    rng = np.random.default_rng(1)
    block_sizes = [16, 32]
    table = rng.integers(1, 1000, size=(2, 40, 64), dtype=np.int32)
    buffers = DecodeInputBuffers(block_sizes)
    seen: list[torch.Tensor] = []
    for num_seqs in [3, 1, 17, 40, 0, 5]:
        rows = [int(r) for r in rng.permutation(40)[:num_seqs]]
        num_computed = [int(n) for n in rng.integers(0, 16 * 64, size=num_seqs)]
        metadata, positions = buffers.build(num_computed, rows, table)
        fresh, fresh_positions = build_decode_metadata(num_computed, rows, table, block_sizes)
        assert torch.equal(positions, fresh_positions) and positions.tolist() == num_computed
        assert torch.equal(metadata.seq_lens, fresh.seq_lens)
        assert torch.equal(metadata.query_start_loc, fresh.query_start_loc)
        assert metadata.max_seq_len == fresh.max_seq_len
        for got, want in zip(metadata.groups, fresh.groups, strict=True):
            assert torch.equal(got.block_table, want.block_table)
            assert got.block_table.is_contiguous() and got.slot_mapping.is_contiguous()
            assert torch.equal(got.slot_mapping, want.slot_mapping)
        assert all(positions is not earlier for earlier in seen)
        seen.append(positions)


def test_the_native_decode_inputs_refuse_bad_input() -> None:
    from hybrid_cache._core import decode_inputs_cpu
    from hybrid_cache.errors import InvalidArgumentError

    table = np.arange(1, 2 * 3 * 4 + 1, dtype=np.int32).reshape(2, 3, 4)
    positions, seq_lens = np.full(4, -1, np.int64), np.full(4, -1, np.int32)
    tables, slots = np.full(64, -1, np.int32), np.full(4, -1, np.int64)
    outputs = (positions, seq_lens, tables, slots)
    assert decode_inputs_cpu(table, [2, 0], [9, 0], [4, 4], *outputs) == 10
    assert positions[:2].tolist() == [9, 0] and seq_lens[:2].tolist() == [10, 1]
    assert tables[:12].reshape(2, 2, 3).tolist() == table[:, [2, 0], :3].tolist()
    assert slots.reshape(2, 2).tolist() == (table[:, [2, 0], [2, 0]] * 4 + [1, 0]).tolist()
    assert (tables[12:] == -1).all()
    for bad_rows, bad_computed, match in [
        ([3, 0], [9, 0], "row 3 of sequence 0 is outside the table's 3 rows"),
        ([2, 0], [9, 16], "position 16 of sequence 1 is outside a row of 4 blocks"),
        ([2, 0], [9, -1], "sequence 1 has -1 computed tokens"),
        ([2, 0], [9], "1 computed counts for 2 rows"),
    ]:
        with pytest.raises(InvalidArgumentError, match=match):
            decode_inputs_cpu(table, bad_rows, bad_computed, [4, 4], *outputs)
    with pytest.raises(InvalidArgumentError, match="block_table has 2 groups, block_sizes names 1"):
        decode_inputs_cpu(table, [2, 0], [9, 0], [4], *outputs)
    with pytest.raises(InvalidArgumentError, match="tables and slots must hold 12 and 4 items"):
        decode_inputs_cpu(table, [2, 0], [9, 0], [4, 4], positions, seq_lens, tables[:11], slots)
    with pytest.raises(InvalidArgumentError, match="positions_out overlaps"):
        decode_inputs_cpu(table, [2, 0], [9, 0], [4, 4], positions, seq_lens, tables, positions)
    with pytest.raises(InvalidArgumentError, match="tables_out must be a writable"):
        decode_inputs_cpu(table, [2, 0], [9, 0], [4, 4], positions, seq_lens, tables[::2], slots)
    with pytest.raises(InvalidArgumentError, match="block_table must be C-contiguous"):
        decode_inputs_cpu(table[:, ::-1], [2, 0], [9, 0], [4, 4], *outputs)


def _decode_inputs_run(reuse: bool) -> tuple[list[list[int]], int, int]:
    """Seeded sampling over requests that finish at different steps, one that joins late and
    preempts, and one-token prompts that join as others finish: the tokens, and how many decode steps took their input ids from the last
    step's sampled tokens (`ModelRunner._last_sampled`), and the preemptions. `reuse=False` reads every step's
    input ids from the requests."""
    from hybrid_cache.engine.llm import LLM
    from hybrid_cache.engine.model_runner import ModelRunner
    from hybrid_cache.engine.sampling_params import SamplingParams

    llm = LLM(
        "tiny-llama", load_format="dummy", kv_cache_memory="192KiB", max_model_len=128, seed=3
    )
    runner = llm.engine.model_runner
    prepare = ModelRunner._prepare_inputs
    reused = 0

    def counting(self, requests, rows, num_computed, query_lens, last_sampled=None):
        nonlocal reused
        decode = sum(query_lens) == len(query_lens)
        if last_sampled is not None and decode and len(last_sampled) == len(requests):
            reused += 1
        return prepare(
            self, requests, rows, num_computed, query_lens, last_sampled if reuse else None
        )

    runner._prepare_inputs = counting.__get__(runner)
    generator = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 500, (n,), generator=generator).tolist() for n in (40, 9, 70)]
    engine = llm.engine
    for index, (prompt, max_tokens) in enumerate(zip(prompts, (30, 12, 25))):
        params = SamplingParams(max_tokens=max_tokens, temperature=0.8, seed=index, ignore_eos=True)
        engine.add_request(str(index), prompt, params)
    outputs: dict[str, list[int]] = {}
    joined = 0
    for step in range(400):
        if step == 6:  # joins while the others decode
            late = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)
            engine.add_request("late", prompts[2][:50], late)
        for finished in engine.step():
            outputs[finished.request_id] = list(finished.output_token_ids)
            if joined < 2:
                # A one-token prompt joins as another leaves: the next step is the same size
                # and computes one token per request, but the newcomer's is its prompt's.
                params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
                engine.add_request(f"one{joined}", [17 + joined], params)
                joined += 1
        if not engine.has_unfinished_requests():
            break
    assert engine.kv_cache.num_free_blocks == engine.kv_cache.num_blocks - 1, "blocks leaked"
    return [outputs[key] for key in sorted(outputs)], reused, engine.stats.num_preemptions


def test_decode_steps_take_the_last_sampled_tokens_as_input_only_for_the_same_batch() -> None:
    """A decode step of the batch the last step sampled in full takes those tokens as its input
    ids; batches that changed (a request finished, joined or was preempted) read them from the
    requests. The tokens equal a run that always reads them from the requests."""
    reused_tokens, reused, preemptions = _decode_inputs_run(reuse=True)
    read_tokens, _, _ = _decode_inputs_run(reuse=False)
    assert preemptions > 0, "the pool should be tight enough to preempt"
    assert reused > 10, "decode steps of an unchanged batch should take the sampled tokens"
    assert reused_tokens == read_tokens
    assert [len(tokens) for tokens in reused_tokens] == [30, 12, 25, 20, 8, 8]
