"""`SamplingParams`: how one request picks its next token and when it stops."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from hybrid_cache.engine.errors import InvalidSamplingParamsError


@dataclass(frozen=True)
class SamplingParams:
    """Sampling and stopping rules for one request, validated on construction.

    temperature 0 means greedy. top_k 0 (or the vocabulary size) and top_p 1.0 disable those
    filters. A `seed` gives the request its own random generator, so its tokens do not depend on
    the batch it runs in nor on preemption. Generation stops at `max_tokens` output tokens, at
    the model's end-of-sequence token (unless `ignore_eos`), at any of `stop_token_ids` (the
    stop token is kept in the output, as the EOS token is), or at `max_model_len` total tokens.
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    seed: Optional[int] = None
    stop_token_ids: tuple[int, ...] = field(default_factory=tuple)
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        # Lists (or None) are accepted for convenience; a tuple keeps the params hashable.
        stop_token_ids = self.stop_token_ids if self.stop_token_ids is not None else ()
        if isinstance(stop_token_ids, (str, bytes)) or not hasattr(stop_token_ids, "__iter__"):
            raise InvalidSamplingParamsError(
                f"stop_token_ids must be a list of token ids, got {stop_token_ids!r}"
            )
        object.__setattr__(self, "stop_token_ids", tuple(stop_token_ids))
        self._validate()

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0

    def _validate(self) -> None:
        if isinstance(self.max_tokens, bool) or not isinstance(self.max_tokens, int):
            raise InvalidSamplingParamsError(
                f"max_tokens must be an int, got {type(self.max_tokens).__name__}"
            )
        if self.max_tokens < 1:
            raise InvalidSamplingParamsError(
                f"max_tokens must be at least 1, got {self.max_tokens}"
            )
        if not isinstance(self.temperature, (int, float)) or not self.temperature >= 0.0:
            raise InvalidSamplingParamsError(
                f"temperature must be a number >= 0 (0 = greedy), got {self.temperature!r}"
            )
        if self.temperature == float("inf"):
            raise InvalidSamplingParamsError("temperature must be finite")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < 0:
            raise InvalidSamplingParamsError(
                f"top_k must be an int >= 0 (0 = no top-k filter), got {self.top_k!r}"
            )
        if not isinstance(self.top_p, (int, float)) or not 0.0 < self.top_p <= 1.0:
            raise InvalidSamplingParamsError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if self.seed is not None and (
            isinstance(self.seed, bool) or not isinstance(self.seed, int)
        ):
            raise InvalidSamplingParamsError(f"seed must be an int or None, got {self.seed!r}")
        for token_id in self.stop_token_ids:
            if isinstance(token_id, bool) or not isinstance(token_id, int) or token_id < 0:
                raise InvalidSamplingParamsError(
                    f"stop_token_ids must be non-negative ints, got {token_id!r}"
                )
