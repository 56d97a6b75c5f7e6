"""Model implementations (one file per architecture), the registry and the weight loader."""

from hybrid_cache.models.loader import (
    ModelLoadError,
    UnsupportedArchitectureError,
    WeightMismatchError,
    build_model,
    load_model,
    model_spec_of,
)
from hybrid_cache.models.registry import MODEL_REGISTRY, register_model, supported_architectures

__all__ = [
    "MODEL_REGISTRY",
    "ModelLoadError",
    "UnsupportedArchitectureError",
    "WeightMismatchError",
    "build_model",
    "load_model",
    "model_spec_of",
    "register_model",
    "supported_architectures",
]
