"""Typed errors of the benchmark front (defined in `hybrid_cache.errors`, re-exported here)."""

from __future__ import annotations

from hybrid_cache.errors import BenchConfigError

__all__ = ["BenchConfigError"]
