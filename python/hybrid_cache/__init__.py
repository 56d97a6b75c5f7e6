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
