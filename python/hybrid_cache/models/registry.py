"""Architecture name -> model class (built from a `ModelSpec`; the architecture is the spec's
`text_architecture`, which `hybrid_cache.config` resolves from `architectures` or `model_type`)."""

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


def supported_architectures() -> list[str]:
    """The architectures a model can be built for (the planner reads a few more)."""
    return sorted(MODEL_REGISTRY)


def register_model(architecture: str, model_class: type[nn.Module]) -> None:
    """Adds (or replaces) the class built for `architecture`."""
    MODEL_REGISTRY[architecture] = model_class
