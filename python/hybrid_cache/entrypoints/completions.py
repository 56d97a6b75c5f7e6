"""`POST /v1/completions`: one or several prompts (text or token ids), `n` choices each.

Choice `i * n + j` is sample `j` of prompt `i`. `echo` puts the prompt's text (and, with
`logprobs`, its tokens' logprobs) before the completion. Streaming sends each step's new text
of every choice as a `text_completion` chunk, the choice's finish reason on its last, then
(`stream_options.include_usage`) a chunk with no choices and the usage, then `[DONE]`.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any, Callable, Optional

from hybrid_cache.engine.sampling_params import SamplingParams
from hybrid_cache.entrypoints.async_llm import RequestStream
from hybrid_cache.entrypoints.formatting import (
    completion_logprobs,
    merge_completion_logprobs,
    usage,
)
from hybrid_cache.entrypoints.protocol import CompletionRequest
from hybrid_cache.entrypoints.sampling import (
    COMPLETIONS_MAX_TOKENS,
    max_tokens_for,
    sampling_params,
)
from hybrid_cache.entrypoints.serving import (
    ServingContext,
    add_all,
    final_output,
    merge_streams,
    run_all,
    sse_chunks,
)
from hybrid_cache.entrypoints.streaming import SampleDelta, StreamOutput
from hybrid_cache.errors import InvalidFieldError, NoTokenizerError


@dataclass
class PreparedPrompt:
    text: Optional[str]  # the prompt's text (decoded from ids when given as ids)
    token_ids: list[int]
    params: SamplingParams
    request_id: str

    def engine_prompt(self) -> dict[str, Any]:
        """What `AsyncLLM` runs: the ids (the text only reported)."""
        return {"prompt_token_ids": self.token_ids, "prompt": self.text}


def split_prompt_field(prompt: Any) -> list[Any]:
    """The prompts of a `prompt` field: a string, ids, or a list of either."""
    if isinstance(prompt, str):
        return [prompt]
    if not prompt:
        raise InvalidFieldError("prompt is empty: give a string, token ids, or a list", "prompt")
    if all(isinstance(item, int) for item in prompt):
        return [list(prompt)]
    return list(prompt)


def prepare(context: ServingContext, body: CompletionRequest) -> list[PreparedPrompt]:
    """Every prompt tokenized and its params built (any bad one refuses the request)."""
    context.check_body(body, body.unsupported_fields())
    tokenizer = context.tokenizer
    base_id = context.request_id("cmpl")
    prepared = []
    for index, prompt in enumerate(split_prompt_field(body.prompt)):
        if isinstance(prompt, str):
            if tokenizer is None:
                raise NoTokenizerError("this model has no tokenizer: send the prompt as token ids")
            text: Optional[str] = prompt
            token_ids = list(tokenizer.encode(prompt, add_special_tokens=body.add_special_tokens))
        else:
            token_ids = list(prompt)
            text = tokenizer.decode(token_ids) if tokenizer is not None and body.echo else None
        max_tokens = max_tokens_for(
            body.max_tokens,
            context.defaults,
            COMPLETIONS_MAX_TOKENS,
            len(token_ids),
            context.max_model_len,
        )
        params = sampling_params(
            body,
            context.defaults,
            max_tokens,
            logprobs=body.logprobs,
            prompt_logprobs=body.logprobs if body.echo and body.logprobs is not None else None,
            best_of=body.best_of,
        )
        prepared.append(PreparedPrompt(text, token_ids, params, f"{base_id}-{index}"))
    return prepared


class CompletionFormatter:
    """Choices, chunks and usage of one `/v1/completions` request."""

    def __init__(self, context: ServingContext, body: CompletionRequest, request_id: str):
        self.context = context
        self.body = body
        self.request_id = request_id
        self.n = body.n
        self.texts = context.texts

    def choice(
        self, prompt: PreparedPrompt, output: StreamOutput, delta: SampleDelta, first: bool
    ) -> dict[str, Any]:
        """A choice (or a chunk's choice) of one sample's delta; `first`: its first delta,
        which carries the echoed prompt."""
        body = self.body
        text = delta.text
        logprobs = None
        if body.logprobs is not None:
            offset = 0
            if first and body.echo:
                prompt_text = prompt.text or ""
                rows = [None, *(output.prompt_logprobs or [])]
                logprobs = completion_logprobs(rows, self.texts, 0, prompt.token_ids[0])
                offset = len(prompt_text)
            own = completion_logprobs(delta.logprobs or [], self.texts, offset)
            logprobs = own if logprobs is None else merge_completion_logprobs(logprobs, own)
        if first and body.echo:
            text = (prompt.text or "") + text
        choice: dict[str, Any] = {
            "index": delta.index,
            "text": text,
            "logprobs": logprobs,
            "finish_reason": delta.finish_reason,
            "stop_reason": delta.stop_reason,
        }
        if body.return_token_ids:
            choice["token_ids"] = delta.token_ids
            if first:
                choice["prompt_token_ids"] = prompt.token_ids
        return choice

    def envelope(self, choices: list[dict[str, Any]]) -> dict[str, Any]:
        return {
            "id": self.request_id,
            "object": "text_completion",
            "created": self.context.created,
            "model": self.body.model,
            "choices": choices,
        }


async def create_completion(
    context: ServingContext,
    body: CompletionRequest,
    disconnected: Callable[[], Any],
) -> Any:
    """The response body (a dict), or with `stream` an async iterator of SSE bytes."""
    prepared = prepare(context, body)
    request_id = prepared[0].request_id.rsplit("-", 1)[0]
    formatter = CompletionFormatter(context, body, request_id)
    engine = context.engine
    if body.stream:
        streams = await add_all(
            engine, [(p.engine_prompt(), p.params, p.request_id) for p in prepared]
        )
        return stream_completion(formatter, prepared, streams)
    outputs = await run_all(
        [
            (lambda p=p: final_output(engine, p.engine_prompt(), p.params, p.request_id))
            for p in prepared
        ],
        disconnected,
    )
    choices = []
    completion_tokens = cached = 0
    for index, (prompt, output) in enumerate(zip(prepared, outputs)):
        for delta in output.deltas:
            completion_tokens += len(delta.token_ids)
            delta.index += index * body.n
            choices.append(formatter.choice(prompt, output, delta, first=True))
        cached += output.num_cached_tokens
    response = formatter.envelope(choices)
    response["usage"] = usage(sum(len(p.token_ids) for p in prepared), completion_tokens, cached)
    return response


def stream_completion(
    formatter: CompletionFormatter,
    prepared: list[PreparedPrompt],
    streams: list[RequestStream],
) -> AsyncIterator[bytes]:
    body = formatter.body
    include_usage = body.stream_options is not None and body.stream_options.include_usage
    started: set[int] = set()
    completion_tokens = cached = 0

    async def choice_lists() -> AsyncIterator[list[dict[str, Any]]]:
        nonlocal completion_tokens, cached
        async for prompt_index, output in merge_streams(streams):
            prompt = prepared[prompt_index]
            choices = []
            for delta in output.deltas:
                index = prompt_index * body.n + delta.index
                first = index not in started
                started.add(index)
                completion_tokens += len(delta.token_ids)
                delta.index = index
                choices.append(formatter.choice(prompt, output, delta, first))
            if output.finished:
                cached += output.num_cached_tokens
            if choices:
                yield choices

    def close() -> None:
        for stream in streams:
            stream.close()

    num_prompt_tokens = sum(len(p.token_ids) for p in prepared)
    return sse_chunks(
        choice_lists(),
        formatter.envelope,
        include_usage,
        lambda: usage(num_prompt_tokens, completion_tokens, cached),
        close,
    )
