"""The registry of attention backends: name -> backend object.

Backends are objects (a module works) with the two functions of
`hybrid_cache.attention.reference`: `write_kv` and `paged_attention`. They register with
`register_attention_backend(name, backend)`, or by module path with
`register_lazy_attention_backend`, so importing this module never imports a GPU library. Which
backend runs a KV-cache group is decided in `selector.py`.
"""

from __future__ import annotations

import importlib
from typing import Any

from hybrid_cache.errors import UnknownAttentionBackendError

AUTO = "auto"
TORCH, REFERENCE, TRITON, FLASH_ATTN = "torch", "reference", "triton", "flash_attn"

_BACKENDS: dict[str, Any] = {}
# name -> module path imported on first use; the module must provide write_kv and paged_attention
_LAZY_BACKENDS: dict[str, str] = {
    TORCH: "hybrid_cache.attention.torch_batched",
    REFERENCE: "hybrid_cache.attention.reference",
    TRITON: "hybrid_cache.attention.triton_backend",
    FLASH_ATTN: "hybrid_cache.attention.flash_attn_backend",
}


def register_attention_backend(name: str, backend: Any) -> None:
    """Makes `backend` (with `write_kv` and `paged_attention`) selectable as `name`."""
    assert hasattr(backend, "write_kv") and hasattr(backend, "paged_attention"), (
        f"backend {name!r} must define write_kv and paged_attention"
    )
    _BACKENDS[name] = backend


def register_lazy_attention_backend(name: str, module_path: str) -> None:
    """Registers a backend by module path, imported the first time it is selected."""
    _LAZY_BACKENDS[name] = module_path


def available_attention_backends() -> list[str]:
    """Every registered name (whether or not it can run on this machine)."""
    return sorted(set(_BACKENDS) | set(_LAZY_BACKENDS))


def get_attention_backend(name: str = REFERENCE) -> Any:
    """The backend registered as `name` (default: the reference, the oracle)."""
    if name not in _BACKENDS and name in _LAZY_BACKENDS:
        try:
            register_attention_backend(name, importlib.import_module(_LAZY_BACKENDS[name]))
        except ImportError as error:
            raise UnknownAttentionBackendError(
                f"attention backend {name!r} could not be imported ({error}); "
                f"install its dependencies or pick one of {available_attention_backends()}"
            ) from error
    if name not in _BACKENDS:
        raise UnknownAttentionBackendError(
            f"unknown attention backend {name!r}; pick one of {available_attention_backends()}"
        )
    return _BACKENDS[name]
