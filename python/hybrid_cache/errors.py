"""The exceptions of hybrid-cache: one class per core error kind, all under `HybridCacheError`.

They are defined by the Rust extension; other Python modules subclass `HybridCacheError` from
here for their own errors.
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
