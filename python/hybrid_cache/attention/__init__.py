"""Attention for the engine: per-step metadata, the forward context, backends and the layer."""

from hybrid_cache.attention.backends import get_attention_backend, register_attention_backend
from hybrid_cache.attention.forward_context import (
    ForwardContext,
    get_forward_context,
    set_forward_context,
)
from hybrid_cache.attention.layer import (
    Attention,
    assign_layer_groups,
    attention_layers,
    set_attention_backend,
)
from hybrid_cache.attention.metadata import (
    AttentionMetadata,
    GroupMetadata,
    build_attention_metadata,
    compute_positions,
    compute_slot_mapping,
)

__all__ = [
    "Attention",
    "AttentionMetadata",
    "ForwardContext",
    "GroupMetadata",
    "assign_layer_groups",
    "attention_layers",
    "build_attention_metadata",
    "compute_positions",
    "compute_slot_mapping",
    "get_attention_backend",
    "get_forward_context",
    "register_attention_backend",
    "set_attention_backend",
    "set_forward_context",
]
