"""The forward context: how the model runner hands per-step state to attention layers.

A model's `forward(input_ids, positions)` signature stays free of paging details; the runner wraps
the call in `with set_forward_context(metadata, kv_caches): ...` and every `Attention` layer reads
its layer's K/V tensors and its group's metadata from here. A `ContextVar` (not a module global)
keeps two runners in two threads from seeing each other's step.
"""

from __future__ import annotations

from contextvars import ContextVar, Token
from dataclasses import dataclass
from typing import Optional, Sequence

import torch

from hybrid_cache.attention.metadata import AttentionMetadata


@dataclass
class ForwardContext:
    """The step being run: its metadata and the K/V cache views of every layer."""

    metadata: AttentionMetadata
    # kv_caches[layer_index] = (k_cache, v_cache), each [num_blocks, block_size, kv_heads, head_dim]
    kv_caches: Sequence[tuple[torch.Tensor, torch.Tensor]]


_CURRENT: ContextVar[ForwardContext | None] = ContextVar(
    "hybrid_cache_forward_context", default=None
)


class _ForwardScope:
    """The `with` block of one forward (a plain class: entered once per step, it costs a
    fraction of a generator-based context manager)."""

    __slots__ = ("context", "token")

    def __init__(self, context: ForwardContext) -> None:
        self.context = context
        self.token: Optional[Token[ForwardContext | None]] = None

    def __enter__(self) -> ForwardContext:
        self.token = _CURRENT.set(self.context)
        return self.context

    def __exit__(self, *exc_info: object) -> None:
        assert self.token is not None, "the forward scope was left without being entered"
        _CURRENT.reset(self.token)
        self.token = None


def set_forward_context(
    metadata: AttentionMetadata, kv_caches: Sequence[tuple[torch.Tensor, torch.Tensor]]
) -> _ForwardScope:
    """Makes `metadata` and `kv_caches` visible to attention layers for the enclosed forward
    (`with set_forward_context(...) as context:`)."""
    return _ForwardScope(ForwardContext(metadata=metadata, kv_caches=kv_caches))


def get_forward_context() -> ForwardContext:
    """The context of the forward in progress; an error outside `set_forward_context`."""
    context = _CURRENT.get()
    assert context is not None, "attention ran outside `set_forward_context(...)`"
    return context
