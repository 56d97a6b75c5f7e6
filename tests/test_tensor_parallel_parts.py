"""The parts of tensor parallelism that need no second process: the per-rank spec and its
checks, the sharded weights (each rank's parameters are exactly its slices of the one-rank
model's, from safetensors slices, MXFP4 pairs and dummy weights), the step's wire form and the
metadata every rank builds from it, the flags, and `hybrid-cache plan --tensor-parallel-size`."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from hybrid_cache.attention.metadata import build_attention_metadata, build_decode_metadata
from hybrid_cache.cli import main
from hybrid_cache.config import check_tensor_parallel, load_model_spec, per_rank_kv_heads
from hybrid_cache.engine import LLM
from hybrid_cache.engine.engine_config import EngineConfig
from hybrid_cache.engine.parallel.step_inputs import (
    HEADER_FIELDS,
    gather_step_inputs,
    pack,
    step_batch,
    unpack,
)
from hybrid_cache.errors import EngineConfigError, TensorParallelConfigError
from hybrid_cache.models import load_model
from hybrid_cache.models.parallel_layers import (
    ColumnParallelLinear,
    RowParallelLinear,
    TensorShard,
    shard_rule,
)
from test_checkpoint_formats import make_mxfp4_gpt_oss
from test_models_vs_hf import make_hf_model
from torch import nn


def test_per_rank_spec_splits_or_replicates_the_kv_heads() -> None:
    spec = load_model_spec("gpt-oss-20b")  # 64 query heads, 8 KV heads
    assert [per_rank_kv_heads(8, size) for size in (1, 2, 8, 16, 64)] == [8, 4, 1, 1, 1]
    for size, heads in ((1, 8), (4, 2), (16, 1)):
        per_rank = spec.per_rank(size)
        assert {layer.num_kv_heads for layer in per_rank.layers} == {heads}
        assert per_rank.tensor_parallel_size == size
        one = spec.layers[0].bytes_per_token()
        assert per_rank.layers[0].bytes_per_token() == one * heads // 8
    assert spec.per_rank(1) is spec


def test_a_size_that_does_not_shard_the_model_is_refused_naming_what_fits() -> None:
    spec = load_model_spec("tiny-llama")  # 4 heads, 2 KV heads, MLP 128
    for size in (1, 2, 4):
        check_tensor_parallel(spec, size)
    with pytest.raises(TensorParallelConfigError, match="num_attention_heads 4.*: 1, 2, 4$"):
        check_tensor_parallel(spec, 3)
    with pytest.raises(TensorParallelConfigError, match="--tensor-parallel-size 3"):
        LLM("tiny-llama", tensor_parallel_size=3, kv_cache_memory="1MiB")  # before any spawn
    with pytest.raises(EngineConfigError, match="--tensor-parallel-size must be a positive"):
        EngineConfig("tiny-llama", tensor_parallel_size=0)
    with pytest.raises(EngineConfigError, match="--distributed-timeout"):
        EngineConfig("tiny-llama", distributed_timeout=0)


def assert_shards_slice_the_full_model(full: nn.Module, size: int, **load) -> None:
    full_parameters = dict(full.named_parameters())
    for rank in range(size):
        shard = load_model(**load, shard=TensorShard(rank, size))
        sharded = 0
        for name, parameter in shard.named_parameters():
            rule = shard_rule(shard, name)
            expected = full_parameters[name]
            if rule is not None:
                assert rule.full_shape == tuple(expected.shape), name
                expected = expected[rule.index()]
                sharded += 1
            torch.testing.assert_close(parameter, expected, rtol=0, atol=0, msg=name)
        assert sharded > 0


@pytest.mark.parametrize("size", [2, 4])
@pytest.mark.parametrize("name", ["qwen2", "gpt_oss"])
def test_each_rank_loads_its_slices_of_the_checkpoint(name: str, size: int, tmp_path) -> None:
    _, folder = make_hf_model(name, tmp_path)
    full = load_model(folder)
    assert_shards_slice_the_full_model(full, size, model=folder)


@pytest.mark.parametrize("size", [2, 4])  # 64 / 2 splits down_proj by whole blocks, 64 / 4 not
def test_mxfp4_experts_shard_like_their_dequantised_weights(size: int, tmp_path) -> None:
    _, folder = make_mxfp4_gpt_oss(tmp_path)
    full = load_model(folder)
    assert_shards_slice_the_full_model(full, size, model=folder)


@pytest.mark.parametrize("preset", ["tiny-gemma3", "tiny-gpt-oss", "tiny-qwen3"])
def test_dummy_weights_of_a_shard_are_the_one_rank_weights_sliced(preset: str) -> None:
    spec = load_model_spec(preset)
    full = load_model(spec=spec, load_format="dummy", seed=7)
    assert_shards_slice_the_full_model(full, 2, spec=spec, load_format="dummy", seed=7)


def test_one_rank_builds_plain_layers_and_a_shard_parallel_ones() -> None:
    spec = load_model_spec("tiny-llama")
    plain = load_model(spec=spec, load_format="dummy")
    layer = plain.model.layers[0]
    assert type(layer.self_attn.q_proj) is nn.Linear and type(layer.mlp.down_proj) is nn.Linear
    shard = load_model(spec=spec, load_format="dummy", shard=TensorShard(1, 2))
    layer = shard.model.layers[0]
    assert isinstance(layer.self_attn.q_proj, ColumnParallelLinear)
    assert isinstance(layer.self_attn.o_proj, RowParallelLinear)
    assert isinstance(layer.mlp.down_proj, RowParallelLinear)
    assert (layer.self_attn.num_heads, layer.self_attn.num_kv_heads) == (2, 1)
    assert shard_rule(shard, "model.layers.0.self_attn.k_proj.weight").start == 16  # head 1


def test_replicated_kv_heads_follow_their_query_heads() -> None:
    """4 query heads over 2 KV heads on 4 ranks: ranks 0-1 read KV head 0, ranks 2-3 head 1
    (query heads 2h and 2h+1 attend with KV head h)."""
    heads = [TensorShard(rank, 4).kv_heads(2) for rank in range(4)]
    assert heads == [(0, 1), (0, 1), (1, 2), (1, 2)]
    assert [TensorShard(rank, 2).kv_heads(8) for rank in range(2)] == [(0, 4), (4, 8)]


def core_table(groups: int, rows: int, width: int) -> np.ndarray:
    generator = np.random.default_rng(0)
    return generator.integers(1, 1000, size=(groups, rows, width), dtype=np.int32)


@pytest.mark.parametrize("block_sizes", [[4, 4], [4, 16]])
def test_a_step_survives_the_wire_and_gives_every_rank_the_runners_metadata(block_sizes) -> None:
    table = core_table(len(block_sizes), 8, 32)
    rows = [5, 1, 3]
    # A mixed step (prefill chunks and a decode token), with block copies.
    computed, lens = [0, 30, 7], [9, 1, 12]
    tokens = list(range(100, 100 + sum(lens)))
    inputs = gather_step_inputs(tokens, computed, lens, rows, table, block_sizes, [(3, 9)])
    header = np.zeros(HEADER_FIELDS + 64, dtype=np.int32)
    payload = pack(inputs, header)
    assert len(payload) > 64  # too long for the header: travels apart
    received = unpack(header, payload.copy())
    ids, metadata, positions = step_batch(received, block_sizes)
    tables = [
        torch.from_numpy(table[g, rows, : -(-max(map(sum, zip(computed, lens))) // size)])
        for g, size in enumerate(block_sizes)
    ]
    expected, expected_positions = build_attention_metadata(lens, computed, tables, block_sizes)
    assert ids.tolist() == tokens
    assert received.block_copies.tolist() == [[3, 9]]
    assert_same_metadata(metadata, expected)
    assert positions.tolist() == expected_positions.tolist()

    # A decode step fits inside the header.
    computed = [12, 40, 3]
    inputs = gather_step_inputs([7, 8, 9], computed, [1, 1, 1], rows, table, block_sizes, [])
    header = np.zeros(HEADER_FIELDS + 4096, dtype=np.int32)
    pack(inputs, header)
    received = unpack(header, header[HEADER_FIELDS:].copy())
    assert received.decode and received.query_lens is None
    ids, metadata, positions = step_batch(received, block_sizes)
    expected, expected_positions = build_decode_metadata(computed, rows, table, block_sizes)
    assert ids.tolist() == [7, 8, 9]
    assert_same_metadata(metadata, expected)
    assert positions.tolist() == expected_positions.tolist() == computed


def assert_same_metadata(ours, expected) -> None:
    assert ours.query_start_loc.tolist() == expected.query_start_loc.tolist()
    assert ours.seq_lens.tolist() == expected.seq_lens.tolist()
    assert (ours.max_query_len, ours.max_seq_len) == (expected.max_query_len, expected.max_seq_len)
    for group, other in zip(ours.groups, expected.groups, strict=True):
        assert group.block_size == other.block_size
        assert group.block_table.tolist() == other.block_table.tolist()
        assert group.slot_mapping.tolist() == other.slot_mapping.tolist()


def test_plan_reports_one_ranks_kv_and_concurrency(capsys) -> None:
    figures = {}
    for size in (1, 2, 4):
        argv = ["plan", "--model", "llama-3.1-8b", "--kv-cache-memory", "8GiB", "--json"]
        assert main([*argv, "--max-model-len", "8192", "--tensor-parallel-size", str(size)]) == 0
        document = json.loads(capsys.readouterr().out)
        assert document["model"]["tensor_parallel_size"] == size
        assert set(document["model"]["kv_heads_per_rank"]) == {8 // size}
        figures[size] = document["hybrid"]
    for size in (2, 4):  # the same budget per device holds `size` times the tokens
        assert figures[size]["page_bytes"] * size == figures[1]["page_bytes"]
        assert (
            figures[size]["report"]["token_capacity"]
            >= size * figures[1]["report"]["token_capacity"] - size
        )
        assert (
            figures[size]["report"]["max_concurrency"]
            >= size * figures[1]["report"]["max_concurrency"]
        )
    assert main(["plan", "--model", "tiny-llama", "--kv-cache-memory", "1MiB", "-tp", "3"]) == 1
    assert "TensorParallelConfigError" in capsys.readouterr().err
    text_argv = ["plan", "--model", "tiny-llama", "--kv-cache-memory", "1MiB", "-tp", "2"]
    assert main(text_argv) == 0
    assert "ranks    2 (tensor parallel): 1 KV heads per rank" in capsys.readouterr().out
