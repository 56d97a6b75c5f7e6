"""`AsyncLLM`: the `LLMEngine` step loop on a background thread, for many asyncio callers.

    engine = AsyncLLM(LLM("path/to/model"))           # starts the loop thread
    async for output in engine.generate("Hello", SamplingParams(max_tokens=8), "req-1"):
        print(output.deltas[0].text, end="")          # the text as tokens arrive
    engine.shutdown()

The engine is not thread-safe, so every engine call runs on the loop thread: `add_request`
and `abort` post commands that it applies between steps. `add_request` returns once the loop
thread has checked and queued the request (a bad one raises its typed error, before any
output), with the request's `RequestStream`: a `StreamOutput` for each step that gave the
request something new (several merged when the consumer fell behind), the last one
`finished` with the whole `RequestOutput`. With `stream=False` only that last one comes,
every token in it. `generate` is both in one async generator.

Closing a stream early (leaving a `generate` loop, a cancelled task: a client that
disconnected) aborts the request, which returns its blocks. A request that fails raises its
error from its own stream alone. An exception in the step loop raises `EngineDeadError` from
every waiting stream and every later call, and `is_healthy` turns False. Past
`max_pending_requests` requests in flight (queued, running, or finished but not yet read to
the end), `add_request` raises `EngineOverloadedError`.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import threading
import time
from collections import deque
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Optional, Union

from hybrid_cache.engine.llm import LLM
from hybrid_cache.engine.llm_engine import Finished
from hybrid_cache.engine.output_builder import request_output
from hybrid_cache.engine.outputs import EngineStats
from hybrid_cache.engine.parallel_sampling import SampleGroup
from hybrid_cache.engine.prompts import tokenize_prompt
from hybrid_cache.engine.request import FinishReason, Request
from hybrid_cache.engine.sampling_params import SamplingParams
from hybrid_cache.entrypoints.server_config import (
    DEFAULT_MAX_PENDING_REQUESTS,
    DEFAULT_STREAM_INTERVAL,
)
from hybrid_cache.entrypoints.streaming import SampleStream, StreamOutput
from hybrid_cache.errors import (
    EngineDeadError,
    EngineOverloadedError,
    InvalidRequestError,
    ServerConfigError,
)

logger = logging.getLogger(__name__)


class RequestListener:
    """What the loop thread reports per request (the server's metrics); does nothing here.
    Called on the loop thread; times in seconds."""

    def on_first_token(self, seconds: float) -> None:
        """Time from `generate` to the request's first token."""

    def on_inter_token(self, seconds: float) -> None:
        """Time between two tokens of one sample."""

    def on_finished(
        self,
        num_prompt_tokens: int,
        num_generated_tokens: int,
        finish_reasons: list[str],
        seconds: float,
    ) -> None:
        """A request ended after `seconds` (any reason: each sample's, "abort" and "error"
        included), having generated `num_generated_tokens` over all its samples."""


@dataclass(frozen=True)
class EngineSnapshot:
    """The engine's state after the loop's last pass (read by other threads)."""

    num_running: int = 0
    num_waiting: int = 0
    num_used_blocks_per_group: tuple[int, ...] = ()
    num_free_blocks: int = 0
    stats: EngineStats = field(default_factory=EngineStats)


@dataclass
class _Tracked:
    """One request `generate` is waiting on (touched by the loop thread only, once added)."""

    request_id: str
    prompt: Optional[str]
    prompt_token_ids: list[int]
    params: SamplingParams
    stream: bool
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue
    arrival: float
    item: Optional[Finished] = None
    samples: list[SampleStream] = field(default_factory=list)
    sample_tokens: list[int] = field(default_factory=list)  # tokens seen per sample
    sample_times: list[float] = field(default_factory=list)  # when each sample's last came
    first_token_seen: bool = False
    sent_prompt_logprobs: bool = False

    def children(self) -> list[Request]:
        item = self.item
        return item.children if isinstance(item, SampleGroup) else [item]  # type: ignore[list-item]


class RequestStream:
    """The outputs of one queued request (`AsyncLLM.add_request`): an async iterator of
    `StreamOutput`s, the last one `finished`. `close()` (or leaving a `generate` loop, or a
    cancelled `__anext__`) before the end aborts the request."""

    def __init__(self, engine: AsyncLLM, tracked: _Tracked) -> None:
        self.engine: AsyncLLM = engine
        self.request_id: str = tracked.request_id
        self.prompt_token_ids: list[int] = tracked.prompt_token_ids
        self._tracked: Optional[_Tracked] = tracked

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> StreamOutput:
        tracked = self._tracked
        if tracked is None:
            raise StopAsyncIteration
        queue = tracked.queue
        try:
            item = await queue.get()
        except BaseException:  # cancelled: the consumer is gone
            self.close()
            raise
        while isinstance(item, StreamOutput) and not item.finished and not queue.empty():
            later = queue.get_nowait()
            if not isinstance(later, StreamOutput):
                item = later
                break
            item.merge(later)
        if isinstance(item, BaseException):
            self._end()
            raise item
        if item.finished:
            self._end()
        return item

    def close(self) -> None:
        """Aborts the request unless it has finished (its blocks are returned)."""
        tracked = self._tracked
        if tracked is not None:
            self._end()
            self.engine._post(("abort", tracked), quiet=True)

    async def aclose(self) -> None:
        self.close()

    def _end(self) -> None:
        if self._tracked is not None:
            self._tracked = None
            self.engine._release()

    def __del__(self) -> None:
        if self._tracked is not None:
            try:
                self.close()
            except Exception:
                pass


class AsyncLLM:
    """An `LLM`'s engine stepped on its own thread; see the module."""

    def __init__(
        self,
        llm: LLM,
        max_pending_requests: int = DEFAULT_MAX_PENDING_REQUESTS,
        listener: Optional[RequestListener] = None,
        stream_interval: int = DEFAULT_STREAM_INTERVAL,
    ) -> None:
        """`stream_interval`: tokens a sample gathers before its stream gets them (the first
        and the last always go at once); more means fewer, larger outputs."""
        for flag, value in (
            ("--max-pending-requests", max_pending_requests),
            ("--stream-interval", stream_interval),
        ):
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ServerConfigError(f"{flag} must be a positive integer, got {value!r}")
        self.stream_interval: int = stream_interval
        self.llm: LLM = llm
        self.engine = llm.engine
        self.tokenizer: Any = llm.tokenizer
        self.max_model_len: int = llm.max_model_len
        self.max_pending_requests: int = max_pending_requests
        self.listener: RequestListener = listener or RequestListener()
        self.snapshot: EngineSnapshot = EngineSnapshot()
        self._commands: deque[tuple[Any, ...]] = deque()
        self._taken: deque[tuple[Any, ...]] = deque()  # taken by the loop thread, not yet done
        self._wake = threading.Condition()
        self._dead: Optional[EngineDeadError] = None
        self._num_pending = 0
        self._pending_lock = threading.Lock()
        self._tracked: dict[str, _Tracked] = {}
        self._outbox: dict[asyncio.AbstractEventLoop, list[tuple[Any, Any]]] = {}
        self._inboxes: dict[asyncio.AbstractEventLoop, _Inbox] = {}
        self._update_snapshot()
        self._thread = threading.Thread(target=self._run, name="hybrid-cache-engine", daemon=True)
        self._thread.start()

    # -----------------------------------------------------------------------------------------
    # The callers' side (any thread with a running event loop).

    @property
    def is_healthy(self) -> bool:
        """False once the step loop has failed or the engine was shut down."""
        return self._dead is None

    @property
    def dead_error(self) -> Optional[EngineDeadError]:
        return self._dead

    @property
    def num_pending_requests(self) -> int:
        """Requests in flight: being checked, queued, running, or finished but their stream
        not yet read to the end."""
        return self._num_pending

    async def add_request(
        self,
        prompt: Any,
        sampling_params: SamplingParams,
        request_id: str,
        *,
        stream: bool = True,
    ) -> RequestStream:
        """Queues one prompt (any form `LLM.generate` takes: text, ids, a dict) once the loop
        thread has checked it, and returns the stream of its outputs. Raises the request's
        typed error, e.g. `InvalidRequestError` for a bad prompt or `PromptTooLongError`;
        `EngineOverloadedError` or `EngineDeadError` when no request can run now."""
        self._raise_if_dead()
        if not isinstance(sampling_params, SamplingParams):
            raise InvalidRequestError(
                f"sampling_params must be SamplingParams, got {type(sampling_params).__name__}"
            )
        if stream and sampling_params.num_samples > sampling_params.n:
            raise InvalidRequestError(
                f"best_of={sampling_params.best_of} > n={sampling_params.n} picks the samples "
                "when all have finished, so it cannot stream: drop best_of or stream=False"
            )
        arrival = time.perf_counter()
        text, token_ids = tokenize_prompt(prompt, self.tokenizer)
        loop = asyncio.get_running_loop()
        tracked = _Tracked(
            request_id, text, token_ids, sampling_params, stream, loop, asyncio.Queue(), arrival
        )
        added = loop.create_future()
        self._reserve()
        try:
            self._post(("add", tracked, added))
        except BaseException:
            self._release()
            raise
        try:
            await added
        except asyncio.CancelledError:  # the add may still happen: undo it
            self._release()
            self._post(("abort", tracked), quiet=True)
            raise
        except BaseException:  # refused: nothing was queued
            self._release()
            raise
        return RequestStream(self, tracked)

    async def generate(
        self,
        prompt: Any,
        sampling_params: SamplingParams,
        request_id: str,
        *,
        stream: bool = True,
    ) -> AsyncIterator[StreamOutput]:
        """`add_request`, then its outputs as they come (see the module); leaving early
        aborts the request."""
        outputs = await self.add_request(prompt, sampling_params, request_id, stream=stream)
        try:
            async for output in outputs:
                yield output
        finally:
            outputs.close()

    async def abort(self, request_id: str) -> None:
        """Stops a request (its `generate` ends with finish reason "abort") and returns its
        blocks; nothing happens for an unknown or finished one."""
        self._post(("abort", request_id), quiet=True)

    def shutdown(self, timeout: float = 10.0) -> None:
        """Stops the loop thread; requests still waiting get `EngineDeadError`."""
        self._post(("stop",), quiet=True)
        self._thread.join(timeout)

    def _raise_if_dead(self) -> None:
        if self._dead is not None:
            raise self._dead

    def _reserve(self) -> None:
        with self._pending_lock:
            if self._num_pending >= self.max_pending_requests:
                raise EngineOverloadedError(
                    f"the engine holds {self._num_pending} requests, its limit "
                    f"(--max-pending-requests {self.max_pending_requests}): retry later"
                )
            self._num_pending += 1

    def _release(self) -> None:
        with self._pending_lock:
            self._num_pending -= 1

    def _post(self, command: tuple[Any, ...], quiet: bool = False) -> None:
        with self._wake:
            if self._dead is not None:
                if quiet:
                    return
                raise self._dead
            self._commands.append(command)
            self._wake.notify()

    # -----------------------------------------------------------------------------------------
    # The loop thread.

    def _run(self) -> None:
        engine = self.engine
        try:
            while True:
                with self._wake:
                    while not self._commands and not engine.has_unfinished_requests():
                        self._wake.wait()
                    self._taken.extend(self._commands)
                    self._commands.clear()
                while self._taken:
                    command = self._taken.popleft()
                    if command[0] == "stop":
                        self._die(EngineDeadError("the engine was shut down"))
                        return
                    if command[0] == "add":
                        self._add(command[1], command[2])
                    else:
                        self._abort(command[1])
                if engine.has_unfinished_requests():
                    finished = engine.step()
                    self._collect(finished)
                self._update_snapshot()
                self._flush()
        except BaseException as error:  # the step loop itself failed: no request can run
            logger.exception("the engine loop failed")
            dead = EngineDeadError(f"the engine loop failed: {type(error).__name__}: {error}")
            dead.__cause__ = error
            self._die(dead)

    def _add(self, tracked: _Tracked, added: asyncio.Future) -> None:
        try:
            item = self.engine.add_request(
                tracked.request_id, tracked.prompt_token_ids, tracked.params
            )
        except Exception as error:  # the request's own error (typed), for its caller alone
            self._send(tracked.loop, added, error)
            return
        tracked.item = item
        children = tracked.children()
        tracked.samples = [SampleStream(index, child) for index, child in enumerate(children)]
        tracked.sample_tokens = [0] * len(children)
        tracked.sample_times = [0.0] * len(children)
        self._tracked[tracked.request_id] = tracked
        self._send(tracked.loop, added, None)

    def _abort(self, target: Union[str, _Tracked]) -> None:
        """Aborts a request by id (`abort`), or the one a `generate` left (never another
        request that has the same id)."""
        request_id = target if isinstance(target, str) else target.request_id
        tracked = self._tracked.get(request_id)
        if tracked is None or (isinstance(target, _Tracked) and tracked is not target):
            return
        self.engine.abort_request(request_id)
        self._finish(tracked, time.perf_counter())

    def _collect(self, finished: Sequence[Finished]) -> None:
        """Every tracked request's news after a step (a request failing here fails alone)."""
        now = time.perf_counter()
        done = {item.request_id for item in finished}
        for tracked in list(self._tracked.values()):
            try:
                if tracked.request_id in done:
                    self._finish(tracked, now)
                else:
                    self._progress(tracked, now)
            except Exception as error:
                logger.exception("request %s failed", tracked.request_id)
                self._fail(tracked, error)

    def _progress(self, tracked: _Tracked, now: float) -> None:
        """Token times for the metrics; with `stream`, the samples' deltas."""
        children = tracked.children()
        self._observe_tokens(tracked, children, now)
        failed = next(
            (child for child in children if child.finish_reason is FinishReason.ERROR), None
        )
        if failed is not None:  # one sample of a group failed: the request fails
            self._fail(tracked, failed.error or RuntimeError(f"{failed} failed"))
            return
        if not tracked.stream:
            return
        interval = self.stream_interval
        if interval > 1 and not any(
            stream.num_tokens == 0
            or child.is_finished
            or len(child.output_token_ids) - stream.num_tokens >= interval
            for stream, child in zip(tracked.samples, children)
        ):
            return
        output = self._stream_output(tracked, children)
        if output.deltas:
            self._send(tracked.loop, tracked.queue, output)

    def _finish(self, tracked: _Tracked, now: float) -> None:
        """A finished (or aborted) request's last output, with its `RequestOutput`."""
        del self._tracked[tracked.request_id]
        item = tracked.item
        assert item is not None
        children = tracked.children()
        self._observe_tokens(tracked, children, now)
        error = next((child.error for child in children if child.error is not None), None)
        if tracked.stream:
            output = self._stream_output(tracked, children)
        else:
            samples = item.samples() if isinstance(item, SampleGroup) else children
            output = self._stream_output(
                tracked, samples, [SampleStream(i, child) for i, child in enumerate(samples)]
            )
        output.finished = True
        output.output = request_output(item, tracked.prompt, self.tokenizer)
        self._report_finished(tracked, children, now)
        if error is not None:
            self._send(tracked.loop, tracked.queue, error)
        else:
            self._send(tracked.loop, tracked.queue, output)

    def _fail(self, tracked: _Tracked, error: BaseException) -> None:
        """Ends a request with an error raised from its `generate` (its blocks are returned)."""
        if self._tracked.pop(tracked.request_id, None) is None:
            return
        try:
            self.engine.abort_request(tracked.request_id)
            self._report_finished(tracked, tracked.children(), time.perf_counter(), "error")
        except Exception:
            logger.exception("aborting failed request %s", tracked.request_id)
        self._send(tracked.loop, tracked.queue, error)

    def _stream_output(
        self,
        tracked: _Tracked,
        children: list[Request],
        streams: Optional[list[SampleStream]] = None,
    ) -> StreamOutput:
        streams = tracked.samples if streams is None else streams
        deltas = []
        for stream, child in zip(streams, children):
            delta = stream.delta(child)
            if delta is not None:
                deltas.append(delta)
        first = tracked.children()[0]  # the sample with the prompt logprobs
        output = StreamOutput(
            tracked.request_id,
            tracked.prompt,
            tracked.prompt_token_ids,
            deltas,
            num_cached_tokens=first.num_cached_tokens,
        )
        if (
            tracked.params.prompt_logprobs is not None
            and not tracked.sent_prompt_logprobs
            and (deltas or first.is_finished)
            and first.finish_reason is not FinishReason.ERROR
        ):
            output.prompt_logprobs = list(first.prompt_logprobs)
            tracked.sent_prompt_logprobs = True
        return output

    def _observe_tokens(self, tracked: _Tracked, children: list[Request], now: float) -> None:
        listener = self.listener
        for index, child in enumerate(children):
            count = len(child.output_token_ids)
            if count == tracked.sample_tokens[index]:
                continue
            if not tracked.first_token_seen:
                tracked.first_token_seen = True
                listener.on_first_token(now - tracked.arrival)
            elif tracked.sample_tokens[index]:
                listener.on_inter_token(now - tracked.sample_times[index])
            tracked.sample_tokens[index] = count
            tracked.sample_times[index] = now

    def _report_finished(
        self, tracked: _Tracked, children: list[Request], now: float, reason: str = ""
    ) -> None:
        reasons = [
            reason or (child.finish_reason.value if child.finish_reason is not None else "abort")
            for child in children
        ]
        try:
            self.listener.on_finished(
                len(tracked.prompt_token_ids),
                sum(len(child.output_token_ids) for child in children),
                reasons,
                now - tracked.arrival,
            )
        except Exception:
            logger.exception("the request listener failed")

    def _send(self, loop: asyncio.AbstractEventLoop, target: Any, value: Any) -> None:
        self._outbox.setdefault(loop, []).append((target, value))

    def _flush(self) -> None:
        """Hands each event loop what the pass produced for it: into its inbox, and a wake-up
        only when the loop has emptied the inbox since the last one (a loop that lags behind
        then reads several steps in one go, for one wake-up)."""
        outbox, self._outbox = self._outbox, {}
        for loop, items in outbox.items():
            inbox = self._inboxes.get(loop)
            if inbox is None:
                inbox = self._inboxes[loop] = _Inbox()
            inbox.items.extend(items)
            if not inbox.scheduled:
                inbox.scheduled = True
                try:
                    loop.call_soon_threadsafe(inbox.drain)
                except RuntimeError:  # the loop has closed: nobody waits for these
                    del self._inboxes[loop]

    def _update_snapshot(self) -> None:
        engine = self.engine
        self.snapshot = EngineSnapshot(
            num_running=len(engine.scheduler.running),
            num_waiting=len(engine.scheduler.waiting),
            num_used_blocks_per_group=tuple(engine.kv_cache.num_used_blocks_per_group()),
            num_free_blocks=engine.kv_cache.num_free_blocks,
            stats=dataclasses.replace(engine.stats),
        )

    def _die(self, dead: EngineDeadError) -> None:
        """No request can run any more: every waiting caller gets `dead`."""
        with self._wake:
            self._dead = dead
            commands = [*self._taken, *self._commands]
            self._taken.clear()
            self._commands.clear()
        for command in commands:
            if command[0] == "add":
                self._send(command[1].loop, command[2], dead)
        for tracked in list(self._tracked.values()):
            self._send(tracked.loop, tracked.queue, dead)
            try:  # give the blocks back where the engine still can
                self.engine.abort_request(tracked.request_id)
            except Exception:
                pass
        self._tracked.clear()
        try:
            self._update_snapshot()
        except Exception:
            pass
        self._flush()


class _Inbox:
    """What the loop thread has for one event loop: filled there, drained on the event loop
    (a deque: appends and pops are atomic; `scheduled` is cleared before draining, so an item
    added after the drain started gets a wake-up of its own)."""

    def __init__(self) -> None:
        self.items: deque[tuple[Any, Any]] = deque()
        self.scheduled: bool = False

    def drain(self) -> None:
        self.scheduled = False
        items = self.items
        while items:
            target, value = items.popleft()
            if isinstance(target, asyncio.Queue):
                target.put_nowait(value)
            elif not target.done():
                if isinstance(value, BaseException):
                    target.set_exception(value)
                else:
                    target.set_result(value)
