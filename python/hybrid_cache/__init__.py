"""hybrid-cache: a KV-cache allocator and small inference engine for hybrid-attention LLMs."""

from hybrid_cache._core import BlockPool, Coordinator, GroupSpec, __version__
from hybrid_cache.errors import (
    DoubleFreeError,
    DuplicateRequestError,
    HybridCacheError,
    InvalidArgumentError,
    InvalidBlockError,
    InvalidGroupError,
    NoFreeBlocksError,
    RequestTooLargeError,
    TooManyRequestsError,
    UnknownRequestError,
)

__all__ = [
    "BlockPool",
    "Coordinator",
    "DoubleFreeError",
    "DuplicateRequestError",
    "GroupSpec",
    "HybridCacheError",
    "InvalidArgumentError",
    "InvalidBlockError",
    "InvalidGroupError",
    "NoFreeBlocksError",
    "RequestTooLargeError",
    "TooManyRequestsError",
    "UnknownRequestError",
    "__version__",
]


_LAZY_EXPORTS = {
    "LLM": "hybrid_cache.engine.llm",
    "SamplingParams": "hybrid_cache.engine.sampling_params",
    "RequestOutput": "hybrid_cache.engine.outputs",
}
__all__ += sorted(_LAZY_EXPORTS)


def __getattr__(name: str):
    """`hybrid_cache.LLM` and friends, imported on first use so `import hybrid_cache` stays
    cheap (no torch)."""
    if name in _LAZY_EXPORTS:
        import importlib

        return getattr(importlib.import_module(_LAZY_EXPORTS[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
