"""`BenchSettings`: everything one benchmark run depends on, checked once, up front."""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, Optional

from hybrid_cache.bench.errors import BenchConfigError
from hybrid_cache.bench.multi_turn import MultiTurnFeed, MultiTurnShape
from hybrid_cache.bench.workload import RandomFeed, make_prompts
from hybrid_cache.engine.engine_config import (
    DEFAULT_DISTRIBUTED_TIMEOUT_S,
    DEFAULT_GPU_MEMORY_UTILIZATION,
    DEFAULT_MAX_NUM_SEQS,
    DEFAULT_PROTECTED_PREFIX_FRACTION,
    DEFAULT_SCHEDULING_POLICY,
    EngineConfig,
)
from hybrid_cache.errors import EngineConfigError, InvalidRequestError
from hybrid_cache.planner import DEFAULT_BLOCK_SIZE, DEFAULT_MAX_NUM_BATCHED_TOKENS

WORKLOADS = ("random", "multi-turn")
# `EngineConfig` fields a run sets for every mode (`model`, `max_model_len` and the mode are
# per settings or per run).
ENGINE_FLAGS = tuple(
    field.name
    for field in dataclasses.fields(EngineConfig)
    if field.name not in ("model", "max_model_len", "kv_cache_mode")
)


@dataclass(frozen=True)
class BenchSettings:
    """The workload (prompts and lengths) and the engine flags shared by every mode of a run.
    `None` for `max_model_len` means `input_len + output_len`; for `kv_cache_memory` the
    engine's default (CPU) or, with `--simulate`, the GPU budget of `cost_model`.

    `multi_turn` set means the multi-turn workload (`multi_turn.py`); build such settings with
    `for_multi_turn`, which derives the per-request fields from the shape."""

    model: str
    input_len: int
    output_len: int
    num_prompts: int
    prefix_len: int = 0
    max_model_len: Optional[int] = None
    kv_cache_memory: Optional[Any] = None
    block_size: int = DEFAULT_BLOCK_SIZE
    kv_group_layout: str = "auto"
    max_num_seqs: int = DEFAULT_MAX_NUM_SEQS
    max_num_batched_tokens: int = DEFAULT_MAX_NUM_BATCHED_TOKENS
    enable_prefix_caching: bool = True
    scheduling_policy: str = DEFAULT_SCHEDULING_POLICY
    hold_waiting_prefixes: bool = True
    admission_headroom: str = "auto"
    tail_replay: bool = True
    token_tails: bool = True
    protected_prefix_fraction: float = DEFAULT_PROTECTED_PREFIX_FRACTION
    tokenizer: Optional[str] = None
    load_format: str = "dummy"
    hf_overrides: dict[str, Any] = field(default_factory=dict)
    generation_config: str = "auto"
    seed: int = 0
    attention_backend: str = "auto"
    dtype: Any = "auto"
    device: Any = None
    gpu_memory_utilization: float = DEFAULT_GPU_MEMORY_UTILIZATION
    enforce_eager: bool = False
    tensor_parallel_size: int = 1
    distributed_timeout: float = DEFAULT_DISTRIBUTED_TIMEOUT_S
    vocab_parallel: bool = True
    multi_turn: Optional[MultiTurnShape] = None
    # What every request asks of the sampler besides greedy tokens (the real engine only).
    logprobs: Optional[int] = None
    stop: tuple[str, ...] = ()

    @classmethod
    def for_multi_turn(cls, model: str, shape: MultiTurnShape, **flags: Any) -> BenchSettings:
        """Settings of a multi-turn run: `input_len` is a turn's new user tokens, `num_prompts`
        sessions x turns; `flags` are the engine flags (no `input_len`, `output_len`,
        `num_prompts` or `prefix_len`)."""
        return cls(
            model,
            input_len=shape.turn_input_len,
            output_len=shape.output_len,
            num_prompts=shape.num_requests,
            multi_turn=shape,
            **flags,
        )

    @property
    def workload(self) -> str:
        return "random" if self.multi_turn is None else "multi-turn"

    @staticmethod
    def engine_flags(config: EngineConfig) -> dict[str, Any]:
        """The keyword arguments of `BenchSettings` that carry `config`'s engine flags."""
        flags = {name: getattr(config, name) for name in ENGINE_FLAGS}
        flags["hf_overrides"] = dict(config.hf_overrides or {})
        return {**flags, "max_model_len": config.max_model_len}

    def engine_config(self, mode: str) -> EngineConfig:
        """The engine's config in `mode` ("hybrid" or "uniform"); `max_model_len` is the
        context length (the longest request unless given)."""
        flags = {name: getattr(self, name) for name in ENGINE_FLAGS}
        return EngineConfig(self.model, max_model_len=self.context_len, kv_cache_mode=mode, **flags)

    def __post_init__(self) -> None:
        for name in ("input_len", "output_len", "num_prompts"):
            check_positive(name, getattr(self, name))
        with engine_errors_as_bench_errors():
            # The engine flags are the engine's to check (once, in `EngineConfig`).
            EngineConfig(
                self.model,
                max_model_len=self.max_model_len,
                **{name: getattr(self, name) for name in ENGINE_FLAGS},
            )
        if self.max_model_len is not None:
            if self.max_model_len < self.longest_request:
                what = (
                    "--input-len + --output-len"
                    if self.multi_turn is None
                    else "a session's last turn (--system-len + --num-turns x "
                    "(--turn-input-len + --output-len))"
                )
                raise BenchConfigError(
                    f"--max-model-len {self.max_model_len} is shorter than {what} "
                    f"({self.longest_request}); raise it"
                )
        if not 0 <= self.prefix_len <= self.input_len:
            raise BenchConfigError(
                f"--prefix-len must be between 0 and --input-len ({self.input_len}), "
                f"got {self.prefix_len}"
            )

    @property
    def longest_request(self) -> int:
        """Prompt plus output tokens of the workload's longest request."""
        if self.multi_turn is not None:
            return self.multi_turn.max_total_tokens
        return self.input_len + self.output_len

    @property
    def context_len(self) -> int:
        return self.max_model_len or self.longest_request


@contextlib.contextmanager
def engine_errors_as_bench_errors() -> Iterator[None]:
    """An engine flag's `EngineConfigError` (or `PlanError`) as the bench front's
    `BenchConfigError`, with the same message (it names the flag)."""
    try:
        yield
    except EngineConfigError as error:
        raise BenchConfigError(str(error)) from error


def check_positive(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        flag = "--" + name.replace("_", "-")
        raise BenchConfigError(f"{flag} must be a positive integer, got {value!r}")


def make_feed(settings: BenchSettings, vocab_size: int) -> Any:
    """The prompt feed of a benchmark run: `RandomFeed` or, for `--workload multi-turn`,
    `MultiTurnFeed` (both have `next_prompts`, `record`, `exhausted` and `reuse`)."""
    if settings.multi_turn is not None:
        return MultiTurnFeed(settings.multi_turn, vocab_size, settings.seed)
    prompts = make_prompts(
        settings.num_prompts, settings.input_len, settings.prefix_len, vocab_size, settings.seed
    )
    return RandomFeed(prompts)


def add_prompts(engine: Any, feed: Any, params: Any, mode: str) -> list[Any]:
    """Adds to `engine` what `feed` hands out now and returns the requests. A request the
    engine refuses (it can never fit, or is longer than `max_model_len`) is a
    `BenchConfigError`: the workload does not fit the engine."""
    requests = []
    for request_id, prompt in feed.next_prompts():
        try:
            requests.append(engine.add_request(request_id, prompt, params))
        except InvalidRequestError as error:
            raise BenchConfigError(
                f"one request of {len(prompt)}+{params.max_tokens} tokens does not fit the "
                f"{mode} engine ({engine.kv_cache.num_blocks - 1} blocks of KV cache): {error}; "
                "raise --kv-cache-memory (or --max-model-len)"
            ) from error
    return requests
