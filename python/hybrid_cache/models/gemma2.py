"""Gemma-2 (and the base of Gemma-3): sandwich norms, softcaps, alternating sliding windows.

Differences from Llama, each a place where a token can flip if missed:
- embeddings are multiplied by sqrt(hidden_size) (rounded to the model dtype first);
- RMSNorm multiplies by (1 + weight);
- every block norms its input *and* its output (post_attention / pre_ and post_feedforward);
- attention scale is query_pre_attn_scalar ** -0.5, not head_dim ** -0.5;
- attention logits are soft-capped (`attn_logit_softcapping`) and so are the final logits
  (`final_logit_softcapping`);
- `layer_types` alternates sliding and full layers (default: even layers slide).
"""

from __future__ import annotations

import torch
from torch import nn

from hybrid_cache.attention.layer import Attention
from hybrid_cache.models import hf_config
from hybrid_cache.models.hf_config import Config
from hybrid_cache.models.layers import GatedMLP, ProjectedSelfAttention, RMSNorm
from hybrid_cache.models.rotary import RotaryEmbedding


class GemmaAttention(ProjectedSelfAttention):
    def __init__(self, config: Config, layer_index: int, layer_type: str, qk_norm: bool) -> None:
        bias = bool(config.get("attention_bias", False))
        super().__init__(config, qkv_bias=bias, o_bias=bias, qk_norm=qk_norm, qk_norm_offset=1.0)
        # Gemma-3 gives local and global layers different rotary bases; Gemma-2 one for all.
        rope_layer_type = layer_type if qk_norm else None
        self.rotary = RotaryEmbedding(
            self.head_dim, hf_config.rope_parameters(config, rope_layer_type)
        )
        window = hf_config.sliding_window(config) if layer_type == "sliding_attention" else None
        self.attn = Attention(
            layer_index,
            self.num_heads,
            self.num_kv_heads,
            self.head_dim,
            scale=config["query_pre_attn_scalar"] ** -0.5,
            sliding_window=window,
            softcap=config.get("attn_logit_softcapping"),
        )


class GemmaDecoderLayer(nn.Module):
    def __init__(self, config: Config, layer_index: int, layer_type: str, qk_norm: bool) -> None:
        super().__init__()
        hidden, eps = config["hidden_size"], config["rms_norm_eps"]
        self.input_layernorm = RMSNorm(hidden, eps, offset=1.0)
        self.self_attn = GemmaAttention(config, layer_index, layer_type, qk_norm)
        self.post_attention_layernorm = RMSNorm(hidden, eps, offset=1.0)
        self.pre_feedforward_layernorm = RMSNorm(hidden, eps, offset=1.0)
        self.mlp = GatedMLP(
            hidden,
            config["intermediate_size"],
            config.get("hidden_activation", "gelu_pytorch_tanh"),
        )
        self.post_feedforward_layernorm = RMSNorm(hidden, eps, offset=1.0)

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        attended = self.self_attn(positions, self.input_layernorm(hidden))
        hidden = hidden + self.post_attention_layernorm(attended)
        fed = self.mlp(self.pre_feedforward_layernorm(hidden))
        return hidden + self.post_feedforward_layernorm(fed)


class GemmaModel(nn.Module):
    def __init__(self, config: Config, layer_types: list[str], qk_norm: bool) -> None:
        super().__init__()
        self.hidden_size = config["hidden_size"]
        self.embed_tokens = nn.Embedding(config["vocab_size"], self.hidden_size)
        self.layers = nn.ModuleList(
            GemmaDecoderLayer(config, index, layer_type, qk_norm)
            for index, layer_type in enumerate(layer_types)
        )
        self.norm = RMSNorm(self.hidden_size, config["rms_norm_eps"], offset=1.0)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        hidden = self.embed_tokens(input_ids)
        hidden = hidden * torch.tensor(self.hidden_size**0.5, dtype=hidden.dtype)
        for layer in self.layers:
            hidden = layer(positions, hidden)
        return self.norm(hidden)


class Gemma2ForCausalLM(nn.Module):
    """`forward(input_ids [T], positions [T]) -> hidden [T, H]`; `compute_logits(hidden)`."""

    QK_NORM = False
    SLIDING_WINDOW_PATTERN = 2  # without layer_types: layer i slides unless (i + 1) % pattern == 0

    def __init__(self, config: Config) -> None:
        super().__init__()
        self.config = config
        pattern = config.get("sliding_window_pattern", self.SLIDING_WINDOW_PATTERN)
        default_types = [
            "sliding_attention" if (index + 1) % pattern else "full_attention"
            for index in range(config["num_hidden_layers"])
        ]
        layer_types = config.get("layer_types") or default_types
        assert len(layer_types) == config["num_hidden_layers"], "layer_types must list every layer"
        self.model = GemmaModel(config, list(layer_types), self.QK_NORM)
        self.lm_head = nn.Linear(config["hidden_size"], config["vocab_size"], bias=False)
        self.final_logit_softcapping = config.get("final_logit_softcapping")

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids, positions)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.lm_head(hidden)
        cap = self.final_logit_softcapping
        return logits if cap is None else cap * torch.tanh(logits / cap)
