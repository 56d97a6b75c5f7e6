"""Model specs from a Hugging Face `config.json`: what the planner and the engine need to know.

The one reader of model configs: `load_hf_config` (folder, `config.json` or preset),
`apply_hf_overrides` (the deep merge of `hf_overrides`) and `model_spec_from_hf_config`. The
`ModelSpec` it makes is the only source of each layer's attention kind, window, chunk size and
sinks: the planner plans from it and every model in `models/` is built from it, so the KV cache
and the attention layers cannot disagree. Field names and defaults follow transformers' own config classes (checked against
transformers 5.24): a field missing from `config.json` takes the class default, exactly as
`AutoConfig` would, so a model built by transformers and our plan agree layer for layer.
transformers itself is not imported: planning must work on a machine without it.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Literal, Mapping, Optional, Union

from hybrid_cache.errors import (
    ConfigError,
    ModelNotLocalError,
    TensorParallelConfigError,
    UnknownArchitectureError,
    UnknownModelError,
)
from hybrid_cache.presets import preset_names, read_preset

AttentionKind = Literal["full", "sliding_window", "chunked_local"]

# How weights are loaded: "auto" reads the folder's safetensors, "dummy" draws seeded random
# weights (the loader and the engine's flag check both read this).
LOAD_FORMATS: tuple[str, ...] = ("auto", "dummy")
_DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2, "float8_e4m3fn": 1, "float8_e5m2": 1}
_DTYPE_ALIASES = {
    "fp32": "float32",
    "float": "float32",
    "fp16": "float16",
    "half": "float16",
    "bf16": "bfloat16",
    "fp8": "float8_e4m3fn",
    "fp8_e4m3": "float8_e4m3fn",
    "fp8_e5m2": "float8_e5m2",
}


def normalize_dtype(name: str) -> str:
    """Canonical dtype name (`bfloat16`, `float16`, `float32`, `float8_e4m3fn`, `float8_e5m2`)."""
    text = str(name).lower().removeprefix("torch.")
    text = _DTYPE_ALIASES.get(text, text)
    if text not in _DTYPE_BYTES:
        known = ", ".join(sorted(_DTYPE_BYTES) + sorted(_DTYPE_ALIASES))
        raise ConfigError(f"unknown dtype {name!r}: use one of {known}")
    return text


def dtype_num_bytes(name: str) -> int:
    """Bytes per element of a dtype (any name `normalize_dtype` accepts)."""
    return _DTYPE_BYTES[normalize_dtype(name)]


@dataclass(frozen=True)
class LayerSpec:
    """One attention layer's KV-cache needs. `window` is set for sliding_window layers only
    (a query at position i sees positions i-window+1..i), `chunk` for chunked_local only.
    `hf_layer_type` is transformers' name for the layer's type ("full_attention",
    "sliding_attention", ...; Gemma-3 keys its rotary parameters by it)."""

    kind: AttentionKind
    num_kv_heads: int
    head_dim_k: int
    head_dim_v: int
    dtype: str
    window: Optional[int] = None
    chunk: Optional[int] = None
    hf_layer_type: Optional[str] = field(default=None, compare=False)

    @property
    def reach(self) -> Optional[int]:
        """The window or chunk (None for full attention)."""
        return self.window if self.kind == "sliding_window" else self.chunk

    def bytes_per_token(self, kv_cache_dtype: Optional[str] = None) -> int:
        """KV bytes one token takes in this layer (K and V), in the cache dtype if given."""
        element_bytes = dtype_num_bytes(kv_cache_dtype or self.dtype)
        return self.num_kv_heads * (self.head_dim_k + self.head_dim_v) * element_bytes


@dataclass(frozen=True)
class ModelSpec:
    """Per-layer KV specs plus the model facts the engine needs. `hf_config` is the full config
    after overrides (to build the transformers config/model); `text_config` the part describing
    the language model (the whole config for text-only models) with transformers' class default
    filled in for every field of the architecture's table that config.json leaves out (published
    configs omit them: gemma-3-4b-it states 6 text fields); `defaulted_fields` names those.
    `tie_word_embeddings`: `lm_head` is the input embedding (the wrapper's own field for a
    multimodal wrapper, as transformers ties). `tensor_parallel_size`: 1, or N for the spec of
    one rank of N (`per_rank`): its layers hold that rank's share of the KV heads."""

    name: str
    architecture: str
    model_type: str
    num_layers: int
    hidden_size: int
    num_attention_heads: int
    vocab_size: int
    max_position_embeddings: int
    dtype: str
    layers: tuple[LayerSpec, ...]
    attention_sinks: bool
    hf_config: dict[str, Any] = field(compare=False, hash=False, repr=False)
    text_config: dict[str, Any] = field(compare=False, hash=False, repr=False)
    tie_word_embeddings: bool = False
    defaulted_fields: tuple[str, ...] = field(default=(), compare=False)
    tensor_parallel_size: int = 1

    @property
    def text_architecture(self) -> str:
        """The architecture the language model is built as: `architecture` itself, or for a
        multimodal wrapper (Gemma-3 4B/12B/27B) the text-only architecture it wraps."""
        return TEXT_CONFIG_WRAPPERS.get(self.architecture, self.architecture)

    @property
    def quant_method(self) -> Optional[str]:
        """`quantization_config.quant_method` of config.json ("mxfp4" for gpt-oss), or None."""
        quantization = self.hf_config.get("quantization_config") or {}
        method = quantization.get("quant_method") if isinstance(quantization, Mapping) else None
        return None if method is None else str(method)

    def per_rank(self, tensor_parallel_size: int) -> ModelSpec:
        """The spec of one rank of `tensor_parallel_size` (the planner's input under tensor
        parallelism): each layer keeps `per_rank_kv_heads` KV heads, so a rank's page, and the
        bytes of a token on one device, are 1/N of the model's (or 1/kv_heads when the heads
        are replicated). `self` for 1. Call `check_tensor_parallel` first."""
        if tensor_parallel_size == 1:
            return self
        layers = tuple(
            dataclasses.replace(
                layer, num_kv_heads=per_rank_kv_heads(layer.num_kv_heads, tensor_parallel_size)
            )
            for layer in self.layers
        )
        return dataclasses.replace(self, layers=layers, tensor_parallel_size=tensor_parallel_size)


def per_rank_kv_heads(num_kv_heads: int, tensor_parallel_size: int) -> int:
    """KV heads one rank holds: `num_kv_heads / N`, or 1 when there are fewer KV heads than
    ranks (each head replicated on `N / num_kv_heads` ranks, as vLLM does)."""
    return max(1, num_kv_heads // tensor_parallel_size)


def tensor_parallel_problems(spec: ModelSpec, tensor_parallel_size: int) -> list[str]:
    """Why `spec` cannot be sharded over `tensor_parallel_size` ranks (empty when it can): the
    query heads must split evenly, the KV heads split evenly or replicate evenly, and the MLP
    width (gpt-oss: each expert's) split evenly."""
    size = tensor_parallel_size
    problems = []
    if spec.num_attention_heads % size:
        problems.append(f"num_attention_heads {spec.num_attention_heads}")
    for kv_heads in sorted({layer.num_kv_heads for layer in spec.layers}):
        if kv_heads % size and size % kv_heads:
            problems.append(f"num_key_value_heads {kv_heads} (nor is N a multiple of it)")
    intermediate = spec.text_config.get("intermediate_size")
    if isinstance(intermediate, int) and intermediate % size:
        problems.append(f"intermediate_size {intermediate}")
    return problems


def check_tensor_parallel(spec: ModelSpec, tensor_parallel_size: int, hint: str = "") -> None:
    """`TensorParallelConfigError` when `spec` cannot be sharded over `tensor_parallel_size`
    ranks, listing the sizes that can (`hint`: how the caller names the argument)."""
    problems = tensor_parallel_problems(spec, tensor_parallel_size)
    if not problems:
        return
    fits = [size for size in range(1, 65) if not tensor_parallel_problems(spec, size)]
    raise TensorParallelConfigError(
        f"--tensor-parallel-size {tensor_parallel_size} does not divide {spec.name}'s "
        f"{', '.join(problems)}{hint}; sizes that shard it: {', '.join(map(str, fits))}"
    )


# ---------------------------------------------------------------------------------------------
# Architecture rules: HF class defaults for the fields we read, and how each one assigns layers.


def _all_full(config: Mapping[str, Any], read: Callable[[str], Any]) -> list[str]:
    return ["full_attention"] * read("num_hidden_layers")


def _mistral_layers(config: Mapping[str, Any], read: Callable[[str], Any]) -> list[str]:
    # MistralModel ignores `layer_types`: one mask for all layers, windowed when the window is set.
    kind = "sliding_attention" if read("sliding_window") is not None else "full_attention"
    return [kind] * read("num_hidden_layers")


def _qwen_layers(config: Mapping[str, Any], read: Callable[[str], Any]) -> list[str]:
    # Qwen2/3: layers from `max_window_layers` on slide, and only when `use_sliding_window` is on.
    if read("layer_types") is not None:
        return list(read("layer_types"))
    sliding = read("use_sliding_window") and read("sliding_window") is not None
    first_sliding = read("max_window_layers")
    return [
        "sliding_attention" if sliding and index >= first_sliding else "full_attention"
        for index in range(read("num_hidden_layers"))
    ]


def _every_nth_full(
    pattern: Optional[int],
) -> Callable[[Mapping[str, Any], Callable[[str], Any]], list[str]]:
    """Layer i is full when (i + 1) % pattern == 0, else sliding: Gemma-2 and gpt-oss use 2
    (even layers slide); None reads Gemma-3's `sliding_window_pattern` (default 6: layers
    5, 11, ... are global, the 5 before each are local)."""

    def layers(config: Mapping[str, Any], read: Callable[[str], Any]) -> list[str]:
        if read("layer_types") is not None:
            return list(read("layer_types"))
        period = pattern if pattern is not None else config.get("sliding_window_pattern", 6)
        if not isinstance(period, int) or period < 1:
            raise ConfigError(f"sliding_window_pattern must be a positive integer, got {period!r}")
        return [
            "full_attention" if (index + 1) % period == 0 else "sliding_attention"
            for index in range(read("num_hidden_layers"))
        ]

    return layers


def _llama4_layers(config: Mapping[str, Any], read: Callable[[str], Any]) -> list[str]:
    # Llama-4: `no_rope_layers[i] == 1` means layer i *uses* RoPE; those layers are chunked.
    if read("layer_types") is not None:
        return list(read("layer_types"))
    num_layers = read("num_hidden_layers")
    uses_rope = read("no_rope_layers") or [
        int((index + 1) % read("no_rope_layer_interval") != 0) for index in range(num_layers)
    ]
    chunked = read("attention_chunk_size") is not None
    return ["chunked_attention" if rope and chunked else "full_attention" for rope in uses_rope]


@dataclass(frozen=True)
class _Architecture:
    model_type: str
    defaults: dict[str, Any]
    layer_types: Callable[[Mapping[str, Any], Callable[[str], Any]], list[str]]
    uses_text_config: bool = False
    attention_sinks: bool = False


# Besides the planner's fields, each table holds the class defaults of the fields the model files
# read (norm eps, MLP size and activation, biases, softcaps, rotary base, experts): a config that
# leaves one out gets it in `ModelSpec.text_config`, as `AutoConfig` would give it.
_COMMON = {"num_key_value_heads": None, "head_dim": None, "layer_types": None}
_BUILT = {
    **_COMMON,
    "rms_norm_eps": 1e-6,
    "rope_theta": 10_000.0,
    "tie_word_embeddings": False,
}
_LLAMA = {
    **_BUILT,
    "hidden_act": "silu",
    "vocab_size": 32000,
    "hidden_size": 4096,
    "intermediate_size": 11008,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "max_position_embeddings": 2048,
}
_QWEN = {
    **_BUILT,
    "hidden_act": "silu",
    "vocab_size": 151936,
    "hidden_size": 4096,
    "intermediate_size": 22016,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 32,
    "max_position_embeddings": 32768,
    "use_sliding_window": False,
    "sliding_window": 4096,
    "max_window_layers": 28,
}
_GEMMA = {
    **_BUILT,
    "hidden_size": 2304,
    "intermediate_size": 9216,
    "hidden_activation": "gelu_pytorch_tanh",
    "num_hidden_layers": 26,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "head_dim": 256,
    "sliding_window": 4096,
    "query_pre_attn_scalar": 256,
    "attention_bias": False,
    "tie_word_embeddings": True,
}
_LLAMA4 = {
    **_COMMON,
    "vocab_size": 202048,
    "hidden_size": 5120,
    "num_hidden_layers": 48,
    "num_attention_heads": 40,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "max_position_embeddings": 4096 * 32,
    "no_rope_layers": None,
    "no_rope_layer_interval": 4,
    "attention_chunk_size": 8192,
}
_ARCHITECTURES: dict[str, _Architecture] = {
    "LlamaForCausalLM": _Architecture(
        "llama", {**_LLAMA, "attention_bias": False, "mlp_bias": False}, _all_full
    ),
    "MistralForCausalLM": _Architecture(
        "mistral",
        {
            **_LLAMA,
            "intermediate_size": 14336,
            "num_key_value_heads": 8,
            "max_position_embeddings": 4096 * 32,
            "sliding_window": 4096,
        },
        _mistral_layers,
    ),
    "Qwen2ForCausalLM": _Architecture("qwen2", _QWEN, _qwen_layers),
    "Qwen3ForCausalLM": _Architecture(
        "qwen3", {**_QWEN, "head_dim": 128, "attention_bias": False}, _qwen_layers
    ),
    "Gemma2ForCausalLM": _Architecture(
        "gemma2",
        {
            **_GEMMA,
            "vocab_size": 256000,
            "max_position_embeddings": 8192,
            "final_logit_softcapping": 30.0,
            "attn_logit_softcapping": 50.0,
        },
        _every_nth_full(2),
    ),
    "Gemma3ForCausalLM": _Architecture(
        "gemma3_text",
        {
            **_GEMMA,
            "vocab_size": 262_208,
            "max_position_embeddings": 131_072,
            # Older configs' rotary fields: global layers' base, local (sliding) layers' base.
            "rope_theta": 1_000_000.0,
            "rope_local_base_freq": 10_000.0,
        },
        _every_nth_full(None),
    ),
    "GptOssForCausalLM": _Architecture(
        "gpt_oss",
        {
            **_BUILT,
            "vocab_size": 201088,
            "hidden_size": 2880,
            "intermediate_size": 2880,
            "num_hidden_layers": 36,
            "num_attention_heads": 64,
            "num_key_value_heads": 8,
            "head_dim": 64,
            "max_position_embeddings": 131072,
            "sliding_window": 128,
            "rms_norm_eps": 1e-5,
            "attention_bias": True,
            "rope_theta": 150_000.0,
            "rope_scaling": {
                "rope_type": "yarn",
                "factor": 32.0,
                "beta_fast": 32.0,
                "beta_slow": 1.0,
                "truncate": False,
                "original_max_position_embeddings": 4096,
            },
            "num_local_experts": 128,
            "num_experts_per_tok": 4,
            "swiglu_alpha": 1.702,
            "swiglu_limit": 7.0,
        },
        _every_nth_full(2),
        attention_sinks=True,
    ),
    "Llama4ForCausalLM": _Architecture("llama4_text", _LLAMA4, _llama4_layers),
}
# Multimodal wrappers: the language model is described by `text_config` and built as the
# text-only architecture named here (the planner reads it; `models.loader` builds it).
TEXT_CONFIG_WRAPPERS = {
    "Gemma3ForConditionalGeneration": "Gemma3ForCausalLM",
    "Llama4ForConditionalGeneration": "Llama4ForCausalLM",
}
_MODEL_TYPES = {
    **{rules.model_type: name for name, rules in _ARCHITECTURES.items()},
    "gemma3": "Gemma3ForConditionalGeneration",
    "llama4": "Llama4ForConditionalGeneration",
}
_HF_LAYER_KINDS: dict[str, AttentionKind] = {
    "full_attention": "full",
    "attention": "full",  # legacy name transformers still remaps to full_attention
    "sliding_attention": "sliding_window",
    "chunked_attention": "chunked_local",
}


def supported_architectures() -> list[str]:
    """Architecture names (`config.json` "architectures") this module can read."""
    return sorted([*_ARCHITECTURES, *TEXT_CONFIG_WRAPPERS])


# ---------------------------------------------------------------------------------------------
# Loading.


def load_hf_config(model: Union[str, os.PathLike]) -> dict[str, Any]:
    """The config dict of a local model folder, a `config.json` path, or a built-in preset."""
    path = Path(model)
    if path.is_dir():
        path = path / "config.json"
        if not path.is_file():
            raise ConfigError(f"model folder {str(model)!r} has no config.json")
    if path.is_file():
        try:
            config = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
            raise ConfigError(f"cannot read {str(path)!r}: not valid JSON ({error})") from error
        if not isinstance(config, dict):
            raise ConfigError(f"{str(path)!r} must hold a JSON object, not {type(config).__name__}")
        return config
    preset = read_preset(str(model))
    if preset is None and ("/" in str(model) or os.sep in str(model)):
        raise not_local_error(model)
    if preset is None:
        raise UnknownModelError(
            f"{str(model)!r} is neither a folder with a config.json nor a built-in preset; "
            f"presets: {', '.join(preset_names())}"
        )
    return preset


def not_local_error(model: Union[str, os.PathLike]) -> ModelNotLocalError:
    """The error for a model name that is no local folder (a Hub id, a mistyped path)."""
    return ModelNotLocalError(
        f"{str(model)!r} is not a local folder: the engine reads local folders only and "
        "downloads nothing. If it is a Hugging Face Hub id, download it first, e.g. "
        f"`huggingface-cli download {model} --local-dir {Path(str(model)).name}`, "
        "and pass that folder's path"
    )


def apply_hf_overrides(config: Mapping[str, Any], overrides: Mapping[str, Any]) -> dict[str, Any]:
    """A copy of `config` with `overrides` merged in; nested dicts (e.g. `text_config`) merge
    key by key, so `{"text_config": {"sliding_window": 512}}` changes only the window."""
    if not isinstance(overrides, Mapping):
        raise ConfigError(f"hf_overrides must be a JSON object, got {type(overrides).__name__}")
    merged = dict(config)
    for key, value in overrides.items():
        if isinstance(value, Mapping) and isinstance(merged.get(key), Mapping):
            merged[key] = apply_hf_overrides(merged[key], value)
        else:
            merged[key] = value
    return merged


def load_model_spec(
    model: Union[str, os.PathLike], hf_overrides: Optional[Mapping[str, Any]] = None
) -> ModelSpec:
    """Reads a folder, `config.json` path or preset, applies overrides, and derives the spec."""
    config = load_hf_config(model)
    if hf_overrides:
        config = apply_hf_overrides(config, hf_overrides)
    return model_spec_from_hf_config(config, name=str(model))


def _architecture_name(config: Mapping[str, Any]) -> str:
    architectures = config.get("architectures") or []
    if not isinstance(architectures, list):
        raise ConfigError(f"'architectures' must be a list, got {architectures!r}")
    for name in architectures:
        if name in _ARCHITECTURES or name in TEXT_CONFIG_WRAPPERS:
            return name
    model_type = config.get("model_type")
    if not architectures and model_type in _MODEL_TYPES:
        return _MODEL_TYPES[model_type]
    found = architectures or f"model_type {model_type!r}"
    raise UnknownArchitectureError(
        f"unsupported architecture {found}; supported: {', '.join(supported_architectures())}"
    )


def _positive_int(value: Any, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ConfigError(f"config field {name!r} must be a positive integer, got {value!r}")
    return value


def model_spec_from_hf_config(config: Mapping[str, Any], name: str = "<config>") -> ModelSpec:
    """Derives the per-layer KV specs of a config dict (see the module docstring for defaults)."""
    architecture = _architecture_name(config)
    text_config: Mapping[str, Any] = config
    if architecture in TEXT_CONFIG_WRAPPERS:
        text_config = config.get("text_config") or {}
        if not isinstance(text_config, Mapping):
            raise ConfigError(f"'text_config' must be a JSON object, got {text_config!r}")
    rules = _ARCHITECTURES[TEXT_CONFIG_WRAPPERS.get(architecture, architecture)]

    def read(key: str) -> Any:
        return text_config[key] if key in text_config else rules.defaults.get(key)

    if text_config.get("use_bidirectional_attention"):
        raise ConfigError(
            "use_bidirectional_attention=true configs (embedding models) cannot generate; "
            "override it with --hf-overrides '{\"use_bidirectional_attention\": false}'"
        )
    num_layers = _positive_int(read("num_hidden_layers"), "num_hidden_layers")
    hidden_size = _positive_int(read("hidden_size"), "hidden_size")
    num_heads = _positive_int(read("num_attention_heads"), "num_attention_heads")
    num_kv_heads = _positive_int(read("num_key_value_heads") or num_heads, "num_key_value_heads")
    head_dim = _positive_int(read("head_dim") or hidden_size // num_heads, "head_dim")
    raw_dtype = text_config.get("dtype") or text_config.get("torch_dtype")
    raw_dtype = raw_dtype or config.get("dtype") or config.get("torch_dtype") or "float32"
    dtype = normalize_dtype(raw_dtype)

    layer_types = rules.layer_types(text_config, read)
    if not isinstance(layer_types, list) or len(layer_types) != num_layers:
        raise ConfigError(
            f"layer_types must list one type per layer ({num_layers}), got {layer_types!r}"
        )
    layers = []
    for index, hf_type in enumerate(layer_types):
        kind = _HF_LAYER_KINDS.get(hf_type)
        if kind is None:
            raise ConfigError(
                f"layer {index} has type {hf_type!r}; supported: {', '.join(_HF_LAYER_KINDS)}"
            )
        window = chunk = None
        # A windowed type without its size attends to everything (transformers does the same).
        if kind == "sliding_window":
            window = _window_of(rules, read)
            kind = "sliding_window" if window is not None else "full"
        elif kind == "chunked_local":
            chunk = read("attention_chunk_size")
            chunk = None if chunk is None else _positive_int(chunk, "attention_chunk_size")
            kind = "chunked_local" if chunk is not None else "full"
        layers.append(
            LayerSpec(kind, num_kv_heads, head_dim, head_dim, dtype, window, chunk, hf_type)
        )

    # A wrapper ties by its own field (not text_config's); its class default equals its text
    # model's (Gemma-3: True, Llama-4: False).
    tie = config.get("tie_word_embeddings", rules.defaults.get("tie_word_embeddings", False))
    # The fields the config leaves out take the class default (None defaults stay absent).
    defaulted = tuple(
        key for key, value in rules.defaults.items() if key not in text_config and value is not None
    )
    filled = {**{key: copy.deepcopy(rules.defaults[key]) for key in defaulted}, **text_config}
    return ModelSpec(
        name=name,
        architecture=architecture,
        model_type=str(config.get("model_type") or rules.model_type),
        num_layers=num_layers,
        hidden_size=hidden_size,
        num_attention_heads=num_heads,
        vocab_size=_positive_int(read("vocab_size"), "vocab_size"),
        max_position_embeddings=_positive_int(
            read("max_position_embeddings"), "max_position_embeddings"
        ),
        dtype=dtype,
        layers=tuple(layers),
        attention_sinks=rules.attention_sinks,
        hf_config=dict(config),
        text_config=filled,
        tie_word_embeddings=bool(tie),
        defaulted_fields=defaulted,
    )


def _window_of(rules: _Architecture, read: Callable[[str], Any]) -> Optional[int]:
    # Qwen2/3 switch the window off entirely unless use_sliding_window is set.
    if "use_sliding_window" in rules.defaults and not read("use_sliding_window"):
        return None
    window = read("sliding_window")
    return None if window is None else _positive_int(window, "sliding_window")
