"""The loader: HF folders (single file, sharded, tied), dummy weights, and every malformed folder
ending in a typed error."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
import transformers
from hybrid_cache.attention import attention_layers, build_attention_metadata, set_forward_context
from hybrid_cache.config import apply_hf_overrides, load_hf_config, model_spec_from_hf_config
from hybrid_cache.engine.llm import LLM
from hybrid_cache.engine.sampling_params import SamplingParams
from hybrid_cache.errors import (
    ConfigError,
    HybridCacheError,
    MissingWeightsError,
    ModelNotLocalError,
    UnsupportedQuantizationError,
    UnsupportedWeightFormatError,
)
from hybrid_cache.models import (
    ModelLoadError,
    UnsupportedArchitectureError,
    WeightMismatchError,
    load_model,
)
from hybrid_cache.presets import read_preset

TINY = dict(
    hidden_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=256,
    intermediate_size=128,
)


@pytest.fixture(scope="module")
def llama_folder(tmp_path_factory):
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**TINY))
    folder = tmp_path_factory.mktemp("llama")
    model.save_pretrained(folder)
    return folder, model.eval()


def copy_folder(source, tmp_path, name="copy"):
    target = tmp_path / name
    shutil.copytree(source, target)
    return target


def prefill_logits(model, token_ids: list[int]) -> torch.Tensor:
    """Logits of every prompt position from one paged prefill (block size 4, fresh blocks)."""
    num_blocks = 1 + -(-len(token_ids) // 4)
    table = torch.arange(1, num_blocks, dtype=torch.int32)[None]
    metadata, positions = build_attention_metadata([len(token_ids)], [0], [table], [4])
    parameter = next(model.parameters())
    caches = [
        (
            torch.zeros(num_blocks, 4, 2, 16, dtype=parameter.dtype),
            torch.zeros(num_blocks, 4, 2, 16, dtype=parameter.dtype),
        )
        for _ in range(2)
    ]
    with torch.no_grad(), set_forward_context(metadata, caches):
        return model.compute_logits(model(torch.tensor(token_ids), positions))


def test_loaded_model_reproduces_transformers_logits(llama_folder) -> None:
    folder, hf_model = llama_folder
    ours = load_model(folder)
    tokens = [5, 17, 99, 3, 250, 42, 7]
    with torch.no_grad():
        expected = hf_model(torch.tensor([tokens])).logits[0]
    torch.testing.assert_close(prefill_logits(ours, tokens), expected, rtol=1e-4, atol=1e-4)


def test_sharded_folder_loads_like_single_file(llama_folder, tmp_path) -> None:
    folder, hf_model = llama_folder
    sharded = tmp_path / "sharded"
    hf_model.save_pretrained(sharded, max_shard_size="100KB")
    assert (sharded / "model.safetensors.index.json").is_file()
    assert len(list(sharded.glob("*.safetensors"))) > 1
    single, split = load_model(folder).state_dict(), load_model(sharded).state_dict()
    assert single.keys() == split.keys()
    assert all(torch.equal(single[name], split[name]) for name in single)


def test_sharded_index_naming_a_missing_shard(llama_folder, tmp_path) -> None:
    _, hf_model = llama_folder
    sharded = tmp_path / "sharded"
    hf_model.save_pretrained(sharded, max_shard_size="100KB")
    next(iter(sorted(sharded.glob("*.safetensors")))).unlink()
    with pytest.raises(ModelLoadError, match="do not exist"):
        load_model(sharded)


def test_missing_config(llama_folder, tmp_path) -> None:
    folder = copy_folder(llama_folder[0], tmp_path)
    (folder / "config.json").unlink()
    with pytest.raises(ModelLoadError, match="config.json"):
        load_model(folder)


def test_malformed_config(llama_folder, tmp_path) -> None:
    folder = copy_folder(llama_folder[0], tmp_path)
    (folder / "config.json").write_text("{ not json")
    with pytest.raises(ModelLoadError, match="not valid JSON"):
        load_model(folder)


def test_config_missing_a_shape_field(llama_folder, tmp_path) -> None:
    """A field config.json leaves out takes the class default, as in transformers; when the
    weights disagree, the error names the defaulted field."""
    folder = copy_folder(llama_folder[0], tmp_path)
    config = load_hf_config(folder)
    del config["hidden_size"]
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(WeightMismatchError, match="does not state hidden_size=4096"):
        load_model(folder)


def test_truncated_safetensors(llama_folder, tmp_path) -> None:
    folder = copy_folder(llama_folder[0], tmp_path)
    weights = folder / "model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes(data[: len(data) // 2])
    with pytest.raises(ModelLoadError, match="truncated or corrupt"):
        load_model(folder)


def test_no_weight_files(llama_folder, tmp_path) -> None:
    """A folder with a config and no weights: download them, or run with random weights."""
    folder = copy_folder(llama_folder[0], tmp_path)
    (folder / "model.safetensors").unlink()
    with pytest.raises(MissingWeightsError, match="no weights") as error:
        load_model(folder)
    assert "huggingface-cli download" in str(error.value)
    assert "--load-format dummy" in str(error.value)
    with pytest.raises(MissingWeightsError):
        LLM(str(folder), kv_cache_memory="1MiB", max_model_len=64)
    llm = LLM(str(folder), load_format="dummy", kv_cache_memory="1MiB", max_model_len=64)
    params = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
    (output,) = llm.generate([{"prompt_token_ids": [5, 6, 7]}], params, use_tqdm=False)
    assert len(output.outputs[0].token_ids) == 3


def test_pickle_only_folder(llama_folder, tmp_path) -> None:
    """pytorch_model.bin without safetensors: the error says to convert."""
    folder = copy_folder(llama_folder[0], tmp_path)
    (folder / "model.safetensors").unlink()
    torch.save(llama_folder[1].state_dict(), folder / "pytorch_model.bin")
    with pytest.raises(UnsupportedWeightFormatError, match="pytorch_model.bin") as error:
        load_model(folder)
    assert "save_pretrained" in str(error.value) and "--load-format dummy" in str(error.value)
    (folder / "pytorch_model.bin").rename(folder / "model.gguf")
    with pytest.raises(UnsupportedWeightFormatError, match="GGUF"):
        load_model(folder)


def test_hub_id_is_not_a_folder(llama_folder) -> None:
    """The engine downloads nothing: a Hub id gets the command that downloads it."""
    hint = "huggingface-cli download google/gemma-3-4b-it --local-dir gemma-3-4b-it"
    with pytest.raises(ModelNotLocalError, match=hint) as error:
        load_model("google/gemma-3-4b-it")
    assert isinstance(error.value, ModelLoadError) and isinstance(error.value, ConfigError)
    spec = model_spec_from_hf_config(load_hf_config(llama_folder[0]))
    with pytest.raises(ModelNotLocalError, match="not a local folder"):
        load_model("google/gemma-3-4b-it", spec=spec)
    with pytest.raises(ModelNotLocalError, match=hint):
        LLM("google/gemma-3-4b-it")


def test_unsupported_quantization(llama_folder, tmp_path) -> None:
    folder = copy_folder(llama_folder[0], tmp_path)
    config = load_hf_config(folder)
    config["quantization_config"] = {"quant_method": "fp8", "weight_block_size": [128, 128]}
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(UnsupportedQuantizationError, match="'fp8'.*mxfp4"):
        load_model(folder)
    assert torch.isfinite(prefill_logits(load_model(folder, load_format="dummy"), [1, 2])).all()


def test_shape_mismatch_with_config(llama_folder, tmp_path) -> None:
    folder = copy_folder(llama_folder[0], tmp_path)
    config = load_hf_config(folder)
    config["intermediate_size"] = 96
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(WeightMismatchError, match="mlp"):
        load_model(folder)


def test_missing_tensor(llama_folder, tmp_path) -> None:
    folder = copy_folder(llama_folder[0], tmp_path)
    config = load_hf_config(folder)
    config["num_hidden_layers"] = 3
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(WeightMismatchError, match="lacks"):
        load_model(folder)


def test_unknown_architecture(llama_folder, tmp_path) -> None:
    folder = copy_folder(llama_folder[0], tmp_path)
    config = load_hf_config(folder)
    config["architectures"] = ["FalconForCausalLM"]
    config["model_type"] = "falcon"
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(UnsupportedArchitectureError, match="FalconForCausalLM") as error:
        load_model(folder)
    assert isinstance(error.value, HybridCacheError)


def test_tied_embeddings_share_one_parameter(tmp_path) -> None:
    config = transformers.Gemma2Config(**TINY, head_dim=16, query_pre_attn_scalar=16)
    assert config.tie_word_embeddings
    torch.manual_seed(0)
    transformers.Gemma2ForCausalLM(config).save_pretrained(tmp_path / "gemma2")
    model = load_model(tmp_path / "gemma2")
    assert model.lm_head.weight is model.model.embed_tokens.weight


def test_dummy_weights_are_seeded(llama_folder) -> None:
    config = load_hf_config(llama_folder[0])
    first = load_model(config=config, load_format="dummy", seed=3).state_dict()
    again = load_model(config=config, load_format="dummy", seed=3).state_dict()
    other = load_model(config=config, load_format="dummy", seed=4).state_dict()
    name = "model.layers.0.self_attn.q_proj.weight"
    assert torch.equal(first[name], again[name])
    assert not torch.equal(first[name], other[name])
    assert torch.equal(first["model.norm.weight"], torch.ones(64))
    logits = prefill_logits(load_model(config=config, load_format="dummy"), [1, 2, 3, 4, 5])
    assert torch.isfinite(logits).all()


def test_dtype_option(llama_folder) -> None:
    model = load_model(llama_folder[0], dtype=torch.bfloat16)
    assert {parameter.dtype for parameter in model.parameters()} == {torch.bfloat16}
    assert torch.isfinite(prefill_logits(model, [9, 8, 7])).all()


def test_bad_load_format(llama_folder) -> None:
    with pytest.raises(ModelLoadError, match="load_format"):
        load_model(llama_folder[0], load_format="pt")


def test_multimodal_wrapper_builds_its_text_model() -> None:
    """Gemma-3 12B/27B configs wrap the language model (`Gemma3ForConditionalGeneration` with a
    `text_config`): the text model is built, with the wrapper spec's layer kinds."""
    small = {"num_hidden_layers": 7, "hidden_size": 64, "intermediate_size": 128}
    small |= {"num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 32}
    small |= {"vocab_size": 512, "sliding_window": 16}
    config = apply_hf_overrides(read_preset("gemma-3-12b"), {"text_config": small})
    model = load_model(config=config, load_format="dummy")
    assert type(model).__name__ == "Gemma3ForCausalLM"
    spec = model_spec_from_hf_config(config, name="gemma-3-12b")
    windows = [layer.sliding_window for layer in attention_layers(model)]
    assert windows == [layer.window for layer in spec.layers]
    assert windows.count(None) == 1  # 7 layers, every 6th full
    llm = LLM(
        "gemma-3-12b",
        hf_overrides={"text_config": small},
        kv_cache_memory="8MiB",
        max_model_len=1024,
    )
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    (output,) = llm.generate([{"prompt_token_ids": list(range(3, 60))}], params, use_tqdm=False)
    output.raise_for_error()
    assert len(output.outputs[0].token_ids) == 4
