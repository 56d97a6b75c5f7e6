"""`POST /v1/chat/completions`: one conversation rendered by the chat template (the same
rendering as `LLM.chat`), `n` choices of the assistant's next message.

Streaming sends a first chunk per choice with the assistant role, then each step's new content
as `chat.completion.chunk`s, the finish reason on a choice's last, then
(`stream_options.include_usage`) a chunk with no choices and the usage, then `[DONE]`. A chat
template in the request must be a template (a file is read only from the server's
`--chat-template`).
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any, Callable, Optional

from hybrid_cache.engine.prompts import render_chat, resolve_chat_template
from hybrid_cache.entrypoints.async_llm import RequestStream
from hybrid_cache.entrypoints.formatting import chat_logprobs, usage
from hybrid_cache.entrypoints.protocol import ChatCompletionRequest
from hybrid_cache.entrypoints.sampling import max_tokens_for, sampling_params
from hybrid_cache.entrypoints.serving import (
    ServingContext,
    add_all,
    final_output,
    run_all,
    sse_chunks,
)
from hybrid_cache.entrypoints.streaming import SampleDelta
from hybrid_cache.errors import InvalidFieldError, InvalidRequestError


def render(context: ServingContext, body: ChatCompletionRequest) -> tuple[str, list[int]]:
    """The conversation's text and token ids."""
    template_field = body.chat_template
    if template_field is not None and "{" not in template_field:
        raise InvalidFieldError(
            "chat_template in a request must be a Jinja template (files are read only from "
            "the server's --chat-template)",
            "chat_template",
        )
    template = resolve_chat_template(context.tokenizer, template_field or context.chat_template)
    if body.add_generation_prompt and body.continue_final_message:
        raise InvalidRequestError(
            "add_generation_prompt and continue_final_message exclude each other: the one "
            "opens a new assistant turn, the other continues the last message"
        )
    text, token_ids = render_chat(
        context.tokenizer,
        body.messages,
        template,
        body.add_generation_prompt,
        body.continue_final_message,
        None,
        body.chat_template_kwargs,
    )
    if body.add_special_tokens:
        token_ids = list(context.tokenizer.encode(text))
    return text, token_ids


class ChatFormatter:
    """Choices and chunks of one chat request."""

    def __init__(self, context: ServingContext, body: ChatCompletionRequest, request_id: str):
        self.context = context
        self.body = body
        self.request_id = request_id

    def logprobs(self, delta: SampleDelta) -> Optional[dict[str, Any]]:
        if not self.body.logprobs:
            return None
        return chat_logprobs(delta.logprobs or [], self.context.texts)

    def choice(self, delta: SampleDelta, prompt_token_ids: list[int]) -> dict[str, Any]:
        choice: dict[str, Any] = {
            "index": delta.index,
            "message": {"role": "assistant", "content": delta.text},
            "logprobs": self.logprobs(delta),
            "finish_reason": delta.finish_reason,
            "stop_reason": delta.stop_reason,
        }
        if self.body.return_token_ids:
            choice["token_ids"] = delta.token_ids
            choice["prompt_token_ids"] = prompt_token_ids
        return choice

    def chunk_choice(
        self, delta: SampleDelta, first: bool, prompt_token_ids: list[int]
    ) -> dict[str, Any]:
        message: dict[str, Any] = {"content": delta.text}
        if first:
            message["role"] = "assistant"
        choice: dict[str, Any] = {
            "index": delta.index,
            "delta": message,
            "logprobs": self.logprobs(delta),
            "finish_reason": delta.finish_reason,
            "stop_reason": delta.stop_reason,
        }
        if self.body.return_token_ids:
            choice["token_ids"] = delta.token_ids
            if first:
                choice["prompt_token_ids"] = prompt_token_ids
        return choice

    def envelope(self, choices: list[dict[str, Any]], chunk: bool) -> dict[str, Any]:
        return {
            "id": self.request_id,
            "object": "chat.completion.chunk" if chunk else "chat.completion",
            "created": self.context.created,
            "model": self.body.model,
            "choices": choices,
        }


async def create_chat_completion(
    context: ServingContext, body: ChatCompletionRequest, disconnected: Callable[[], Any]
) -> Any:
    """The response body (a dict), or with `stream` an async iterator of SSE bytes."""
    context.check_body(body, body.unsupported_fields())
    if body.top_logprobs is not None and not body.logprobs:
        raise InvalidFieldError("top_logprobs needs logprobs=true", "top_logprobs")
    text, token_ids = render(context, body)
    requested = body.max_completion_tokens if body.max_completion_tokens is not None else None
    if requested is None:
        requested = body.max_tokens
    max_tokens = max_tokens_for(
        requested, context.defaults, None, len(token_ids), context.max_model_len
    )
    params = sampling_params(
        body,
        context.defaults,
        max_tokens,
        logprobs=(body.top_logprobs or 0) if body.logprobs else None,
    )
    request_id = context.request_id("chatcmpl")
    formatter = ChatFormatter(context, body, request_id)
    prompt = {"prompt_token_ids": token_ids, "prompt": text}
    engine = context.engine
    if body.stream:
        (stream,) = await add_all(engine, [(prompt, params, request_id)])
        return stream_chat(formatter, stream, token_ids)
    (output,) = await run_all(
        [lambda: final_output(engine, prompt, params, request_id)], disconnected
    )
    response = formatter.envelope(
        [formatter.choice(delta, token_ids) for delta in output.deltas], chunk=False
    )
    completion_tokens = sum(len(delta.token_ids) for delta in output.deltas)
    response["usage"] = usage(len(token_ids), completion_tokens, output.num_cached_tokens)
    return response


def stream_chat(
    formatter: ChatFormatter, stream: RequestStream, prompt_token_ids: list[int]
) -> AsyncIterator[bytes]:
    body = formatter.body
    include_usage = body.stream_options is not None and body.stream_options.include_usage
    started: set[int] = set()
    completion_tokens = cached = 0

    async def choice_lists() -> AsyncIterator[list[dict[str, Any]]]:
        nonlocal completion_tokens, cached
        async for output in stream:
            choices = []
            for delta in output.deltas:
                first = delta.index not in started
                started.add(delta.index)
                completion_tokens += len(delta.token_ids)
                choices.append(formatter.chunk_choice(delta, first, prompt_token_ids))
            cached = output.num_cached_tokens
            if choices:
                yield choices

    return sse_chunks(
        choice_lists(),
        lambda choices: formatter.envelope(choices, chunk=True),
        include_usage,
        lambda: usage(len(prompt_token_ids), completion_tokens, cached),
        stream.close,
    )
