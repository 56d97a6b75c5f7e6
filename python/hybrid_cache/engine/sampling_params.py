"""`SamplingParams`: how one request picks its next token and when it stops (vLLM's names and
meanings)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Optional, Union

from hybrid_cache.checks import is_int, is_real
from hybrid_cache.engine.errors import InvalidSamplingParamsError

# presence_penalty and frequency_penalty range (as vLLM and the OpenAI API).
MAX_ABS_PENALTY = 2.0
# Seeds a torch generator takes (a signed 64-bit integer).
MIN_SEED = -(2**63)
MAX_SEED = 2**63 - 1


@dataclass(frozen=True)
class SamplingParams:
    """Sampling and stopping rules for one request, validated on construction.

    Samples: `n` completions per prompt, sharing the prompt's KV through the prefix cache;
    `best_of` (>= n) draws that many and returns the `n` with the highest cumulative logprob.

    Token choice, in vLLM's order: `min_tokens` masks the stop tokens (EOS unless `ignore_eos`,
    and `stop_token_ids`) until that many tokens are generated; `repetition_penalty` (> 1
    discourages) divides the positive and multiplies the negative logits of every token seen in
    the prompt or the output; `frequency_penalty` subtracts its value times a token's count in
    the output, `presence_penalty` its value once for every token in the output; temperature 0
    is greedy (argmax of those logits); otherwise logits / temperature, then `min_p` (drop
    tokens less likely than `min_p` times the most likely one), `top_k` (0 or -1 = off) and
    `top_p` (1.0 = off). A `seed` gives the request its own random generator, so its tokens do
    not depend on the batch it runs in nor on preemption (sample i of n uses `seed + i`).

    Stopping: at `max_tokens` output tokens or `max_model_len` total ("length"); at the model's
    EOS token (unless `ignore_eos`), at any of `stop_token_ids` or when the text contains one
    of `stop` ("stop", with `stop_reason` the stop token id or string, None for EOS). Every
    token generated stays in `token_ids`; the text leaves out the stop token's or stop string's
    text unless `include_stop_str_in_output`.

    Logprobs are of the raw model distribution (log_softmax of the logits before penalties,
    temperature or filters: vLLM's default "raw_logprobs"). `logprobs=k`: per output token, the
    sampled token's logprob and the top k; `prompt_logprobs=k`: the same for each prompt token
    (the first is None). A request asking for prompt logprobs computes its whole prompt (no
    prefix-cache hit).

    Text: `detokenize=False` returns no text; `skip_special_tokens` leaves special tokens out
    of the text; `spaces_between_special_tokens` is passed to the tokenizer (only slow
    tokenizers use it).
    """

    n: int = 1
    best_of: Optional[int] = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: Optional[int] = None
    stop: tuple[str, ...] = field(default_factory=tuple)
    stop_token_ids: tuple[int, ...] = field(default_factory=tuple)
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    max_tokens: int = 16
    min_tokens: int = 0
    logprobs: Optional[int] = None
    prompt_logprobs: Optional[int] = None
    detokenize: bool = True
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True

    def __post_init__(self) -> None:
        # Lists (or None, or one string for `stop`) are accepted; tuples keep the params hashable.
        object.__setattr__(self, "stop_token_ids", _int_tuple(self.stop_token_ids))
        object.__setattr__(self, "stop", _str_tuple(self.stop))
        self._validate()
        # What the sampler and engine check per step, worked out once (the params are frozen).
        has_penalties = (
            self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
            or self.repetition_penalty != 1.0
        )
        object.__setattr__(self, "has_penalties", has_penalties)
        object.__setattr__(self, "needs_history", has_penalties or self.min_tokens > 0)

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def num_samples(self) -> int:
        """How many sequences run for the prompt: `best_of`, else `n`."""
        return self.n if self.best_of is None else self.best_of

    def _validate(self) -> None:
        _check_int("n", self.n, 1)
        if self.best_of is not None:
            _check_int("best_of", self.best_of, 1)
            if self.best_of < self.n:
                raise InvalidSamplingParamsError(
                    f"best_of must be >= n, got best_of={self.best_of} and n={self.n}"
                )
        _check_int("max_tokens", self.max_tokens, 1)
        _check_int("min_tokens", self.min_tokens, 0)
        if self.min_tokens > self.max_tokens:
            raise InvalidSamplingParamsError(
                f"min_tokens must be <= max_tokens, got min_tokens={self.min_tokens} and "
                f"max_tokens={self.max_tokens}"
            )
        if not is_real(self.temperature) or not 0.0 <= self.temperature < math.inf:
            raise InvalidSamplingParamsError(
                f"temperature must be a finite number >= 0 (0 = greedy), got {self.temperature!r}"
            )
        if self.is_greedy and self.num_samples > 1:
            raise InvalidSamplingParamsError(
                f"n and best_of must be 1 with greedy sampling (temperature 0): every sample "
                f"would be the same; got n={self.n}, best_of={self.best_of}. Set temperature > 0"
            )
        _check_int("top_k", self.top_k, -1, "(0 or -1 = no top-k filter)")
        if not is_real(self.top_p) or not 0.0 < self.top_p <= 1.0:
            raise InvalidSamplingParamsError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not is_real(self.min_p) or not 0.0 <= self.min_p <= 1.0:
            raise InvalidSamplingParamsError(
                f"min_p must be in [0, 1] (0 = off), got {self.min_p!r}"
            )
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not is_real(value) or not -MAX_ABS_PENALTY <= value <= MAX_ABS_PENALTY:
                raise InvalidSamplingParamsError(
                    f"{name} must be in [-2, 2] (0 = off), got {value!r}"
                )
        penalty = self.repetition_penalty
        if not is_real(penalty) or not 0.0 < penalty < math.inf:
            raise InvalidSamplingParamsError(
                f"repetition_penalty must be a finite number > 0 (1 = off), got {penalty!r}"
            )
        if self.seed is not None:
            _check_int("seed", self.seed, None, "or None")
            last = self.seed + self.num_samples - 1  # sample i of n uses seed + i
            if self.seed < MIN_SEED or last > MAX_SEED:
                raise InvalidSamplingParamsError(
                    f"seed must be a signed 64-bit integer ([-2**63, 2**63 - 1], and seed + "
                    f"n - 1 too: sample i uses seed + i), got {self.seed}"
                )
        for token_id in self.stop_token_ids:
            if isinstance(token_id, bool) or not isinstance(token_id, int) or token_id < 0:
                raise InvalidSamplingParamsError(
                    f"stop_token_ids must be non-negative ints, got {token_id!r}"
                )
        for text in self.stop:
            if not isinstance(text, str) or not text:
                raise InvalidSamplingParamsError(
                    f"stop must be a string or a list of non-empty strings, got {text!r}"
                )
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None:
                _check_int(name, value, 0, "or None (0 = the sampled token only)")
        for name in (
            "include_stop_str_in_output",
            "ignore_eos",
            "detokenize",
            "skip_special_tokens",
            "spaces_between_special_tokens",
        ):
            if not isinstance(getattr(self, name), bool):
                raise InvalidSamplingParamsError(
                    f"{name} must be True or False, got {getattr(self, name)!r}"
                )
        if self.stop and not self.detokenize:
            raise InvalidSamplingParamsError(
                "stop strings are matched on the text: set detokenize=True, or use stop_token_ids"
            )


def _check_int(name: str, value: object, minimum: Optional[int], hint: str = "") -> None:
    if not is_int(value):
        raise InvalidSamplingParamsError(
            f"{name} must be an int{' ' + hint if hint else ''}, got {value!r}"
        )
    if minimum is not None and value < minimum:
        raise InvalidSamplingParamsError(
            f"{name} must be at least {minimum}{' ' + hint if hint else ''}, got {value}"
        )


def _int_tuple(values: object) -> tuple:
    if values is None:
        return ()
    if isinstance(values, (str, bytes)) or not hasattr(values, "__iter__"):
        raise InvalidSamplingParamsError(
            f"stop_token_ids must be a list of token ids, got {values!r}"
        )
    return tuple(values)


def _str_tuple(values: Union[str, object, None]) -> tuple:
    if values is None:
        return ()
    if isinstance(values, str):
        return (values,)
    if isinstance(values, bytes) or not hasattr(values, "__iter__"):
        raise InvalidSamplingParamsError(
            f"stop must be a string or a list of strings, got {values!r}"
        )
    return tuple(values)
