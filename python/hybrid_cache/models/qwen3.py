"""Qwen3: Llama with a per-head RMSNorm on queries and keys before rotary."""

from __future__ import annotations

from typing import Any

from hybrid_cache.models.llama import LlamaForCausalLM


class Qwen3ForCausalLM(LlamaForCausalLM):
    @classmethod
    def attention_options(cls, config: dict[str, Any]) -> dict[str, bool]:
        bias = bool(config["attention_bias"])
        return {"qkv_bias": bias, "o_bias": bias, "qk_norm": True}
