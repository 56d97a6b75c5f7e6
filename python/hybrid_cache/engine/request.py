"""Per-request state the scheduler and model runner share."""

from __future__ import annotations

import enum
import operator
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Optional, Union

from hybrid_cache.engine.detokenizer import IncrementalDetokenizer, StopFlags
from hybrid_cache.engine.logprobs import take_rows
from hybrid_cache.engine.sampling_params import SamplingParams

if TYPE_CHECKING:
    from hybrid_cache.engine.logprobs import LogprobLog, LogprobRecord, TokenLogprobs


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED = "finished"


class FinishReason(str, enum.Enum):
    STOP = "stop"  # end-of-sequence, a stop token or a stop string
    LENGTH = "length"  # max_tokens or max_model_len
    ABORT = "abort"
    ERROR = "error"


# Stop-token sets by value, so requests asking alike share one object: every step reads each
# running request's set, and a shared one stays in the CPU caches (the forward evicts the rest).
_STOP_SETS: dict[frozenset[int], frozenset[int]] = {}
_MAX_STOP_SETS = 256


def _shared_stop_set(stop_ids: frozenset[int]) -> frozenset[int]:
    shared = _STOP_SETS.get(stop_ids)
    if shared is None:
        if len(_STOP_SETS) >= _MAX_STOP_SETS:
            _STOP_SETS.clear()
        shared = _STOP_SETS[stop_ids] = stop_ids
    return shared


def same_requests(these: Sequence[Request], those: Sequence[Request]) -> bool:
    """Whether two batches are the same request objects in the same order (one C-level pass,
    no request's attributes read): what the engine's per-batch memos are keyed on."""
    return len(these) == len(those) and all(map(operator.is_, these, those))


class Request:
    """One generation request: its tokens, how many of them have KV in the cache, its status.

    `num_computed_tokens` counts tokens whose KV is in the cache. On preemption it drops to 0 and
    the request is re-added later with prompt + output tokens so far (recompute), which gives the
    same results because sampled tokens are kept and a seeded generator is not rewound.

    `detokenizer` (given when the engine has a tokenizer and the params ask for text) decodes
    the output after each token when the params have stop strings, else once at the end
    (`finish_text`). Sampled-token logprobs are recorded by the runner when the params ask for
    them or `track_logprobs` (best_of ranks samples by their cumulative logprob), in
    `logprob_log` (the runner's), from which the request takes its rows when they are read.
    """

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams,
        arrival_index: int,
        max_total_tokens: int,
        eos_token_ids: tuple[int, ...] = (),
        detokenizer: Optional[IncrementalDetokenizer] = None,
        track_logprobs: bool = False,
        arrival_time: Optional[float] = None,
        logprob_log: Optional[LogprobLog] = None,
    ) -> None:
        assert prompt_token_ids, "an empty prompt is rejected before a Request is built"
        # What `append_output_token` checks, worked out once (the params are frozen): the tokens
        # that stop the request (also what min_tokens masks until that many are generated), and
        # the token count at which it reaches a length limit (prompt + max_tokens output tokens,
        # or max_total_tokens).
        eos_stop_ids = frozenset(() if sampling_params.ignore_eos else eos_token_ids)
        num_sample_logprobs = (
            0 if track_logprobs and sampling_params.logprobs is None else sampling_params.logprobs
        )
        # Assigned first, so they sit together in the instance's values: what each step reads
        # of every running request (its lines are cold after the forward evicted them).
        self.request_id: str = request_id
        # prompt + output, kept up to date so a step slices it instead of concatenating.
        self.all_token_ids: list[int] = list(prompt_token_ids)
        self.num_computed_tokens: int = 0
        self.output_token_ids: list[int] = []
        self.stop_token_id_set: frozenset[int] = _shared_stop_set(
            eos_stop_ids.union(sampling_params.stop_token_ids)
        )
        self.min_tokens: int = sampling_params.min_tokens
        self._length_limit: int = min(
            len(prompt_token_ids) + sampling_params.max_tokens, max_total_tokens
        )
        self.checks_stop_strings: bool = detokenizer is not None and bool(sampling_params.stop)
        # Which tokens may complete a stop string (the detokenizer's, shared by requests with
        # the same stop strings; None: every token is decoded as it comes), and whether the
        # detokenizer holds tokens back (then the next token is decoded whatever it is): read
        # here, a step touches the detokenizer only for the tokens it decodes.
        self.stop_flags: Optional[StopFlags] = (
            detokenizer.stop_flags if detokenizer is not None else None
        )
        self.holds_text: bool = False
        self.detokenizer: Optional[IncrementalDetokenizer] = detokenizer
        # Metrics (time.time() seconds), set by the scheduler.
        self.last_token_time: Optional[float] = None
        self.first_token_time: Optional[float] = None
        self.status: RequestStatus = RequestStatus.WAITING
        # Where the tail replay of its current hit ends (0: none): full-attention KV below it is
        # read from the cache, never written (`KVCacheManager.replay_frontier`).
        self.replay_frontier: int = 0
        # Whether sampling needs this request's tokens or logprobs (the sampler's slow path).
        self.needs_sampling_extras: bool = (
            sampling_params.needs_history or num_sample_logprobs is not None
        )
        # Logprobs: per output token (None = not computed), per prompt token after the first.
        self.num_sample_logprobs: Optional[int] = num_sample_logprobs
        # True until every prompt token's logprobs are recorded (no prefix-cache hit till then).
        self.wants_prompt_logprobs: bool = (
            sampling_params.prompt_logprobs is not None and len(prompt_token_ids) > 1
        )
        self.sampling_params: SamplingParams = sampling_params

        self.prompt_token_ids: list[int] = list(prompt_token_ids)
        self.arrival_index: int = arrival_index
        # prompt + output can never exceed this (max_model_len or prompt + max_tokens).
        self.max_total_tokens: int = max_total_tokens
        self.eos_token_ids: tuple[int, ...] = eos_token_ids
        self.eos_stop_ids: frozenset[int] = eos_stop_ids
        self.finish_reason: Optional[FinishReason] = None
        self.error: Optional[Exception] = None  # set when finish_reason is ERROR
        # Figures: prompt tokens served from the prefix cache at first scheduling, the fewest
        # served at any scheduling (a preempted request may recompute some it hit at first),
        # preemptions.
        self.num_cached_tokens: int = 0
        self.min_cached_tokens: int = 0
        self.num_preemptions: int = 0
        self.has_been_scheduled: bool = False
        self.arrival_time: float = time.time() if arrival_time is None else arrival_time
        self.first_scheduled_time: Optional[float] = None
        self.finished_time: Optional[float] = None

        # Text and stop strings.
        self.stop_reason: Union[int, str, None] = None
        self.stopped_by_token: bool = False
        self.output_text: Optional[str] = None  # set by `finish_text`

        # Per sampled token its logprob row: those read; the others wait in the engine's
        # `logprob_log`, in its records from `logprob_cursor` (opened when the request is
        # queued, None before), or, once the request finished, in `logprob_span` (the records
        # from its cursor on when it finished).
        self.sample_logprobs: list[TokenLogprobs] = []
        self.logprob_log: Optional[LogprobLog] = logprob_log
        self.logprob_cursor: Optional[int] = None
        self.logprob_span: list[LogprobRecord] = []
        # The sum of the sampled tokens' logprobs over the first `_num_summed` rows (summed
        # when read, in order: the same float as a running sum).
        self._cumulative_logprob: float = 0.0
        self._num_summed: int = 0
        self.prompt_logprobs: list[TokenLogprobs] = []

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_uncomputed_tokens(self) -> int:
        return self.num_tokens - self.num_computed_tokens

    @property
    def is_finished(self) -> bool:
        return self.status is RequestStatus.FINISHED

    def append_output_token(self, token_id: int) -> Optional[FinishReason]:
        """Records a sampled token; returns why the request stops now, if it does."""
        output_token_ids = self.output_token_ids
        output_token_ids.append(token_id)
        all_token_ids = self.all_token_ids
        all_token_ids.append(token_id)
        # EOS (unless ignored) or a stop token once min_tokens are out; then a stop string;
        # then max_tokens outputs or max_total_tokens.
        if token_id in self.stop_token_id_set and len(output_token_ids) >= self.min_tokens:
            self.stopped_by_token = True
            self.stop_reason = None if token_id in self.eos_stop_ids else token_id
            return FinishReason.STOP
        if self.checks_stop_strings:
            flags = self.stop_flags
            # A token that cannot complete a stop string waits undecoded (`detokenizer.py`).
            if flags is None or flags[token_id] or self.holds_text:
                detokenizer = self.detokenizer
                assert detokenizer is not None
                stop = detokenizer.catch_up_and_match(
                    output_token_ids, len(output_token_ids) > self.min_tokens
                )
                self.holds_text = detokenizer.num_unflushed > 0
                if stop is not None:
                    self.stop_reason = stop
                    return FinishReason.STOP
        if len(all_token_ids) >= self._length_limit:
            return FinishReason.LENGTH
        return None

    def open_sample_logprobs(self) -> None:
        """Opens the request's cursor in `logprob_log` (when it is queued, if it asks for
        logprobs): the rows recorded from now on are kept for it."""
        log = self.logprob_log
        if log is not None and self.num_sample_logprobs is not None:
            self.logprob_cursor = log.open()

    def resolve_sample_logprobs(self) -> None:
        """Takes the request's rows not read yet (from `logprob_span` once it finished, else
        from `logprob_log`) into `sample_logprobs`."""
        span = self.logprob_span
        if span:
            self.sample_logprobs.extend(take_rows(span, self.request_id))
            span.clear()
        log, cursor = self.logprob_log, self.logprob_cursor
        if log is not None and cursor is not None and cursor < log.num_records:
            taken, self.logprob_cursor = log.take(self.request_id, cursor)
            self.sample_logprobs.extend(taken)

    def close_sample_logprobs(self) -> None:
        """Closes the request's cursor (it finished): the records since stay with it, unread
        (`logprob_span`), and the log forgets them once no other request needs them."""
        log, cursor = self.logprob_log, self.logprob_cursor
        if log is not None and cursor is not None:
            self.logprob_span = log.close(cursor)
            self.logprob_cursor = None

    def sample_logprob_rows(self, start: int = 0, end: Optional[int] = None) -> list[TokenLogprobs]:
        """The sampled tokens' logprob rows from `start` to `end` (all by default)."""
        self.resolve_sample_logprobs()
        return self.sample_logprobs[start:end]

    @property
    def cumulative_logprob(self) -> float:
        """The sum of the sampled tokens' logprobs so far."""
        self.resolve_sample_logprobs()
        rows = self.sample_logprobs
        total = self._cumulative_logprob
        for index in range(self._num_summed, len(rows)):
            total += rows[index][1][0]
        self._cumulative_logprob, self._num_summed = total, len(rows)
        return total

    def finish_text(self) -> None:
        """Decodes what the detokenizer has not seen yet (the stop token only with
        `include_stop_str_in_output`) and sets `output_text`."""
        detokenizer = self.detokenizer
        if detokenizer is None:
            return
        end = len(self.output_token_ids)
        if self.stopped_by_token and not self.sampling_params.include_stop_str_in_output:
            end -= 1
        if detokenizer.truncate_at is None:
            remaining = self.output_token_ids[detokenizer.num_output_tokens : end]
            detokenizer.add_tokens(remaining, final=True)
        self.output_text = detokenizer.text

    def __repr__(self) -> str:
        return (
            f"Request({self.request_id!r}, status={self.status.value}, "
            f"tokens={self.num_tokens}, computed={self.num_computed_tokens})"
        )
