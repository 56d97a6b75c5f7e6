"""Seeded random prompts: `num_prompts` prompts of `input_len` token ids whose first
`prefix_len` ids are shared by every prompt (a system prompt for the prefix cache to hit), fed
to the engine all at once by `RandomFeed` (`settings.make_feed` picks the feed of a run: this one,
or the multi-turn workload of `multi_turn.py`).

Ids are drawn from `[FIRST_ORDINARY_ID, vocab_size)` so they avoid the usual pad/bos/eos ids
(0, 1, 2) of the presets; benchmarks also set `ignore_eos` so every request generates exactly
`output_len` tokens.
"""

from __future__ import annotations

import random
from typing import Any, Optional

from hybrid_cache.bench.errors import BenchConfigError

FIRST_ORDINARY_ID = 3


def make_prompts(
    num_prompts: int, input_len: int, prefix_len: int, vocab_size: int, seed: int
) -> list[list[int]]:
    """Token-id prompts, the same for the same arguments (hybrid and uniform runs compare on
    identical work)."""
    if prefix_len < 0 or prefix_len > input_len:
        raise BenchConfigError(
            f"--prefix-len must be between 0 and --input-len ({input_len}), got {prefix_len}"
        )
    if vocab_size <= FIRST_ORDINARY_ID:
        raise BenchConfigError(f"the vocabulary ({vocab_size} ids) is too small for prompts")
    generator = random.Random(seed)
    prefix = [generator.randrange(FIRST_ORDINARY_ID, vocab_size) for _ in range(prefix_len)]
    return [
        prefix
        + [
            generator.randrange(FIRST_ORDINARY_ID, vocab_size)
            for _ in range(input_len - prefix_len)
        ]
        for _ in range(num_prompts)
    ]


class RandomFeed:
    """The random workload's prompts, all at once (the bench's default workload)."""

    def __init__(self, prompts: list[list[int]]) -> None:
        self._prompts: Optional[list[list[int]]] = prompts
        self.reuse = None  # no reuse figures: `MultiTurnFeed.reuse` has them

    @property
    def exhausted(self) -> bool:
        return self._prompts is None

    def next_prompts(self) -> list[tuple[str, list[int]]]:
        prompts, self._prompts = self._prompts, None
        return [(f"bench-{index}", prompt) for index, prompt in enumerate(prompts or [])]

    def record(self, request: Any) -> None:
        pass
