"""Qwen3: Llama with a per-head RMSNorm on queries and keys before rotary."""

from __future__ import annotations

from hybrid_cache.models.hf_config import Config
from hybrid_cache.models.llama import LlamaForCausalLM


class Qwen3ForCausalLM(LlamaForCausalLM):
    @classmethod
    def attention_options(cls, config: Config) -> dict[str, bool]:
        bias = bool(config.get("attention_bias", False))
        return {"qkv_bias": bias, "o_bias": bias, "qk_norm": True}
