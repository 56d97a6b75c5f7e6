"""`AttentionParams`: one layer's score options, the last argument of every backend's
`paged_attention(q, k_cache, v_cache, metadata, group, params)`.

The `Attention` layer builds it when its options are set (not per step); the visibility rules
and the order of operations on the logits are in `reference`'s docstring.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Optional

import torch


@dataclass(frozen=True, eq=False)
class AttentionParams:
    """How one layer scores its keys. Compared by identity (`sinks` is a tensor).

    scale           logits are `scale * q.k`
    sliding_window  W: a query at p sees keys p-W+1 .. p; None for no window
    softcap         cap: logits become `cap * tanh(s / cap)`; None for none
    sinks           [Hq] per-head sink logits (gpt-oss), added to the softmax denominator only
    chunk           C: chunked-local attention, a query sees only its own chunk; None for none
    """

    scale: float
    sliding_window: Optional[int] = None
    softcap: Optional[float] = None
    sinks: Optional[torch.Tensor] = None
    chunk: Optional[int] = None

    def with_sinks(self, sinks: Optional[torch.Tensor]) -> AttentionParams:
        """These options with `sinks` (itself when they already hold that very tensor)."""
        if sinks is self.sinks:
            return self
        return dataclasses.replace(self, sinks=sinks)
