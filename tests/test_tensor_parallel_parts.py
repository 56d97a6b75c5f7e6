"""The parts of tensor parallelism that need no second process: the per-rank spec and its
checks, the sharded weights (each rank's parameters are exactly its slices of the one-rank
model's, from safetensors slices, MXFP4 pairs and dummy weights), the step's wire form and the
metadata every rank builds from it, the flags, and `hybrid-cache plan --tensor-parallel-size`."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from hybrid_cache.attention.decode_inputs import build_decode_metadata
from hybrid_cache.attention.metadata import build_attention_metadata
from hybrid_cache.cli import main
from hybrid_cache.config import check_tensor_parallel, load_model_spec, per_rank_kv_heads
from hybrid_cache.engine import LLM
from hybrid_cache.engine.engine_config import EngineConfig
from hybrid_cache.engine.parallel.step_inputs import (
    HEADER_FIELDS,
    gather_step_inputs,
    pack,
    sampled_rows,
    step_batch,
    unpack,
)
from hybrid_cache.errors import EngineConfigError, TensorParallelConfigError
from hybrid_cache.models import load_model, parallel_layers
from hybrid_cache.models.parallel_layers import (
    ColumnParallelLinear,
    RowParallelLinear,
    TensorShard,
    VocabParallelEmbedding,
    VocabParallelLMHead,
    padded_vocab_size,
    shard_rule,
)
from hybrid_cache.weight_bytes import rank_weight_bytes
from test_checkpoint_formats import make_mxfp4_gpt_oss
from test_models_vs_hf import make_hf_model
from torch import nn
from torch.nn import functional as F


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
                expected = rule.pad(expected[rule.index()])
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


@pytest.mark.parametrize("name", ["llama3", "gemma2"])  # an untied head, a tied one
@pytest.mark.parametrize("size", [2, 4])
def test_a_padded_vocabulary_loads_its_rows_and_zeros(name: str, size: int, tmp_path) -> None:
    """255 ids: the last rank's rows end with padding (zeros), every other row is the
    checkpoint's."""
    _, folder = make_hf_model(name, tmp_path, vocab_size=255)
    full = load_model(folder)
    assert_shards_slice_the_full_model(full, size, model=folder)
    last = load_model(folder, shard=TensorShard(size - 1, size)).model.embed_tokens.weight
    assert last.shape[0] == 256 // size and not last[-1].any() and last[-2].any()


def vocab_bytes(model: nn.Module) -> tuple[int, int, bool]:
    """Bytes of the embedding and of the LM head, and whether they are one tensor."""
    embedding, head = model.model.embed_tokens.weight, model.lm_head.weight
    return (
        embedding.numel() * embedding.element_size(),
        head.numel() * head.element_size(),
        embedding.data_ptr() == head.data_ptr(),
    )


@pytest.mark.parametrize("preset", ["tiny-llama", "tiny-gemma3"])  # untied, tied
@pytest.mark.parametrize("vocab_size", [512, 509])
def test_each_rank_holds_its_share_of_the_embedding_and_lm_head(
    preset: str, vocab_size: int
) -> None:
    spec = load_model_spec(preset, {"vocab_size": vocab_size})
    tied = spec.tie_word_embeddings
    hidden, element = spec.hidden_size, 4  # float32
    full = vocab_size * hidden * element
    assert vocab_bytes(load_model(spec=spec, load_format="dummy")) == (full, full, tied)
    for size in (2, 4):
        rows = padded_vocab_size(vocab_size, size) // size
        assert rows == -(-vocab_size // size)
        held = []
        for rank in range(size):
            shard = load_model(spec=spec, load_format="dummy", shard=TensorShard(rank, size))
            assert isinstance(shard.model.embed_tokens, VocabParallelEmbedding)
            assert isinstance(shard.lm_head, VocabParallelLMHead)
            assert vocab_bytes(shard) == (rows * hidden * element,) * 2 + (tied,)
            held.append(shard.model.embed_tokens.rows)
            assert_plan_counts_the_weights(spec, size, shard, True)
        assert held == [(rank * rows, (rank + 1) * rows) for rank in range(size)]
        # Replicated: every rank holds the whole vocabulary (a rank's LM head unused but 0's).
        replicated = load_model(
            spec=spec, load_format="dummy", shard=TensorShard(1, size, shard_vocab=False)
        )
        assert vocab_bytes(replicated) == (full, full, tied)
        assert_plan_counts_the_weights(spec, size, replicated, False)


def assert_plan_counts_the_weights(spec, size: int, shard: nn.Module, vocab_parallel: bool) -> None:
    """The planner's per-rank weight bytes: the vocabulary's exactly what the rank holds, the
    total within the norms and biases it leaves out."""
    counted = rank_weight_bytes(spec, size, vocab_parallel)
    embedding, head, tied = vocab_bytes(shard)
    assert counted.vocab == embedding + (0 if tied else head)
    held = sum(p.numel() * p.element_size() for p in shard.parameters())  # the tied one once
    assert 0 <= held - counted.total < 0.05 * held  # tiny models: norms weigh a little


def test_plan_shows_the_weights_of_one_rank(capsys) -> None:
    argv = ["plan", "--model", "gemma-3-27b", "--kv-cache-memory", "20GiB", "--json"]
    figures = {}
    for flags in ([], ["-tp", "2"], ["-tp", "2", "--no-vocab-parallel"]):
        assert main([*argv, *flags]) == 0
        model = json.loads(capsys.readouterr().out)["model"]
        figures[tuple(flags)] = (
            model["weight_bytes_per_rank"],
            model["vocab_weight_bytes_per_rank"],
        )
    whole, vocab = figures[()]
    assert vocab == 262208 * 5376 * 2  # tied, bf16: 2.8 GB
    assert 53e9 < whole < 56e9
    sharded, sharded_vocab = figures[("-tp", "2")]
    assert sharded_vocab == vocab // 2
    replicated, replicated_vocab = figures[("-tp", "2", "--no-vocab-parallel")]
    assert replicated_vocab == vocab and replicated - sharded == vocab // 2
    assert sharded < whole / 2 + 1e8  # norms aside, half of everything
    assert main(["plan", "--model", "tiny-llama", "--kv-cache-memory", "1MiB", "-tp", "2"]) == 0
    text = capsys.readouterr().out
    assert (
        "weights  416.00 KiB per rank besides the budget (embedding and LM head 128.00 KiB, "
        in text
    )


def test_the_padded_logits_are_dropped_and_the_embedding_sums_to_the_full_one(
    monkeypatch,
) -> None:
    """Two ranks' shards of a 509-id vocabulary, their collectives done by hand: the gathered
    logits are the one-rank model's, 509 columns. Every real logit is made negative, so rank
    1's padded column (0: a zero row) would win the argmax if it were kept."""
    spec = load_model_spec("tiny-llama", {"vocab_size": 509})
    full = load_model(spec=spec, load_format="dummy", seed=3)
    with torch.no_grad():
        full.lm_head.weight.copy_(-torch.rand_like(full.lm_head.weight) - 0.1)
    shards = [
        load_model(spec=spec, load_format="dummy", seed=3, shard=TensorShard(rank, 2))
        for rank in range(2)
    ]
    with torch.no_grad():
        for shard in shards:
            rule = shard_rule(shard, "lm_head.weight")
            shard.lm_head.weight.copy_(rule.pad(full.lm_head.weight[rule.index()]))
    hidden = torch.rand(3, spec.hidden_size) + 0.5
    other = F.linear(hidden, shards[1].lm_head.weight)
    assert (other[:, -1] == 0).all() and (full.compute_logits(hidden) < 0).all()
    monkeypatch.setattr(parallel_layers, "gather_to_driver", lambda local: [local, other])
    logits = shards[0].compute_logits(hidden)
    assert logits.shape == (3, 509)
    torch.testing.assert_close(logits, full.compute_logits(hidden))
    assert (logits.argmax(-1) < 509).all()

    ids = torch.tensor([0, 254, 255, 508, 7])  # both sides of the split, the last real id
    monkeypatch.setattr(parallel_layers, "all_reduce", lambda tensor: tensor)
    summed = shards[0].model.embed_tokens(ids) + shards[1].model.embed_tokens(ids)
    assert torch.equal(summed, full.model.embed_tokens(ids))


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
    sample = sampled_rows(lens, [1, 2])
    assert sample == [9, 21]
    inputs = gather_step_inputs(
        tokens, computed, lens, rows, table, block_sizes, [(3, 9)], [2, 3, 4], sample
    )
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
    assert received.prompt_rows.tolist() == [2, 3, 4]
    assert received.sample_rows.tolist() == [9, 21]
    assert_same_metadata(metadata, expected)
    assert positions.tolist() == expected_positions.tolist()

    # A decode step fits inside the header.
    computed = [12, 40, 3]
    inputs = gather_step_inputs([7, 8, 9], computed, [1, 1, 1], rows, table, block_sizes, [])
    header = np.zeros(HEADER_FIELDS + 4096, dtype=np.int32)
    pack(inputs, header)
    received = unpack(header, header[HEADER_FIELDS:].copy())
    assert received.decode and received.query_lens is None
    assert received.sample_rows is None and len(received.prompt_rows) == 0  # every row samples
    assert sampled_rows([1, 1, 1], [0, 1, 2]) is None
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
