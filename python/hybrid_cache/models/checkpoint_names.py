"""Checkpoint tensor names -> the built model's parameter names.

A text-only checkpoint names its tensors as our parameters are named (the model files mirror
transformers' module tree). A multimodal wrapper's checkpoint (Gemma-3 4B/12B/27B,
`Gemma3ForConditionalGeneration`) keeps its language model under a prefix, in one of two layouts:

- `language_model.model.*` and `language_model.lm_head.weight`: the published checkpoints, and
  what transformers 5 writes with `save_pretrained` (it saves in that layout);
- `model.language_model.*` and `lm_head.weight`: transformers' module names, found in
  checkpoints saved from them.

Its vision tower and multimodal projector (`vision_tower.*`, `multi_modal_projector.*`, either
with `model.` in front) have no place in the text model: they are skipped and counted, and the
model serves text prompts only.
"""

from __future__ import annotations

from collections import Counter

from hybrid_cache.config import ModelSpec

# Checkpoint entries that are not parameters (older exports saved rotary buffers).
IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)
# A wrapper's language-model prefixes -> ours, tried in order.
WRAPPER_TEXT_PREFIXES = (
    ("language_model.model.", "model."),
    ("language_model.lm_head.", "lm_head."),
    ("model.language_model.", "model."),
)
# A wrapper's other parts, skipped: prefix -> what the log calls it.
WRAPPER_SKIPPED_PREFIXES = (
    ("vision_tower.", "vision tower"),
    ("model.vision_tower.", "vision tower"),
    ("multi_modal_projector.", "multimodal projector"),
    ("model.multi_modal_projector.", "multimodal projector"),
)


class CheckpointNames:
    """Maps the tensor names of one checkpoint of `spec`'s model; counts what it skips."""

    def __init__(self, spec: ModelSpec) -> None:
        self.spec = spec
        self.wrapper = spec.architecture != spec.text_architecture
        self.skipped: Counter[str] = Counter()

    def parameter_name(self, name: str) -> str | None:
        """Our parameter name for checkpoint tensor `name`, or None for one to skip."""
        if name.endswith(IGNORED_SUFFIXES):
            return None
        if not self.wrapper:
            return name
        for prefix, part in WRAPPER_SKIPPED_PREFIXES:
            if name.startswith(prefix):
                self.skipped[part] += 1
                return None
        for prefix, ours in WRAPPER_TEXT_PREFIXES:
            if name.startswith(prefix):
                return ours + name.removeprefix(prefix)
        return name

    def layout_hint(self) -> str:
        """What the checkpoint's names should look like, for an error message."""
        if self.wrapper:
            return (
                f"a {self.spec.architecture} checkpoint names its language model "
                "language_model.model.* or model.language_model.*"
            )
        return f"a {self.spec.architecture} checkpoint names its tensors model.* and lm_head.*"

    def skipped_summary(self) -> str | None:
        """'skipped 12 vision tower and 2 multimodal projector tensors', or None."""
        if not self.skipped:
            return None
        order = dict.fromkeys(part for _, part in WRAPPER_SKIPPED_PREFIXES)
        counts = [(part, self.skipped[part]) for part in order if self.skipped[part]]
        parts = " and ".join(f"{count} {part}" for part, count in counts)
        return f"skipped {parts} tensors"
