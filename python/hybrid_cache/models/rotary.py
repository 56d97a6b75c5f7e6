"""Rotary position embeddings: the rotary parameters of a config (`rope_parameters`), the inverse
frequencies of each `rope_type` (default, linear, llama3, yarn) and the neox-style rotation of
queries and keys.

Configs on disk come in two generations: transformers >= 5 writes `rope_parameters` (nested by
layer type for Gemma-3), older ones write `rope_theta` + `rope_scaling` (+ Gemma-3's
`rope_local_base_freq`); `rope_parameters` accepts both so a model file reads one shape.

A step's cos/sin tables depend only on its positions and the rope parameters, so they are built
once per step and shared by every layer with the same parameters (cached on the positions
tensor, like the attention backends cache their step plans on the step's metadata).
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from hybrid_cache.models import cpu_ops
from hybrid_cache.step_cache import cached_on

# Attribute of a step's positions tensor holding its cos/sin tables, keyed by rope parameters.
_TABLES = "_rotary_tables"
ROPE_TYPES_WITH_ORIGINAL_LENGTH = ("llama3", "yarn", "longrope")


def rope_parameters(config: dict[str, Any], layer_type: str | None = None) -> dict[str, Any]:
    """The rotary parameters of `layer_type` (or of every layer), with `rope_type`, `rope_theta`
    and, for scaled types, `original_max_position_embeddings` filled in."""
    params = config.get("rope_parameters")
    if params and layer_type is not None and layer_type in params:
        params = params[layer_type]
    elif params and any(isinstance(value, dict) for value in params.values()):
        params = params.get("full_attention", next(iter(params.values())))
    if not params:
        params = dict(config.get("rope_scaling") or {})
        if layer_type == "sliding_attention" and "rope_local_base_freq" in config:
            params = {"rope_theta": config["rope_local_base_freq"]}
        params.setdefault("rope_theta", config.get("rope_theta", 10000.0))
    params = dict(params)
    params.setdefault("rope_type", params.get("type", "default"))
    if "partial_rotary_factor" in config:
        params.setdefault("partial_rotary_factor", config["partial_rotary_factor"])
    if params["rope_type"] in ROPE_TYPES_WITH_ORIGINAL_LENGTH:
        params.setdefault(
            "original_max_position_embeddings",
            config.get("original_max_position_embeddings", config["max_position_embeddings"]),
        )
    return params


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
        # Layers with equal parameters share a step's tables.
        self._table_key = (self.attention_scaling, tuple(self.inv_freq.tolist()))

    def forward(
        self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """q [T, Hq, D], k [T, Hkv, D] rotated by each token's position [T]."""
        if q.is_cuda and q.shape[-1] == k.shape[-1] == self.rotary_dim:
            cos, sin = self.wide_tables(positions, q.dtype)
            return self.rotate_wide(q, cos, sin), self.rotate_wide(k, cos, sin)
        cos, sin = self.tables(positions, q.dtype)
        return self._rotate(q, cos, sin), self._rotate(k, cos, sin)

    def tables(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
        """cos and sin [T, 1, rotary_dim / 2] of each position's angles (scaled), built by the
        step's first layer with these parameters and reused by the others. Like the attention
        step plans, the cache assumes a positions tensor is not rewritten in place once used (the
        model runner builds a new one every step)."""
        key = (self._table_key, dtype)
        return cached_on(positions, _TABLES, key, (), lambda: self._build_tables(positions, dtype))

    def wide_tables(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
        """`tables` over the whole rotary width for `rotate_wide`: (cos, cos) and (-sin, sin)
        [T, 1, rotary_dim], built once per step like `tables`."""
        key = (self._table_key, dtype, "wide")

        def build() -> tuple[torch.Tensor, ...]:
            cos, sin = self.tables(positions, dtype)
            return torch.cat((cos, cos), -1), torch.cat((-sin, sin), -1)

        return cached_on(positions, _TABLES, key, (), build)

    def rotate_wide(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """`_rotate` of x [T, H, rotary_dim] in 4 operators instead of 11 (each one launched
        costs host time on CUDA, where it runs): x * (cos, cos) + (x2, x1) * (-sin, sin), the
        halves swapped by one `roll`. The same products and sums, each rounded once in x's
        dtype (negating is exact), so the same values as `_rotate`; it allocates two full-size
        temporaries where `_rotate` writes one output, which on the CPU costs more."""
        out = x * cos
        out.add_(torch.roll(x, self.rotary_dim // 2, -1) * sin)
        return out

    def _build_tables(
        self, positions: torch.Tensor, dtype: torch.dtype
    ) -> tuple[torch.Tensor, ...]:
        if self.inv_freq.device != positions.device:
            self.inv_freq = self.inv_freq.to(positions.device)
        angles = (positions.float()[:, None] * self.inv_freq[None, :])[:, None, :]
        cos = (angles.cos() * self.attention_scaling).to(dtype)
        sin = (angles.sin() * self.attention_scaling).to(dtype)
        return cos, sin

    def _rotate(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """(x1, x2) -> (x1 cos - x2 sin, x2 cos + x1 sin) on the rotary dims, the rest copied.

        Written into one output with in-place ops: the same products and sums, each rounded
        once in x's dtype, as `x * cos + rotate_half(x) * sin`, without that form's three
        full-size temporaries (on the CPU, fresh multi-megabyte buffers cost page faults). On CPU
        float32 tensors the fused Rust op does the same in one pass (`cpu_ops.rotary_neox`)."""
        fused = cpu_ops.rotary_neox(x, cos, sin, self.rotary_dim)
        if fused is not None:
            return fused
        half = self.rotary_dim // 2
        x1, x2 = x[..., :half], x[..., half : self.rotary_dim]
        out = torch.empty_like(x)
        first, second = out[..., :half], out[..., half : self.rotary_dim]
        torch.mul(x1, cos, out=first)
        first.sub_(x2 * sin)
        torch.mul(x2, cos, out=second)
        second.add_(x1 * sin)
        if self.rotary_dim < x.shape[-1]:
            out[..., self.rotary_dim :] = x[..., self.rotary_dim :]
        return out
