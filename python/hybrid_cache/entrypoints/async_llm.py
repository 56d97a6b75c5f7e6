"""`AsyncLLM`: the `LLMEngine` step loop in an engine process of its own (or on a background
thread), for many asyncio callers.

    engine = AsyncLLM(EngineConfig("path/to/model"))  # starts the engine process
    async for output in engine.generate("Hello", SamplingParams(max_tokens=8), "req-1"):
        print(output.deltas[0].text, end="")          # the text as tokens arrive
    engine.shutdown()

The engine side (`engine_core.py`: scheduler, KV cache, model, stop strings, detokenizing)
runs in a child process (`engine_process.py`), so the callers' event loop and the engine do
not share one interpreter lock; `engine_process=False` runs it on a thread of this process
instead (same behaviour). Either way callers post commands that the loop applies between
steps, and get back one batch per step with every request's news. `add_request` returns once
the engine has checked and queued the request (a bad one raises its typed error, before any
output), with the request's `RequestStream`: a `StreamOutput` for each step that gave the
request something new (several merged when the consumer fell behind), the last one
`finished` with the whole `RequestOutput`. With `stream=False` only that last one comes,
every token in it. `generate` is both in one async generator.

Closing a stream early (leaving a `generate` loop, a cancelled task: a client that
disconnected) aborts the request, which returns its blocks. A request that fails raises its
error from its own stream alone. An exception in the step loop, or an engine process that
dies, raises `EngineDeadError` from every waiting stream and every later call, and
`is_healthy` turns False. Past `max_pending_requests` requests in flight (queued, running,
or finished but not yet read to the end), `add_request` raises `EngineOverloadedError`.
"""

from __future__ import annotations

import asyncio
import atexit
import concurrent.futures
import itertools
import logging
import threading
import time
from collections import deque
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any, Callable, Optional, Union

import torch

from hybrid_cache.engine.engine_config import EngineConfig
from hybrid_cache.engine.llm import LLM
from hybrid_cache.engine.prompts import tokenize_prompt
from hybrid_cache.engine.sampling_params import SamplingParams
from hybrid_cache.engine.tokenizer import load_tokenizer
from hybrid_cache.entrypoints.engine_core import (
    ADDED,
    CALLED,
    FAILED,
    FIRST_TOKEN,
    INTER_TOKEN,
    OUTPUT,
    Batch,
    EngineCore,
    EngineInfo,
    EngineSnapshot,
    run_loop,
)
from hybrid_cache.entrypoints.engine_process import EngineProcess
from hybrid_cache.entrypoints.server_config import (
    DEFAULT_ENGINE_PROCESS,
    DEFAULT_MAX_PENDING_REQUESTS,
    DEFAULT_STREAM_INTERVAL,
)
from hybrid_cache.entrypoints.streaming import StreamOutput
from hybrid_cache.errors import (
    EngineDeadError,
    EngineOverloadedError,
    InvalidRequestError,
    ServerConfigError,
)

__all__ = ["AsyncLLM", "EngineInfo", "EngineSnapshot", "RequestListener", "RequestStream"]

logger = logging.getLogger(__name__)


class RequestListener:
    """What the engine reports per request (the server's metrics); does nothing here. Called
    on the thread that delivers the engine's batches; times in seconds."""

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


@dataclass
class _Tracked:
    """One request `generate` is waiting on, on the callers' side (keyed by `key`)."""

    key: int
    request_id: str
    prompt: Optional[str]
    prompt_token_ids: list[int]
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue
    added: asyncio.Future
    acked: bool = False


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
            self.engine._post(("abort", tracked.key), quiet=True)

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
    """An engine stepped in its own process (or thread) for asyncio callers; see the module."""

    def __init__(
        self,
        llm: Union[LLM, EngineConfig],
        max_pending_requests: int = DEFAULT_MAX_PENDING_REQUESTS,
        listener: Optional[RequestListener] = None,
        stream_interval: int = DEFAULT_STREAM_INTERVAL,
        *,
        engine_process: bool = DEFAULT_ENGINE_PROCESS,
    ) -> None:
        """`llm`: an `EngineConfig` (the engine process builds the `LLM`; on a thread, this
        process does), or a built `LLM` (on a thread it is the engine; in a process, its
        config builds a second one there and `llm` stays idle). `stream_interval`: tokens a
        sample gathers before its stream gets them (the first and the last always go at
        once); more means fewer, larger outputs. `engine_process`: the engine in a child
        process (default) or on a thread of this one."""
        for flag, value in (
            ("--max-pending-requests", max_pending_requests),
            ("--stream-interval", stream_interval),
        ):
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ServerConfigError(f"{flag} must be a positive integer, got {value!r}")
        self.stream_interval: int = stream_interval
        self.max_pending_requests: int = max_pending_requests
        self.listener: RequestListener = listener or RequestListener()
        self.engine_process: bool = engine_process
        self.snapshot: EngineSnapshot = EngineSnapshot()
        self._lock = threading.Lock()
        self._dead: Optional[EngineDeadError] = None
        self._num_pending = 0
        self._pending_lock = threading.Lock()
        self._keys = itertools.count()
        self._tracked: dict[int, _Tracked] = {}
        self._calls: dict[int, concurrent.futures.Future] = {}
        self._outbox: dict[asyncio.AbstractEventLoop, list[tuple[Any, Any]]] = {}
        self._inboxes: dict[asyncio.AbstractEventLoop, _Inbox] = {}
        self.llm: Optional[LLM] = llm if isinstance(llm, LLM) else None
        config = llm.config if isinstance(llm, LLM) else llm
        self._process: Optional[EngineProcess] = None
        self._thread: Optional[threading.Thread] = None
        if engine_process:
            self._process = EngineProcess.start(
                config, stream_interval, self._deliver, torch.get_num_threads()
            )
            atexit.register(self._process.stop)
            self.info: EngineInfo = self._process.info
            self.tokenizer: Any = (
                self.llm.tokenizer
                if self.llm is not None
                else load_tokenizer(config.tokenizer_source)
            )
        else:
            if self.llm is None:
                self.llm = LLM(config)
            self.info = EngineInfo.of(self.llm)
            self.tokenizer = self.llm.tokenizer
            core = EngineCore(self.llm, stream_interval)
            self.snapshot = core.snapshot()
            self._commands: deque[tuple[Any, ...]] = deque()
            self._wake = threading.Condition(self._lock)
            self._thread = threading.Thread(
                target=run_loop,
                args=(core, self._next_commands, self._deliver),
                name="hybrid-cache-engine",
                daemon=True,
            )
            self._thread.start()
        self.max_model_len: int = self.info.max_model_len

    # -----------------------------------------------------------------------------------------
    # The callers' side (any thread with a running event loop).

    @property
    def is_healthy(self) -> bool:
        """False once the step loop has failed, the engine process died, or the engine was
        shut down."""
        return self._dead is None

    @property
    def dead_error(self) -> Optional[EngineDeadError]:
        return self._dead

    @property
    def engine_pid(self) -> Optional[int]:
        """The engine process's id (None on a thread)."""
        return self._process.pid if self._process is not None else None

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
        """Queues one prompt (any form `LLM.generate` takes: text, ids, a dict) once the
        engine has checked it, and returns the stream of its outputs. Raises the request's
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
        key = next(self._keys)
        tracked = _Tracked(
            key, request_id, text, token_ids, loop, asyncio.Queue(), loop.create_future()
        )
        self._reserve()
        try:
            command = ("add", key, request_id, text, token_ids, sampling_params, stream, arrival)
            self._post(command, register=tracked)
        except BaseException:
            self._release()
            raise
        try:
            await tracked.added
        except asyncio.CancelledError:  # the add may still happen: undo it
            self._release()
            self._post(("abort", key), quiet=True)
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
        self._post(("abort_id", request_id), quiet=True)

    def call_engine(
        self, fn: Callable[..., Any], *args: Any, timeout: Optional[float] = 60.0
    ) -> Any:
        """Runs `fn(llm, *args)` where the engine runs, between two steps, and returns its
        result (blocking; `fn` raising raises here). In the engine process `fn`, `args` and
        the result must pickle (`fn` a module-level function). For inspection and tests."""
        future: concurrent.futures.Future = concurrent.futures.Future()
        key = next(self._keys)
        self._post(("call", key, fn, args), register=future)
        ok, value = future.result(timeout)
        if not ok:
            raise value
        return value

    def shutdown(self, timeout: float = 10.0) -> None:
        """Stops the engine (process or thread); requests still waiting get
        `EngineDeadError`."""
        if self._process is not None:
            atexit.unregister(self._process.stop)
            self._process.stop(timeout)
        else:
            self._post(("stop",), quiet=True)
            assert self._thread is not None
            self._thread.join(timeout)
        self._die(EngineDeadError("the engine was shut down"))

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

    def _post(self, command: tuple[Any, ...], quiet: bool = False, register: Any = None) -> None:
        """Sends a command to the engine; `register`: the request (`_Tracked`) or call
        (`Future`) its answer goes to, recorded first."""
        with self._lock:
            if self._dead is not None:
                if quiet:
                    return
                raise self._dead
            key = command[1] if register is not None else None
            if isinstance(register, _Tracked):
                self._tracked[key] = register
            elif register is not None:
                self._calls[key] = register
            if self._process is None:
                self._commands.append(command)
                self._wake.notify()
                return
            try:
                self._process.send([command])
            except OSError:  # the engine process is gone (its receiver is failing everyone)
                self._tracked.pop(key, None)  # type: ignore[arg-type]
                self._calls.pop(key, None)  # type: ignore[arg-type]
                if not quiet:
                    raise EngineDeadError("the engine process is gone") from None

    # -----------------------------------------------------------------------------------------
    # The delivering side: the loop thread, or the engine process's receiver thread.

    def _next_commands(self, idle: bool) -> list[tuple[Any, ...]]:
        with self._wake:
            while idle and not self._commands:
                self._wake.wait()
            commands = list(self._commands)
            self._commands.clear()
        return commands

    def _deliver(self, batch: Batch) -> None:
        """Routes a batch's events to their callers' event loops, feeds the listener."""
        tracked_by_key = self._tracked
        for kind, key, value in batch.events:
            if kind == CALLED:
                future = self._calls.pop(key, None)
                if future is not None and not future.done():
                    future.set_result(value)
                continue
            tracked = tracked_by_key.get(key)
            if tracked is None:
                continue
            if kind == OUTPUT:
                value.prompt = tracked.prompt
                value.prompt_token_ids = tracked.prompt_token_ids
                if value.finished:
                    tracked_by_key.pop(key, None)
                self._send(tracked.loop, tracked.queue, value)
            elif kind == ADDED:
                if value is None:
                    tracked.acked = True
                else:
                    tracked_by_key.pop(key, None)
                self._send(tracked.loop, tracked.added, value)
            elif kind == FAILED:
                tracked_by_key.pop(key, None)
                self._send(tracked.loop, tracked.queue, value)
        if batch.observations:
            self._observe(batch.observations)
        if batch.snapshot is not None:
            self.snapshot = batch.snapshot
        self._flush()
        if batch.dead is not None:
            message, cause = batch.dead
            dead = EngineDeadError(message)
            dead.__cause__ = cause
            self._die(dead)

    def _observe(self, observations: list[tuple[Any, ...]]) -> None:
        listener = self.listener
        try:
            for observation in observations:
                kind = observation[0]
                if kind == INTER_TOKEN:
                    listener.on_inter_token(observation[1])
                elif kind == FIRST_TOKEN:
                    listener.on_first_token(observation[1])
                else:
                    listener.on_finished(*observation[1:])
        except Exception:
            logger.exception("the request listener failed")

    def _die(self, dead: EngineDeadError) -> None:
        """No request can run any more: every waiting caller gets `dead` (the first cause
        stands)."""
        with self._lock:
            if self._dead is not None:
                return
            self._dead = dead
            waiting = list(self._tracked.values())
            self._tracked.clear()
            calls = list(self._calls.values())
            self._calls.clear()
        for tracked in waiting:
            target = tracked.queue if tracked.acked else tracked.added
            self._send(tracked.loop, target, dead)
        for future in calls:
            if not future.done():
                future.set_exception(dead)
        self._flush()

    def _send(self, loop: asyncio.AbstractEventLoop, target: Any, value: Any) -> None:
        self._outbox.setdefault(loop, []).append((target, value))

    def _flush(self) -> None:
        """Hands each event loop what the batch held for it: into its inbox, and a wake-up
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
