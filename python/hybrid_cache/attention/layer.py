"""`Attention`: the paged attention step every model calls, whatever the backend.

The layer owns no weights: projections, norms and rotary embeddings stay in the model. Per
forward it takes the already projected and rotated q/k/v of the flattened batch, writes k/v into
its layer's cache at the group's slots, and attends over the group's block table, with its own
window/chunk, softcap and scale. Its K/V tensors and the step's metadata come from the forward
context (`set_forward_context`), bound by the model runner:

    kv_caches[layer_index] -> (k_cache, v_cache)     metadata.groups[group_id] -> block table, slots
"""

from __future__ import annotations

import dataclasses
from typing import Any, Optional, Sequence

import torch
from torch import nn

from hybrid_cache.attention.backends import get_attention_backend
from hybrid_cache.attention.forward_context import get_forward_context
from hybrid_cache.attention.params import AttentionParams
from hybrid_cache.errors import LayerGroupMismatchError


def _score_option(name: str) -> Any:
    """A layer attribute kept in the layer's `params`; setting it rebuilds them (they are frozen)."""

    def get(layer: Attention) -> Any:
        return getattr(layer.params, name)

    def set_(layer: Attention, value: Any) -> None:
        layer.params = dataclasses.replace(layer.params, **{name: value})

    return property(get, set_, doc=f"`params.{name}`; settable.")


class Attention(nn.Module):
    """Paged attention for one layer (no parameters).

    Its score options (`scale`, `sliding_window`, `chunk`, `softcap`) live in `params`, the
    `AttentionParams` handed to the backend; they are built here, and again only when one of
    them is set, not per step. The sinks the model passes to `forward` join them on the first
    call (and whenever a different tensor comes)."""

    scale = _score_option("scale")
    sliding_window = _score_option("sliding_window")
    chunk = _score_option("chunk")
    softcap = _score_option("softcap")

    def __init__(
        self,
        layer_index: int,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        scale: float,
        sliding_window: int | None = None,
        chunk: int | None = None,
        softcap: float | None = None,
        backend: str = "torch",
    ) -> None:
        super().__init__()
        assert num_heads % num_kv_heads == 0, "query heads must be a multiple of kv heads"
        self.layer_index = layer_index
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.params = AttentionParams(
            scale=scale, sliding_window=sliding_window, softcap=softcap, chunk=chunk
        )
        self.backend = backend
        # The KV-cache group whose block table this layer reads; set by the runner from its plan.
        self.group_id = 0

    @property
    def kind(self) -> str:
        """ "sliding_window", "chunked_local" or "full" (the planner's names)."""
        if self.sliding_window is not None:
            return "sliding_window"
        return "full" if self.chunk is None else "chunked_local"

    @property
    def reach(self) -> int | None:
        """The sliding window W or the chunk size C; None for full attention."""
        return self.sliding_window if self.sliding_window is not None else self.chunk

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """q [T, Hq, D], k/v [T, Hkv, D] -> [T, Hq, D]. `sinks` [Hq]: gpt-oss per-head sink logits
        (a parameter of the model's attention module, passed here so weights keep HF names)."""
        context = get_forward_context()
        k_cache, v_cache = context.kv_caches[self.layer_index]
        group = context.metadata.groups[self.group_id]
        backend = get_attention_backend(self.backend)
        if group.write_rows is not None:  # a tail replay: cached KV is read, not rewritten
            k, v = k[group.write_rows], v[group.write_rows]
        backend.write_kv(k_cache, v_cache, k, v, group.slot_mapping)
        params = self.params.with_sinks(sinks)
        if params is not self.params:  # the model's sinks tensor: once, on the first call
            self.params = params
        return backend.paged_attention(q, k_cache, v_cache, context.metadata, group, params)


def attention_layers(model: nn.Module) -> list[Attention]:
    """The model's `Attention` layers, ordered by layer index."""
    layers = [module for module in model.modules() if isinstance(module, Attention)]
    return sorted(layers, key=lambda layer: layer.layer_index)


GroupAttention = tuple[str, Optional[int]]  # (kind, window or chunk; None for full attention)


def assign_layer_groups(
    model: nn.Module,
    group_of_layer: Sequence[int],
    group_attention: Sequence[GroupAttention],
    full_accepts_reach: Optional[int] = None,
) -> None:
    """Tells each attention layer which KV-cache group (block table) it reads, after checking
    that the group keeps exactly what the layer attends to.

    `group_of_layer[i]`: the group of the i-th attention layer (by layer index);
    `group_attention[g]`: group g's (kind, window or chunk), as a layer's `kind`/`reach`. A layer's own
    (kind, window or chunk) must equal its group's, except that a full-attention group also
    holds windowed or chunked layers whose window/chunk is at least `full_accepts_reach` (the
    planner plans those as full attention since they never slide; 1 for its uniform mode,
    where every group is full). Anything else raises `LayerGroupMismatchError` naming the layer,
    and no layer is assigned."""
    layers = attention_layers(model)
    if len(group_of_layer) != len(layers):
        raise LayerGroupMismatchError(
            f"{len(group_of_layer)} group ids for {len(layers)} attention layers"
        )
    for layer, group_id in zip(layers, group_of_layer):
        if not 0 <= group_id < len(group_attention):
            raise LayerGroupMismatchError(
                f"layer {layer.layer_index} is assigned group {group_id}, but there are "
                f"{len(group_attention)} groups"
            )
        kind, reach = group_attention[group_id]
        if (layer.kind, layer.reach) == (kind, reach):
            continue
        demoted = layer.reach is not None and full_accepts_reach is not None
        if kind == "full" and demoted and layer.reach >= full_accepts_reach:
            continue
        own = layer.kind if layer.reach is None else f"{layer.kind} {layer.reach}"
        theirs = kind if reach is None else f"{kind} {reach}"
        raise LayerGroupMismatchError(
            f"layer {layer.layer_index} attends as {own}, but its KV-cache group {group_id} "
            f"is {theirs}: the model and the KV-cache plan were built from different specs"
        )
    for layer, group_id in zip(layers, group_of_layer):
        layer.group_id = int(group_id)


def set_attention_backend(model: nn.Module, backend: str) -> None:
    """Selects the attention backend (by registered name) for every layer of `model`."""
    get_attention_backend(backend)  # fail now, with the list of names, not in the first forward
    for layer in attention_layers(model):
        layer.backend = backend
