"""Triton kernels for paged attention over grouped block tables.

The package lives in the repository's top-level ``kernels/`` folder and is installed as
``hybrid_cache.kernels`` (see ``kernels/README.md``). Importing it imports neither torch nor
Triton (``hybrid_cache.errors`` re-exports ``KernelArgumentError`` from here); the functions
below load on first use.

- ``unified_attention``: one launch for the prefill chunks and decode tokens of many sequences.
- ``write_kv_cache``: scatters new keys and values into the paged cache by slot mapping.
- ``reference_unified_attention`` / ``reference_write_kv_cache``: the torch oracles for both.
"""

from typing import Any

from .errors import KernelArgumentError

__all__ = [
    "KernelArgumentError",
    "reference_unified_attention",
    "reference_write_kv_cache",
    "unified_attention",
    "write_kv_cache",
]

# Where each lazily loaded name lives. `hybrid_cache.errors` imports this package for
# KernelArgumentError, so importing it must need neither torch nor Triton.
_LAZY = {
    "unified_attention": "paged_attention",
    "write_kv_cache": "cache_write",
    "reference_unified_attention": "reference",
    "reference_write_kv_cache": "reference",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
