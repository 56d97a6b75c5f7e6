"""Every exception hybrid-cache raises derives from `HybridCacheError`.

The allocator's errors are defined by the Rust extension (one class per core error kind) and
re-exported here; Python-side modules define their own subclasses next to the code that raises
them and re-export them here too.
"""

from typing import TYPE_CHECKING

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
from hybrid_cache.config import ConfigError, UnknownArchitectureError, UnknownModelError
from hybrid_cache.kernels.errors import KernelArgumentError
from hybrid_cache.planner import (
    BudgetTooSmallError,
    InvalidBlockSizeError,
    PlanError,
    WindowTooLargeError,
)
from hybrid_cache.sizes import MemorySizeError

if TYPE_CHECKING:
    from hybrid_cache.attention.selector import (
        AttentionBackendUnavailableError,
        UnknownAttentionBackendError,
    )
    from hybrid_cache.engine.errors import (
        EngineConfigError,
        InsufficientKVCacheError,
        InvalidRequestError,
        InvalidSamplingParamsError,
        PromptTooLongError,
    )
    from hybrid_cache.models.loader import (
        ModelLoadError,
        UnsupportedArchitectureError,
        WeightMismatchError,
    )

# Errors of the model side, re-exported lazily so importing this module does not import torch.
_LAZY_ERRORS = {
    "ModelLoadError": "hybrid_cache.models.loader",
    "UnsupportedArchitectureError": "hybrid_cache.models.loader",
    "WeightMismatchError": "hybrid_cache.models.loader",
    "UnknownAttentionBackendError": "hybrid_cache.attention.selector",
    "AttentionBackendUnavailableError": "hybrid_cache.attention.selector",
    # The engine's errors (they subclass classes defined above, so they cannot be eager here).
    "EngineConfigError": "hybrid_cache.engine.errors",
    "InsufficientKVCacheError": "hybrid_cache.engine.errors",
    "InvalidRequestError": "hybrid_cache.engine.errors",
    "InvalidSamplingParamsError": "hybrid_cache.engine.errors",
    "PromptTooLongError": "hybrid_cache.engine.errors",
}


def __getattr__(name: str) -> type:
    if name in _LAZY_ERRORS:
        import importlib

        return getattr(importlib.import_module(_LAZY_ERRORS[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "AttentionBackendUnavailableError",
    "BudgetTooSmallError",
    "ConfigError",
    "DoubleFreeError",
    "DuplicateRequestError",
    "EngineConfigError",
    "HybridCacheError",
    "InsufficientKVCacheError",
    "InvalidArgumentError",
    "InvalidBlockError",
    "InvalidBlockSizeError",
    "InvalidGroupError",
    "InvalidRequestError",
    "InvalidSamplingParamsError",
    "KernelArgumentError",
    "MemorySizeError",
    "ModelLoadError",
    "NoFreeBlocksError",
    "PlanError",
    "PromptTooLongError",
    "RequestTooLargeError",
    "TooManyRequestsError",
    "UnknownArchitectureError",
    "UnknownAttentionBackendError",
    "UnknownModelError",
    "UnknownRequestError",
    "UnsupportedArchitectureError",
    "WeightMismatchError",
    "WindowTooLargeError",
]
