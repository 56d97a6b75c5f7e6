"""Llama-3 (also Mistral, and the base of Qwen2/Qwen3): pre-norm decoder, GQA, gated SiLU MLP.

Module and parameter names follow transformers' checkpoints (`model.layers.N.self_attn.q_proj`…),
so loading is a name-for-name copy. Options the variants switch on: biases on q/k/v (Qwen2), per
head RMSNorm on q and k before rotary (Qwen3). Which layers slide, and how far, is the
`ModelSpec`'s (every layer for Mistral with a window; Qwen2/3's layers from `max_window_layers`
on with `use_sliding_window`, or `layer_types`).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from hybrid_cache.config import ModelSpec
from hybrid_cache.models.layers import GatedMLP, ProjectedSelfAttention, RMSNorm
from hybrid_cache.models.parallel_layers import lm_head, vocab_embedding
from hybrid_cache.models.rotary import RotaryEmbedding, rope_parameters


class LlamaAttention(ProjectedSelfAttention):
    def __init__(
        self, spec: ModelSpec, layer_index: int, qkv_bias: bool, o_bias: bool, qk_norm: bool
    ) -> None:
        super().__init__(spec, layer_index, qkv_bias=qkv_bias, o_bias=o_bias, qk_norm=qk_norm)
        self.rotary = RotaryEmbedding(self.head_dim, rope_parameters(spec.text_config))


class LlamaDecoderLayer(nn.Module):
    def __init__(
        self, spec: ModelSpec, layer_index: int, qkv_bias: bool, o_bias: bool, qk_norm: bool
    ) -> None:
        super().__init__()
        config = spec.text_config
        eps = config["rms_norm_eps"]
        self.input_layernorm = RMSNorm(spec.hidden_size, eps)
        self.self_attn = LlamaAttention(spec, layer_index, qkv_bias, o_bias, qk_norm)
        self.post_attention_layernorm = RMSNorm(spec.hidden_size, eps)
        self.mlp = GatedMLP(
            spec.hidden_size,
            config["intermediate_size"],
            config["hidden_act"],
            bias=bool(config.get("mlp_bias", False)),
        )

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        hidden = hidden + self.self_attn(positions, self.input_layernorm(hidden))
        return hidden + self.mlp(self.post_attention_layernorm(hidden))


class LlamaModel(nn.Module):
    def __init__(self, spec: ModelSpec, qkv_bias: bool, o_bias: bool, qk_norm: bool) -> None:
        super().__init__()
        self.embed_tokens = vocab_embedding(spec.vocab_size, spec.hidden_size)
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(spec, index, qkv_bias, o_bias, qk_norm)
            for index in range(spec.num_layers)
        )
        self.norm = RMSNorm(spec.hidden_size, spec.text_config["rms_norm_eps"])

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        hidden = self.embed_tokens(input_ids)
        for layer in self.layers:
            hidden = layer(positions, hidden)
        return self.norm(hidden)


class LlamaForCausalLM(nn.Module):
    """`forward(input_ids [T], positions [T]) -> hidden [T, H]`; `compute_logits(hidden)` (None
    on tensor-parallel ranks other than 0 when the LM head is vocabulary-parallel)."""

    def __init__(self, spec: ModelSpec) -> None:
        super().__init__()
        self.spec = spec
        self.config = spec.text_config
        self.model = LlamaModel(spec, **self.attention_options(spec.text_config))
        self.lm_head = lm_head(spec.hidden_size, spec.vocab_size)

    @classmethod
    def attention_options(cls, config: dict[str, Any]) -> dict[str, bool]:
        bias = bool(config.get("attention_bias", False))  # Mistral has no such field
        return {"qkv_bias": bias, "o_bias": bias, "qk_norm": False}

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids, positions)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)
