"""`RunResult`: what one mode of a benchmark measured, and the throughput figures from it.

Per-step series come from the engine's `StepStats` (blocks in use per group, requests in the
batch) plus, on the real engine, the wall time of each step and of its model forward. In a
simulation `elapsed_s` and the step times are the cost model's, not wall time.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

from hybrid_cache.bench.multi_turn import ReuseFigures


def counter_deltas(before: dict[str, Any], after: dict[str, Any]) -> dict[str, Any]:
    """The core's cumulative counters (`KVCacheManager.stats()`) over a stretch of a run: ints,
    and per-group lists element by element."""
    deltas: dict[str, Any] = {}
    for name, value in after.items():
        if isinstance(value, int):
            deltas[name] = value - before.get(name, 0)
        elif isinstance(value, list):
            earlier = before.get(name) or [0] * len(value)
            deltas[name] = [now - then for now, then in zip(value, earlier)]
    return deltas


def is_decode_step(running: int, tokens: int) -> bool:
    """A pure decode step: one token for each request in the batch."""
    return running == tokens and running > 0


@dataclass(frozen=True)
class PhaseTimes:
    """Sums over one kind of step (seconds), from `RunResult.phase_times`."""

    steps: int
    step_s: float
    forward_s: float
    logits_s: float

    @property
    def engine_s(self) -> float:
        """Step time outside the model forward and the LM head."""
        return self.step_s - self.forward_s - self.logits_s


@dataclass
class RunResult:
    """One mode's run. `group_kinds[g]` names group g (e.g. `sliding_window(W=16)`)."""

    mode: str
    simulated: bool
    elapsed_s: float
    num_requests: int
    num_prompt_tokens: int
    num_output_tokens: int
    num_blocks: int
    group_kinds: list[str]
    num_preemptions: int
    prefix_cache_hit_rate: float
    peak_blocks_per_group: list[int]
    # Process CPU time of the timed loop (real engine only): on a shared machine it moves less
    # with other processes' load than wall time does.
    cpu_time_s: Optional[float] = None
    # Seconds of the untimed warm-up before the run (real engine only): first torch calls and,
    # on CUDA, every Triton compile the run needs; apart from `elapsed_s`.
    warm_up_s: Optional[float] = None
    # One entry per engine step.
    running_per_step: list[int] = field(default_factory=list)
    tokens_per_step: list[int] = field(default_factory=list)
    blocks_per_group_per_step: list[list[int]] = field(default_factory=list)
    step_time_s: list[float] = field(default_factory=list)
    forward_time_s: list[float] = field(default_factory=list)
    # The LM head's share of each step (`model.compute_logits`): model compute, outside forward.
    logits_time_s: list[float] = field(default_factory=list)
    # Ranks the model ran on; under tensor parallelism, per step: rank 0's time posting the
    # step's inputs to the other ranks, and how long after the posting the slowest had them.
    tensor_parallel_size: int = 1
    broadcast_time_s: list[float] = field(default_factory=list)
    broadcast_latency_s: list[float] = field(default_factory=list)
    # Generated tokens per request, in prompt order (real engine only; not in the JSON).
    output_token_ids: list[list[int]] = field(default_factory=list)
    # The multi-turn workload's reusable-token hit rates (None for the random workload).
    reuse: Optional[ReuseFigures] = None
    # The core's cumulative counters over the timed run (after minus before): prefix queries and
    # hits, evictions, cached and spare blocks (`Coordinator.stats`).
    cache_counters: dict[str, int] = field(default_factory=dict)

    @classmethod
    def starting(
        cls, mode: str, simulated: bool, num_blocks: int, group_kinds: list[str]
    ) -> RunResult:
        """A run before its first step: every count and figure at zero."""
        return cls(
            mode=mode,
            simulated=simulated,
            elapsed_s=0.0,
            num_requests=0,
            num_prompt_tokens=0,
            num_output_tokens=0,
            num_blocks=num_blocks,
            group_kinds=group_kinds,
            num_preemptions=0,
            prefix_cache_hit_rate=0.0,
            peak_blocks_per_group=[0] * len(group_kinds),
        )

    @property
    def num_steps(self) -> int:
        return len(self.running_per_step)

    @property
    def mean_running(self) -> float:
        steps = self.running_per_step
        return sum(steps) / len(steps) if steps else 0.0

    @property
    def requests_per_s(self) -> float:
        return self.num_requests / self.elapsed_s if self.elapsed_s > 0 else 0.0

    @property
    def total_tokens_per_s(self) -> float:
        total = self.num_prompt_tokens + self.num_output_tokens
        return total / self.elapsed_s if self.elapsed_s > 0 else 0.0

    @property
    def output_tokens_per_s(self) -> float:
        return self.num_output_tokens / self.elapsed_s if self.elapsed_s > 0 else 0.0

    @property
    def total_tokens_per_cpu_s(self) -> Optional[float]:
        if not self.cpu_time_s:
            return None
        return (self.num_prompt_tokens + self.num_output_tokens) / self.cpu_time_s

    def overhead_share(self, min_running: int = 0, lm_head_is_model: bool = True) -> float | None:
        """Share of step time outside the model (its forward and, unless `lm_head_is_model` is
        False, its LM head), over the steps with at least `min_running` requests in the batch;
        None when nothing was timed."""
        logits = self.logits_time_s if lm_head_is_model else []
        logits = logits or [0.0] * len(self.step_time_s)
        steps = [
            (step, forward + head)
            for step, forward, head, running in zip(
                self.step_time_s, self.forward_time_s, logits, self.running_per_step
            )
            if running >= min_running
        ]
        step_total = sum(step for step, _ in steps)
        if not steps or step_total <= 0:
            return None
        return 1.0 - sum(model for _, model in steps) / step_total

    def broadcast_share(self, min_running: int = 0, latency: bool = False) -> float | None:
        """Share of step time rank 0 spent posting the steps' inputs to the other ranks (or,
        `latency`, the time until the slowest worker had them), over the steps with at least
        `min_running` requests; None on one rank."""
        series = self.broadcast_latency_s if latency else self.broadcast_time_s
        if not series:
            return None
        steps = [
            (step, sent)
            for step, sent, running in zip(self.step_time_s, series, self.running_per_step)
            if running >= min_running
        ]
        step_total = sum(step for step, _ in steps)
        return None if step_total <= 0 else sum(sent for _, sent in steps) / step_total

    def decode_step_cost(self) -> Optional[tuple[float, float]]:
        """Least-squares fit of pure decode steps (one token per request):
        `step_time = fixed + per_request x running`; (fixed, per_request) seconds, or None when
        there are too few such steps. Says how much a larger batch amortises."""
        points = [
            (running, step)
            for running, tokens, step in zip(
                self.running_per_step, self.tokens_per_step, self.step_time_s
            )
            if is_decode_step(running, tokens)
        ]
        if len({running for running, _ in points}) < 2:
            return None
        count = len(points)
        mean_x = sum(x for x, _ in points) / count
        mean_y = sum(y for _, y in points) / count
        spread = sum((x - mean_x) ** 2 for x, _ in points)
        slope = sum((x - mean_x) * (y - mean_y) for x, y in points) / spread
        return mean_y - slope * mean_x, slope

    def phase_times(self) -> dict[str, PhaseTimes]:
        """{"prefill": ..., "decode": ...}: the step time of pure decode steps
        (`is_decode_step`) and of every other step (prompt tokens in it, with or without
        decodes riding along), each split into forward, LM head and engine time. Needs a
        measured run (every per-step series of the same length)."""
        series = (
            self.tokens_per_step,
            self.running_per_step,
            self.step_time_s,
            self.forward_time_s,
            self.logits_time_s,
        )
        if len({len(values) for values in series}) != 1:
            raise ValueError(
                "phase_times needs a measured run: every per-step series of the same length, "
                f"got {[len(values) for values in series]}"
            )
        sums = {kind: [0, 0.0, 0.0, 0.0] for kind in ("prefill", "decode")}
        for tokens, running, step_s, forward_s, logits_s in zip(*series):
            total = sums["decode" if is_decode_step(running, tokens) else "prefill"]
            total[0] += 1
            total[1] += step_s
            total[2] += forward_s
            total[3] += logits_s
        return {kind: PhaseTimes(*values) for kind, values in sums.items()}

    def throughput_line(self) -> str:
        return (
            f"Throughput: {self.requests_per_s:.2f} requests/s, "
            f"{self.total_tokens_per_s:.2f} total tokens/s, "
            f"{self.output_tokens_per_s:.2f} output tokens/s"
        )

    def summary(self) -> dict[str, Any]:
        """The headline figures (no per-step series), for JSON and tables."""
        return {
            "mode": self.mode,
            "simulated": self.simulated,
            "elapsed_s": self.elapsed_s,
            "num_requests": self.num_requests,
            "num_prompt_tokens": self.num_prompt_tokens,
            "num_output_tokens": self.num_output_tokens,
            "requests_per_s": self.requests_per_s,
            "total_tokens_per_s": self.total_tokens_per_s,
            "output_tokens_per_s": self.output_tokens_per_s,
            "cpu_time_s": self.cpu_time_s,
            "warm_up_s": self.warm_up_s,
            "total_tokens_per_cpu_s": self.total_tokens_per_cpu_s,
            "num_steps": self.num_steps,
            "mean_running": self.mean_running,
            "num_preemptions": self.num_preemptions,
            "prefix_cache_hit_rate": self.prefix_cache_hit_rate,
            "num_blocks": self.num_blocks,
            "group_kinds": self.group_kinds,
            "peak_blocks_per_group": self.peak_blocks_per_group,
            "engine_overhead_share": self.overhead_share(),
            "max_running": max(self.running_per_step, default=0),
            "engine_overhead_share_at_max_running": self.overhead_share(
                max(self.running_per_step, default=0)
            ),
            "engine_overhead_share_at_max_running_lm_head_as_engine": self.overhead_share(
                max(self.running_per_step, default=0), lm_head_is_model=False
            ),
            "decode_step_cost_s": self.decode_step_cost(),
            "tensor_parallel_size": self.tensor_parallel_size,
            "broadcast_share": self.broadcast_share(),
            "broadcast_share_at_max_running": self.broadcast_share(
                max(self.running_per_step, default=0)
            ),
            "broadcast_latency_share": self.broadcast_share(latency=True),
            "broadcast_latency_share_at_max_running": self.broadcast_share(
                max(self.running_per_step, default=0), latency=True
            ),
            "reuse": None if self.reuse is None else self.reuse.to_dict(),
            "cache_counters": self.cache_counters,
        }

    def to_dict(self) -> dict[str, Any]:
        """Everything, per-step series included."""
        return {
            **self.summary(),
            "steps": {
                "running": self.running_per_step,
                "tokens": self.tokens_per_step,
                "blocks_per_group": self.blocks_per_group_per_step,
                "step_time_s": self.step_time_s,
                "forward_time_s": self.forward_time_s,
                "logits_time_s": self.logits_time_s,
                "broadcast_time_s": self.broadcast_time_s,
                "broadcast_latency_s": self.broadcast_latency_s,
            },
        }
