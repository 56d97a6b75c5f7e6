"""Small readers for the fields of a Hugging Face `config.json` that our models need.

Configs on disk come in two generations: transformers >= 5 writes `rope_parameters` (nested by
layer type for Gemma-3), older ones write `rope_theta` + `rope_scaling` (+ Gemma-3's
`rope_local_base_freq`). These helpers accept both so a model file reads one shape.
"""

from __future__ import annotations

from typing import Any

Config = dict[str, Any]

ROPE_TYPES_WITH_ORIGINAL_LENGTH = ("llama3", "yarn", "longrope")


def head_dim(config: Config) -> int:
    """`head_dim` when given (and not null), else hidden_size / num_attention_heads."""
    value = config.get("head_dim")
    return int(value) if value else config["hidden_size"] // config["num_attention_heads"]


def num_kv_heads(config: Config) -> int:
    value = config.get("num_key_value_heads")
    return int(value) if value else int(config["num_attention_heads"])


def layer_types(config: Config, default: str = "full_attention") -> list[str]:
    """Per-layer attention type ("full_attention" / "sliding_attention" / "chunked_attention")."""
    types = config.get("layer_types")
    if types:
        assert len(types) == config["num_hidden_layers"], "layer_types must list every layer"
        return list(types)
    return [default] * config["num_hidden_layers"]


def sliding_window(config: Config) -> int | None:
    """The window of the sliding layers; Qwen2-style `use_sliding_window: false` turns it off."""
    if config.get("use_sliding_window") is False:
        return None
    window = config.get("sliding_window")
    return int(window) if window else None


def rope_parameters(config: Config, layer_type: str | None = None) -> dict[str, Any]:
    """The rotary parameters of `layer_type` (or of every layer), with `rope_type`, `rope_theta`
    and, for scaled types, `original_max_position_embeddings` filled in."""
    params = config.get("rope_parameters")
    if params and layer_type is not None and layer_type in params:
        params = params[layer_type]
    elif params and any(isinstance(value, dict) for value in params.values()):
        params = params.get("full_attention", next(iter(params.values())))
    if not params:
        params = dict(config.get("rope_scaling") or {})
        if layer_type == "sliding_attention" and "rope_local_base_freq" in config:
            params = {"rope_theta": config["rope_local_base_freq"]}
        params.setdefault("rope_theta", config.get("rope_theta", 10000.0))
    params = dict(params)
    params.setdefault("rope_type", params.get("type", "default"))
    if "partial_rotary_factor" in config:
        params.setdefault("partial_rotary_factor", config["partial_rotary_factor"])
    if params["rope_type"] in ROPE_TYPES_WITH_ORIGINAL_LENGTH:
        params.setdefault(
            "original_max_position_embeddings",
            config.get("original_max_position_embeddings", config["max_position_embeddings"]),
        )
    return params
