"""gpt-oss: attention sinks, alternating sliding windows, YaRN rotary, a top-k mixture of experts.

- Attention has biases on all projections and one learned sink logit per head: the sink joins the
  softmax denominator and contributes no value, so a head can attend "nowhere".
- Sliding and full layers alternate (the `ModelSpec`'s layers); the window is small (128 in the
  release).
- The MLP routes each token to `num_experts_per_tok` of `num_local_experts` experts: router logits
  (with bias) -> top-k -> softmax over the k chosen logits. Each expert is a clamped SwiGLU:
  gate/up interleaved in one projection (even columns gate, odd up), gate clamped above at
  `swiglu_limit`, up clamped to +-limit, out = (up + 1) * gate * sigmoid(alpha * gate).
  Expert weights are stored stacked and input-major: gate_up_proj [E, H, 2I], down_proj [E, I, H].
- Sharded (`parallel_layers`): attention as every model's; each rank holds every expert's slice
  [i0, i1) of the intermediate dimension (gate/up columns 2*i0..2*i1, interleaved pairs kept
  together; down rows i0..i1), rank 0 adds the down bias, and the MoE output is summed over the
  ranks by one all-reduce. The router is replicated.
- Eagerly, each expert runs on the tokens that chose it (the chosen experts are read on the
  host). While a CUDA graph records a decode step, every expert runs on every token instead,
  weighted by its routing weight (0 where not chosen): nothing is read on the host, and a
  decode batch reads every expert's weights anyway (32 x 4 choices over 32 experts), so the
  extra products cost little at small batches; decode graphs stop at `max_cuda_graph_batch`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from hybrid_cache.config import ModelSpec
from hybrid_cache.models.layers import ProjectedSelfAttention, RMSNorm
from hybrid_cache.models.parallel_layers import (
    all_reduce,
    current_shard,
    declare_sharded,
    lm_head,
    vocab_embedding,
)
from hybrid_cache.models.rotary import RotaryEmbedding, rope_parameters


class GptOssAttention(ProjectedSelfAttention):
    """Biased projections and, from `ModelSpec.attention_sinks`, one sink logit per head."""

    def __init__(self, spec: ModelSpec, layer_index: int) -> None:
        bias = bool(spec.text_config["attention_bias"])
        super().__init__(spec, layer_index, qkv_bias=bias, o_bias=bias)
        self.rotary = RotaryEmbedding(self.head_dim, rope_parameters(spec.text_config))


class GptOssRouter(nn.Module):
    def __init__(self, hidden_size: int, num_experts: int, top_k: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_experts, hidden_size))
        self.bias = nn.Parameter(torch.empty(num_experts))
        self.top_k = top_k

    def forward(self, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Chosen experts [T, k] and their weights [T, k] (softmax over the chosen logits)."""
        logits = F.linear(hidden, self.weight, self.bias)
        top_logits, top_experts = torch.topk(logits, self.top_k, dim=-1)
        return top_experts, torch.softmax(top_logits, dim=-1)


def recording(hidden: torch.Tensor) -> bool:
    """Whether a CUDA graph is recording the forward `hidden` flows through."""
    return hidden.is_cuda and torch.cuda.is_current_stream_capturing()


class GptOssExperts(nn.Module):
    # Stored [E, in, out]; checkpoints' MXFP4 experts are [E, out, in] (the loader transposes).
    INPUT_MAJOR_PARAMETERS = ("gate_up_proj", "down_proj")

    def __init__(self, spec: ModelSpec) -> None:
        super().__init__()
        config = spec.text_config
        experts, hidden = config["num_local_experts"], spec.hidden_size
        intermediate = config["intermediate_size"]
        shard = current_shard()
        start, stop = shard.split(intermediate)
        local = stop - start
        self.gate_up_proj = nn.Parameter(torch.empty(experts, hidden, 2 * local))
        self.gate_up_proj_bias = nn.Parameter(torch.empty(experts, 2 * local))
        self.down_proj = nn.Parameter(torch.empty(experts, local, hidden))
        self.down_proj_bias = nn.Parameter(torch.empty(experts, hidden))
        self.alpha = config["swiglu_alpha"]
        self.limit = config["swiglu_limit"]
        # Sharded: the partial outputs are summed over the ranks; the bias is added once.
        self.reduce = shard.size > 1
        self.add_down_bias = shard.rank == 0
        if self.reduce:
            gate_up = (2 * start, 2 * stop)
            declare_sharded(self, "gate_up_proj", 2, gate_up, 2 * intermediate)
            declare_sharded(self, "gate_up_proj_bias", 1, gate_up, 2 * intermediate)
            declare_sharded(self, "down_proj", 1, (start, stop), intermediate)

    def glu(self, gate_up: torch.Tensor) -> torch.Tensor:
        """The clamped SwiGLU of interleaved gate/up columns (module docs)."""
        gate = gate_up[..., 0::2].clamp(max=self.limit)
        up = gate_up[..., 1::2].clamp(min=-self.limit, max=self.limit)
        return (up + 1) * (gate * torch.sigmoid(gate * self.alpha))

    def expert_forward(self, expert: int, x: torch.Tensor) -> torch.Tensor:
        gate_up = x @ self.gate_up_proj[expert] + self.gate_up_proj_bias[expert]
        out = self.glu(gate_up) @ self.down_proj[expert]
        return out + self.down_proj_bias[expert] if self.add_down_bias else out

    def forward(
        self, hidden: torch.Tensor, top_experts: torch.Tensor, top_weights: torch.Tensor
    ) -> torch.Tensor:
        """Sum over each token's chosen experts; one batched matmul per expert that is used
        (every expert over every token while a CUDA graph records: `forward_dense`)."""
        if recording(hidden):
            output = self.forward_dense(hidden, top_experts, top_weights)
        else:
            output = torch.zeros_like(hidden)
            for expert in torch.unique(top_experts).tolist():
                token_index, slot = torch.nonzero(top_experts == expert, as_tuple=True)
                out = self.expert_forward(expert, hidden[token_index])
                output.index_add_(0, token_index, out * top_weights[token_index, slot, None])
        return all_reduce(output) if self.reduce else output

    def forward_dense(
        self, hidden: torch.Tensor, top_experts: torch.Tensor, top_weights: torch.Tensor
    ) -> torch.Tensor:
        """`forward` without reading anything on the host: every expert over every token
        ([E, T, ...] batched matmuls), each token's outputs weighted by its routing weights,
        0 for the experts it did not choose."""
        num_experts = self.gate_up_proj.shape[0]
        weights = torch.zeros(
            hidden.shape[0], num_experts, dtype=top_weights.dtype, device=hidden.device
        ).scatter_(1, top_experts, top_weights)
        gate_up = torch.matmul(hidden, self.gate_up_proj) + self.gate_up_proj_bias[:, None]
        out = torch.matmul(self.glu(gate_up), self.down_proj)
        if self.add_down_bias:
            out = out + self.down_proj_bias[:, None]
        return (out * weights.T[..., None]).sum(0)


class GptOssMLP(nn.Module):
    def __init__(self, spec: ModelSpec) -> None:
        super().__init__()
        config = spec.text_config
        self.router = GptOssRouter(
            spec.hidden_size, config["num_local_experts"], config["num_experts_per_tok"]
        )
        self.experts = GptOssExperts(spec)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        top_experts, top_weights = self.router(hidden)
        return self.experts(hidden, top_experts, top_weights)


class GptOssDecoderLayer(nn.Module):
    def __init__(self, spec: ModelSpec, layer_index: int) -> None:
        super().__init__()
        config = spec.text_config
        self.input_layernorm = RMSNorm(
            spec.hidden_size, config["rms_norm_eps"], round_before_weight=False
        )
        self.self_attn = GptOssAttention(spec, layer_index)
        self.post_attention_layernorm = RMSNorm(
            spec.hidden_size, config["rms_norm_eps"], round_before_weight=False
        )
        self.mlp = GptOssMLP(spec)

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        hidden = hidden + self.self_attn(positions, self.input_layernorm(hidden))
        return hidden + self.mlp(self.post_attention_layernorm(hidden))


class GptOssModel(nn.Module):
    def __init__(self, spec: ModelSpec) -> None:
        super().__init__()
        self.embed_tokens = vocab_embedding(spec.vocab_size, spec.hidden_size)
        self.layers = nn.ModuleList(
            GptOssDecoderLayer(spec, index) for index in range(spec.num_layers)
        )
        self.norm = RMSNorm(
            spec.hidden_size, spec.text_config["rms_norm_eps"], round_before_weight=False
        )

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        hidden = self.embed_tokens(input_ids)
        for layer in self.layers:
            hidden = layer(positions, hidden)
        return self.norm(hidden)


class GptOssForCausalLM(nn.Module):
    """`forward(input_ids [T], positions [T]) -> hidden [T, H]`; `compute_logits(hidden)` (None
    on tensor-parallel ranks other than 0 when the LM head is vocabulary-parallel)."""

    # Decode graphs record the dense experts (`GptOssExperts.forward_dense`), whose products
    # grow with experts x tokens: batches past this run eagerly.
    max_cuda_graph_batch = 64

    def __init__(self, spec: ModelSpec) -> None:
        super().__init__()
        self.spec = spec
        self.config = spec.text_config
        self.model = GptOssModel(spec)
        self.lm_head = lm_head(spec.hidden_size, spec.vocab_size)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids, positions)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)
