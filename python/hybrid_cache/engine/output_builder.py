"""A finished request (or `SampleGroup`) turned into the `RequestOutput` `LLM.generate`
returns: its completions, logprobs in vLLM's form, metrics."""

from __future__ import annotations

from typing import Any, Optional, Union

from hybrid_cache.engine.logprobs import logprob_dicts
from hybrid_cache.engine.outputs import (
    CompletionOutput,
    PromptLogprobs,
    RequestMetrics,
    RequestOutput,
)
from hybrid_cache.engine.parallel_sampling import SampleGroup
from hybrid_cache.engine.request import FinishReason, Request


def request_output(
    finished: Union[Request, SampleGroup], prompt: Optional[str], tokenizer: Optional[Any]
) -> RequestOutput:
    """The output of a finished request or sample group; `prompt` is the prompt text, if the
    prompt was text. Logprobs get decoded tokens when the request has text."""
    if isinstance(finished, SampleGroup):
        children, samples = finished.children, finished.samples()
    else:
        children = samples = [finished]
    first = children[0]
    params = first.sampling_params
    decoder = tokenizer if params.detokenize else None
    prompt_logprobs: Optional[PromptLogprobs] = None
    if params.prompt_logprobs is not None and first.finish_reason is not FinishReason.ERROR:
        prompt_logprobs = [None, *logprob_dicts(first.prompt_logprobs, decoder)]
    return RequestOutput(
        request_id=finished.request_id,
        prompt=prompt,
        prompt_token_ids=first.prompt_token_ids,
        outputs=[completion_output(index, sample, decoder) for index, sample in enumerate(samples)],
        num_cached_tokens=first.num_cached_tokens,
        num_preemptions=sum(child.num_preemptions for child in children),
        error=next((child.error for child in children if child.error is not None), None),
        prompt_logprobs=prompt_logprobs,
        metrics=request_metrics(children),
    )


def completion_output(index: int, request: Request, decoder: Optional[Any]) -> CompletionOutput:
    reason = request.finish_reason
    assert reason is not None, f"{request} has not finished"
    tracked = request.num_sample_logprobs is not None
    asked = request.sampling_params.logprobs is not None
    return CompletionOutput(
        index=index,
        token_ids=list(request.output_token_ids),
        text=request.output_text if reason is not FinishReason.ERROR else None,
        finish_reason=reason.value,
        cumulative_logprob=request.cumulative_logprob if tracked else None,
        logprobs=logprob_dicts(request.sample_logprob_rows(), decoder) if asked else None,
        stop_reason=request.stop_reason,
    )


def request_metrics(requests: list[Request]) -> RequestMetrics:
    """The metrics of a prompt's samples together: first arrival, scheduling and token, last
    token and finish."""
    arrival = min(request.arrival_time for request in requests)
    scheduled = _earliest(request.first_scheduled_time for request in requests)
    return RequestMetrics(
        arrival_time=arrival,
        first_scheduled_time=scheduled,
        first_token_time=_earliest(request.first_token_time for request in requests),
        last_token_time=_latest(request.last_token_time for request in requests),
        finished_time=_latest(request.finished_time for request in requests),
        time_in_queue=None if scheduled is None else scheduled - arrival,
    )


def _earliest(times: Any) -> Optional[float]:
    return min((time for time in times if time is not None), default=None)


def _latest(times: Any) -> Optional[float]:
    return max((time for time in times if time is not None), default=None)
