"""What both generation endpoints share: the server's `ServingContext`, request ids, the body
checks every request gets, and running a request's prompts (all at once, or merged into one
stream) so that a client that goes away aborts them all."""

from __future__ import annotations

import asyncio
import itertools
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, TypeVar

from hybrid_cache.engine.sampling_params import SamplingParams
from hybrid_cache.entrypoints.async_llm import AsyncLLM, RequestStream
from hybrid_cache.entrypoints.errors import error_of
from hybrid_cache.entrypoints.formatting import DONE_EVENT, TokenTexts, sse
from hybrid_cache.entrypoints.protocol import SamplingFields
from hybrid_cache.entrypoints.streaming import StreamOutput
from hybrid_cache.errors import (
    ClientDisconnectedError,
    InvalidFieldError,
    UnknownServedModelError,
)

T = TypeVar("T")


@dataclass
class ServingContext:
    """The engine and what the endpoints read of the model (set once at start)."""

    engine: AsyncLLM
    model_names: tuple[str, ...]
    model_root: str
    chat_template: Optional[str] = None
    defaults: Mapping[str, Any] = field(default_factory=dict)
    created: int = field(default_factory=lambda: int(time.time()))

    def __post_init__(self) -> None:
        self.tokenizer: Any = self.engine.tokenizer
        self.max_model_len: int = self.engine.max_model_len
        self.vocab_size: int = self.engine.info.vocab_size
        self.texts: TokenTexts = TokenTexts(self.tokenizer)
        self._counter = itertools.count()
        self._prefix = uuid.uuid4().hex[:12]

    def request_id(self, kind: str) -> str:
        return f"{kind}-{self._prefix}{next(self._counter):08x}"

    def check_body(self, body: SamplingFields, unsupported: Mapping[str, Any]) -> None:
        """The served model is named, and no field the server does not do is set."""
        if body.model not in self.model_names:
            raise UnknownServedModelError(
                f"the model {body.model!r} does not exist here; this server serves "
                f"{', '.join(repr(name) for name in self.model_names)} (GET /v1/models)"
            )
        for name, value in unsupported.items():
            raise InvalidFieldError(
                f"{name}={value!r} is not supported by this server; leave it out", name
            )
        if body.stream_options is not None and not body.stream:
            raise InvalidFieldError("stream_options needs stream=true", "stream_options")


async def run_all(
    calls: Sequence[Callable[[], Awaitable[T]]], disconnected: Callable[[], Awaitable[None]]
) -> list[T]:
    """Runs every call at once and returns their results in order. When one raises, or the
    client disconnects first (`disconnected` returns), the others are cancelled (which aborts
    their requests) and the error (`ClientDisconnectedError` for a disconnect) is raised."""
    tasks = [asyncio.ensure_future(call()) for call in calls]
    watcher = asyncio.ensure_future(disconnected())
    try:
        everything = asyncio.ensure_future(asyncio.gather(*tasks))
        done, _ = await asyncio.wait({everything, watcher}, return_when=asyncio.FIRST_COMPLETED)
        if everything in done:
            return everything.result()
        raise ClientDisconnectedError("the client disconnected before the response was ready")
    finally:
        watcher.cancel()
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, watcher, return_exceptions=True)


async def add_all(
    engine: AsyncLLM, requests: Sequence[tuple[Any, SamplingParams, str]]
) -> list[RequestStream]:
    """Queues every (prompt, params, request id) for streaming; when one is refused, the
    others are aborted and its error raised (before any response is sent)."""
    streams: list[RequestStream] = []
    try:
        for prompt, params, request_id in requests:
            streams.append(await engine.add_request(prompt, params, request_id, stream=True))
    except BaseException:
        for stream in streams:
            stream.close()
        raise
    return streams


async def final_output(
    engine: AsyncLLM, prompt: Any, params: SamplingParams, request_id: str
) -> StreamOutput:
    """A prompt's whole output (`generate` with `stream=False`)."""
    result: Optional[StreamOutput] = None
    async for output in engine.generate(prompt, params, request_id, stream=False):
        result = output
    assert result is not None and result.finished
    return result


async def merge_streams(
    streams: Sequence[RequestStream],
) -> AsyncIterator[tuple[int, StreamOutput]]:
    """(stream index, output) from several streams as they come; the first error ends all of
    them (leaving early closes them, which aborts their requests)."""
    if len(streams) == 1:
        async for output in streams[0]:
            yield 0, output
        return
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(index: int, stream: AsyncIterator[StreamOutput]) -> None:
        try:
            async for output in stream:
                await queue.put((index, output))
        except BaseException as error:
            await queue.put((index, error))
            return
        await queue.put((index, None))

    tasks = [asyncio.ensure_future(pump(i, stream)) for i, stream in enumerate(streams)]
    try:
        remaining = len(tasks)
        while remaining:
            index, item = await queue.get()
            if item is None:
                remaining -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield index, item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def sse_chunks(
    choice_lists: AsyncIterator[list[dict[str, Any]]],
    envelope: Callable[[list[dict[str, Any]]], dict[str, Any]],
    include_usage: bool,
    final_usage: Callable[[], dict[str, Any]],
    close: Callable[[], None],
) -> AsyncIterator[bytes]:
    """The server-sent events of a streamed response: a chunk per list of choices (`"usage":
    null` in it when the client asked for usage), an error event and `[DONE]` if the stream
    fails, else the usage chunk (read from `final_usage` at the end) and `[DONE]`. `close`
    runs however it ends, a client that went away included."""
    try:
        async for choices in choice_lists:
            chunk = envelope(choices)
            if include_usage:
                chunk["usage"] = None
            yield sse(chunk)
    except Exception as error:
        yield sse(error_of(error)[1])
        yield DONE_EVENT
        return
    finally:
        close()
    if include_usage:
        chunk = envelope([])
        chunk["usage"] = final_usage()
        yield sse(chunk)
    yield DONE_EVENT
