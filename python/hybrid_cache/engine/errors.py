"""Typed errors the engine raises for one request or one call.

Each is a `HybridCacheError` (catch everything from this package with one class) and a
`ValueError` (the caller passed something the engine cannot run). A per-request error is
attached to that request's output (`finish_reason == "error"`); see `LLM.generate`.
"""

from __future__ import annotations

from hybrid_cache.errors import HybridCacheError, RequestTooLargeError


class EngineConfigError(HybridCacheError, ValueError):
    """An `LLM(...)` argument is invalid (unknown mode, non-positive size, ...)."""


class InvalidSamplingParamsError(HybridCacheError, ValueError):
    """A `SamplingParams` field is out of range."""


class InvalidRequestError(HybridCacheError, ValueError):
    """A prompt cannot be run: empty, wrong shape, or token ids outside the vocabulary."""


class PromptTooLongError(InvalidRequestError):
    """The prompt has more tokens than `max_model_len`."""


class InsufficientKVCacheError(InvalidRequestError, RequestTooLargeError):
    """The request can never fit in the KV-cache pool, even running alone."""


__all__ = [
    "EngineConfigError",
    "InsufficientKVCacheError",
    "InvalidRequestError",
    "InvalidSamplingParamsError",
    "PromptTooLongError",
]
