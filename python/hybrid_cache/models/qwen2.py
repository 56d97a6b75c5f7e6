"""Qwen2: Llama with biases on the q/k/v projections (none on o_proj)."""

from __future__ import annotations

from typing import Any

from hybrid_cache.models.llama import LlamaForCausalLM


class Qwen2ForCausalLM(LlamaForCausalLM):
    @classmethod
    def attention_options(cls, config: dict[str, Any]) -> dict[str, bool]:
        return {"qkv_bias": True, "o_bias": False, "qk_norm": False}
