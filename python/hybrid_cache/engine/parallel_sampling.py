"""Several samples of one prompt (`n > 1` or `best_of`): one request per sample, one result.

The samples are queued one after another, so the first one's prompt blocks are allocated
(and cached) before the others are admitted: the others start from a prefix-cache hit on them,
in the same step or a later one, and the prompt's KV is computed once (all but the tokens past
the last block a hit can end at, and only with prefix caching on). With `best_of > n` every
sample's cumulative logprob is tracked and the `n` highest are returned.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Optional

from hybrid_cache.engine.request import FinishReason, Request
from hybrid_cache.engine.sampling_params import SamplingParams


def child_request_id(request_id: str, index: int) -> str:
    """The engine id of sample `index` of `request_id` (as vLLM names them)."""
    return f"{index}_{request_id}"


def child_params(params: SamplingParams, index: int) -> SamplingParams:
    """Sample `index`'s params: one sample, seed + index, prompt logprobs on the first only."""
    return dataclasses.replace(
        params,
        n=1,
        best_of=None,
        seed=None if params.seed is None else params.seed + index,
        prompt_logprobs=params.prompt_logprobs if index == 0 else None,
    )


class SampleGroup:
    """The samples of one prompt; finished when every sample is."""

    def __init__(self, request_id: str, params: SamplingParams, children: list[Request]) -> None:
        self.request_id: str = request_id
        self.sampling_params: SamplingParams = params
        self.children: list[Request] = children
        self.num_unfinished: int = len(children)

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.children[0].prompt_token_ids

    @property
    def is_finished(self) -> bool:
        return self.num_unfinished == 0

    @property
    def error(self) -> Optional[Exception]:
        return next((child.error for child in self.children if child.error is not None), None)

    def samples(self) -> list[Request]:
        """The `n` samples to return: all of them in order, or with `best_of > n` the `n` with
        the highest cumulative logprob (failed ones last)."""
        n = self.sampling_params.n
        if len(self.children) == n:
            return list(self.children)

        def score(child: Request) -> float:
            if child.finish_reason is FinishReason.ERROR:
                return -math.inf
            return child.cumulative_logprob

        return sorted(self.children, key=score, reverse=True)[:n]
