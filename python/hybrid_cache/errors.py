"""Every exception hybrid-cache raises derives from `HybridCacheError`.

The allocator's errors are defined by the Rust extension (one class per core error kind) and
re-exported here; Python-side modules define their own subclasses next to the code that raises
them and re-export them here too.
"""

from hybrid_cache._core import (
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
    "DoubleFreeError",
    "DuplicateRequestError",
    "HybridCacheError",
    "InvalidArgumentError",
    "InvalidBlockError",
    "InvalidGroupError",
    "NoFreeBlocksError",
    "RequestTooLargeError",
    "TooManyRequestsError",
    "UnknownRequestError",
]
