"""Builds a model from a Hugging Face folder (config.json + safetensors) or with random weights.

The model is built from a `ModelSpec` (`hybrid_cache.config`, the one config reader): its layers'
attention kinds, windows, chunks and sinks are the spec's, the same the KV-cache planner reads.

Weight names in the checkpoints equal our parameter names (the model files mirror transformers'
module tree), up to a multimodal wrapper's prefixes (`checkpoint_names.py`: Gemma-3 4B/12B/27B
load their language model, the vision tower is skipped). Loading is: read every tensor of every
file (one folder, or the shards `model.safetensors.index.json` names), check its shape against
the parameter, copy (cast to the requested dtype). MXFP4 experts (gpt-oss: `*_blocks` +
`*_scales`) are dequantised to that dtype (`mxfp4.py` documents the format). Tied embeddings
share one parameter. Every way a folder can be wrong ends in a `ModelLoadError` subclass naming
the file and what to do: no weights, pickles only, a Hub id instead of a folder, an unsupported
quantisation, a tensor that does not fit.

Tensor parallelism: `build_model(..., shard=TensorShard(rank, size))` builds one rank's shard
(`parallel_layers.py`); the loader reads only the rank's slice of each sharded tensor
(`safe_open(...).get_slice`, the shape checked against the full tensor first; MXFP4 experts by
their rows, or by their 32-element blocks where the split is block-aligned) and dummy weights
are drawn at full size and sliced, so every shard holds the single-device model's numbers.
A vocabulary-parallel shard's rows past the vocabulary (its padding) are zeros.
"""

from __future__ import annotations

import contextlib
import json
import logging
from pathlib import Path
from typing import Any, Mapping

import torch
from safetensors import safe_open
from torch import nn

from hybrid_cache.config import (
    LOAD_FORMATS,
    ModelSpec,
    apply_hf_overrides,
    load_model_spec,
    model_spec_from_hf_config,
    not_local_error,
)
from hybrid_cache.errors import (
    ConfigError,
    MissingWeightsError,
    ModelLoadError,
    ModelNotLocalError,
    UnknownArchitectureError,
    UnsupportedArchitectureError,
    UnsupportedQuantizationError,
    UnsupportedWeightFormatError,
    WeightMismatchError,
)
from hybrid_cache.models.checkpoint_names import CheckpointNames
from hybrid_cache.models.layers import RMSNorm
from hybrid_cache.models.mxfp4 import (
    BLOCK_SIZE,
    BLOCKS_SUFFIX,
    SCALES_SUFFIX,
    dequantize_mxfp4,
    mxfp4_shape_error,
)
from hybrid_cache.models.parallel_layers import (
    NO_SHARD,
    ShardRule,
    TensorShard,
    building_shard,
    shard_rule,
)
from hybrid_cache.models.registry import MODEL_REGISTRY, supported_architectures

logger = logging.getLogger(__name__)

INDEX_FILE = "model.safetensors.index.json"
# safetensors' dtype names of the tensors whose dtype the loader checks before reading them.
SAFETENSORS_DTYPES = {"U8": torch.uint8, "I8": torch.int8, "BF16": torch.bfloat16}
DUMMY_HINT = "or pass --load-format dummy (load_format='dummy') for random weights"
# Weight files the loader does not read (PyTorch pickles), named in the error.
PICKLES = (".bin", ".pt", ".pth")
SUPPORTED_QUANT_METHODS = ("mxfp4",)
MXFP4_SUFFIXES = (BLOCKS_SUFFIX, SCALES_SUFFIX)
# The config fields weight shapes follow, named when a shape mismatch meets their class default.
SHAPE_FIELDS = (
    "hidden_size",
    "intermediate_size",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "vocab_size",
    "num_local_experts",
)


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
    except ModelNotLocalError:
        raise  # a ModelLoadError already (and a ConfigError)
    except UnknownArchitectureError as error:
        raise UnsupportedArchitectureError(str(error)) from error
    except ConfigError as error:
        raise ModelLoadError(str(error)) from error


def build_model(
    spec: ModelSpec,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    shard: TensorShard = NO_SHARD,
) -> nn.Module:
    """The model of `spec` (its `shard` under tensor parallelism), parameters of `dtype`
    allocated on `device`, not initialised. A multimodal wrapper (Gemma-3 4B/12B/27B) builds
    its language model only. Fields config.json leaves out take transformers' class defaults
    (`ModelSpec.text_config`)."""
    model_class = MODEL_REGISTRY.get(spec.text_architecture)
    if model_class is None:
        raise UnsupportedArchitectureError(
            f"unsupported architecture {spec.architecture!r}: no model file builds it; "
            f"supported: {supported_architectures()}"
        )
    try:
        with torch.device("meta"), building_shard(shard):
            model = model_class(spec)
    except (KeyError, TypeError, ValueError, AssertionError) as error:
        raise ModelLoadError(f"config.json is missing or has a bad value: {error!r}") from error
    return model.to(dtype).to_empty(device=device)


def safetensors_files(model_dir: Path) -> list[Path]:
    """The weight files of a folder: those named by the sharded index, else every *.safetensors.
    A folder without them raises `UnsupportedWeightFormatError` (pickles, GGUF) or
    `MissingWeightsError` (nothing), each saying what to do."""
    index_path = model_dir / INDEX_FILE
    if index_path.is_file():
        try:
            weight_map = json.loads(index_path.read_text())["weight_map"]
        except (OSError, json.JSONDecodeError, KeyError, TypeError) as error:
            raise ModelLoadError(f"{index_path} is malformed ({error!r})") from error
        files = [model_dir / name for name in sorted(set(weight_map.values()))]
        missing = [str(path) for path in files if not path.is_file()]
        if missing:
            raise ModelLoadError(
                f"{index_path} names shard files that do not exist: {missing}; "
                "download the missing shards (or the whole repository) again"
            )
        return files
    files = sorted(model_dir.glob("*.safetensors"))
    if files:
        return files
    pickles = sorted(path.name for path in model_dir.iterdir() if path.name.endswith(PICKLES))
    if pickles:
        raise UnsupportedWeightFormatError(
            f"{model_dir} holds PyTorch pickle weights ({', '.join(pickles[:3])}) and no "
            "*.safetensors: the loader reads safetensors only. Convert them once with "
            "transformers (`from_pretrained(folder)` then `save_pretrained(folder)` writes "
            "model.safetensors), or download the repository's *.safetensors files; "
            f"{DUMMY_HINT}"
        )
    gguf = sorted(path.name for path in model_dir.glob("*.gguf"))
    if gguf:
        raise UnsupportedWeightFormatError(
            f"{model_dir} holds GGUF weights ({', '.join(gguf[:3])}), which the loader does not "
            "read: use the original Hugging Face repository's *.safetensors files; "
            f"{DUMMY_HINT}"
        )
    raise MissingWeightsError(
        f"{model_dir} has a config.json but no weights (*.safetensors): download them too "
        f"(`huggingface-cli download <repo-id> --local-dir {model_dir}` fetches the whole "
        f"repository); {DUMMY_HINT}"
    )


class CheckpointTensor:
    """One tensor of an open safetensors file, read whole or by a slice when asked."""

    def __init__(self, handle: Any, name: str, path: Path) -> None:
        self.handle, self.name, self.path = handle, name, path

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self._guard(lambda: self.handle.get_slice(self.name).get_shape()))

    @property
    def dtype(self) -> torch.dtype:
        """The stored dtype (safetensors' name, e.g. "U8", mapped to torch's)."""
        name = self._guard(lambda: self.handle.get_slice(self.name).get_dtype())
        return SAFETENSORS_DTYPES.get(name, torch.float32)

    def read(self, index: tuple[slice, ...] | None = None) -> torch.Tensor:
        """The tensor, or only `index` of it (read from the file by that slice alone)."""
        if index is None:
            return self._guard(lambda: self.handle.get_tensor(self.name))
        return self._guard(lambda: self.handle.get_slice(self.name)[index])

    def _guard(self, read: Any) -> Any:
        try:
            return read()
        except Exception as error:  # safetensors raises its own error types (and OSError)
            raise ModelLoadError(
                f"{self.path} is not a readable safetensors file (truncated or corrupt?): {error}"
            ) from error


def iterate_weights(model_dir: Path):
    """Yields (name, `CheckpointTensor`) for every tensor of every weight file; each stays
    readable until the iteration ends (the files are closed then), so an MXFP4 pair split
    over two shards reads both halves."""
    with contextlib.ExitStack() as files:
        for path in safetensors_files(model_dir):
            try:
                handle = files.enter_context(safe_open(str(path), framework="pt"))
                names = list(handle.keys())
            except Exception as error:  # safetensors raises its own error types (and OSError)
                raise ModelLoadError(
                    f"{path} is not a readable safetensors file (truncated or corrupt?): {error}"
                ) from error
            for name in names:
                yield name, CheckpointTensor(handle, name, path)


def tie_embeddings(model: nn.Module) -> None:
    """Makes `lm_head.weight` the same parameter as the input embedding."""
    model.lm_head.weight = model.model.embed_tokens.weight


def check_quantization(spec: ModelSpec) -> None:
    """Raises `UnsupportedQuantizationError` for a quantisation the loader cannot undo."""
    method = spec.quant_method
    if method is not None and method not in SUPPORTED_QUANT_METHODS:
        raise UnsupportedQuantizationError(
            f"config.json's quantization_config has quant_method {method!r}; the loader "
            f"dequantises only {', '.join(SUPPORTED_QUANT_METHODS)} (gpt-oss experts): use an "
            f"unquantised (bf16) checkpoint of the model; {DUMMY_HINT}"
        )


def shape_hint(spec: ModelSpec) -> str:
    """The shape fields config.json leaves to class defaults, for a shape mismatch message."""
    defaulted = [name for name in SHAPE_FIELDS if name in spec.defaulted_fields]
    if not defaulted:
        return ""
    values = ", ".join(f"{name}={spec.text_config[name]!r}" for name in defaulted)
    return f" (config.json does not state {values}: transformers' defaults, used here)"


def copy_tensor(
    parameter: nn.Parameter,
    name: str,
    tensor: CheckpointTensor,
    spec: ModelSpec,
    rule: ShardRule | None = None,
) -> None:
    """Copies the checkpoint tensor (only the slice `rule` names) into `parameter`."""
    expected = tuple(parameter.shape) if rule is None else rule.full_shape
    if tensor.shape != expected:
        raise WeightMismatchError(
            f"checkpoint tensor {name!r} has shape {tensor.shape}, config.json implies "
            f"{expected}{shape_hint(spec)}"
        )
    values = tensor.read(None) if rule is None else rule.pad(tensor.read(rule.index()))
    with torch.no_grad():
        parameter.copy_(values.to(parameter.dtype))


def mxfp4_reads(
    rule: ShardRule | None, input_major: bool, ndim: int
) -> tuple[tuple[slice, ...] | None, tuple[slice, ...] | None]:
    """How to read one rank's slice of an MXFP4 pair whose parameter takes `rule`: the
    (blocks, scales) indices read from the file, and the index of the dequantised matrix
    [..., out, in] still to take (None: nothing). The output (row) dim slices both tensors;
    the input dim slices them by whole 32-element blocks, or is read whole and sliced after
    dequantisation when the split is not block-aligned."""
    if rule is None:
        return None, None
    dim = rule.dim
    if input_major and dim >= ndim - 2:
        dim = (2 * ndim - 3) - dim  # the stored matrix is the transpose
    lead = (slice(None),) * dim
    if dim < ndim - 1:  # rows (or a leading dim): the same index of blocks and scales
        return lead + (slice(rule.start, rule.stop),), None
    if rule.start % BLOCK_SIZE == 0 and rule.stop % BLOCK_SIZE == 0:
        blocks = slice(rule.start // BLOCK_SIZE, rule.stop // BLOCK_SIZE)
        return lead + (blocks,), lead + (slice(None),)
    return None, lead + (slice(rule.start, rule.stop),)


def copy_mxfp4(
    parameter: nn.Parameter,
    name: str,
    pair: Mapping[str, CheckpointTensor],
    input_major: bool,
    spec: ModelSpec,
    rule: ShardRule | None = None,
) -> None:
    """Dequantises an MXFP4 pair (`models/mxfp4.py`) into `parameter` (its slice `rule`), one
    matrix at a time on the parameter's device; an `input_major` parameter takes the
    transpose."""
    blocks_file, scales_file = pair[BLOCKS_SUFFIX], pair[SCALES_SUFFIX]
    blocks_shape, scales_shape = blocks_file.shape, scales_file.shape
    error = mxfp4_shape_error(
        torch.empty(blocks_shape, dtype=blocks_file.dtype, device="meta"),
        torch.empty(scales_shape, dtype=scales_file.dtype, device="meta"),
    )
    if error is not None:
        raise WeightMismatchError(f"MXFP4 tensors {name}_blocks / _scales: {error}")
    stored = (*blocks_shape[:-2], blocks_shape[-2] * BLOCK_SIZE)
    shape = tuple(parameter.shape) if rule is None else rule.full_shape
    expected = (*shape[:-2], shape[-1], shape[-2]) if input_major else shape
    if stored != expected:
        raise WeightMismatchError(
            f"checkpoint tensors {name}_blocks / _scales dequantise to shape {stored}, config.json "
            f"implies {expected}{shape_hint(spec)}"
        )
    read_index, after = mxfp4_reads(rule, input_major, len(shape))
    blocks, scales = blocks_file.read(read_index), scales_file.read(read_index)
    local = tuple(parameter.shape)
    matrices = parameter.data.view(-1, *local[-2:])
    blocks = blocks.reshape(-1, *blocks.shape[-3:])
    scales = scales.reshape(-1, *scales.shape[-2:])
    matrix_index = None if after is None else after[len(shape) - 2 :] or None
    with torch.no_grad():
        for index in range(matrices.shape[0]):
            device = matrices.device
            weight = dequantize_mxfp4(blocks[index].to(device), scales[index].to(device))
            if matrix_index is not None:
                weight = weight[matrix_index]
            matrices[index].copy_(weight.transpose(0, 1) if input_major else weight)


def is_input_major(model: nn.Module, name: str) -> bool:
    """Whether parameter `name` is stored [in, out] (its module lists it as such)."""
    owner, _, leaf = name.rpartition(".")
    return leaf in getattr(model.get_submodule(owner), "INPUT_MAJOR_PARAMETERS", ())


def load_weights(model: nn.Module, model_dir: Path, spec: ModelSpec) -> None:
    """Copies every checkpoint tensor into its parameter; strict about names and shapes.
    Checkpoint names map through `CheckpointNames` (a wrapper's prefixes, its skipped vision
    tower); MXFP4 pairs (`*_blocks` + `*_scales`) dequantise into the parameter they name. A
    sharded parameter (`parallel_layers.shard_rule`) reads only its slice."""
    names = CheckpointNames(spec)
    tied = spec.tie_word_embeddings
    if tied:
        tie_embeddings(model)
    parameters = dict(model.named_parameters())
    loaded: dict[str, str] = {}
    packed: dict[str, dict[str, CheckpointTensor]] = {}
    for name, tensor in iterate_weights(model_dir):
        target = names.parameter_name(name)
        if target is None or (tied and target == "lm_head.weight"):
            continue
        suffix = next((end for end in MXFP4_SUFFIXES if target.endswith(end)), None)
        base = target.removesuffix(suffix) if suffix else target
        if suffix and base in parameters:
            pair = packed.setdefault(base, {})
            pair[suffix] = tensor
            if len(pair) < len(MXFP4_SUFFIXES):
                continue
            del packed[base]
            input_major = is_input_major(model, base)
            rule = shard_rule(model, base)
            copy_mxfp4(parameters[base], base, pair, input_major, spec, rule)
        elif target in parameters:
            base = target
            copy_tensor(parameters[target], name, tensor, spec, shard_rule(model, target))
        else:
            raise WeightMismatchError(
                f"checkpoint tensor {name!r} has no place in {type(model).__name__} "
                f"({names.layout_hint()}); is config.json from the same model?"
            )
        if base in loaded:
            raise WeightMismatchError(
                f"checkpoint tensors {loaded[base]!r} and {name!r} both load {base!r}"
            )
        loaded[base] = name
    if packed:
        unpaired = [f"{base}{next(iter(pair))}" for base, pair in packed.items()]
        raise WeightMismatchError(
            f"MXFP4 tensors without their other half (*_blocks needs *_scales): {unpaired[:5]}"
        )
    missing = sorted(set(parameters) - set(loaded))
    if missing:
        raise WeightMismatchError(f"checkpoint lacks {len(missing)} tensors, e.g. {missing[:5]}")
    summary = names.skipped_summary()
    if summary:
        logger.info(
            "%s: loaded the language model of %s, %s (text prompts only)",
            model_dir,
            spec.architecture,
            summary,
        )


def init_dummy_weights(model: nn.Module, seed: int) -> None:
    """Seeded random weights: norms at their identity value, everything else N(0, 0.02).

    The numbers are drawn on the parameters' device (one generator per device, seeded with
    `seed`): drawing billions of them on the CPU and copying them over would take minutes for a
    real-size model on a GPU. The same seed therefore gives different weights on the CPU and on
    CUDA; on one device type they are reproducible. A sharded parameter draws its full tensor
    and keeps its slice: a tensor-parallel model holds the single-device model's weights."""
    generators: dict[torch.device, torch.Generator] = {}
    with torch.no_grad():
        for module in model.modules():
            rules = getattr(module, "shard_rules", {})
            for name, parameter in module.named_parameters(recurse=False):
                if isinstance(module, RMSNorm) and name == "weight":
                    parameter.fill_(1.0 - module.offset)
                    continue
                device = parameter.device
                if device not in generators:
                    generators[device] = torch.Generator(device=device).manual_seed(seed)
                rule = rules.get(name)
                shape = parameter.shape if rule is None else rule.full_shape
                values = torch.randn(shape, generator=generators[device], device=device)
                if rule is not None:
                    values = rule.pad(values[rule.index()])
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
    shard: TensorShard = NO_SHARD,
) -> nn.Module:
    """A model in eval mode from a HF folder (`load_format="auto"`) or with seeded random weights
    (`load_format="dummy"`). It is built from `spec` when given (the engine passes the one it
    plans from), else from the spec of `config` or of the folder's config.json, with
    `hf_overrides` deep-merged (`model_spec_of`). `shard`: the tensor-parallel rank to build
    (its slices of the weights only)."""
    if load_format not in LOAD_FORMATS:
        raise ModelLoadError(f"load_format must be 'auto' or 'dummy', got {load_format!r}")
    if spec is None:
        spec = model_spec_of(model, config, hf_overrides)
    elif config is not None or hf_overrides:
        raise ModelLoadError("give either a spec or a config (with hf_overrides), not both")
    if load_format == "auto":
        if model is None:
            raise ModelLoadError("load_format='auto' needs a model folder")
        if not Path(model).is_dir():
            raise not_local_error(model)
        check_quantization(spec)
    built = build_model(spec, dtype, device, shard)
    if load_format == "dummy":
        if spec.tie_word_embeddings:
            tie_embeddings(built)
        init_dummy_weights(built, seed)
    else:
        load_weights(built, Path(model), spec)
    return built.eval()
