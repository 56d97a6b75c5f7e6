"""One place that decides which attention backend runs each KV-cache group, and maps names to
backend objects.

Backends are objects (a module works) with the two functions of
`hybrid_cache.attention.reference`: `write_kv` and `paged_attention`. They register with
`register_attention_backend(name, backend)`, or by module path with
`register_lazy_attention_backend`, so importing this module never imports a GPU library.

Built in:

    name        runs on                          can do
    torch       any device                       everything; vectorised over the batch
                                                 (`torch_batched`), the CPU engine's backend
    reference   any device                       everything; one sequence at a time
                                                 (`reference`), slow: the test oracle
    triton      CUDA, or the CPU under           windows, chunks, softcap, sinks, any block size
                TRITON_INTERPRET=1
    flash_attn  CUDA with `flash-attn` installed windows, softcap; block sizes that are multiples
                                                 of 256 (FA2's paged KV); fp16/bf16; no sinks,
                                                 no chunked-local attention

Selection (`resolve_attention_backend`): "auto" picks flash_attn on CUDA when it is importable
and every layer of the group suits it, else triton on CUDA, else torch (always torch on the CPU).
"reference" is never chosen by "auto": force it to check another backend against the oracle.
A forced name that cannot run raises `AttentionBackendUnavailableError` listing every reason and
what to choose instead; there is no silent fallback. `select_attention_backends` applies that per
group to a model's layers; `attention_backends_by_group` / `describe_attention_backends` report
the result for the engine's log.
"""

from __future__ import annotations

import functools
import importlib
import os
import sys
from dataclasses import dataclass
from typing import TYPE_CHECKING, Iterable, Mapping, Optional, Sequence, Union

import torch

from hybrid_cache.attention.backends import (
    AUTO,
    FLASH_ATTN,
    REFERENCE,
    TORCH,
    TRITON,
    available_attention_backends,
    get_attention_backend,
    register_attention_backend,
    register_lazy_attention_backend,
)
from hybrid_cache.attention.layer import Attention, attention_layers
from hybrid_cache.errors import AttentionBackendUnavailableError, UnknownAttentionBackendError

if TYPE_CHECKING:
    from torch import nn

__all__ = [
    "AUTO",
    "FLASH_ATTN",
    "REFERENCE",
    "TORCH",
    "TRITON",
    "AttentionBackendUnavailableError",
    "AttentionFeatures",
    "UnknownAttentionBackendError",
    "attention_backend_unavailable_reasons",
    "attention_backends_by_group",
    "available_attention_backends",
    "describe_attention_backends",
    "get_attention_backend",
    "layer_attention_features",
    "register_attention_backend",
    "register_lazy_attention_backend",
    "resolve_attention_backend",
    "select_attention_backends",
    "triton_interpreter_requested",
    "triton_kernels_interpreted",
]

# The module whose @triton.jit decorators fixed, at its import, whether our kernels are
# interpreted (CPU) or compiled (CUDA).
_KERNEL_MODULE = "hybrid_cache.kernels.paged_attention"
# What Triton's getenv_bool accepts as true (case-insensitive).
_TRUE_VALUES = ("1", "true", "on", "yes")

TRITON_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
FLASH_ATTN_DTYPES = (torch.float16, torch.bfloat16)
FLASH_ATTN_BLOCK_MULTIPLE = 256  # FA2's paged-KV kernels need page_block_size % 256 == 0
FLASH_ATTN_MAX_HEAD_DIM = 256


@dataclass(frozen=True)
class AttentionFeatures:
    """What one attention layer asks of a backend: its group's block size and its own
    options. A group is served by a backend only if every one of its layers is."""

    block_size: int
    head_dim: int
    dtype: torch.dtype
    sliding_window: Optional[int] = None
    chunk: Optional[int] = None
    softcap: Optional[float] = None
    sinks: bool = False


FeaturesArg = Union[AttentionFeatures, Iterable[AttentionFeatures]]


def _as_feature_list(features: FeaturesArg) -> list[AttentionFeatures]:
    if isinstance(features, AttentionFeatures):
        return [features]
    return list(features)


def triton_interpreter_requested() -> bool:
    """True when TRITON_INTERPRET is set to a value Triton reads as true."""
    return os.environ.get("TRITON_INTERPRET", "").strip().lower() in _TRUE_VALUES


def triton_kernels_interpreted() -> Optional[bool]:
    """Whether our kernels were decorated for the interpreter; None while not yet imported
    (then TRITON_INTERPRET at their import decides)."""
    module = sys.modules.get(_KERNEL_MODULE)
    if module is None:
        return None
    from hybrid_cache.kernels._launch import is_interpreted

    return is_interpreted(module._unified_attention_kernel)


@functools.cache
def _import_error(module: str) -> Optional[str]:
    """None when `module` imports; else the error, as text (cached: imports are not retried)."""
    try:
        importlib.import_module(module)
    except Exception as error:  # a broken CUDA extension raises more than ImportError
        return f"{type(error).__name__}: {error}"
    return None


def _triton_import_error() -> Optional[str]:
    return _import_error("triton")


def _flash_attn_import_error() -> Optional[str]:
    return _import_error("flash_attn")


def _cuda_capability(device: torch.device) -> tuple[int, int]:
    return torch.cuda.get_device_capability(device)


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _triton_reasons(device: torch.device, features: list[AttentionFeatures]) -> list[str]:
    reasons = []
    import_error = _triton_import_error()
    if import_error is not None:
        reasons.append(f"Triton is not importable ({import_error}); install triton")
    interpreted = triton_kernels_interpreted()
    if device.type == "cuda":
        if interpreted or (interpreted is None and triton_interpreter_requested()):
            reasons.append(
                "TRITON_INTERPRET is set, so the Triton kernels run on the CPU only; unset it "
                "(before Python starts) to run them on CUDA"
            )
    elif device.type == "cpu":
        if interpreted is False:
            reasons.append(
                "the Triton kernels were already imported for the GPU in this process "
                "(TRITON_INTERPRET was not set when Triton decorated them); on the CPU set "
                "TRITON_INTERPRET=1 in the environment before Triton is imported, e.g. "
                "`TRITON_INTERPRET=1 python ...`"
            )
        elif interpreted is None and not triton_interpreter_requested():
            reasons.append(
                "on the CPU the Triton kernels run only under Triton's interpreter: set "
                "TRITON_INTERPRET=1 in the environment before Triton is imported, e.g. "
                "`TRITON_INTERPRET=1 python ...` (slow; meant for tests)"
            )
    else:
        reasons.append(
            f"the Triton kernels need a CUDA device (or the CPU under TRITON_INTERPRET=1), "
            f"not {device.type}"
        )
    for dtype in sorted({f.dtype for f in features if f.dtype not in TRITON_DTYPES}, key=str):
        reasons.append(f"the Triton kernels take float32/float16/bfloat16, not {dtype}")
    return reasons


def _flash_attn_reasons(device: torch.device, features: list[AttentionFeatures]) -> list[str]:
    reasons = []
    if device.type != "cuda":
        reasons.append(f"FlashAttention runs on CUDA only, and the device is {device.type}")
    else:
        import_error = _flash_attn_import_error()
        if import_error is not None:
            reasons.append(
                f"flash_attn is not importable ({import_error}); install the optional extra "
                "`pip install 'hybrid-cache[flash-attn]'`"
            )
    block_sizes = sorted({f.block_size for f in features})
    bad_blocks = [size for size in block_sizes if size % FLASH_ATTN_BLOCK_MULTIPLE != 0]
    if bad_blocks:
        reasons.append(
            f"FlashAttention's paged KV path needs a block size that is a multiple of "
            f"{FLASH_ATTN_BLOCK_MULTIPLE}, got {bad_blocks}; pass block_size=256 (or 512, ...)"
        )
    if any(f.sinks for f in features):
        reasons.append("FlashAttention (FA2) cannot apply attention sinks (gpt-oss layers)")
    if any(f.chunk is not None for f in features):
        reasons.append("FlashAttention (FA2) cannot do chunked-local attention")
    for dtype in sorted({f.dtype for f in features if f.dtype not in FLASH_ATTN_DTYPES}, key=str):
        reasons.append(f"FlashAttention takes float16/bfloat16, not {_dtype_name(dtype)}")
    head_dims = sorted({f.head_dim for f in features})
    bad_dims = [d for d in head_dims if d > FLASH_ATTN_MAX_HEAD_DIM or d % 8 != 0]
    if bad_dims:
        reasons.append(
            f"FlashAttention needs head dims that are multiples of 8 up to "
            f"{FLASH_ATTN_MAX_HEAD_DIM}, got {bad_dims}"
        )
    if not reasons and torch.cuda.is_available():
        major, minor = _cuda_capability(device)
        if major < 8:
            reasons.append(
                f"FlashAttention 2 needs an Ampere (sm80) or newer GPU; this one is "
                f"sm{major}{minor}"
            )
    return reasons


def attention_backend_unavailable_reasons(
    name: str, device: Union[str, torch.device], features: FeaturesArg
) -> list[str]:
    """Why backend `name` cannot serve layers with `features` on `device` (empty: it can).
    Backends registered by users are taken to run anywhere."""
    device = torch.device(device)
    feature_list = _as_feature_list(features)
    if name == TRITON:
        return _triton_reasons(device, feature_list)
    if name == FLASH_ATTN:
        return _flash_attn_reasons(device, feature_list)
    return []


_INSTEAD = {
    TRITON: "choose attention_backend='torch' (vectorised torch, any device) or 'auto'",
    FLASH_ATTN: (
        "choose attention_backend='triton' (our kernels: any block size, sinks, chunks) or 'auto'"
    ),
}


def resolve_attention_backend(
    requested: str, device: Union[str, torch.device], features: FeaturesArg
) -> str:
    """The backend name to run layers with `features` on `device`.

    "auto": flash_attn on CUDA when importable and every layer suits it (block size a multiple of
    256, no sinks, no chunked-local attention, fp16/bf16), else triton on CUDA, else torch (always
    torch on the CPU). A forced name is checked and returned unchanged, or refused with
    `AttentionBackendUnavailableError`; an unregistered name raises
    `UnknownAttentionBackendError`.
    """
    device = torch.device(device)
    feature_list = _as_feature_list(features)
    if requested == AUTO:
        if device.type != "cuda":
            return TORCH
        for candidate in (FLASH_ATTN, TRITON):
            if not attention_backend_unavailable_reasons(candidate, device, feature_list):
                return candidate
        return TORCH
    if requested not in available_attention_backends():
        raise UnknownAttentionBackendError(
            f"unknown attention backend {requested!r}; pick 'auto' or one of "
            f"{available_attention_backends()}"
        )
    reasons = attention_backend_unavailable_reasons(requested, device, feature_list)
    if reasons:
        instead = _INSTEAD.get(requested, "choose 'auto'")
        raise AttentionBackendUnavailableError(
            f"attention backend {requested!r} cannot run here: " + "; ".join(reasons) + f". "
            f"{instead[0].upper()}{instead[1:]}."
        )
    return requested


def _layers_with_sinks(model: nn.Module) -> set[int]:
    """Layer indices whose attention module holds a `sinks` tensor (gpt-oss): the model passes it
    to its `Attention` child at run time, so it is found next to that child."""
    found = set()
    for module in model.modules():
        if not isinstance(getattr(module, "sinks", None), torch.Tensor):
            continue
        for child in module.children():
            if isinstance(child, Attention):
                found.add(child.layer_index)
    return found


def layer_attention_features(
    model: nn.Module,
    block_sizes: Sequence[int],
    dtype: Optional[torch.dtype] = None,
    attention_sinks: Optional[bool] = None,
) -> dict[int, list[AttentionFeatures]]:
    """Per KV-cache group id, the features of each of its layers (groups as set by
    `assign_layer_groups`; `block_sizes[g]` is group g's block size). `dtype` is the KV-cache
    dtype (default: the model's parameters'). `attention_sinks`: whether the layers use sinks
    (e.g. `ModelSpec.attention_sinks`); None detects it from the model's modules."""
    if dtype is None:
        dtype = next(model.parameters()).dtype
    with_sinks = _layers_with_sinks(model) if attention_sinks is None else set()
    groups: dict[int, list[AttentionFeatures]] = {}
    for layer in attention_layers(model):
        assert 0 <= layer.group_id < len(block_sizes), (
            f"layer {layer.layer_index} is in group {layer.group_id} but only "
            f"{len(block_sizes)} block sizes were given"
        )
        groups.setdefault(layer.group_id, []).append(
            AttentionFeatures(
                block_size=int(block_sizes[layer.group_id]),
                head_dim=layer.head_dim,
                dtype=dtype,
                sliding_window=layer.sliding_window,
                chunk=layer.chunk,
                softcap=layer.softcap,
                sinks=bool(attention_sinks) or layer.layer_index in with_sinks,
            )
        )
    return dict(sorted(groups.items()))


def select_attention_backends(
    model: nn.Module,
    requested: str,
    device: Union[str, torch.device],
    block_sizes: Sequence[int],
    dtype: Optional[torch.dtype] = None,
    attention_sinks: Optional[bool] = None,
) -> dict[int, str]:
    """Resolves `requested` for every KV-cache group of `model` and sets each layer's backend.

    Call after `assign_layer_groups`. Returns {group id: backend name}. A forced backend that
    cannot serve some group raises `AttentionBackendUnavailableError` naming that group, before
    any layer is changed.
    """
    chosen: dict[int, str] = {}
    for group_id, features in layer_attention_features(
        model, block_sizes, dtype, attention_sinks
    ).items():
        try:
            chosen[group_id] = resolve_attention_backend(requested, device, features)
        except AttentionBackendUnavailableError as error:
            raise AttentionBackendUnavailableError(f"KV-cache group {group_id}: {error}") from None
    for name in set(chosen.values()):
        get_attention_backend(name)  # fail now (import errors), not in the first forward
    for layer in attention_layers(model):
        layer.backend = chosen[layer.group_id]
    return chosen


def attention_backends_by_group(model: nn.Module) -> dict[int, str]:
    """{group id: backend name} as the model's layers are set now. A group whose layers run
    different backends (set by hand) reports them joined with '+'."""
    names: dict[int, list[str]] = {}
    for layer in attention_layers(model):
        group_names = names.setdefault(layer.group_id, [])
        if layer.backend not in group_names:
            group_names.append(layer.backend)
    return {group: "+".join(found) for group, found in sorted(names.items())}


def describe_attention_backends(
    model: nn.Module, block_sizes: Optional[Mapping[int, int] | Sequence[int]] = None
) -> str:
    """One line for the engine's log, e.g.
    "attention backends: group 0 (full, B=16): triton; group 1 (sliding_window W=128, B=16): triton".
    """
    kinds: dict[int, str] = {}
    for layer in attention_layers(model):
        letter = "C" if layer.kind == "chunked_local" else "W"
        window = "" if layer.reach is None else f" {letter}={layer.reach}"
        kinds.setdefault(layer.group_id, f"{layer.kind}{window}")
    parts = []
    for group, name in attention_backends_by_group(model).items():
        size = "" if block_sizes is None else f", B={block_sizes[group]}"
        parts.append(f"group {group} ({kinds[group]}{size}): {name}")
    return "attention backends: " + "; ".join(parts)
