"""One place that maps a backend name to its `write_kv` / `paged_attention` pair.

Backends register themselves with `register_attention_backend(name, backend)`; a backend is any
object (a module works) with the two functions of `hybrid_cache.attention.reference`. Optional
backends (triton, flash_attn) register lazily through `_LAZY_BACKENDS`, so importing this module
never imports a GPU library.
"""

from __future__ import annotations

import importlib
from typing import Any

from hybrid_cache.errors import HybridCacheError


class UnknownAttentionBackendError(HybridCacheError):
    """The requested attention backend is not registered (or its module failed to import)."""


_BACKENDS: dict[str, Any] = {}
# name -> module path imported on first use; the module must provide write_kv and paged_attention
_LAZY_BACKENDS: dict[str, str] = {"torch": "hybrid_cache.attention.reference"}


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
    return sorted(set(_BACKENDS) | set(_LAZY_BACKENDS))


def get_attention_backend(name: str = "torch") -> Any:
    """The backend registered as `name`."""
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
