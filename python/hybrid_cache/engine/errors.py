"""Typed errors the engine raises for one request or one call (defined in
`hybrid_cache.errors`, re-exported here).

Each is a `HybridCacheError` (catch everything from this package with one class) and a
`ValueError` (the caller passed something the engine cannot run). A per-request error is
attached to that request's output (`finish_reason == "error"`); see `LLM.generate`.
"""

from __future__ import annotations

from hybrid_cache.errors import (
    EngineConfigError,
    InsufficientKVCacheError,
    InvalidRequestError,
    InvalidSamplingParamsError,
    PromptTooLongError,
    UnsupportedSamplingParamsError,
)

__all__ = [
    "EngineConfigError",
    "InsufficientKVCacheError",
    "InvalidRequestError",
    "InvalidSamplingParamsError",
    "PromptTooLongError",
    "UnsupportedSamplingParamsError",
]
