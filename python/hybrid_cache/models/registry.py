"""Architecture name (config.json `architectures[0]`) -> model class."""

from __future__ import annotations

from torch import nn

from hybrid_cache.models.gemma2 import Gemma2ForCausalLM
from hybrid_cache.models.gemma3 import Gemma3ForCausalLM
from hybrid_cache.models.gpt_oss import GptOssForCausalLM
from hybrid_cache.models.llama import LlamaForCausalLM
from hybrid_cache.models.qwen2 import Qwen2ForCausalLM
from hybrid_cache.models.qwen3 import Qwen3ForCausalLM

MODEL_REGISTRY: dict[str, type[nn.Module]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": Qwen2ForCausalLM,
    "Qwen3ForCausalLM": Qwen3ForCausalLM,
    "Gemma2ForCausalLM": Gemma2ForCausalLM,
    "Gemma3ForCausalLM": Gemma3ForCausalLM,
    "GptOssForCausalLM": GptOssForCausalLM,
}

# For configs without `architectures`: their `model_type`.
MODEL_TYPE_TO_ARCHITECTURE: dict[str, str] = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "gemma2": "Gemma2ForCausalLM",
    "gemma3_text": "Gemma3ForCausalLM",
    "gpt_oss": "GptOssForCausalLM",
}


def supported_architectures() -> list[str]:
    return sorted(MODEL_REGISTRY)


def register_model(architecture: str, model_class: type[nn.Module]) -> None:
    """Adds (or replaces) the class built for `architecture`."""
    MODEL_REGISTRY[architecture] = model_class
