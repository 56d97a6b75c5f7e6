"""Llama-3 (also Mistral, and the base of Qwen2/Qwen3): pre-norm decoder, GQA, gated SiLU MLP.

Module and parameter names follow transformers' checkpoints (`model.layers.N.self_attn.q_proj`…),
so loading is a name-for-name copy. Options the variants switch on: biases on q/k/v (Qwen2), per
head RMSNorm on q and k before rotary (Qwen3), a sliding window on every layer (Mistral) or on the
layers `layer_types` marks as sliding.
"""

from __future__ import annotations

import torch
from torch import nn

from hybrid_cache.attention.layer import Attention
from hybrid_cache.models import hf_config
from hybrid_cache.models.hf_config import Config
from hybrid_cache.models.layers import GatedMLP, ProjectedSelfAttention, RMSNorm
from hybrid_cache.models.rotary import RotaryEmbedding


class LlamaAttention(ProjectedSelfAttention):
    def __init__(
        self, config: Config, layer_index: int, qkv_bias: bool, o_bias: bool, qk_norm: bool
    ) -> None:
        super().__init__(config, qkv_bias=qkv_bias, o_bias=o_bias, qk_norm=qk_norm)
        layer_type = hf_config.layer_types(config, default=self.default_layer_type(config))[
            layer_index
        ]
        window = hf_config.sliding_window(config) if layer_type == "sliding_attention" else None
        self.rotary = RotaryEmbedding(self.head_dim, hf_config.rope_parameters(config))
        self.attn = Attention(
            layer_index,
            self.num_heads,
            self.num_kv_heads,
            self.head_dim,
            scale=self.head_dim**-0.5,
            sliding_window=window,
        )

    @staticmethod
    def default_layer_type(config: Config) -> str:
        """Without `layer_types`, a config with a sliding window (Mistral) slides on every layer."""
        return "sliding_attention" if hf_config.sliding_window(config) else "full_attention"


class LlamaDecoderLayer(nn.Module):
    def __init__(
        self, config: Config, layer_index: int, qkv_bias: bool, o_bias: bool, qk_norm: bool
    ) -> None:
        super().__init__()
        eps = config["rms_norm_eps"]
        self.input_layernorm = RMSNorm(config["hidden_size"], eps)
        self.self_attn = LlamaAttention(config, layer_index, qkv_bias, o_bias, qk_norm)
        self.post_attention_layernorm = RMSNorm(config["hidden_size"], eps)
        self.mlp = GatedMLP(
            config["hidden_size"],
            config["intermediate_size"],
            config.get("hidden_act", "silu"),
            bias=bool(config.get("mlp_bias", False)),
        )

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        hidden = hidden + self.self_attn(positions, self.input_layernorm(hidden))
        return hidden + self.mlp(self.post_attention_layernorm(hidden))


class LlamaModel(nn.Module):
    def __init__(self, config: Config, qkv_bias: bool, o_bias: bool, qk_norm: bool) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(config["vocab_size"], config["hidden_size"])
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(config, index, qkv_bias, o_bias, qk_norm)
            for index in range(config["num_hidden_layers"])
        )
        self.norm = RMSNorm(config["hidden_size"], config["rms_norm_eps"])

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        hidden = self.embed_tokens(input_ids)
        for layer in self.layers:
            hidden = layer(positions, hidden)
        return self.norm(hidden)


class LlamaForCausalLM(nn.Module):
    """`forward(input_ids [T], positions [T]) -> hidden [T, H]`; `compute_logits(hidden)`."""

    def __init__(self, config: Config) -> None:
        super().__init__()
        self.config = config
        self.model = LlamaModel(config, **self.attention_options(config))
        self.lm_head = nn.Linear(config["hidden_size"], config["vocab_size"], bias=False)

    @classmethod
    def attention_options(cls, config: Config) -> dict[str, bool]:
        bias = bool(config.get("attention_bias", False))
        return {"qkv_bias": bias, "o_bias": bias, "qk_norm": False}

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids, positions)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)
