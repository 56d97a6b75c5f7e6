"""Built-in model presets: Hugging Face `config.json` contents (architecture only, no weights).

They live inside the package (one `<name>.json` per preset) so they ship in the wheel and let
`hybrid-cache plan --model gemma-3-27b` answer capacity questions without downloading anything.
The real-model presets copy the published configs' attention-relevant fields; the `tiny-*` ones
are CPU-sized configs of each architecture, valid for transformers' own config classes, for tests
and demos (windows of 16-32 tokens so short prompts already slide).
"""

from __future__ import annotations

import json
from importlib import resources
from typing import Any, Optional


def preset_names() -> list[str]:
    """Sorted names of the built-in presets."""
    files = resources.files(__name__).iterdir()
    return sorted(entry.name[: -len(".json")] for entry in files if entry.name.endswith(".json"))


def read_preset(name: str) -> Optional[dict[str, Any]]:
    """The preset's config dict (a fresh copy), or None when no preset has this name."""
    if name not in preset_names():
        return None
    text = resources.files(__name__).joinpath(f"{name}.json").read_text(encoding="utf-8")
    return json.loads(text)
