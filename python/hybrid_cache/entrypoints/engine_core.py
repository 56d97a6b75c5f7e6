"""`EngineCore`: the engine's side of `AsyncLLM`, wherever the step loop runs (a thread of the
server's process, or the engine process of `engine_process.py`).

It owns the `LLM`'s engine and nothing of the callers: requests are known by a key the caller
side picks. `apply` takes one command between steps:

    ("add", key, request_id, prompt_text, prompt_token_ids, params, stream, arrival)
    ("abort", key)            the request a stream left (never another with the same id)
    ("abort_id", request_id)  `AsyncLLM.abort`
    ("call", key, fn, args)   runs fn(llm, *args) here (`AsyncLLM.call_engine`)
    ("stop",)

and `take_batch` hands over what the commands and the steps since the last call produced, as
one `Batch`: events per request (its add checked, a `StreamOutput`, a failure, a call's
result), the token times the server's metrics observe, and an `EngineSnapshot`. `run_loop`
is the loop both places run: commands, a step when there is work, a batch, and sleep only
when idle.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

from hybrid_cache.engine.llm import LLM
from hybrid_cache.engine.llm_engine import Finished
from hybrid_cache.engine.output_builder import request_output
from hybrid_cache.engine.outputs import EngineStats
from hybrid_cache.engine.parallel_sampling import SampleGroup
from hybrid_cache.engine.request import FinishReason, Request
from hybrid_cache.engine.sampling_params import SamplingParams
from hybrid_cache.entrypoints.streaming import SampleStream, StreamOutput

logger = logging.getLogger(__name__)

# Event kinds of a `Batch`.
ADDED = "added"  # value: None, or the error that refused the request
OUTPUT = "output"  # value: a StreamOutput (its prompt fields left empty: the caller has them)
FAILED = "failed"  # value: the error the request's stream raises
CALLED = "called"  # value: (True, result) or (False, error)
# Observation kinds (the server's metrics, `RequestListener`).
FIRST_TOKEN = "first_token"  # (seconds,)
INTER_TOKEN = "inter_token"  # (seconds,)
REQUEST_FINISHED = "finished"  # (num_prompt_tokens, num_generated_tokens, reasons, seconds)


@dataclass(frozen=True)
class EngineSnapshot:
    """The engine's state after the loop's last pass (read by other threads)."""

    num_running: int = 0
    num_waiting: int = 0
    num_used_blocks_per_group: tuple[int, ...] = ()
    num_free_blocks: int = 0
    num_protected_blocks: int = 0
    stats: EngineStats = field(default_factory=EngineStats)


@dataclass(frozen=True)
class EngineInfo:
    """What the serving side reads of the engine's model once, at start."""

    model_root: str
    max_model_len: int
    vocab_size: int
    generation_sampling: dict[str, Any]
    group_kinds: tuple[str, ...]
    num_usable_blocks: int  # the null block apart

    @classmethod
    def of(cls, llm: LLM) -> EngineInfo:
        return cls(
            llm.config.model,
            llm.max_model_len,
            llm.spec.vocab_size,
            dict(llm.generation_defaults.sampling),
            tuple(str(kind) for kind, _ in llm.layout.group_attention()),
            llm.layout.num_blocks - 1,
        )


@dataclass
class Batch:
    """What one pass of the loop produced (see the module). `dead`: set on the last batch,
    (message, cause) of why no request can run any more."""

    events: list[tuple[str, int, Any]]
    observations: list[tuple[Any, ...]]
    snapshot: Optional[EngineSnapshot]  # None: unknown (the last one stands)
    dead: Optional[tuple[str, Optional[BaseException]]] = None


@dataclass
class _Tracked:
    """One queued request, on the engine's side."""

    key: int
    request_id: str
    prompt: Optional[str]
    num_prompt_tokens: int
    params: SamplingParams
    stream: bool
    arrival: float
    item: Finished
    samples: list[SampleStream] = field(default_factory=list)
    sample_tokens: list[int] = field(default_factory=list)  # tokens seen per sample
    sample_times: list[float] = field(default_factory=list)  # when each sample's last came
    first_token_seen: bool = False
    sent_prompt_logprobs: bool = False
    single: Optional[Request] = None  # the request itself when it has one sample

    def __post_init__(self) -> None:
        if not isinstance(self.item, SampleGroup):
            self.single = self.item  # type: ignore[assignment]

    def children(self) -> list[Request]:
        item = self.item
        return item.children if isinstance(item, SampleGroup) else [item]  # type: ignore[list-item]


def same_error(error: BaseException) -> BaseException:
    return error


class EngineCore:
    """The engine side of `AsyncLLM` (see the module). `portable(error)` makes an error fit to
    cross to the callers (the engine process: one that survives pickling)."""

    def __init__(
        self,
        llm: LLM,
        stream_interval: int,
        portable: Callable[[BaseException], BaseException] = same_error,
    ) -> None:
        self.llm: LLM = llm
        self.engine = llm.engine
        self.tokenizer: Any = llm.tokenizer
        self.stream_interval: int = stream_interval
        self.portable = portable
        self._tracked: dict[int, _Tracked] = {}
        self._by_id: dict[str, _Tracked] = {}
        self._events: list[tuple[str, int, Any]] = []
        self._observations: list[tuple[Any, ...]] = []

    @property
    def has_work(self) -> bool:
        return self.engine.has_unfinished_requests()

    def apply(self, command: tuple[Any, ...]) -> None:
        kind = command[0]
        if kind == "add":
            self._add(*command[1:])
        elif kind == "abort":
            self._abort(self._tracked.get(command[1]))
        elif kind == "abort_id":
            self._abort(self._by_id.get(command[1]))
        elif kind == "call":
            self._call(command[1], command[2], command[3])
        else:
            raise ValueError(f"unknown engine command {kind!r}")

    def step(self) -> None:
        self._collect(self.engine.step())

    def take_batch(self) -> Batch:
        events, self._events = self._events, []
        observations, self._observations = self._observations, []
        return Batch(events, observations, self.snapshot())

    def snapshot(self) -> EngineSnapshot:
        engine = self.engine
        stats = engine.stats
        return EngineSnapshot(
            num_running=len(engine.scheduler.running),
            num_waiting=len(engine.scheduler.waiting),
            num_used_blocks_per_group=tuple(engine.kv_cache.num_used_blocks_per_group()),
            num_free_blocks=engine.kv_cache.num_free_blocks,
            num_protected_blocks=engine.kv_cache.num_protected_blocks,
            stats=dataclasses.replace(
                stats,
                max_used_blocks_per_group=list(stats.max_used_blocks_per_group),
                prefix_alone_hit_tokens_per_group=list(stats.prefix_alone_hit_tokens_per_group),
                prefix_shortened_tokens_per_group=list(stats.prefix_shortened_tokens_per_group),
            ),
        )

    def abort_all(self) -> None:
        """Gives every request's blocks back where the engine still can (the loop ends)."""
        for tracked in list(self._tracked.values()):
            try:
                self.engine.abort_request(tracked.request_id)
            except Exception:
                pass
        self._tracked.clear()
        self._by_id.clear()

    # -----------------------------------------------------------------------------------------

    def _add(
        self,
        key: int,
        request_id: str,
        prompt: Optional[str],
        prompt_token_ids: list[int],
        params: SamplingParams,
        stream: bool,
        arrival: float,
    ) -> None:
        try:
            item = self.engine.add_request(request_id, prompt_token_ids, params)
        except Exception as error:  # the request's own error (typed), for its caller alone
            self._events.append((ADDED, key, self.portable(error)))
            return
        tracked = _Tracked(
            key, request_id, prompt, len(prompt_token_ids), params, stream, arrival, item
        )
        children = tracked.children()
        tracked.samples = [SampleStream(index, child) for index, child in enumerate(children)]
        tracked.sample_tokens = [0] * len(children)
        tracked.sample_times = [0.0] * len(children)
        self._tracked[key] = tracked
        self._by_id[request_id] = tracked
        self._events.append((ADDED, key, None))

    def _abort(self, tracked: Optional[_Tracked]) -> None:
        if tracked is None or self._tracked.get(tracked.key) is not tracked:
            return
        self.engine.abort_request(tracked.request_id)
        self._finish(tracked, time.perf_counter())

    def _call(self, key: int, fn: Callable[..., Any], args: Sequence[Any]) -> None:
        try:
            result: tuple[bool, Any] = (True, fn(self.llm, *args))
        except Exception as error:
            result = (False, self.portable(error))
        self._events.append((CALLED, key, result))

    def _forget(self, tracked: _Tracked) -> bool:
        if self._tracked.pop(tracked.key, None) is None:
            return False
        if self._by_id.get(tracked.request_id) is tracked:
            del self._by_id[tracked.request_id]
        return True

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
        if tracked.single is not None:
            self._progress_single(tracked, tracked.single, now)
            return
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
            self._events.append((OUTPUT, tracked.key, output))

    def _progress_single(self, tracked: _Tracked, request: Request, now: float) -> None:
        """`_progress` of a request with one sample (`n == 1`), the usual case: the same
        events in fewer steps (it runs for every request after every step)."""
        count = len(request.output_token_ids)
        if count != tracked.sample_tokens[0]:
            self._observe_tokens(tracked, [request], now)
        if request.finish_reason is FinishReason.ERROR:
            self._fail(tracked, request.error or RuntimeError(f"{request} failed"))
            return
        if not tracked.stream:
            return
        stream = tracked.samples[0]
        interval = self.stream_interval
        if (
            interval > 1
            and stream.num_tokens
            and count - stream.num_tokens < interval
            and not request.is_finished
        ):
            return
        delta = stream.delta(request)
        if delta is None:
            return
        output = StreamOutput(
            tracked.request_id, None, [], [delta], num_cached_tokens=request.num_cached_tokens
        )
        if tracked.params.prompt_logprobs is not None and not tracked.sent_prompt_logprobs:
            output.prompt_logprobs = list(request.prompt_logprobs)
            tracked.sent_prompt_logprobs = True
        self._events.append((OUTPUT, tracked.key, output))

    def _finish(self, tracked: _Tracked, now: float) -> None:
        """A finished (or aborted) request's last output, with its `RequestOutput`."""
        self._forget(tracked)
        item = tracked.item
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
            self._events.append((FAILED, tracked.key, self.portable(error)))
        else:
            self._events.append((OUTPUT, tracked.key, output))

    def _fail(self, tracked: _Tracked, error: BaseException) -> None:
        """Ends a request with an error raised from its `generate` (its blocks are returned)."""
        if not self._forget(tracked):
            return
        try:
            self.engine.abort_request(tracked.request_id)
            self._report_finished(tracked, tracked.children(), time.perf_counter(), "error")
        except Exception:
            logger.exception("aborting failed request %s", tracked.request_id)
        self._events.append((FAILED, tracked.key, self.portable(error)))

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
            tracked.request_id, None, [], deltas, num_cached_tokens=first.num_cached_tokens
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
        observations = self._observations
        for index, child in enumerate(children):
            count = len(child.output_token_ids)
            if count == tracked.sample_tokens[index]:
                continue
            if not tracked.first_token_seen:
                tracked.first_token_seen = True
                observations.append((FIRST_TOKEN, now - tracked.arrival))
            elif tracked.sample_tokens[index]:
                observations.append((INTER_TOKEN, now - tracked.sample_times[index]))
            tracked.sample_tokens[index] = count
            tracked.sample_times[index] = now

    def _report_finished(
        self, tracked: _Tracked, children: list[Request], now: float, reason: str = ""
    ) -> None:
        reasons = [
            reason or (child.finish_reason.value if child.finish_reason is not None else "abort")
            for child in children
        ]
        self._observations.append(
            (
                REQUEST_FINISHED,
                tracked.num_prompt_tokens,
                sum(len(child.output_token_ids) for child in children),
                reasons,
                now - tracked.arrival,
            )
        )


def run_loop(
    core: EngineCore,
    next_commands: Callable[[bool], Optional[list[tuple[Any, ...]]]],
    send: Callable[[Batch], None],
) -> None:
    """Steps `core` until a stop: each pass takes the commands waiting (`next_commands(idle)`
    blocks for one only when `idle`; None: the callers are gone), applies them, runs a step
    when there is work and sends the pass's batch. The last batch has `dead` set: a stop,
    or the loop's own failure (every request's blocks are returned first)."""
    try:
        while True:
            commands = next_commands(not core.has_work)
            if commands is None:
                core.abort_all()
                return
            stop = False
            for command in commands:
                if command[0] == "stop":
                    stop = True
                    break
                core.apply(command)
            if stop:
                core.abort_all()
                batch = core.take_batch()
                batch.dead = ("the engine was shut down", None)
                send(batch)
                return
            if core.has_work:
                core.step()
            send(core.take_batch())
    except BaseException as error:  # the step loop itself failed: no request can run
        logger.exception("the engine loop failed")
        core.abort_all()
        try:
            batch = core.take_batch()
        except Exception:
            batch = Batch([], [], None)
        batch.dead = (
            f"the engine loop failed: {type(error).__name__}: {error}",
            core.portable(error),
        )
        send(batch)
