"""The error the kernel launchers raise before launching anything (defined in
`hybrid_cache.errors`, re-exported here for the kernels' relative imports)."""

from hybrid_cache.errors import KernelArgumentError

__all__ = ["KernelArgumentError"]
