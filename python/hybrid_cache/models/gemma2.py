"""Gemma-2 (and the base of Gemma-3): sandwich norms, softcaps, alternating sliding windows.

Differences from Llama, each a place where a token can flip if missed:
- embeddings are multiplied by sqrt(hidden_size) (rounded to the model dtype first);
- RMSNorm multiplies by (1 + weight);
- every block norms its input *and* its output (post_attention / pre_ and post_feedforward);
- attention scale is query_pre_attn_scalar ** -0.5, not head_dim ** -0.5;
- attention logits are soft-capped (`attn_logit_softcapping`) and so are the final logits
  (`final_logit_softcapping`);
- sliding and full layers alternate (the `ModelSpec`'s layers; by default even layers slide).
"""

from __future__ import annotations

import torch
from torch import nn

from hybrid_cache.config import ModelSpec
from hybrid_cache.models.layers import GatedMLP, ProjectedSelfAttention, RMSNorm
from hybrid_cache.models.parallel_layers import lm_head, vocab_embedding
from hybrid_cache.models.rotary import RotaryEmbedding, rope_parameters


class GemmaAttention(ProjectedSelfAttention):
    def __init__(self, spec: ModelSpec, layer_index: int, qk_norm: bool) -> None:
        config = spec.text_config
        bias = bool(config["attention_bias"])
        super().__init__(
            spec,
            layer_index,
            qkv_bias=bias,
            o_bias=bias,
            scale=config["query_pre_attn_scalar"] ** -0.5,
            softcap=config.get("attn_logit_softcapping"),
            qk_norm=qk_norm,
            qk_norm_offset=1.0,
        )
        # Gemma-3 gives local and global layers different rotary bases; Gemma-2 one for all.
        rope_layer_type = spec.layers[layer_index].hf_layer_type if qk_norm else None
        self.rotary = RotaryEmbedding(self.head_dim, rope_parameters(config, rope_layer_type))


class GemmaDecoderLayer(nn.Module):
    def __init__(self, spec: ModelSpec, layer_index: int, qk_norm: bool) -> None:
        super().__init__()
        config = spec.text_config
        hidden, eps = spec.hidden_size, config["rms_norm_eps"]
        self.input_layernorm = RMSNorm(hidden, eps, offset=1.0)
        self.self_attn = GemmaAttention(spec, layer_index, qk_norm)
        self.post_attention_layernorm = RMSNorm(hidden, eps, offset=1.0)
        self.pre_feedforward_layernorm = RMSNorm(hidden, eps, offset=1.0)
        self.mlp = GatedMLP(
            hidden,
            config["intermediate_size"],
            config["hidden_activation"],
        )
        self.post_feedforward_layernorm = RMSNorm(hidden, eps, offset=1.0)

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        attended = self.self_attn(positions, self.input_layernorm(hidden))
        hidden = hidden + self.post_attention_layernorm(attended)
        fed = self.mlp(self.pre_feedforward_layernorm(hidden))
        return hidden + self.post_feedforward_layernorm(fed)


class GemmaModel(nn.Module):
    def __init__(self, spec: ModelSpec, qk_norm: bool) -> None:
        super().__init__()
        self.hidden_size = spec.hidden_size
        self.embed_tokens = vocab_embedding(spec.vocab_size, self.hidden_size)
        self.layers = nn.ModuleList(
            GemmaDecoderLayer(spec, index, qk_norm) for index in range(spec.num_layers)
        )
        self.norm = RMSNorm(self.hidden_size, spec.text_config["rms_norm_eps"], offset=1.0)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        hidden = self.embed_tokens(input_ids)
        hidden = hidden * torch.tensor(self.hidden_size**0.5, dtype=hidden.dtype)
        for layer in self.layers:
            hidden = layer(positions, hidden)
        return self.norm(hidden)


class Gemma2ForCausalLM(nn.Module):
    """`forward(input_ids [T], positions [T]) -> hidden [T, H]`; `compute_logits(hidden)` (None
    on tensor-parallel ranks other than 0 when the LM head is vocabulary-parallel)."""

    QK_NORM = False

    def __init__(self, spec: ModelSpec) -> None:
        super().__init__()
        self.spec = spec
        self.config = spec.text_config
        self.model = GemmaModel(spec, self.QK_NORM)
        self.lm_head = lm_head(spec.hidden_size, spec.vocab_size)
        self.final_logit_softcapping = self.config.get("final_logit_softcapping")

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids, positions)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.lm_head(hidden)  # gathered on rank 0 first: the cap sees every column
        cap = self.final_logit_softcapping
        return logits if cap is None or logits is None else cap * torch.tanh(logits / cap)
