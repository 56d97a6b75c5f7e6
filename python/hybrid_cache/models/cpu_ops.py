"""Fused Rust CPU ops for the model layers: RMSNorm (`_core.rms_norm_cpu`), the gated MLP
activations `act(gate) * up` (`_core.gelu_tanh_mul_cpu`, `_core.silu_mul_cpu`) and the rotary
embedding (`_core.rotary_neox_cpu`).

Each function returns the result when the fused op applies (CPU tensors, float32,
C-contiguous, nothing that autograd would have to track, the extension built with these ops)
and None otherwise; the caller then runs its torch code unchanged. One pass over the data
instead of ~6 torch ops for an RMSNorm and 2 for an activation times up. Set
`HYBRID_CACHE_CPU_OPS=0` in the environment to turn them off.
"""

from __future__ import annotations

import os
from typing import Optional

import torch

from hybrid_cache import _core

ENABLED = os.environ.get("HYBRID_CACHE_CPU_OPS", "1") != "0" and hasattr(_core, "rms_norm_cpu")

ROTARY = getattr(_core, "rotary_neox_cpu", None)
# The activations (names of `layers.ACTIVATIONS`) with a fused `act(gate) * up`.
GATED = {
    "silu": getattr(_core, "silu_mul_cpu", None),
    "gelu_pytorch_tanh": getattr(_core, "gelu_tanh_mul_cpu", None),
}


def _fits(*tensors: torch.Tensor) -> bool:
    """CPU float32 C-contiguous non-empty tensors, none of them tracked by autograd."""
    track = torch.is_grad_enabled()
    return all(
        t.device.type == "cpu"
        and t.dtype == torch.float32
        and t.is_contiguous()
        and t.numel() > 0
        and not (track and t.requires_grad)
        for t in tensors
    )


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, offset: float, eps: float
) -> Optional[torch.Tensor]:
    """`x / sqrt(mean(x^2, -1) + eps) * (offset + weight)` over the last axis of x [..., dim]
    (e.g. a [tokens, heads, head_dim] q/k view), or None where the fused op does not apply."""
    if not (ENABLED and x.dim() >= 1 and weight.shape == x.shape[-1:] and _fits(x, weight)):
        return None
    out = torch.empty_like(x)
    _core.rms_norm_cpu(x.numpy(), weight.detach().numpy(), out.numpy(), float(offset), float(eps))
    return out


def gated(activation: str, gate: torch.Tensor, up: torch.Tensor) -> Optional[torch.Tensor]:
    """`act(gate) * up` for the activation named `activation`, or None where no fused op
    applies (another activation, other tensors)."""
    op = GATED.get(activation) if ENABLED else None
    if op is None or gate.shape != up.shape or not _fits(gate, up):
        return None
    out = torch.empty_like(gate)
    op(gate.numpy(), up.numpy(), out.numpy())
    return out


def rotary_neox(
    x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, rotary_dim: int
) -> Optional[torch.Tensor]:
    """x [tokens, heads, head_dim] rotated on its first `rotary_dim` dims by cos / sin
    [tokens, 1, rotary_dim / 2] (neox style, the rest copied), or None where the fused op does
    not apply. The same f32 operations as `RotaryEmbedding._rotate`: identical results."""
    if not (ENABLED and ROTARY is not None and x.dim() == 3 and _fits(x, cos, sin)):
        return None
    if cos.shape != (x.shape[0], 1, rotary_dim // 2) or sin.shape != cos.shape:
        return None
    out = torch.empty_like(x)
    ROTARY(x.numpy(), cos.numpy(), sin.numpy(), out.numpy(), rotary_dim)
    return out
