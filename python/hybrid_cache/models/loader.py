"""Builds a model from a Hugging Face folder (config.json + safetensors) or with random weights.

The model is built from a `ModelSpec` (`hybrid_cache.config`, the one config reader): its layers'
attention kinds, windows, chunks and sinks are the spec's, the same the KV-cache planner reads.

Weight names in the checkpoints equal our parameter names (the model files mirror transformers'
module tree), so loading is: read every tensor, check its shape against the parameter, copy (cast
to the requested dtype). Tied embeddings share one parameter. Every way a folder can be wrong ends
in a `ModelLoadError` subclass naming the file and what to fix.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Mapping

import torch
from safetensors import safe_open
from torch import nn

from hybrid_cache.config import (
    ModelSpec,
    apply_hf_overrides,
    load_model_spec,
    model_spec_from_hf_config,
)
from hybrid_cache.errors import (
    ConfigError,
    ModelLoadError,
    UnknownArchitectureError,
    UnsupportedArchitectureError,
    WeightMismatchError,
)
from hybrid_cache.models.layers import RMSNorm
from hybrid_cache.models.registry import MODEL_REGISTRY, supported_architectures

INDEX_FILE = "model.safetensors.index.json"
# Checkpoint entries that are not parameters (older exports saved rotary buffers).
IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)
# Fields a config must state for a model to be built (the planner alone takes class defaults).
STATED_FIELDS = ("hidden_size", "num_hidden_layers", "num_attention_heads", "vocab_size")


def model_spec_of(
    model: str | Path | None,
    config: Mapping[str, Any] | None,
    hf_overrides: Mapping[str, Any] | None,
) -> ModelSpec:
    """The spec a model is built from, read by the one config reader (`hybrid_cache.config`):
    `config` (a config dict) or else the folder's config.json, with `hf_overrides` deep-merged.
    The reader's `ConfigError`s come out as `ModelLoadError`s (an unknown architecture as
    `UnsupportedArchitectureError`)."""
    try:
        if config is None:
            if model is None:
                raise ModelLoadError("give a model folder or a config dict")
            return load_model_spec(model, hf_overrides)
        merged = apply_hf_overrides(config, hf_overrides) if hf_overrides else dict(config)
        return model_spec_from_hf_config(merged, name=str(model or "<config>"))
    except UnknownArchitectureError as error:
        raise UnsupportedArchitectureError(str(error)) from error
    except ConfigError as error:
        raise ModelLoadError(str(error)) from error


def build_model(
    spec: ModelSpec, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu"
) -> nn.Module:
    """The model of `spec`, parameters of `dtype` allocated on `device`, not initialised. A
    multimodal wrapper (Gemma-3 12B/27B) builds its language model only; a wrapper checkpoint's
    vision tower and weight prefixes are not supported."""
    model_class = MODEL_REGISTRY.get(spec.text_architecture)
    if model_class is None:
        raise UnsupportedArchitectureError(
            f"unsupported architecture {spec.architecture!r}: no model file builds it; "
            f"supported: {supported_architectures()}"
        )
    # The shape fields must be stated, not taken from a class default: the weights' shapes
    # follow them, and a wrong default would only show up as a cryptic shape mismatch.
    missing = [name for name in STATED_FIELDS if name not in spec.text_config]
    if missing:
        raise ModelLoadError(f"config.json is missing or has a bad value: {missing}")
    try:
        with torch.device("meta"):
            model = model_class(spec)
    except (KeyError, TypeError, ValueError, AssertionError) as error:
        raise ModelLoadError(f"config.json is missing or has a bad value: {error!r}") from error
    return model.to(dtype).to_empty(device=device)


def safetensors_files(model_dir: Path) -> list[Path]:
    """The weight files of a folder: those named by the sharded index, else every *.safetensors."""
    index_path = model_dir / INDEX_FILE
    if index_path.is_file():
        try:
            weight_map = json.loads(index_path.read_text())["weight_map"]
        except (OSError, json.JSONDecodeError, KeyError, TypeError) as error:
            raise ModelLoadError(f"{index_path} is malformed ({error!r})") from error
        files = [model_dir / name for name in sorted(set(weight_map.values()))]
        missing = [str(path) for path in files if not path.is_file()]
        if missing:
            raise ModelLoadError(f"{index_path} names shard files that do not exist: {missing}")
        return files
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"no *.safetensors files in {model_dir}")
    return files


def iterate_weights(model_dir: Path):
    """Yields (name, tensor) for every tensor of every weight file."""
    for path in safetensors_files(model_dir):
        try:
            with safe_open(str(path), framework="pt") as handle:
                for name in handle.keys():
                    yield name, handle.get_tensor(name)
        except ModelLoadError:
            raise
        except Exception as error:  # safetensors raises its own error types (and OSError)
            raise ModelLoadError(
                f"{path} is not a readable safetensors file (truncated or corrupt?): {error}"
            ) from error


def tie_embeddings(model: nn.Module) -> None:
    """Makes `lm_head.weight` the same parameter as the input embedding."""
    model.lm_head.weight = model.model.embed_tokens.weight


def load_weights(model: nn.Module, model_dir: Path, config: Mapping[str, Any]) -> None:
    """Copies every checkpoint tensor into its parameter; strict about names and shapes."""
    tied = bool(config.get("tie_word_embeddings", False))
    if tied:
        tie_embeddings(model)
    parameters = dict(model.named_parameters())
    loaded: set[str] = set()
    for name, tensor in iterate_weights(model_dir):
        if name.endswith(IGNORED_SUFFIXES) or (tied and name == "lm_head.weight"):
            continue
        if name not in parameters:
            raise WeightMismatchError(
                f"checkpoint tensor {name!r} has no place in {type(model).__name__}; "
                "is config.json from the same model?"
            )
        parameter = parameters[name]
        if tuple(tensor.shape) != tuple(parameter.shape):
            raise WeightMismatchError(
                f"checkpoint tensor {name!r} has shape {tuple(tensor.shape)}, config.json implies "
                f"{tuple(parameter.shape)}"
            )
        with torch.no_grad():
            parameter.copy_(tensor.to(parameter.dtype))
        loaded.add(name)
    missing = sorted(set(parameters) - loaded)
    if missing:
        raise WeightMismatchError(f"checkpoint lacks {len(missing)} tensors, e.g. {missing[:5]}")


def init_dummy_weights(model: nn.Module, seed: int) -> None:
    """Seeded random weights: norms at their identity value, everything else N(0, 0.02).

    The numbers are drawn on the parameters' device (one generator per device, seeded with
    `seed`): drawing billions of them on the CPU and copying them over would take minutes for a
    real-size model on a GPU. The same seed therefore gives different weights on the CPU and on
    CUDA; on one device type they are reproducible."""
    generators: dict[torch.device, torch.Generator] = {}
    with torch.no_grad():
        for module in model.modules():
            for name, parameter in module.named_parameters(recurse=False):
                if isinstance(module, RMSNorm) and name == "weight":
                    parameter.fill_(1.0 - module.offset)
                    continue
                device = parameter.device
                if device not in generators:
                    generators[device] = torch.Generator(device=device).manual_seed(seed)
                values = torch.randn(parameter.shape, generator=generators[device], device=device)
                parameter.copy_(values.mul_(0.02).to(parameter.dtype))


def load_model(
    model: str | Path | None = None,
    *,
    spec: ModelSpec | None = None,
    config: Mapping[str, Any] | None = None,
    load_format: str = "auto",
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    seed: int = 0,
    hf_overrides: Mapping[str, Any] | None = None,
) -> nn.Module:
    """A model in eval mode from a HF folder (`load_format="auto"`) or with seeded random weights
    (`load_format="dummy"`). It is built from `spec` when given (the engine passes the one it
    plans from), else from the spec of `config` or of the folder's config.json, with
    `hf_overrides` deep-merged (`model_spec_of`)."""
    if load_format not in ("auto", "dummy"):
        raise ModelLoadError(f"load_format must be 'auto' or 'dummy', got {load_format!r}")
    if spec is None:
        spec = model_spec_of(model, config, hf_overrides)
    elif config is not None or hf_overrides:
        raise ModelLoadError("give either a spec or a config (with hf_overrides), not both")
    built = build_model(spec, dtype, device)
    if load_format == "dummy":
        if spec.hf_config.get("tie_word_embeddings", False):
            tie_embeddings(built)
        init_dummy_weights(built, seed)
    else:
        if model is None:
            raise ModelLoadError("load_format='auto' needs a model folder")
        load_weights(built, Path(model), spec.hf_config)
    return built.eval()
