"""What `LLM.generate` returns, and the per-step figures the engine records."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, Union


@dataclass
class Logprob:
    """One token's logprob at one position (of the raw model distribution), its rank (1 = most
    likely) and its text (None without a tokenizer or with `detokenize=False`)."""

    logprob: float
    rank: Optional[int] = None
    decoded_token: Optional[str] = None


# Per position, token id -> Logprob: the sampled (or prompt) token and the top-k.
SampleLogprobs = list[dict[int, Logprob]]
# The same for each prompt token; the first is None (nothing comes before it).
PromptLogprobs = list[Optional[dict[int, Logprob]]]


@dataclass
class CompletionOutput:
    """One generated continuation of a request.

    `cumulative_logprob` (the sum of the sampled tokens' logprobs) and `logprobs` are set when
    the request asked for `logprobs` (the cumulative one also with `best_of > n`), else None.
    `stop_reason`: the stop string or stop token id that ended it; None for EOS, length, abort.
    """

    index: int
    token_ids: list[int]
    text: Optional[str]  # None when the model folder has no tokenizer, or detokenize=False
    finish_reason: str  # "stop" | "length" | "abort" | "error"
    cumulative_logprob: Optional[float] = None
    logprobs: Optional[SampleLogprobs] = None
    stop_reason: Union[int, str, None] = None


@dataclass
class RequestMetrics:
    """When a request arrived, was first scheduled, got its first and last token and finished
    (`time.time()` seconds); `time_in_queue` = first scheduled - arrival."""

    arrival_time: float
    first_scheduled_time: Optional[float] = None
    first_token_time: Optional[float] = None
    last_token_time: Optional[float] = None
    finished_time: Optional[float] = None
    time_in_queue: Optional[float] = None


@dataclass
class RequestOutput:
    """One request's result, in prompt order: `outputs` holds its `n` completions. A failed
    request has `finish_reason == "error"`, no tokens and its typed exception in `error`."""

    request_id: str
    prompt: Optional[str]
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache (the first sample's)
    num_preemptions: int = 0
    error: Optional[Exception] = None
    prompt_logprobs: Optional[PromptLogprobs] = None
    metrics: Optional[RequestMetrics] = None

    @property
    def finished(self) -> bool:
        return True

    @property
    def token_ids(self) -> list[int]:
        return self.outputs[0].token_ids

    @property
    def text(self) -> Optional[str]:
        return self.outputs[0].text

    @property
    def finish_reason(self) -> str:
        return self.outputs[0].finish_reason

    def raise_for_error(self) -> None:
        """Raises the request's typed error, if it failed."""
        if self.error is not None:
            raise self.error


@dataclass(frozen=True)
class PrefixMisses:
    """Looked-up prompt tokens that were not prefix-cache hits, by reason (cumulative). A
    request's tokens split into its hit and these four; see `docs/DESIGN.md` "Cache-hit search".

    - `window_tail`: the full-attention prefix was cached further, but a windowed (or chunked)
      group lacked the blocks a hit point there needs;
    - `never_cached`: the prefix was never cached past the hit;
    - `evicted`: it was, and has been evicted since (a Bloom filter tells: may count a few
      never-cached tokens as evicted);
    - `alignment`: the last prompt token (always computed) and the tokens past the last
      multiple of the hit alignment.
    """

    window_tail: int = 0
    never_cached: int = 0
    evicted: int = 0
    alignment: int = 0

    @classmethod
    def from_core(cls, core: dict) -> PrefixMisses:
        return cls(
            window_tail=core.get("prefix_miss_window_tail", 0),
            never_cached=core.get("prefix_miss_never_cached", 0),
            evicted=core.get("prefix_miss_evicted", 0),
            alignment=core.get("prefix_miss_alignment", 0),
        )

    @property
    def total(self) -> int:
        return self.window_tail + self.never_cached + self.evicted + self.alignment


@dataclass
class StepStats:
    """Figures of one engine step (`LLM.step_stats` keeps them for the last `generate`)."""

    num_scheduled_requests: int
    num_scheduled_tokens: int
    num_running: int
    num_waiting: int
    num_preemptions: int  # in this step
    num_used_blocks_per_group: list[int]
    num_free_blocks: int
    prefix_cache_hit_rate: float  # cumulative hit tokens / queried tokens since the engine started
    prefix_misses: PrefixMisses = PrefixMisses()  # cumulative, since the engine started


@dataclass
class EngineStats:
    """Totals over the engine's life."""

    num_steps: int = 0
    num_preemptions: int = 0
    num_prefix_query_tokens: int = 0
    num_prefix_hit_tokens: int = 0
    max_used_blocks_per_group: list[int] = field(default_factory=list)
    prefix_misses: PrefixMisses = PrefixMisses()
    # Per KV-cache group: prompt tokens that group alone would have hit, and of those, the ones
    # the other groups cut (a windowed group's missing tail shortens every group's hit).
    prefix_alone_hit_tokens_per_group: list[int] = field(default_factory=list)
    prefix_shortened_tokens_per_group: list[int] = field(default_factory=list)
    # Tail replays (a hit whose windowed blocks were gone, taken with the full-attention blocks
    # and the windows recomputed): lookups that took one, the tokens they recompute below the
    # full-attention hit point, and the hit tokens they gained over the plain hit.
    num_tail_replays: int = 0
    num_tail_replay_tokens: int = 0
    num_tail_replay_gain_tokens: int = 0
    # Token tails (a hit ending where a finished request's computed tokens ended, inside a
    # block): lookups whose hit ended on one, and the hit tokens beyond the aligned hit.
    num_token_tail_hits: int = 0
    num_token_tail_gain_tokens: int = 0

    @property
    def prefix_cache_hit_rate(self) -> float:
        if self.num_prefix_query_tokens == 0:
            return 0.0
        return self.num_prefix_hit_tokens / self.num_prefix_query_tokens
