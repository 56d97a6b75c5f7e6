"""A simple step-time model of a GPU serving a real-size model, for `--simulate`.

A step runs one batch (prefill chunks and decode tokens mixed). Its time is

    step_time = STEP_OVERHEAD                                   (scheduling, launches, sampling)
              + weight_bytes / (HBM bandwidth x BANDWIDTH_EFFICIENCY)   (every weight read once)
              + kv_bytes_attended / (HBM bandwidth x BANDWIDTH_EFFICIENCY)
              + 2 x active_params x num_tokens / (peak FLOP/s x COMPUTE_EFFICIENCY)

* `weight_bytes`: all parameters at the model dtype, read once per step whatever the batch
  size — the term a larger batch amortises, which is where a hybrid cache's extra concurrency
  pays. gpt-oss ships its expert weights in MXFP4 (4.25 bits per weight with the shared
  scales); those count at that size, and a batch is assumed to touch every expert.
* `kv_bytes_attended`: for each scheduled request and layer, the KV bytes of the keys its
  queries see: `seq_len` tokens for full attention, `min(seq_len, W - 1 + num_new_tokens)` for
  a sliding window W (the same in both modes: the model reads what it attends to, however the
  cache is laid out).
* compute: the matrix multiplies of every scheduled token (prefill and decode alike) with the
  active parameters (for mixture-of-experts, the experts a token is routed to). Attention
  FLOPs are left out (under 10% of the weight FLOPs at these lengths).

Constants are H100-SXM-like (80 GB HBM3 at 3.35 TB/s, 989 TFLOP/s dense bf16) with achievable
fractions of the peaks; `--simulate` budgets the KV cache as one such GPU does:
`80 GB x 0.9 - weight_bytes`. The model is deliberately simple: it ignores kernel
efficiency at small batches, communication, and prefill/decode interference, so read its
absolute tokens/s as a rough estimate and the hybrid/uniform ratio as the result.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Optional

from hybrid_cache.bench.errors import BenchConfigError
from hybrid_cache.config import ModelSpec, dtype_num_bytes

STEP_OVERHEAD_S = 0.003
BANDWIDTH_EFFICIENCY = 0.8
COMPUTE_EFFICIENCY = 0.5
MXFP4_BYTES_PER_PARAM = 4.25 / 8


@dataclass(frozen=True)
class Hardware:
    """One accelerator: memory, bandwidth and dense FLOP/s at the model dtype."""

    name: str = "H100-SXM-80GB (modelled)"
    memory_bytes: int = 80 * 10**9
    memory_bandwidth: float = 3.35e12
    peak_flops: float = 989e12
    memory_utilization: float = 0.9

    def kv_cache_budget(self, weight_bytes: int) -> int:
        """Bytes left for the KV cache: `memory x utilization - weights`."""
        budget = int(self.memory_bytes * self.memory_utilization) - weight_bytes
        if budget <= 0:
            raise BenchConfigError(
                f"the weights ({weight_bytes / 1e9:.1f} GB) leave no KV cache on a "
                f"{self.memory_bytes / 1e9:.0f} GB GPU at {self.memory_utilization:.0%}; "
                "pass --kv-cache-memory or a larger --gpu-memory"
            )
        return budget


@dataclass(frozen=True)
class ParameterCount:
    total: int  # every parameter
    active: int  # parameters one token multiplies with (MoE: routed experts only)
    weight_bytes: int  # all weights as stored


def count_parameters(spec: ModelSpec) -> ParameterCount:
    """Parameters of a decoder-only transformer from its text config (embeddings, attention
    projections, gated MLP or mixture of experts, LM head unless tied). Norms and biases are
    negligible and left out."""
    config = spec.text_config
    hidden = spec.hidden_size
    head_dim = spec.layers[0].head_dim_k
    num_kv_heads = spec.layers[0].num_kv_heads
    attention = hidden * head_dim * (2 * spec.num_attention_heads + 2 * num_kv_heads)
    intermediate = int(config.get("intermediate_size", 4 * hidden))
    mlp_one = 3 * hidden * intermediate
    num_experts = int(config.get("num_local_experts") or 1)
    experts_per_token = int(config.get("num_experts_per_tok") or 1) if num_experts > 1 else 1
    embedding = spec.vocab_size * hidden
    head = 0 if spec.tie_word_embeddings else embedding
    dense_per_layer = attention + (hidden * num_experts if num_experts > 1 else 0)
    dense = spec.num_layers * dense_per_layer + embedding + head
    experts = spec.num_layers * num_experts * mlp_one
    active = dense - embedding + spec.num_layers * experts_per_token * mlp_one
    element_bytes = dtype_num_bytes(spec.dtype)
    expert_bytes = MXFP4_BYTES_PER_PARAM if spec.model_type == "gpt_oss" else element_bytes
    return ParameterCount(
        total=dense + experts,
        active=active,
        weight_bytes=int(dense * element_bytes + experts * expert_bytes),
    )


class CostModel:
    """Step times for one model on one `Hardware` (see the module docstring)."""

    def __init__(self, spec: ModelSpec, hardware: Hardware, kv_cache_dtype: str = "auto") -> None:
        self.hardware: Hardware = hardware
        self.parameters: ParameterCount = count_parameters(spec)
        kv_dtype = None if kv_cache_dtype == "auto" else kv_cache_dtype
        # (kind, window or chunk, bytes per token) -> number of layers: one term per spec.
        self.layer_kinds: Counter[tuple[str, Optional[int], int]] = Counter(
            (layer.kind, layer.window or layer.chunk, layer.bytes_per_token(kv_dtype))
            for layer in spec.layers
        )

    def kv_bytes_attended(self, seq_len: int, num_new_tokens: int) -> int:
        """KV bytes one request's queries read in a step ending at `seq_len` tokens."""
        total = 0
        for (kind, reach, bytes_per_token), num_layers in self.layer_kinds.items():
            if kind == "sliding_window" and reach is not None:
                visible = min(seq_len, reach - 1 + num_new_tokens)
            elif kind == "chunked_local" and reach is not None:  # at most the chunk + new tokens
                visible = min(seq_len, reach + num_new_tokens)
            else:
                visible = seq_len
            total += visible * bytes_per_token * num_layers
        return total

    def step_time(self, batch: Iterable[tuple[int, int]]) -> float:
        """Seconds for a step; `batch` holds (num_computed_tokens, num_new_tokens) per request.
        An empty batch costs nothing."""
        hardware = self.hardware
        bandwidth = hardware.memory_bandwidth * BANDWIDTH_EFFICIENCY
        num_tokens = kv_bytes = 0
        for num_computed, num_new in batch:
            num_tokens += num_new
            kv_bytes += self.kv_bytes_attended(num_computed + num_new, num_new)
        if num_tokens == 0:
            return 0.0
        compute = 2 * self.parameters.active * num_tokens
        return (
            STEP_OVERHEAD_S
            + (self.parameters.weight_bytes + kv_bytes) / bandwidth
            + compute / (hardware.peak_flops * COMPUTE_EFFICIENCY)
        )

    def describe(self) -> Mapping[str, Any]:
        p = self.parameters
        return {
            "hardware": self.hardware.name,
            "total_params": p.total,
            "active_params": p.active,
            "weight_bytes": p.weight_bytes,
            "step_overhead_s": STEP_OVERHEAD_S,
            "bandwidth_efficiency": BANDWIDTH_EFFICIENCY,
            "compute_efficiency": COMPUTE_EFFICIENCY,
        }
