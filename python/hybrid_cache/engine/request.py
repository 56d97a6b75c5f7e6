"""Per-request state the scheduler and model runner share."""

from __future__ import annotations

import enum
from typing import Optional

from hybrid_cache.engine.sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED = "finished"


class FinishReason(str, enum.Enum):
    STOP = "stop"  # end-of-sequence or a stop token
    LENGTH = "length"  # max_tokens or max_model_len
    ABORT = "abort"
    ERROR = "error"


class Request:
    """One generation request: its tokens, how many of them have KV in the cache, its status.

    `num_computed_tokens` counts tokens whose KV is in the cache. On preemption it drops to 0 and
    the request is re-added later with prompt + output tokens so far (recompute), which gives the
    same results because sampled tokens are kept and a seeded generator is not rewound.
    """

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams,
        arrival_index: int,
        max_total_tokens: int,
        eos_token_ids: tuple[int, ...] = (),
    ) -> None:
        assert prompt_token_ids, "an empty prompt is rejected before a Request is built"
        self.request_id: str = request_id
        self.prompt_token_ids: list[int] = list(prompt_token_ids)
        self.output_token_ids: list[int] = []
        # prompt + output, kept up to date so a step slices it instead of concatenating.
        self.all_token_ids: list[int] = list(prompt_token_ids)
        self.sampling_params: SamplingParams = sampling_params
        self.arrival_index: int = arrival_index
        # prompt + output can never exceed this (max_model_len or prompt + max_tokens).
        self.max_total_tokens: int = max_total_tokens
        self.eos_token_ids: tuple[int, ...] = eos_token_ids
        # What `append_output_token` checks, worked out once (the params are frozen): the tokens
        # that stop the request, and the token count at which it reaches a length limit
        # (prompt + max_tokens output tokens, or max_total_tokens).
        self._stop_token_ids: frozenset[int] = frozenset(sampling_params.stop_token_ids).union(
            () if sampling_params.ignore_eos else eos_token_ids
        )
        self._length_limit: int = min(
            len(self.prompt_token_ids) + sampling_params.max_tokens, max_total_tokens
        )
        self.status: RequestStatus = RequestStatus.WAITING
        self.finish_reason: Optional[FinishReason] = None
        self.error: Optional[Exception] = None  # set when finish_reason is ERROR
        self.num_computed_tokens: int = 0
        # Figures: prompt tokens served from the prefix cache at first scheduling, preemptions.
        self.num_cached_tokens: int = 0
        self.num_preemptions: int = 0
        self.has_been_scheduled: bool = False

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
        self.output_token_ids.append(token_id)
        all_token_ids = self.all_token_ids
        all_token_ids.append(token_id)
        # EOS (unless ignored) or a stop token; then max_tokens outputs or max_total_tokens.
        if token_id in self._stop_token_ids:
            return FinishReason.STOP
        if len(all_token_ids) >= self._length_limit:
            return FinishReason.LENGTH
        return None

    def __repr__(self) -> str:
        return (
            f"Request({self.request_id!r}, status={self.status.value}, "
            f"tokens={self.num_tokens}, computed={self.num_computed_tokens})"
        )
