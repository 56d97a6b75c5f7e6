"""Model implementations (one file per architecture), the registry and the weight loader."""

from hybrid_cache.models.loader import (
    ModelLoadError,
    UnsupportedArchitectureError,
    WeightMismatchError,
    load_model,
    read_config,
)
from hybrid_cache.models.registry import MODEL_REGISTRY, register_model, supported_architectures

__all__ = [
    "MODEL_REGISTRY",
    "ModelLoadError",
    "UnsupportedArchitectureError",
    "WeightMismatchError",
    "load_model",
    "read_config",
    "register_model",
    "supported_architectures",
]
