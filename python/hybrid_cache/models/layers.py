"""Building blocks shared by the model files: RMSNorm, rotary embeddings, gated MLPs, and the
projections around paged attention."""

from __future__ import annotations

import math
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import nn

from hybrid_cache.models import hf_config
from hybrid_cache.models.hf_config import Config


class RMSNorm(nn.Module):
    """RMSNorm with the statistics in float32: `x / rms(x) * (offset + weight)`.

    Llama-style models use offset 0 (weight initialised to 1) and round the normalised value to
    the model dtype *before* the weight multiply; Gemma uses offset 1 (the stored weight is a delta
    around 1) and gpt-oss multiplies in float32, both rounding after (`round_before_weight=False`).
    The two orders differ in bf16, so each model picks the one its checkpoint was trained with.
    """

    def __init__(
        self, dim: int, eps: float, offset: float = 0.0, round_before_weight: bool = True
    ) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(dim))
        self.eps = eps
        self.offset = offset
        self.round_before_weight = round_before_weight and offset == 0.0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x_float = x.float()
        normed = x_float * torch.rsqrt(x_float.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.round_before_weight:
            return self.weight * normed.to(x.dtype)
        return (normed * (self.offset + self.weight.float())).to(x.dtype)


def _default_inv_freq(dim: int, base: float) -> torch.Tensor:
    exponents = torch.arange(0, dim, 2, dtype=torch.int64, device="cpu").float() / dim
    return 1.0 / (base**exponents)


def _llama3_inv_freq(dim: int, rope: dict[str, Any]) -> torch.Tensor:
    """Llama-3.1 scaling: long wavelengths divided by `factor`, short ones kept, a smooth ramp
    between `original / low_freq_factor` and `original / high_freq_factor`."""
    inv_freq = _default_inv_freq(dim, rope["rope_theta"])
    factor, low, high = rope["factor"], rope["low_freq_factor"], rope["high_freq_factor"]
    original = rope["original_max_position_embeddings"]
    wavelength = 2 * math.pi / inv_freq
    scaled = torch.where(wavelength > original / low, inv_freq / factor, inv_freq)
    smooth = (original / wavelength - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = (wavelength >= original / high) & (wavelength <= original / low)
    return torch.where(is_medium, smoothed, scaled)


def _yarn_inv_freq(dim: int, rope: dict[str, Any]) -> tuple[torch.Tensor, float]:
    """YaRN: interpolate low frequencies by `factor`, keep high ones, ramp between the dims that
    rotate `beta_slow` and `beta_fast` times over the original context; scale cos/sin by mscale."""
    base, factor = rope["rope_theta"], rope.get("factor")
    original = rope["original_max_position_embeddings"]
    if factor is None:
        factor = rope.get("max_position_embeddings", original) / original

    def mscale(scale: float, coefficient: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * coefficient * math.log(scale) + 1.0

    attention_factor = rope.get("attention_factor")
    if attention_factor is None:
        if rope.get("mscale") and rope.get("mscale_all_dim"):
            attention_factor = mscale(factor, rope["mscale"]) / mscale(
                factor, rope["mscale_all_dim"]
            )
        else:
            attention_factor = mscale(factor)
    beta_fast = rope.get("beta_fast") or 32
    beta_slow = rope.get("beta_slow") or 1

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(original / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if rope.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = torch.clamp(
        (torch.arange(dim // 2, dtype=torch.float32, device="cpu") - low) / (high - low), 0, 1
    )
    position_freqs = base ** (torch.arange(0, dim, 2, dtype=torch.float32, device="cpu") / dim)
    extrapolated, interpolated = 1.0 / position_freqs, 1.0 / (factor * position_freqs)
    keep = 1 - ramp
    return interpolated * (1 - keep) + extrapolated * keep, float(attention_factor)


def rope_inv_freq(dim: int, rope: dict[str, Any]) -> tuple[torch.Tensor, float]:
    """Inverse frequencies [dim / 2] and the cos/sin scale for a `rope_parameters` dict."""
    rope_type = rope.get("rope_type", "default")
    if rope_type == "default":
        return _default_inv_freq(dim, rope["rope_theta"]), 1.0
    if rope_type == "linear":
        return _default_inv_freq(dim, rope["rope_theta"]) / rope["factor"], 1.0
    if rope_type == "llama3":
        return _llama3_inv_freq(dim, rope), 1.0
    if rope_type == "yarn":
        return _yarn_inv_freq(dim, rope)
    raise ValueError(
        f"unsupported rope_type {rope_type!r} (supported: default, linear, llama3, yarn)"
    )


class RotaryEmbedding(nn.Module):
    """Neox-style rotary embedding (rotate halves) on the first `rotary_dim` dims of each head.

    The inverse frequencies are a plain attribute rather than a buffer so a model built on the
    meta device keeps real values; they move to the input's device on first use.
    """

    def __init__(self, head_dim: int, rope: dict[str, Any]) -> None:
        super().__init__()
        self.rotary_dim = int(head_dim * rope.get("partial_rotary_factor", 1.0))
        self.inv_freq, self.attention_scaling = rope_inv_freq(self.rotary_dim, rope)

    def forward(
        self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """q [T, Hq, D], k [T, Hkv, D] rotated by each token's position [T]."""
        if self.inv_freq.device != positions.device:
            self.inv_freq = self.inv_freq.to(positions.device)
        freqs = positions.float()[:, None] * self.inv_freq[None, :]
        angles = torch.cat([freqs, freqs], dim=-1)[:, None, :]
        cos = (angles.cos() * self.attention_scaling).to(q.dtype)
        sin = (angles.sin() * self.attention_scaling).to(q.dtype)
        return self._rotate(q, cos, sin), self._rotate(k, cos, sin)

    def _rotate(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        rotary, passthrough = x[..., : self.rotary_dim], x[..., self.rotary_dim :]
        half = self.rotary_dim // 2
        rotated_half = torch.cat([-rotary[..., half:], rotary[..., :half]], dim=-1)
        rotary = rotary * cos + rotated_half * sin
        return torch.cat([rotary, passthrough], dim=-1) if passthrough.numel() else rotary


ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "silu": F.silu,
    "gelu": F.gelu,
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
}


def activation(name: str) -> Callable[[torch.Tensor], torch.Tensor]:
    if name not in ACTIVATIONS:
        raise ValueError(f"unsupported activation {name!r} (supported: {sorted(ACTIVATIONS)})")
    return ACTIVATIONS[name]


class GatedMLP(nn.Module):
    """`down(act(gate(x)) * up(x))`, the Llama/Qwen/Gemma feed-forward (HF weight names)."""

    def __init__(
        self, hidden_size: int, intermediate_size: int, act: str, bias: bool = False
    ) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=bias)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=bias)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=bias)
        self.act = activation(act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))


class ProjectedSelfAttention(nn.Module):
    """The part of self-attention every model shares: q/k/v/o projections (transformers' names,
    so checkpoints load as they are), optional per-head q/k RMSNorm, rotary embedding, then the
    paged `Attention`. Subclasses set `self.rotary` and `self.attn` (rope, window, scale and
    softcap differ per model) and override `attend` to pass extra inputs such as sinks."""

    def __init__(
        self,
        config: Config,
        *,
        qkv_bias: bool,
        o_bias: bool,
        qk_norm: bool = False,
        qk_norm_offset: float = 0.0,
    ) -> None:
        super().__init__()
        hidden = config["hidden_size"]
        self.num_heads = config["num_attention_heads"]
        self.num_kv_heads = hf_config.num_kv_heads(config)
        self.head_dim = hf_config.head_dim(config)
        self.q_proj = nn.Linear(hidden, self.num_heads * self.head_dim, bias=qkv_bias)
        self.k_proj = nn.Linear(hidden, self.num_kv_heads * self.head_dim, bias=qkv_bias)
        self.v_proj = nn.Linear(hidden, self.num_kv_heads * self.head_dim, bias=qkv_bias)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, hidden, bias=o_bias)
        self.qk_norm = qk_norm
        if qk_norm:
            eps = config["rms_norm_eps"]
            self.q_norm = RMSNorm(self.head_dim, eps, offset=qk_norm_offset)
            self.k_norm = RMSNorm(self.head_dim, eps, offset=qk_norm_offset)

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return self.attn(q, k, v)

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        num_tokens = hidden.shape[0]
        q = self.q_proj(hidden).view(num_tokens, self.num_heads, self.head_dim)
        k = self.k_proj(hidden).view(num_tokens, self.num_kv_heads, self.head_dim)
        v = self.v_proj(hidden).view(num_tokens, self.num_kv_heads, self.head_dim)
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = self.rotary(positions, q, k)
        out = self.attend(q, k, v)
        return self.o_proj(out.reshape(num_tokens, self.num_heads * self.head_dim))
