"""`BenchSettings`: everything one benchmark run depends on, checked once, up front."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

from hybrid_cache.bench.errors import BenchConfigError
from hybrid_cache.bench.multi_turn import MultiTurnFeed, MultiTurnShape
from hybrid_cache.bench.workload import RandomFeed, make_prompts
from hybrid_cache.engine.scheduler import SCHEDULING_POLICIES
from hybrid_cache.planner import GROUP_LAYOUTS

KV_CACHE_MODES = ("hybrid", "uniform")
WORKLOADS = ("random", "multi-turn")


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
    kv_cache_memory: Optional[str] = None
    block_size: int = 16
    kv_group_layout: str = "auto"
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    enable_prefix_caching: bool = True
    scheduling_policy: str = "fcfs"
    load_format: str = "dummy"
    hf_overrides: dict[str, Any] = field(default_factory=dict)
    seed: int = 0
    attention_backend: str = "auto"
    enforce_eager: bool = False
    multi_turn: Optional[MultiTurnShape] = None

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

    def __post_init__(self) -> None:
        for name in ("input_len", "output_len", "num_prompts", "block_size", "max_num_seqs"):
            check_positive(name, getattr(self, name))
        check_positive("max_num_batched_tokens", self.max_num_batched_tokens)
        if self.max_model_len is not None:
            check_positive("max_model_len", self.max_model_len)
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
        if self.kv_group_layout not in GROUP_LAYOUTS:
            raise BenchConfigError(
                f"--kv-group-layout must be one of {', '.join(GROUP_LAYOUTS)}, "
                f"got {self.kv_group_layout!r}"
            )
        if self.scheduling_policy not in SCHEDULING_POLICIES:
            raise BenchConfigError(
                f"--scheduling-policy must be one of {', '.join(SCHEDULING_POLICIES)}, got "
                f"{self.scheduling_policy!r}"
            )
        if self.load_format not in ("auto", "dummy"):
            raise BenchConfigError(f"--load-format must be auto or dummy, got {self.load_format!r}")

    @property
    def longest_request(self) -> int:
        """Prompt plus output tokens of the workload's longest request."""
        if self.multi_turn is not None:
            return self.multi_turn.max_total_tokens
        return self.input_len + self.output_len

    @property
    def context_len(self) -> int:
        return self.max_model_len or self.longest_request


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
