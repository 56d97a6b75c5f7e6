"""The model folder's tokenizer, when it has one (transformers is optional)."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any, Optional

logger = logging.getLogger(__name__)

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")


def has_tokenizer_files(model: str) -> bool:
    """Whether `model` is a folder with tokenizer files (a preset has none)."""
    return any((Path(model) / name).is_file() for name in TOKENIZER_FILES)


def load_tokenizer(model_dir: str) -> Optional[Any]:
    """`AutoTokenizer` of the folder, or None when it has no tokenizer files (prompts must then
    be token ids) or transformers is not installed."""
    folder = Path(model_dir)
    if not has_tokenizer_files(model_dir):
        return None
    try:
        from transformers import AutoTokenizer
    except ImportError:
        logger.warning("%s has a tokenizer but transformers is not installed", model_dir)
        return None
    return AutoTokenizer.from_pretrained(str(folder))
