"""Typed errors of the benchmark front."""

from __future__ import annotations

from hybrid_cache.errors import HybridCacheError


class BenchConfigError(HybridCacheError, ValueError):
    """A benchmark flag is invalid or the flags contradict each other; the message says which."""
