"""Building blocks shared by the model files: RMSNorm, gated MLPs, and the projections around
paged attention (rotary embeddings: `rotary`). Under tensor parallelism (`parallel_layers`) the
projections hold one rank's heads and MLP columns; at one rank they are plain `nn.Linear`s."""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from hybrid_cache.attention.layer import Attention
from hybrid_cache.config import ModelSpec
from hybrid_cache.models import cpu_ops
from hybrid_cache.models.parallel_layers import (
    column_parallel_linear,
    current_shard,
    declare_sharded,
    row_parallel_linear,
)


class RMSNorm(nn.Module):
    """RMSNorm with the statistics in float32: `x / rms(x) * (offset + weight)`.

    Llama-style models use offset 0 (weight initialised to 1) and round the normalised value to
    the model dtype *before* the weight multiply; Gemma uses offset 1 (the stored weight is a delta
    around 1) and gpt-oss multiplies in float32, both rounding after (`round_before_weight=False`).
    The two orders differ in bf16, so each model picks the one its checkpoint was trained with.
    On CPU float32 tensors (where both orders are the same) the fused Rust op runs
    (`cpu_ops.rms_norm`).
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
        fused = cpu_ops.rms_norm(x, self.weight, self.offset, self.eps)
        if fused is not None:
            return fused
        if x.is_cuda:
            return self.forward_fused(x)
        x_float = x.float()
        normed = x_float * torch.rsqrt(x_float.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.round_before_weight:
            return self.weight * normed.to(x.dtype)
        return (normed * (self.offset + self.weight.float())).to(x.dtype)

    def forward_fused(self, x: torch.Tensor) -> torch.Tensor:
        """`forward` through torch's `rms_norm` on the float32 values (one fused kernel on CUDA,
        where each operator launched costs host time: 10 operators become 3-5), rounding as
        `forward` does; on the CPU it is what CUDA runs, for tests."""
        x_float = x.float()
        shape = x.shape[-1:]
        if self.round_before_weight:
            return self.weight * F.rms_norm(x_float, shape, eps=self.eps).to(x.dtype)
        scale = self.weight.float()
        if self.offset != 0.0:
            scale = scale + self.offset
        return F.rms_norm(x_float, shape, scale, eps=self.eps).to(x.dtype)


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
    """`down(act(gate(x)) * up(x))`, the Llama/Qwen/Gemma feed-forward (HF weight names); on CPU
    float32 tensors `act(gate) * up` is one fused Rust op (`cpu_ops.gated`) for silu and
    gelu-tanh. Sharded: gate/up column-parallel, down row-parallel (one all-reduce)."""

    def __init__(
        self, hidden_size: int, intermediate_size: int, act: str, bias: bool = False
    ) -> None:
        super().__init__()
        self.gate_proj = column_parallel_linear(hidden_size, intermediate_size, bias)
        self.up_proj = column_parallel_linear(hidden_size, intermediate_size, bias)
        self.down_proj = row_parallel_linear(intermediate_size, hidden_size, bias)
        self.act = activation(act)
        self.act_name = act

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_proj(x), self.up_proj(x)
        hidden = cpu_ops.gated(self.act_name, gate, up)
        if hidden is None:
            hidden = self.act(gate) * up
        return self.down_proj(hidden)


class ProjectedSelfAttention(nn.Module):
    """The part of self-attention every model shares: q/k/v/o projections (transformers' names,
    so checkpoints load as they are), optional per-head q/k RMSNorm, rotary embedding, then the
    paged `Attention`. Subclasses set `self.rotary` (rope parameters differ per model).

    The layer's attention comes from the `ModelSpec` and nothing else: its kind, window or chunk
    from `spec.layers[layer_index]`, its kv heads and head dim likewise, and a learned sink logit
    per query head (`self.sinks`, passed to `Attention`) when `spec.attention_sinks` (gpt-oss).

    Sharded (`current_shard()`): a rank holds its query heads (q rows, their sinks, o columns)
    and the KV heads they read (`TensorShard.kv_heads`: split, or replicated when there are
    fewer KV heads than ranks); scale and softcap are per head, so unchanged."""

    def __init__(
        self,
        spec: ModelSpec,
        layer_index: int,
        *,
        qkv_bias: bool,
        o_bias: bool,
        scale: float | None = None,
        softcap: float | None = None,
        qk_norm: bool = False,
        qk_norm_offset: float = 0.0,
    ) -> None:
        super().__init__()
        layer = spec.layers[layer_index]
        hidden = spec.hidden_size
        shard = current_shard()
        head_dim = self.head_dim = layer.head_dim_k
        q_heads = shard.split(spec.num_attention_heads)
        kv_heads = shard.kv_heads(layer.num_kv_heads)
        self.num_heads = q_heads[1] - q_heads[0]
        self.num_kv_heads = kv_heads[1] - kv_heads[0]
        q_rows = (q_heads[0] * head_dim, q_heads[1] * head_dim)
        kv_rows = (kv_heads[0] * head_dim, kv_heads[1] * head_dim)
        q_width, kv_width = spec.num_attention_heads * head_dim, layer.num_kv_heads * head_dim
        self.q_proj = column_parallel_linear(hidden, q_width, qkv_bias, q_rows)
        self.k_proj = column_parallel_linear(hidden, kv_width, qkv_bias, kv_rows)
        self.v_proj = column_parallel_linear(hidden, kv_width, qkv_bias, kv_rows)
        self.o_proj = row_parallel_linear(q_width, hidden, o_bias, q_rows)
        self.qk_norm = qk_norm
        if qk_norm:
            eps = spec.text_config["rms_norm_eps"]
            self.q_norm = RMSNorm(self.head_dim, eps, offset=qk_norm_offset)
            self.k_norm = RMSNorm(self.head_dim, eps, offset=qk_norm_offset)
        self.sinks = nn.Parameter(torch.empty(self.num_heads)) if spec.attention_sinks else None
        if self.sinks is not None and shard.size > 1:
            declare_sharded(self, "sinks", 0, q_heads, spec.num_attention_heads)
        self.attn = Attention(
            layer_index,
            self.num_heads,
            self.num_kv_heads,
            self.head_dim,
            scale=self.head_dim**-0.5 if scale is None else scale,
            sliding_window=layer.window,
            chunk=layer.chunk,
            softcap=softcap,
        )

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        num_tokens = hidden.shape[0]
        q = self.q_proj(hidden).view(num_tokens, self.num_heads, self.head_dim)
        k = self.k_proj(hidden).view(num_tokens, self.num_kv_heads, self.head_dim)
        v = self.v_proj(hidden).view(num_tokens, self.num_kv_heads, self.head_dim)
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = self.rotary(positions, q, k)
        out = self.attn(q, k, v, sinks=self.sinks)
        return self.o_proj(out.reshape(num_tokens, self.num_heads * self.head_dim))
