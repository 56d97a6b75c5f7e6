"""Each layer's attention (full, or sliding with its window) is the same in transformers, in our
`ModelSpec`, in the model built from that spec, and in the KV-cache plan.

transformers' side is read from its own objects: the config class fills `layer_types` (and, for
Qwen2/3, clears `sliding_window` unless `use_sliding_window`), and the modeling code gives each
attention module `sliding_window = config.sliding_window if layer_types[i] == "sliding_attention"
else None` (Qwen2/3, Gemma-2/3, gpt-oss). Mistral's attention has no such attribute: every layer
gets `config.sliding_window` (its `layer_types`, if any, are ignored), and Llama's none. Models are
built on the meta device, so real-size presets cost nothing.
"""

from __future__ import annotations

import json

import pytest
import torch
import transformers
from hybrid_cache.attention import assign_layer_groups, attention_layers
from hybrid_cache.config import load_model_spec, model_spec_from_hf_config
from hybrid_cache.errors import LayerGroupMismatchError
from hybrid_cache.models import build_model
from hybrid_cache.planner import PlanOptions, plan_kv_cache
from hybrid_cache.presets import preset_names, read_preset
from transformers.models.mistral.modeling_mistral import MistralAttention

Attention = tuple[str, "int | None"]  # ("full", None) or ("sliding_window", W)


def hf_text_config(config: dict) -> transformers.PretrainedConfig:
    """transformers' config object of a config dict (the text part for a multimodal wrapper)."""
    fields = {k: v for k, v in config.items() if k not in ("architectures", "model_type")}
    hf_config = transformers.AutoConfig.for_model(config["model_type"], **fields)
    return hf_config.get_text_config()


def hf_layer_attention(config: dict) -> list[Attention]:
    """Per layer, the attention transformers' model of `config` runs."""
    text_config = hf_text_config(config)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(text_config)
    kinds = []
    for layer in model.model.layers:
        attention = layer.self_attn
        if isinstance(attention, MistralAttention):
            window = getattr(text_config, "sliding_window", None)  # one mask for every layer
        else:
            window = getattr(attention, "sliding_window", None)
        kinds.append(("full", None) if window is None else ("sliding_window", window))
    return kinds


def spec_attention(spec) -> list[Attention]:
    return [(layer.kind, layer.window) for layer in spec.layers]


def model_attention(model) -> list[Attention]:
    return [(layer.kind, layer.reach) for layer in attention_layers(model)]


def plan_for(spec):
    longest = max([layer.window or 0 for layer in spec.layers] + [64])
    options = PlanOptions(kv_cache_memory="1TiB", max_model_len=2 * longest)
    return plan_kv_cache(spec, options)


def planned_attention(spec) -> list[Attention]:
    layout = plan_for(spec)
    kinds = []
    for index in range(spec.num_layers):
        group = layout.groups[layout.layer_slot(index)[0]]
        kinds.append((group.kind, group.window))
    return kinds


def assert_all_agree(config: dict, expected: list[Attention] | None = None) -> None:
    spec = model_spec_from_hf_config(config)
    model = build_model(spec, device="meta")
    theirs = hf_layer_attention(config)
    assert spec_attention(spec) == theirs
    assert model_attention(model) == theirs
    assert planned_attention(spec) == theirs
    layout = plan_for(spec)
    groups = [layout.layer_slot(index)[0] for index in range(spec.num_layers)]
    assign_layer_groups(model, groups, layout.group_attention(), layout.full_accepts_reach)
    if expected is not None:
        assert theirs == expected


@pytest.mark.parametrize("name", preset_names())
def test_every_preset_agrees_with_transformers(name: str) -> None:
    assert_all_agree(read_preset(name))


FULL, SLIDE = ("full", None), ("sliding_window", 8)
TINY = dict(
    hidden_size=64,
    intermediate_size=128,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    vocab_size=128,
    max_position_embeddings=256,
    rms_norm_eps=1e-6,
)


def tiny(architecture: str, model_type: str, **fields) -> dict:
    return {"architectures": [architecture], "model_type": model_type, **TINY, **fields}


SHAPES = {
    # Qwen2/3: layers from max_window_layers on slide, only with use_sliding_window.
    "qwen2-max-window-layers": (
        tiny(
            "Qwen2ForCausalLM",
            "qwen2",
            num_hidden_layers=4,
            use_sliding_window=True,
            sliding_window=8,
            max_window_layers=2,
        ),
        [FULL, FULL, SLIDE, SLIDE],
    ),
    "qwen2-sliding-off": (
        tiny("Qwen2ForCausalLM", "qwen2", num_hidden_layers=3, sliding_window=8),
        [FULL, FULL, FULL],
    ),
    "qwen2-class-default-max-window-layers": (
        tiny(
            "Qwen2ForCausalLM",
            "qwen2",
            num_hidden_layers=30,
            use_sliding_window=True,
            sliding_window=8,
        ),
        [FULL] * 28 + [SLIDE] * 2,
    ),
    "qwen2-layer-types": (
        tiny(
            "Qwen2ForCausalLM",
            "qwen2",
            num_hidden_layers=3,
            use_sliding_window=True,
            sliding_window=8,
            max_window_layers=0,
            layer_types=["sliding_attention", "full_attention", "sliding_attention"],
        ),
        [SLIDE, FULL, SLIDE],
    ),
    "qwen3-max-window-layers": (
        tiny(
            "Qwen3ForCausalLM",
            "qwen3",
            num_hidden_layers=3,
            use_sliding_window=True,
            sliding_window=8,
            max_window_layers=1,
        ),
        [FULL, SLIDE, SLIDE],
    ),
    # Gemma-2 and gpt-oss: even layers slide unless layer_types says otherwise.
    "gemma2-default": (
        tiny(
            "Gemma2ForCausalLM",
            "gemma2",
            num_hidden_layers=4,
            sliding_window=8,
            query_pre_attn_scalar=16,
        ),
        [SLIDE, FULL, SLIDE, FULL],
    ),  # fmt: skip
    "gemma2-layer-types": (
        tiny(
            "Gemma2ForCausalLM",
            "gemma2",
            num_hidden_layers=3,
            sliding_window=8,
            query_pre_attn_scalar=16,
            layer_types=["full_attention", "sliding_attention", "sliding_attention"],
        ),
        [FULL, SLIDE, SLIDE],
    ),  # fmt: skip
    "gpt-oss-default": (
        tiny(
            "GptOssForCausalLM",
            "gpt_oss",
            num_hidden_layers=4,
            sliding_window=8,
            num_local_experts=2,
            num_experts_per_tok=1,
        ),
        [SLIDE, FULL, SLIDE, FULL],
    ),  # fmt: skip
    "gpt-oss-layer-types": (
        tiny(
            "GptOssForCausalLM",
            "gpt_oss",
            num_hidden_layers=3,
            sliding_window=8,
            num_local_experts=2,
            num_experts_per_tok=1,
            layer_types=["full_attention", "full_attention", "sliding_attention"],
        ),
        [FULL, FULL, SLIDE],
    ),  # fmt: skip
    # Gemma-3: every sliding_window_pattern-th layer (default 6) is full, unless layer_types.
    "gemma3-default": (
        tiny(
            "Gemma3ForCausalLM",
            "gemma3_text",
            num_hidden_layers=7,
            sliding_window=8,
            query_pre_attn_scalar=16,
        ),
        [SLIDE] * 5 + [FULL, SLIDE],
    ),  # fmt: skip
    "gemma3-sliding-window-pattern": (
        tiny(
            "Gemma3ForCausalLM",
            "gemma3_text",
            num_hidden_layers=6,
            sliding_window=8,
            query_pre_attn_scalar=16,
            sliding_window_pattern=3,
        ),
        [SLIDE, SLIDE, FULL, SLIDE, SLIDE, FULL],
    ),  # fmt: skip
    "gemma3-layer-types": (
        tiny(
            "Gemma3ForCausalLM",
            "gemma3_text",
            num_hidden_layers=3,
            sliding_window=8,
            query_pre_attn_scalar=16,
            sliding_window_pattern=2,
            layer_types=["full_attention", "sliding_attention", "full_attention"],
        ),
        [FULL, SLIDE, FULL],
    ),  # fmt: skip
    "gemma3-wrapper": (
        {
            "architectures": ["Gemma3ForConditionalGeneration"],
            "model_type": "gemma3",
            "text_config": {
                **TINY,
                "model_type": "gemma3_text",
                "num_hidden_layers": 4,
                "sliding_window": 8,
                "query_pre_attn_scalar": 16,
                "sliding_window_pattern": 2,
            },
        },
        [SLIDE, FULL, SLIDE, FULL],
    ),  # fmt: skip
    # Mistral: one mask for every layer, windowed when sliding_window is set; layer_types ignored.
    "mistral-window": (
        tiny("MistralForCausalLM", "mistral", num_hidden_layers=2, sliding_window=8),
        [SLIDE, SLIDE],
    ),
    "mistral-no-window": (
        tiny("MistralForCausalLM", "mistral", num_hidden_layers=2, sliding_window=None),
        [FULL, FULL],
    ),
    "mistral-layer-types-ignored": (
        tiny(
            "MistralForCausalLM",
            "mistral",
            num_hidden_layers=2,
            sliding_window=8,
            layer_types=["full_attention", "full_attention"],
        ),
        [SLIDE, SLIDE],
    ),
    "llama": (tiny("LlamaForCausalLM", "llama", num_hidden_layers=2), [FULL, FULL]),
}


@pytest.mark.parametrize("shape", list(SHAPES))
def test_config_shapes_agree_with_transformers(shape: str) -> None:
    config, expected = SHAPES[shape]
    assert_all_agree(config, expected)


def test_folder_and_overrides_reach_the_model_through_one_reader(tmp_path) -> None:
    """A folder's config.json and a nested hf_overrides (deep-merged) give the model and the
    planner the same layers."""
    config, _ = SHAPES["gemma3-wrapper"]
    (tmp_path / "config.json").write_text(json.dumps(config))
    overrides = {"text_config": {"sliding_window_pattern": 3}}
    spec = load_model_spec(tmp_path, overrides)
    assert spec.text_config["sliding_window"] == 8  # the rest of text_config kept
    model = build_model(spec, device="meta")
    assert model_attention(model) == spec_attention(spec) == [SLIDE, SLIDE, FULL, SLIDE]


def test_a_layer_outside_its_groups_attention_is_a_typed_error() -> None:
    """The Qwen2 `max_window_layers` shape, with the model giving every layer the window (what
    reading `sliding_window` without `max_window_layers` does): refused when groups are set."""
    config, _ = SHAPES["qwen2-max-window-layers"]
    spec = model_spec_from_hf_config(config)
    model = build_model(spec, device="meta")
    layout = plan_for(spec)
    groups = [layout.layer_slot(index)[0] for index in range(spec.num_layers)]
    attention_layers(model)[0].sliding_window = 8
    with pytest.raises(LayerGroupMismatchError, match="layer 0 attends as sliding_window 8"):
        assign_layer_groups(model, groups, layout.group_attention(), layout.full_accepts_reach)
    assert {layer.group_id for layer in attention_layers(model)} == {0}  # nothing assigned
    # A window covering the whole context is planned as full attention and accepted there.
    attention_layers(model)[0].sliding_window = layout.options.max_model_len
    assign_layer_groups(model, groups, layout.group_attention(), layout.full_accepts_reach)
    assert [layer.group_id for layer in attention_layers(model)] == groups
    with pytest.raises(LayerGroupMismatchError, match="2 group ids for 4 attention layers"):
        assign_layer_groups(model, groups[:2], layout.group_attention())
    with pytest.raises(LayerGroupMismatchError, match="assigned group 5"):
        assign_layer_groups(model, [5, 0, 0, 0], layout.group_attention())


def test_uniform_plans_take_every_layer_into_full_groups() -> None:
    spec = load_model_spec("tiny-gemma2")
    layout = plan_kv_cache(spec, PlanOptions(kv_cache_memory="8MiB", max_model_len=64), "uniform")
    model = build_model(spec, device="meta")
    groups = [layout.layer_slot(index)[0] for index in range(spec.num_layers)]
    assert layout.full_accepts_reach == 1
    assign_layer_groups(model, groups, layout.group_attention(), layout.full_accepts_reach)
    with pytest.raises(LayerGroupMismatchError, match="KV-cache group"):
        assign_layer_groups(model, groups, layout.group_attention())
