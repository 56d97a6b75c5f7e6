"""Weight bytes one tensor-parallel rank holds, from a `ModelSpec` alone (no weights loaded), as
the engine shards the model (`models/parallel_layers.py`): q/o by query heads and k/v by KV
heads (one replicated head when there are fewer heads than ranks), the MLP or every expert by
its intermediate dimension, the router replicated, and the embedding and LM head either by
vocabulary rows (the vocabulary padded to a multiple of the ranks) or whole on every rank.
Counted at the model's dtype, as the engine holds them (MXFP4 experts are dequantised when
loaded); norms and biases are negligible and left out.
"""

from __future__ import annotations

from dataclasses import dataclass

from hybrid_cache.config import ModelSpec, dtype_num_bytes, per_rank_kv_heads


@dataclass(frozen=True)
class RankWeights:
    """One rank's weight bytes: the embedding and the LM head (`vocab`), the decoder layers
    (`layers`), and their sum (`total`)."""

    vocab: int
    layers: int

    @property
    def total(self) -> int:
        return self.vocab + self.layers


def rank_weight_bytes(
    spec: ModelSpec, tensor_parallel_size: int = 1, vocab_parallel: bool = True
) -> RankWeights:
    """The weight bytes of one of `tensor_parallel_size` ranks of `spec` (the full model's
    spec; `check_tensor_parallel` first)."""
    size = tensor_parallel_size
    config = spec.text_config
    hidden = spec.hidden_size
    heads = spec.num_attention_heads // size
    layers = 0
    for layer in spec.layers:
        kv_heads = per_rank_kv_heads(layer.num_kv_heads, size)
        q_and_o = 2 * heads * layer.head_dim_k
        layers += hidden * (q_and_o + kv_heads * (layer.head_dim_k + layer.head_dim_v))
    num_experts = int(config.get("num_local_experts") or 1)
    intermediate = int(config.get("intermediate_size", 4 * hidden))
    router = hidden * num_experts if num_experts > 1 else 0
    layers += spec.num_layers * (num_experts * 3 * hidden * intermediate // size + router)
    rows = -(-spec.vocab_size // size) if vocab_parallel else spec.vocab_size
    vocab = rows * hidden * (1 if spec.tie_word_embeddings else 2)
    element = dtype_num_bytes(spec.dtype)
    return RankWeights(vocab=vocab * element, layers=layers * element)
