"""The error the kernel launchers raise before launching anything."""

# Imported from the extension rather than `hybrid_cache.errors`: that module re-exports
# `KernelArgumentError` from here, and importing it back would be a cycle. It is the same class.
from hybrid_cache._core import HybridCacheError


class KernelArgumentError(HybridCacheError, ValueError):
    """A kernel launcher was given tensors of the wrong shape, dtype, device or layout.

    Raised before anything is launched; the message names the argument and what to change.
    """
