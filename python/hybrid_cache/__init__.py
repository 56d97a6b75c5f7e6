"""hybrid-cache: a KV-cache allocator and small inference engine for hybrid-attention LLMs."""

from hybrid_cache._core import __version__

__all__ = ["__version__"]
