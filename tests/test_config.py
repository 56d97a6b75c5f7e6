"""Model specs from HF configs: every architecture's layer pattern, checked against transformers."""

import json
import warnings

import pytest
from hybrid_cache.config import (
    apply_hf_overrides,
    dtype_num_bytes,
    load_hf_config,
    load_model_spec,
    model_spec_from_hf_config,
    supported_architectures,
)
from hybrid_cache.errors import (
    ConfigError,
    HybridCacheError,
    ModelNotLocalError,
    UnknownArchitectureError,
    UnknownModelError,
)
from hybrid_cache.presets import preset_names, read_preset

REAL_PRESETS = [
    "gemma-2-9b",
    "gemma-2-27b",
    "gemma-3-12b",
    "gemma-3-27b",
    "gpt-oss-20b",
    "gpt-oss-120b",
    "llama-3.1-8b",
    "mistral-7b",
    "qwen2.5-7b",
]
TINY_PRESETS = [
    "tiny-llama",
    "tiny-mistral",
    "tiny-qwen2",
    "tiny-qwen3",
    "tiny-gemma2",
    "tiny-gemma3",
    "tiny-gpt-oss",
]


def kinds(spec):
    return [layer.kind for layer in spec.layers]


def test_presets_are_the_promised_ones():
    assert sorted(REAL_PRESETS + TINY_PRESETS) == preset_names()


@pytest.mark.parametrize("name", REAL_PRESETS + TINY_PRESETS)
def test_every_preset_parses(name):
    spec = load_model_spec(name)
    text = read_preset(name).get("text_config") or read_preset(name)
    assert spec.num_layers == len(spec.layers) == text["num_hidden_layers"]
    assert spec.dtype in ("bfloat16", "float32")
    assert all(layer.num_kv_heads > 0 and layer.head_dim_k > 0 for layer in spec.layers)


def _hf_config(config):
    transformers = pytest.importorskip("transformers")
    config = dict(config)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        hf = transformers.AutoConfig.for_model(config.pop("model_type"), **config)
    return hf, hf.get_text_config()


@pytest.mark.parametrize("name", REAL_PRESETS + TINY_PRESETS)
def test_preset_agrees_with_transformers_config_class(name):
    """The preset is valid for transformers' own config class, and our layer kinds, windows,
    KV heads and head dims are what transformers' model would use."""
    hf, text = _hf_config(read_preset(name))
    spec = load_model_spec(name)
    hf_types = getattr(text, "layer_types", None)
    if hf_types is None:  # Llama and Mistral: one mask for every layer
        hf_types = [
            "sliding_attention" if getattr(text, "sliding_window", None) else "full_attention"
        ] * len(spec.layers)
    expected = ["sliding_window" if t == "sliding_attention" else "full" for t in hf_types]
    assert kinds(spec) == expected
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
    for layer in spec.layers:
        assert layer.num_kv_heads == text.num_key_value_heads
        assert layer.head_dim_k == layer.head_dim_v == head_dim
        assert layer.window == (text.sliding_window if layer.kind == "sliding_window" else None)
    assert spec.vocab_size == text.vocab_size
    assert spec.max_position_embeddings == text.max_position_embeddings


@pytest.mark.parametrize("name", TINY_PRESETS)
def test_tiny_preset_builds_a_transformers_model(name):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    hf, _ = _hf_config(read_preset(name))
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(hf)
    num_params = sum(p.numel() for p in model.parameters())
    assert num_params < 2_000_000, "tiny presets must stay CPU-sized"
    with torch.no_grad():
        logits = model(torch.tensor([[1, 5, 7, 9]])).logits
    assert logits.shape == (1, 4, hf.vocab_size)


def test_real_preset_facts():
    gemma2 = load_model_spec("gemma-2-9b")
    assert kinds(gemma2)[:4] == ["sliding_window", "full", "sliding_window", "full"]
    assert {layer.window for layer in gemma2.layers if layer.kind == "sliding_window"} == {4096}
    gemma3 = load_model_spec("gemma-3-27b")
    assert gemma3.architecture == "Gemma3ForConditionalGeneration"
    assert [i for i, k in enumerate(kinds(gemma3)) if k == "full"] == list(range(5, 62, 6))
    assert gemma3.layers[0].num_kv_heads == 16 and gemma3.layers[0].head_dim_k == 128
    assert gemma3.layers[0].window == 1024 and gemma3.hidden_size == 5376
    oss = load_model_spec("gpt-oss-20b")
    assert oss.attention_sinks and kinds(oss).count("full") == 12
    assert {layer.window for layer in oss.layers} == {128, None}
    assert not load_model_spec("llama-3.1-8b").attention_sinks
    assert set(kinds(load_model_spec("llama-3.1-8b"))) == {"full"}
    assert set(kinds(load_model_spec("qwen2.5-7b"))) == {"full"}
    assert {(layer.kind, layer.window) for layer in load_model_spec("mistral-7b").layers} == {
        ("sliding_window", 4096)
    }


def base(architecture, model_type, **fields):
    return {
        "architectures": [architecture],
        "model_type": model_type,
        "hidden_size": 64,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "num_hidden_layers": 8,
        "vocab_size": 512,
        "max_position_embeddings": 2048,
        "torch_dtype": "bfloat16",
        **fields,
    }


def test_mistral_window_default_and_null():
    # transformers' MistralConfig defaults sliding_window to 4096 when the field is absent.
    assert load_model_spec_dict(base("MistralForCausalLM", "mistral")).layers[0].window == 4096
    spec = load_model_spec_dict(base("MistralForCausalLM", "mistral", sliding_window=None))
    assert set(kinds(spec)) == {"full"}


def test_qwen_sliding_layers_follow_max_window_layers_only_when_enabled():
    config = base("Qwen2ForCausalLM", "qwen2", sliding_window=32, max_window_layers=5)
    assert set(kinds(load_model_spec_dict(config))) == {"full"}  # use_sliding_window defaults off
    spec = load_model_spec_dict({**config, "use_sliding_window": True})
    assert kinds(spec) == ["full"] * 5 + ["sliding_window"] * 3
    typed = {**config, "layer_types": ["sliding_attention"] * 8}
    assert set(kinds(load_model_spec_dict(typed))) == {"full"}, "window off: types do not matter"
    qwen3 = base("Qwen3ForCausalLM", "qwen3", num_key_value_heads=None)
    spec = load_model_spec_dict(qwen3)
    assert spec.layers[0].head_dim_k == 128, "Qwen3Config's head_dim default"
    assert spec.layers[0].num_kv_heads == 4, "null kv heads means one per attention head"


def test_gemma3_older_pattern_field_and_text_config():
    text = base("Gemma3ForCausalLM", "gemma3_text", sliding_window=64, sliding_window_pattern=4)
    text.pop("architectures")
    wrapped = {"architectures": ["Gemma3ForConditionalGeneration"], "model_type": "gemma3"}
    spec = load_model_spec_dict({**wrapped, "text_config": text, "torch_dtype": "float16"})
    assert kinds(spec) == (["sliding_window"] * 3 + ["full"]) * 2
    assert spec.dtype == "bfloat16", "text_config's dtype wins over the wrapper's"
    typed = {**text, "layer_types": ["full_attention"] * 7 + ["sliding_attention"]}
    assert kinds(load_model_spec_dict({**wrapped, "text_config": typed}))[-2:] == [
        "full",
        "sliding_window",
    ]


def test_llama4_chunked_layers_match_transformers():
    config = base("Llama4ForCausalLM", "llama4_text", attention_chunk_size=32, head_dim=16)
    spec = load_model_spec_dict(config)
    assert kinds(spec) == (["chunked_local"] * 3 + ["full"]) * 2
    assert {layer.chunk for layer in spec.layers} == {32, None}
    _, hf_text = _hf_config(config)
    assert [t == "chunked_attention" for t in hf_text.layer_types] == [
        k == "chunked_local" for k in kinds(spec)
    ]
    explicit = load_model_spec_dict({**config, "no_rope_layers": [1, 0] * 4})
    assert kinds(explicit) == ["chunked_local", "full"] * 4
    wrapped = {
        "architectures": ["Llama4ForConditionalGeneration"],
        "model_type": "llama4",
        "text_config": {**config, "attention_chunk_size": None},
    }
    assert set(kinds(load_model_spec_dict(wrapped))) == {"full"}


def test_model_type_alone_is_enough():
    config = base("LlamaForCausalLM", "llama")
    del config["architectures"]
    assert load_model_spec_dict(config).architecture == "LlamaForCausalLM"


def test_overrides_merge_nested_dicts():
    config = read_preset("gemma-3-27b")
    merged = apply_hf_overrides(config, {"text_config": {"sliding_window": 512}})
    assert merged["text_config"]["sliding_window"] == 512
    assert merged["text_config"]["num_hidden_layers"] == 62
    assert config["text_config"]["sliding_window"] == 1024, "the original is not changed"
    spec = load_model_spec("gemma-3-27b", {"text_config": {"sliding_window": 512}})
    assert {layer.window for layer in spec.layers} == {512, None}
    assert load_model_spec("tiny-llama", {"num_hidden_layers": 2}).num_layers == 2


def test_loads_folder_and_file(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(read_preset("tiny-gemma2")))
    from_folder, from_file = load_model_spec(tmp_path), load_model_spec(tmp_path / "config.json")
    assert from_folder.layers == from_file.layers and from_folder.name == str(tmp_path)
    assert kinds(load_model_spec(str(tmp_path))) == kinds(load_model_spec("tiny-gemma2"))


def test_dtype_sizes():
    assert [dtype_num_bytes(d) for d in ("bf16", "float16", "torch.float32", "fp8")] == [2, 2, 4, 1]
    assert "Gemma2ForCausalLM" in supported_architectures()


def load_model_spec_dict(config):
    return model_spec_from_hf_config(config, name="test")


def test_missing_config_json(tmp_path):
    with pytest.raises(ConfigError, match="has no config.json"):
        load_hf_config(tmp_path)


def test_malformed_config_json(tmp_path):
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ConfigError, match="JSON"):
        load_model_spec(tmp_path)
    (tmp_path / "config.json").write_text("[1, 2]")
    with pytest.raises(ConfigError, match="JSON object"):
        load_model_spec(tmp_path)


def test_unknown_preset_lists_the_known_ones():
    with pytest.raises(UnknownModelError, match="gemma-3-27b.*tiny-llama") as caught:
        load_model_spec("gemma-9-1t")
    assert isinstance(caught.value, (ValueError, HybridCacheError))


def test_unknown_architecture_lists_the_supported_ones():
    with pytest.raises(UnknownArchitectureError, match="GptOssForCausalLM"):
        load_model_spec_dict(base("BertModel", "bert"))


@pytest.mark.parametrize(
    ("fields", "match"),
    [
        ({"num_hidden_layers": 0}, "num_hidden_layers"),
        ({"num_attention_heads": "4"}, "num_attention_heads"),
        ({"head_dim": -8}, "head_dim"),
        ({"torch_dtype": "int3"}, "unknown dtype"),
        ({"layer_types": ["full_attention"] * 3}, "one type per layer"),
        ({"layer_types": ["linear_attention"] * 8}, "linear_attention"),
        ({"sliding_window": 0}, "sliding_window"),
        ({"use_bidirectional_attention": True}, "bidirectional"),
        ({"architectures": "Gemma2ForCausalLM"}, "must be a list"),
    ],
)
def test_bad_fields_raise_config_error(fields, match):
    with pytest.raises(ConfigError, match=match):
        load_model_spec_dict(base("Gemma2ForCausalLM", "gemma2", **fields))


def test_overrides_must_be_a_mapping():
    with pytest.raises(ConfigError):
        load_model_spec("tiny-llama", ["num_hidden_layers", 2])


BUILT_MODEL_TYPES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "Gemma2ForCausalLM": "gemma2",
    "Gemma3ForCausalLM": "gemma3_text",
    "GptOssForCausalLM": "gpt_oss",
}


@pytest.mark.parametrize("architecture", list(BUILT_MODEL_TYPES))
def test_fields_a_config_leaves_out_take_transformers_class_defaults(architecture):
    """Published configs omit fields at their class default (gemma-3-4b-it states 6 text
    fields): the spec's text_config holds transformers' default for each field a model reads,
    the rotary parameters of every layer type and the embedding tie included."""
    transformers = pytest.importorskip("transformers")
    rotary = pytest.importorskip("hybrid_cache.models.rotary")
    spec = model_spec_from_hf_config({"architectures": [architecture]})
    hf = transformers.AutoConfig.for_model(BUILT_MODEL_TYPES[architecture])
    assert "rms_norm_eps" in spec.defaulted_fields and "intermediate_size" in spec.defaulted_fields
    for key in spec.defaulted_fields:
        if key in ("rope_theta", "rope_local_base_freq", "rope_scaling"):
            continue  # checked as the rotary parameters below
        if key == "sliding_window" and not spec.text_config.get("use_sliding_window", True):
            continue  # Qwen's config object nulls it; the planner reads use_sliding_window
        assert spec.text_config[key] == getattr(hf, key), key
    assert spec.tie_word_embeddings == hf.tie_word_embeddings
    for layer_type in set(getattr(hf, "layer_types", None) or ["full_attention"]):
        theirs = hf.rope_parameters.get(layer_type, hf.rope_parameters)
        ours = rotary.rope_parameters(spec.text_config, layer_type)
        assert {key: ours.get(key) for key in theirs} == theirs, layer_type


def test_a_wrapper_ties_by_its_own_field():
    text = {"hidden_size": 64, "num_hidden_layers": 2, "tie_word_embeddings": False}
    wrapper = {"architectures": ["Gemma3ForConditionalGeneration"], "text_config": text}
    assert model_spec_from_hf_config(wrapper).tie_word_embeddings  # Gemma3Config's default
    assert not model_spec_from_hf_config(
        {**wrapper, "tie_word_embeddings": False}
    ).tie_word_embeddings


def test_a_hub_id_is_no_local_folder():
    with pytest.raises(ModelNotLocalError, match="huggingface-cli download google/gemma-3-4b-it"):
        load_model_spec("google/gemma-3-4b-it")
    with pytest.raises(UnknownModelError, match="preset"):
        load_model_spec("gemma-9-1t")  # no slash: a mistyped preset name
