"""`--simulate`: the real engine, scheduler and Rust allocator on a real-size model, no model.

The workload goes through `LLMEngine.add_request` and `LLMEngine.step()` exactly as in
`LLM.generate` (admission, chunked prefill, prefix caching, sliding-window release, preemption),
over the planner's layout for the model and a GPU-sized KV budget. The engine's step runner is
`SimulatedRunner`: every request that samples gets `DUMMY_TOKEN_ID` (requests ignore EOS, so
each generates `output_len` tokens), and the step's time comes from `CostModel.step_time`. No
model is loaded and no KV tensors are allocated.
"""

from __future__ import annotations

from typing import Any, Optional

from hybrid_cache.bench.cost_model import CostModel, Hardware
from hybrid_cache.bench.errors import BenchConfigError
from hybrid_cache.bench.metrics import RunResult, counter_deltas
from hybrid_cache.bench.settings import BenchSettings, add_prompts, make_feed
from hybrid_cache.bench.workload import FIRST_ORDINARY_ID
from hybrid_cache.config import ModelSpec, load_model_spec
from hybrid_cache.engine.llm_engine import LLMEngine
from hybrid_cache.engine.sampling_params import SamplingParams
from hybrid_cache.engine.scheduler import SchedulerOutput
from hybrid_cache.planner import KVCacheLayout, plan_kv_cache

DUMMY_TOKEN_ID = FIRST_ORDINARY_ID


class SimulatedRunner:
    """The engine's `StepRunner` in a simulation: no model, no KV tensors. Every request that
    samples gets `DUMMY_TOKEN_ID`; `last_step_s` is the cost model's time of the last step."""

    def __init__(self, cost: CostModel) -> None:
        self.cost: CostModel = cost
        self.last_step_s: float = 0.0
        self.logprob_log: None = None  # no logprobs

    def execute(self, output: SchedulerOutput) -> list[int]:
        self.last_step_s = self.cost.step_time(zip(output.num_computed, output.num_new))
        return [DUMMY_TOKEN_ID] * sum(output.samples)


def plan_for_simulation(
    spec: ModelSpec, settings: BenchSettings, mode: str, cost: CostModel
) -> KVCacheLayout:
    """The layout one GPU would hold: `--kv-cache-memory`, else memory x utilization - weights."""
    config = settings.engine_config(mode)
    budget: Any = config.kv_cache_memory
    if budget is None:
        budget = cost.hardware.kv_cache_budget(cost.parameters.weight_bytes)
    return plan_kv_cache(spec, config.plan_options(budget, settings.context_len), mode=mode)


def simulated_engine(
    settings: BenchSettings, spec: ModelSpec, layout: KVCacheLayout, runner: SimulatedRunner
) -> LLMEngine:
    """An `LLMEngine` with the bench limits whose every step runs through `runner`."""
    return LLMEngine(
        layout,
        settings.engine_config(layout.mode).scheduler_limits(settings.context_len),
        vocab_size=spec.vocab_size,
        eos_token_ids=(),
        make_runner=lambda kv_cache, sampler: runner,
        seed=settings.seed,
    )


def simulate_mode(
    settings: BenchSettings,
    mode: str,
    hardware: Optional[Hardware] = None,
    progress: Any = None,
) -> RunResult:
    """Runs the workload through the engine and allocator in `mode`; times are modelled."""
    spec = load_model_spec(settings.model, settings.hf_overrides)
    cost = CostModel(spec, hardware or Hardware())
    layout = plan_for_simulation(spec, settings, mode, cost)
    runner = SimulatedRunner(cost)
    engine = simulated_engine(settings, spec, layout, runner)
    params = SamplingParams(max_tokens=settings.output_len, temperature=0.0, ignore_eos=True)
    feed = make_feed(settings, spec.vocab_size)
    core_before = engine.kv_cache.stats()

    add_prompts(engine, feed, params, mode)
    result = RunResult.starting(mode, True, layout.num_blocks, group_names(layout))
    while engine.has_unfinished_requests() or not feed.exhausted:
        finished = engine.step()
        failed = [request for request in finished if request.error is not None]
        if failed:
            raise BenchConfigError(f"{len(failed)} request(s) could not run: {failed[0].error}")
        step = engine.step_stats[-1]
        result.elapsed_s += runner.last_step_s
        result.step_time_s.append(runner.last_step_s)
        result.running_per_step.append(step.num_scheduled_requests)
        result.tokens_per_step.append(step.num_scheduled_tokens)
        result.blocks_per_group_per_step.append(step.num_used_blocks_per_group)
        for request in finished:
            result.num_requests += 1
            result.num_prompt_tokens += request.num_prompt_tokens
            result.num_output_tokens += request.num_output_tokens
            feed.record(request)
        if finished:
            add_prompts(engine, feed, params, mode)
        if progress is not None and finished:
            progress.update(len(finished))
    result.num_preemptions = engine.stats.num_preemptions
    result.peak_blocks_per_group = list(engine.stats.max_used_blocks_per_group)
    result.prefix_cache_hit_rate = engine.stats.prefix_cache_hit_rate
    result.reuse = feed.reuse
    result.cache_counters = counter_deltas(core_before, engine.kv_cache.stats())
    return result


def group_names(layout: KVCacheLayout) -> list[str]:
    """`full`, `sliding_window(W=4096)`, ... per group, with its layer count."""
    names = []
    for group in layout.groups:
        reach = "" if group.window is None else f"(W={group.window})"
        reach += "" if group.chunk is None else f"(C={group.chunk})"
        names.append(f"{group.kind}{reach} x{len(group.layer_indices)}")
    return names
