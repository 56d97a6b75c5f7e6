"""One mode of the benchmark on the real engine: `LLM` with the bench flags, the workload's
prompts added as its feed hands them out (all at once, or a multi-turn wave after the previous
one finished), then `LLMEngine.step()` until done, each step timed (`ModeRun`; `run_engine_mode` runs
one alone, `interleaved.py` two side by side).

Engine overhead is measured by timing the model apart from the step: a forward pre-hook and a
forward hook on the model (`torch.nn.Module` hooks, no change to the engine) take
`time.perf_counter()` around `model(input_ids, positions)`, and a wrapper around the model's
`compute_logits` (the LM head, model compute that the engine calls after the forward) times
that; the step's wall time is taken around `LLMEngine.step()`. Overhead = step time - model
time: scheduling, the Rust allocator, building the batch and attention metadata, sampling,
bookkeeping. The report also gives the share with the LM head counted as engine time. On the
CPU every torch op is synchronous, so the timers see the work itself; on CUDA the hooks first
synchronise the device (`synchronizer`), so that the model's time is the kernels' and not their
launches' (which costs the run the overlap of host work with the device's at those points).
"""

from __future__ import annotations

import time
from typing import Any, Callable, Optional

from hybrid_cache.bench.errors import BenchConfigError
from hybrid_cache.bench.metrics import RunResult, counter_deltas
from hybrid_cache.bench.settings import BenchSettings, add_prompts, make_feed
from hybrid_cache.bench.simulate import group_names
from hybrid_cache.bench.workload import FIRST_ORDINARY_ID
from hybrid_cache.engine.llm import LLM
from hybrid_cache.engine.sampling_params import SamplingParams

WARM_UP_LEN = 32


def _no_sync() -> None:
    pass


def synchronizer(device: Any) -> Callable[[], None]:
    """What makes a host timer see the work queued on `device`: `torch.cuda.synchronize` for a
    CUDA device (kernels run asynchronously), nothing for the CPU."""
    import torch

    device = torch.device(device)
    if device.type == "cuda":
        return lambda: torch.cuda.synchronize(device)
    return _no_sync


class _Timer:
    """Wall time accumulated by a subclass's instrumentation, taken step by step;
    `synchronize` runs before each clock reading."""

    total_s: float = 0.0

    def __init__(self, synchronize: Callable[[], None]) -> None:
        self._sync = synchronize

    def _now(self) -> float:
        self._sync()
        return time.perf_counter()

    def take(self) -> float:
        """The time accumulated since the last call."""
        total, self.total_s = self.total_s, 0.0
        return total


class ForwardTimer(_Timer):
    """Accumulates the wall time of a module's forward calls (hooks on the module) and of the
    decode steps `graphs` (the runner's `DecodeGraphs`, if any) replays instead of calling it
    (an instance attribute wrapping its `run`); `issue_s` accumulates the host time of both up
    to their return, the device not waited for (close to the wall time: the host is the
    bottleneck)."""

    def __init__(
        self, module: Any, synchronize: Callable[[], None] = _no_sync, graphs: Any = None
    ) -> None:
        super().__init__(synchronize)
        self._started: Optional[float] = None
        self.issue_s = 0.0
        self._handles = [
            module.register_forward_pre_hook(self._before),
            module.register_forward_hook(self._after),
        ]
        self._graphs = graphs
        if graphs is not None:
            run = graphs.run

            def timed(*args: Any, **kwargs: Any) -> Any:
                self._before(None, args)
                try:
                    return run(*args, **kwargs)
                finally:
                    self._after(None, args, None)

            graphs.run = timed

    def _before(self, module: Any, inputs: Any) -> None:
        self._started = self._now()

    def _after(self, module: Any, inputs: Any, output: Any) -> None:
        assert self._started is not None, "forward hook without its pre-hook"
        self.issue_s += time.perf_counter() - self._started
        self.total_s += self._now() - self._started
        self._started = None

    def take_issue(self) -> float:
        """The host time (`issue_s`) accumulated since the last call."""
        total, self.issue_s = self.issue_s, 0.0
        return total

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        if self._graphs is not None:
            del self._graphs.run  # the class's method again


class BroadcastTimer(_Timer):
    """Accumulates the wall time of a tensor-parallel executor's `send` (rank 0 posting the
    step's inputs to the other ranks; an instance attribute wrapping the method), and reads
    the broadcast's latency: how long after the posting the slowest worker had the step."""

    def __init__(self, executor: Any) -> None:
        super().__init__(_no_sync)
        self._executor = executor
        self._latency_seen = executor.broadcast_latency_s() or 0.0
        method = executor.send

        def timed(*args: Any, **kwargs: Any) -> Any:
            started = time.perf_counter()
            try:
                return method(*args, **kwargs)
            finally:
                self.total_s += time.perf_counter() - started

        executor.send = timed

    def take_latency(self) -> float:
        """The broadcasts' latency since the last call (0 where it is not measured)."""
        total = self._executor.broadcast_latency_s() or 0.0
        latency, self._latency_seen = total - self._latency_seen, total
        return latency

    def remove(self) -> None:
        self._executor.__dict__.pop("send", None)


class LogitsTimer(_Timer):
    """Accumulates the wall time of the model's `compute_logits` calls (an instance attribute
    wrapping the method, removed by `remove`)."""

    def __init__(self, model: Any, synchronize: Callable[[], None] = _no_sync) -> None:
        super().__init__(synchronize)
        self._model = model
        method = model.compute_logits

        def timed(*args: Any, **kwargs: Any) -> Any:
            started = self._now()
            try:
                return method(*args, **kwargs)
            finally:
                self.total_s += self._now() - started

        model.compute_logits = timed

    def remove(self) -> None:
        del self._model.compute_logits  # the class's method again


def build_llm(settings: BenchSettings, mode: str) -> Any:
    return LLM(settings.engine_config(mode))


def run_engine_mode(settings: BenchSettings, mode: str, progress: Any = None) -> RunResult:
    """Builds the engine (not timed), runs every prompt to completion (timed), and returns the
    figures. Greedy sampling, EOS ignored: each request generates exactly `output_len` tokens."""
    run = ModeRun(settings, mode, progress)
    started, started_cpu = time.perf_counter(), time.process_time()
    try:
        while not run.done:
            run.step()
    finally:
        run.close()
    return run.finish(time.perf_counter() - started, time.process_time() - started_cpu)


class ModeRun:
    """One mode's engine fed by the workload, stepped from outside (`step` until `done`,
    then `finish`): `run_engine_mode` steps one alone, `interleaved.py` two side by side. The
    engine is built and warmed up (untimed) by the constructor; each `step` is timed on its
    own (`step_time_s`), with the model forward and LM head apart (hooks)."""

    def __init__(self, settings: BenchSettings, mode: str, progress: Any = None) -> None:
        self.mode, self._progress = mode, progress
        self._llm = llm = build_llm(settings, mode)
        self._engine = engine = llm.engine
        self._feed = make_feed(settings, llm.spec.vocab_size)
        self._params = SamplingParams(
            max_tokens=settings.output_len,
            temperature=0.0,
            ignore_eos=True,
            logprobs=settings.logprobs,
            stop=list(settings.stop),
        )
        warm_up_started = time.perf_counter()
        warm_up(llm, settings)
        warm_up_s = time.perf_counter() - warm_up_started
        self._core_before = engine.kv_cache.stats()  # the core's cumulative prefix-cache counters
        engine.reset_step_stats()
        self._requests: list[Any] = []
        self._add_prompts()
        sync = synchronizer(llm.device)
        graphs = getattr(engine.model_runner, "decode_graphs", None)
        self._timer = ForwardTimer(llm.model, sync, graphs)
        self._logits_timer = LogitsTimer(llm.model, sync)
        parallel = getattr(llm, "parallel", None)
        self._broadcast_timer = None if parallel is None else BroadcastTimer(parallel)
        self.result = RunResult.starting(
            mode, False, llm.layout.num_blocks, group_names(llm.layout)
        )
        self.result.tensor_parallel_size = settings.tensor_parallel_size
        self.result.warm_up_s = warm_up_s

    def _add_prompts(self) -> None:
        """Adds what the feed hands out now. Raises `BenchConfigError` when a request does not
        fit the engine."""
        self._requests += add_prompts(self._engine, self._feed, self._params, self.mode)

    @property
    def llm(self) -> Any:
        """The `LLM` this run steps."""
        return self._llm

    @property
    def forward_timer(self) -> ForwardTimer:
        """The timer of the model's forwards and replayed decode graphs."""
        return self._timer

    @property
    def done(self) -> bool:
        return not self._engine.has_unfinished_requests() and self._feed.exhausted

    def step(self) -> float:
        """One engine step, timed; returns its seconds. Raises `BenchConfigError` when a request
        fails (a benchmark with a failed request measures something else)."""
        result = self.result
        step_started = time.perf_counter()
        finished = self._engine.step()
        step_s = time.perf_counter() - step_started
        result.step_time_s.append(step_s)
        result.forward_time_s.append(self._timer.take())
        result.logits_time_s.append(self._logits_timer.take())
        if self._broadcast_timer is not None:
            result.broadcast_time_s.append(self._broadcast_timer.take())
            result.broadcast_latency_s.append(self._broadcast_timer.take_latency())
        for request in finished:
            if request.error is not None:
                raise BenchConfigError(f"request {request.request_id} failed: {request.error}")
            result.num_requests += 1
            result.num_prompt_tokens += request.num_prompt_tokens
            result.num_output_tokens += request.num_output_tokens
            self._feed.record(request)
        if finished:
            self._add_prompts()
        if self._progress is not None and finished:
            self._progress.update(len(finished))
        return step_s

    def close(self) -> None:
        """Removes the timing hooks (the model is as it was) and stops the engine's worker
        processes, if it has any."""
        self._timer.remove()
        self._logits_timer.remove()
        if self._broadcast_timer is not None:
            self._broadcast_timer.remove()
            self._llm.shutdown()

    def finish(self, elapsed_s: float, cpu_time_s: float) -> RunResult:
        """The figures, with the run's time as measured by the caller."""
        result = self.result
        result.elapsed_s, result.cpu_time_s = elapsed_s, cpu_time_s
        result.output_token_ids = [list(request.output_token_ids) for request in self._requests]
        for step in self._engine.step_stats:
            result.running_per_step.append(step.num_scheduled_requests)
            result.tokens_per_step.append(step.num_scheduled_tokens)
            result.blocks_per_group_per_step.append(list(step.num_used_blocks_per_group))
        result.num_preemptions = sum(step.num_preemptions for step in self._engine.step_stats)
        result.peak_blocks_per_group = [
            max(per_group) for per_group in zip(*result.blocks_per_group_per_step)
        ]
        counters = counter_deltas(self._core_before, self._engine.kv_cache.stats())
        queries, hits = counters.get("prefix_queries", 0), counters.get("prefix_hits", 0)
        result.prefix_cache_hit_rate = hits / queries if queries else 0.0
        result.reuse = self._feed.reuse
        result.cache_counters = counters
        return result


def warm_up(llm: Any, settings: BenchSettings) -> None:
    """Short untimed requests, so one-time costs (first torch calls, allocator setup, Triton
    compiles) fall outside the measurement; on CUDA then every Triton attention variant the
    run's steps can meet (`compile_attention_variants`), whatever their batch sizes and
    lengths. The prefix cache is emptied afterwards."""
    prompt = {"prompt_token_ids": [FIRST_ORDINARY_ID] * min(settings.input_len, WARM_UP_LEN)}
    params = SamplingParams(max_tokens=2, temperature=0.0)
    for batch in warm_up_batches(llm.device.type, settings.num_prompts, settings.max_num_seqs):
        llm.generate([prompt] * batch, params, use_tqdm=False)
    if llm.device.type == "cuda":
        compile_attention_variants(llm)
    assert llm.reset_prefix_cache(), "the warm-up requests must have given their blocks back"


def compile_attention_variants(llm: Any) -> list:
    """Compiles every Triton attention variant of the engine's layers (decode-only and mixed
    batches, with and without KV splits): the warm-up's short prompts alone would leave the
    split variants of long contexts to the timed run. Returns them (none without Triton
    layers)."""
    runner = llm.engine.model_runner
    kv_caches = getattr(runner, "kv_caches", None)
    if kv_caches is None:
        return []
    from hybrid_cache.attention.triton_backend import compile_kernel_variants

    return compile_kernel_variants(llm.model, kv_caches)


def warm_up_batches(device_type: str, num_prompts: int, max_num_seqs: int) -> list[int]:
    """Batch sizes of the warm-up: one request on the CPU; on CUDA 1, 2, 4, ... up to the run's
    largest batch, so each batch-size class meets its first torch and Triton calls here (the
    attention kernels' split count is a runtime argument, and `compile_attention_variants`
    compiles their split variants; before both, a first hybrid run of a tiny preset took
    6.8-8.1 s on an H200 against 1.4 s warm)."""
    if device_type != "cuda":
        return [1]
    largest = max(1, min(num_prompts, max_num_seqs))
    batches = [1 << power for power in range(largest.bit_length()) if 1 << power < largest]
    return [*batches, largest]
