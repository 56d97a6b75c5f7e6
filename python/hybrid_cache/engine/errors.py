"""Typed errors the engine raises for one request or one call (defined in
`hybrid_cache.errors`, re-exported here).

Each is a `HybridCacheError` (catch everything from this package with one class) and a
`ValueError` (the caller passed something the engine cannot run). `LLM.generate` checks its
whole batch first and raises one `InvalidRequestsError` listing every bad prompt; the step API
(`LLMEngine.add_request`) raises for the one request it is given.
"""

from __future__ import annotations

from hybrid_cache.errors import (
    BudgetTooSmallError,
    DeviceUnavailableError,
    EngineConfigError,
    EngineShutDownError,
    InsufficientKVCacheError,
    InvalidRequestError,
    InvalidRequestsError,
    InvalidSamplingParamsError,
    KVCacheMemoryError,
    NoTokenizerError,
    PromptTooLongError,
    TensorParallelConfigError,
    TensorParallelError,
    UnsupportedSamplingParamsError,
    WorkerFailedError,
)

__all__ = [
    "BudgetTooSmallError",
    "DeviceUnavailableError",
    "EngineConfigError",
    "EngineShutDownError",
    "InsufficientKVCacheError",
    "InvalidRequestError",
    "InvalidRequestsError",
    "InvalidSamplingParamsError",
    "KVCacheMemoryError",
    "NoTokenizerError",
    "PromptTooLongError",
    "TensorParallelConfigError",
    "TensorParallelError",
    "UnsupportedSamplingParamsError",
    "WorkerFailedError",
]
