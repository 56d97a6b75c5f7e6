"""`--simulate`: the real scheduler and Rust allocator on a real-size model, without a model.

The engine's `Scheduler` and `KVCacheManager` run exactly as in `LLM.generate` (admission,
chunked prefill, prefix caching, sliding-window release, preemption), over the planner's layout
for the model and a GPU-sized KV budget. Where the engine would run the model, every request
that samples gets `DUMMY_TOKEN_ID` (requests ignore EOS, so each generates `output_len`
tokens), and the step's time comes from `CostModel.step_time`. No KV tensors are allocated.
"""

from __future__ import annotations

from typing import Any, Optional

from hybrid_cache.bench.cost_model import CostModel, Hardware
from hybrid_cache.bench.errors import BenchConfigError
from hybrid_cache.bench.metrics import RunResult
from hybrid_cache.bench.settings import BenchSettings
from hybrid_cache.bench.workload import FIRST_ORDINARY_ID, make_prompts
from hybrid_cache.config import ModelSpec, load_model_spec
from hybrid_cache.engine.kv_cache import KVCacheManager, num_kv_tokens
from hybrid_cache.engine.request import Request
from hybrid_cache.engine.sampling_params import SamplingParams
from hybrid_cache.engine.scheduler import Scheduler
from hybrid_cache.planner import KVCacheLayout, PlanOptions, plan_kv_cache

DUMMY_TOKEN_ID = FIRST_ORDINARY_ID


def plan_for_simulation(
    spec: ModelSpec, settings: BenchSettings, mode: str, cost: CostModel
) -> KVCacheLayout:
    """The layout one GPU would hold: `--kv-cache-memory`, else memory x utilization - weights."""
    budget: Any = settings.kv_cache_memory
    if budget is None:
        budget = cost.hardware.kv_cache_budget(cost.parameters.weight_bytes)
    options = PlanOptions(
        kv_cache_memory=budget,
        max_model_len=settings.context_len,
        block_size=settings.block_size,
        max_num_batched_tokens=settings.max_num_batched_tokens,
    )
    return plan_kv_cache(spec, options, mode=mode)


def simulate_mode(
    settings: BenchSettings,
    mode: str,
    hardware: Optional[Hardware] = None,
    progress: Any = None,
) -> RunResult:
    """Runs the workload through the scheduler and allocator in `mode`; times are modelled."""
    spec = load_model_spec(settings.model, settings.hf_overrides)
    cost = CostModel(spec, hardware or Hardware())
    layout = plan_for_simulation(spec, settings, mode, cost)
    kv_cache = KVCacheManager.from_layout(
        layout,
        max_num_seqs=settings.max_num_seqs,
        max_model_len=settings.context_len,
        max_num_batched_tokens=settings.max_num_batched_tokens,
        enable_prefix_caching=settings.enable_prefix_caching,
        hash_seed=settings.seed,
    )
    scheduler = Scheduler(kv_cache, settings.max_num_seqs, settings.max_num_batched_tokens)
    params = SamplingParams(max_tokens=settings.output_len, temperature=0.0, ignore_eos=True)
    prompts = make_prompts(
        settings.num_prompts,
        settings.input_len,
        settings.prefix_len,
        spec.vocab_size,
        settings.seed,
    )
    for index, prompt in enumerate(prompts):
        request = Request(
            str(index),
            prompt,
            params,
            arrival_index=index,
            max_total_tokens=min(len(prompt) + settings.output_len, settings.context_len),
        )
        if not kv_cache.can_ever_fit(num_kv_tokens(request)):
            raise BenchConfigError(
                f"one request of {settings.input_len}+{settings.output_len} tokens does not fit "
                f"the {mode} KV cache ({layout.num_blocks - 1} blocks); raise --kv-cache-memory"
            )
        scheduler.add_request(request)

    result = RunResult(
        mode=mode,
        simulated=True,
        elapsed_s=0.0,
        num_requests=0,
        num_prompt_tokens=0,
        num_output_tokens=0,
        num_blocks=layout.num_blocks,
        group_kinds=group_names(layout),
        num_preemptions=0,
        prefix_cache_hit_rate=0.0,
        peak_blocks_per_group=[0] * layout.num_groups,
    )
    while scheduler.has_unfinished_requests():
        output = scheduler.schedule()
        if output.failed:
            raise BenchConfigError(
                f"{len(output.failed)} request(s) could not run: {output.failed[0].error}"
            )
        step_s = cost.step_time(
            (item.num_computed_tokens, item.num_new_tokens) for item in output.scheduled
        )
        sampled = {
            item.request.request_id: DUMMY_TOKEN_ID for item in output.scheduled if item.samples
        }
        finished = scheduler.update_from_output(output, sampled)
        used = kv_cache.num_used_blocks_per_group()
        result.elapsed_s += step_s
        result.step_time_s.append(step_s)
        result.running_per_step.append(len(output.scheduled))
        result.tokens_per_step.append(output.num_scheduled_tokens)
        result.blocks_per_group_per_step.append(used)
        result.peak_blocks_per_group = [
            max(a, b) for a, b in zip(result.peak_blocks_per_group, used)
        ]
        result.num_preemptions += output.num_preemptions
        for request in finished:
            result.num_requests += 1
            result.num_prompt_tokens += request.num_prompt_tokens
            result.num_output_tokens += request.num_output_tokens
        if progress is not None and finished:
            progress.update(len(finished))
    core = kv_cache.stats()
    queries = core.get("prefix_queries", 0)
    result.prefix_cache_hit_rate = core.get("prefix_hits", 0) / queries if queries else 0.0
    return result


def group_names(layout: KVCacheLayout) -> list[str]:
    """`full`, `sliding_window(W=4096)`, ... per group, with its layer count."""
    names = []
    for group in layout.groups:
        reach = "" if group.window is None else f"(W={group.window})"
        reach += "" if group.chunk is None else f"(C={group.chunk})"
        names.append(f"{group.kind}{reach} x{len(group.layer_indices)}")
    return names
