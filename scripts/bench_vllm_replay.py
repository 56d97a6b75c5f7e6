#!/usr/bin/env python3
"""The allocator against vLLM's KV cache manager on the same scheduler traces, in one process.

Both sides replay the traces of `cargo bench -p hybrid-cache-core --bench replay` (pool of
131072 blocks of 16 tokens, one full-attention and one sliding-window group of 4096 tokens,
prefix caching on, sha256 block hashes on both sides):

- T1: 256 requests of 2048 tokens (every other one starts with the same 1024 tokens), each
  admitted and prefilled whole, then 512 decode steps of all of them, then all freed;
- T2: 64 requests of 8192 unique tokens prefilled in 512-token chunks (all advance together),
  then 256 decode steps, then all freed;
- T3: T2's shape with 64 decode steps, three waves of new prompts on one manager: the pool keeps
  every wave's blocks cached, so from the third wave on every block allocated evicts a cached
  one (a server's steady state); only the last wave is timed.

vLLM's side calls `KVCacheManager` as its scheduler does (`get_computed_blocks`,
`allocate_slots`, `new_step_starts` once per step, `free`) and records each sampled token on its
`Request` (`append_output_token_ids`, which hashes blocks as they fill). Ours calls
`_core.Coordinator` as the engine does (`add_request` + `find_cache_hit` + `allocate` to admit,
one `allocate_batch` per step for the running requests, one `append_token_ids_batch` per step).
Phases, timed alike on both sides:

- lookup: hashing the prompt and finding its hit, per request (vLLM: the hasher `Request()`
  runs, then `get_computed_blocks`, the request object built untimed; ours: `add_request`,
  which also converts and copies the prompt, then `find_cache_hit`);
- prefill: the allocations of the prompt's slots, per block allocated;
- decode: one step's allocations plus recording its sampled tokens, per request and step;
- free: per block freed; whole: the four together.

The implementations alternate round by round, so machine noise hits both alike; the ratio
vLLM / ours is taken per round and the median printed with its range. Hits, peak blocks in use
and the blocks the last request holds must agree (checked).

Set-up: vLLM from the package index without its CUDA dependencies (`pip install --no-deps
vllm==0.33.0` in a virtualenv with a CPU torch and the modules it imports), and this package
installed in the same environment (`maturin build --release`, then `pip install` the wheel).

    python scripts/bench_vllm_replay.py --rounds 3 [--trace T1|T2] [--json out.json]
"""

from __future__ import annotations

import argparse
import gc
import json
import random
import statistics
import time
from collections.abc import Callable

BLOCK = 16
WINDOW = 4096
NUM_BLOCKS = 131072
VOCAB = 32000
TRACES = {
    "T1": dict(num_reqs=256, prompt_len=2048, shared=1024, chunk=None, steps=512),
    "T2": dict(num_reqs=64, prompt_len=8192, shared=0, chunk=512, steps=256),
    "T3": dict(num_reqs=64, prompt_len=8192, shared=0, chunk=512, steps=64, waves=3),
}
clock = time.perf_counter


def prompts_of(trace: dict, wave: int = 0) -> list[list[int]]:
    rng = random.Random(7 + 1000 * wave)
    shared = [rng.randrange(VOCAB) for _ in range(trace["shared"])]
    out = []
    for index in range(trace["num_reqs"]):
        head = list(shared) if index % 2 == 0 else []
        out.append(head + [rng.randrange(VOCAB) for _ in range(trace["prompt_len"] - len(head))])
    return out


def sampled_of(trace: dict) -> list[list[int]]:
    rng = random.Random(11)
    return [
        [rng.randrange(VOCAB) for _ in range(trace["num_reqs"])] for _ in range(trace["steps"] + 1)
    ]


class Phases:
    """Seconds per phase and the units they are divided by, plus the invariants."""

    def __init__(self) -> None:
        self.seconds = dict(lookup=0.0, prefill=0.0, decode=0.0, free=0.0)
        self.prefill_blocks = 0
        self.free_blocks = 0
        self.hit_tokens = 0
        self.peak_used = 0
        self.last_live: list[int] = []

    def per_unit(self, trace: dict) -> dict[str, float]:
        seconds = self.seconds
        return {
            "lookup us/request": seconds["lookup"] / trace["num_reqs"] * 1e6,
            "prefill ns/block": seconds["prefill"] / self.prefill_blocks * 1e9,
            "decode ns/request-step": seconds["decode"]
            / (trace["num_reqs"] * trace["steps"])
            * 1e9,
            "free ns/block": seconds["free"] / self.free_blocks * 1e9,
            "whole ms": sum(seconds.values()) * 1e3,
        }


def time_free(phases: Phases, free: Callable, requests: list, used: Callable[[], int]) -> Phases:
    """Frees every request (timed), checks that no block is left in use, ends the round."""
    phases.free_blocks = used()
    start = clock()
    for request in requests:
        free(request)
    phases.seconds["free"] = clock() - start
    assert used() == 0, "blocks leaked"
    gc.unfreeze()
    return phases


def run_vllm(trace: dict) -> Phases:
    import torch
    from vllm.utils.hashing import get_hash_fn_by_name
    from vllm.v1.core.kv_cache_manager import KVCacheManager
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.kv_cache_interface import (
        FullAttentionSpec,
        KVCacheConfig,
        KVCacheGroupSpec,
        SlidingWindowSpec,
    )

    shape = dict(block_size=BLOCK, num_kv_heads=8, head_size=128, dtype=torch.bfloat16)
    config = KVCacheConfig(
        num_blocks=NUM_BLOCKS,
        kv_cache_tensors=[],
        kv_cache_groups=[
            KVCacheGroupSpec(["layers.0"], FullAttentionSpec(**shape)),
            KVCacheGroupSpec(["layers.1"], SlidingWindowSpec(**shape, sliding_window=WINDOW)),
        ],
    )
    max_tokens = trace["steps"] + 1
    manager = KVCacheManager(
        config,
        max_model_len=trace["prompt_len"] + max_tokens + BLOCK,
        scheduler_block_size=BLOCK,
        hash_block_size=BLOCK,
        enable_caching=True,
    )
    hash_fn = get_hash_fn_by_name("sha256")
    init_none_hash(hash_fn)
    hasher = get_request_block_hasher(BLOCK, hash_fn)
    pool = manager.block_pool
    usable = NUM_BLOCKS - 1

    def used() -> int:
        return usable - pool.get_num_free_blocks()

    for wave in range(trace.get("waves", 1)):
        phases = vllm_wave(trace, manager, hasher, wave, used)
    return phases


def vllm_wave(trace: dict, manager, hasher, wave: int, used: Callable[[], int]) -> Phases:
    """One wave of requests on vLLM's manager (request ids `w{wave}r{index}`)."""
    from vllm.sampling_params import SamplingParams
    from vllm.v1.request import Request, RequestStatus

    max_tokens = trace["steps"] + 1
    prompts, sampled = prompts_of(trace, wave), sampled_of(trace)
    phases = Phases()
    params = []
    for _ in prompts:
        sampling = SamplingParams(max_tokens=max_tokens)
        sampling.update_from_generation_config({}, eos_token_id=VOCAB)
        params.append(sampling)
    gc.collect()
    gc.freeze()

    requests: list = []
    chunk = trace["chunk"] or trace["prompt_len"]
    manager.new_step_starts()
    for index, prompt in enumerate(prompts):
        # The request object is built untimed; its prompt is hashed in the lookup's time, as
        # `Request(..., block_hasher=...)` would hash it.
        request = Request(
            request_id=f"w{wave}r{index}",
            prompt_token_ids=prompt,
            sampling_params=params[index],
            pooling_params=None,
            block_hasher=None,
        )
        request._block_hasher = hasher
        start = clock()
        request.block_hashes.extend(hasher(request))
        blocks, hit, _ = manager.get_computed_blocks(request)
        looked_up = clock()
        before = used()
        new = min(chunk, len(prompt) - hit)
        assert manager.allocate_slots(request, new, hit, blocks) is not None
        phases.seconds["prefill"] += clock() - looked_up
        phases.seconds["lookup"] += looked_up - start
        phases.prefill_blocks += used() - before
        phases.hit_tokens += hit
        request.status = RequestStatus.RUNNING
        request.num_computed_tokens = hit + new
        if request.num_computed_tokens == len(prompt):
            request.append_output_token_ids(sampled[0][index])
        requests.append(request)
    pending = [r for r in requests if r.num_computed_tokens < r.num_prompt_tokens]
    while pending:
        before = used()
        start = clock()
        manager.new_step_starts()
        for request in pending:
            new = min(chunk, request.num_prompt_tokens - request.num_computed_tokens)
            assert manager.allocate_slots(request, new) is not None
            request.num_computed_tokens += new
        phases.seconds["prefill"] += clock() - start
        phases.prefill_blocks += used() - before
        for index, request in enumerate(requests):
            if request in pending and request.num_computed_tokens == request.num_prompt_tokens:
                request.append_output_token_ids(sampled[0][index])
        pending = [r for r in pending if r.num_computed_tokens < r.num_prompt_tokens]
    phases.peak_used = used()
    for step in range(1, trace["steps"] + 1):
        tokens = sampled[step]
        start = clock()
        manager.new_step_starts()
        for request in requests:
            assert manager.allocate_slots(request, 1) is not None
        for request, token in zip(requests, tokens):
            request.num_computed_tokens += 1
            request.append_output_token_ids(token)
        phases.seconds["decode"] += clock() - start
        phases.peak_used = max(phases.peak_used, used())
    last = requests[-1].request_id
    phases.last_live = [
        sum(1 for block in group.req_to_blocks.get(last, []) if not block.is_null)
        for group in manager.coordinator.single_type_managers
    ]
    return time_free(phases, manager.free, requests, used)


def run_ours(trace: dict, core=None) -> Phases:
    """Our side of a round; `core` is a `_core` module (default: the installed one)."""
    if core is None:
        from hybrid_cache import _core as core

    max_tokens = trace["steps"] + 1
    chunk = trace["chunk"] or trace["prompt_len"]
    coordinator = core.Coordinator(
        NUM_BLOCKS,
        [core.GroupSpec("full", BLOCK), core.GroupSpec("sliding_window", BLOCK, window=WINDOW)],
        max_num_reqs=trace["num_reqs"],
        max_model_len=trace["prompt_len"] + max_tokens + BLOCK,
        max_num_batched_tokens=chunk,
        hash_algo="sha256",
    )
    usable = NUM_BLOCKS - 1

    def used() -> int:
        return usable - coordinator.num_free_blocks

    for wave in range(trace.get("waves", 1)):
        phases = ours_wave(trace, coordinator, wave, used)
    return phases


def ours_wave(trace: dict, coordinator, wave: int, used: Callable[[], int]) -> Phases:
    """One wave of requests on our coordinator (request ids from `wave * num_reqs` on)."""
    max_tokens = trace["steps"] + 1
    chunk = trace["chunk"] or trace["prompt_len"]
    prompts, sampled = prompts_of(trace, wave), sampled_of(trace)
    base = wave * trace["num_reqs"]
    phases = Phases()
    gc.collect()
    gc.freeze()
    ids = [base + i for i in range(trace["num_reqs"])]
    computed = [0] * trace["num_reqs"]
    for index, prompt in enumerate(prompts):
        request_id = base + index
        start = clock()
        coordinator.add_request(request_id, prompt, max_total_tokens=len(prompt) + max_tokens - 1)
        hit = coordinator.find_cache_hit(request_id)
        looked_up = clock()
        before = used()
        new = min(chunk, len(prompt) - hit)
        assert coordinator.allocate(request_id, hit, new)
        phases.seconds["prefill"] += clock() - looked_up
        phases.seconds["lookup"] += looked_up - start
        phases.prefill_blocks += used() - before
        phases.hit_tokens += hit
        computed[index] = hit + new
        if computed[index] == len(prompt):
            coordinator.append_token_ids_batch([request_id], [sampled[0][index]])
    pending = [i for i in range(trace["num_reqs"]) if computed[i] < len(prompts[i])]
    while pending:
        news = [min(chunk, len(prompts[i]) - computed[i]) for i in pending]
        pending_ids = [base + i for i in pending]
        before = used()
        start = clock()
        assert coordinator.allocate_batch(pending_ids, [computed[i] for i in pending], news) == len(
            pending
        )
        phases.seconds["prefill"] += clock() - start
        phases.prefill_blocks += used() - before
        for i, new in zip(pending, news):
            computed[i] += new
        done = [i for i in pending if computed[i] == len(prompts[i])]
        if done:
            coordinator.append_token_ids_batch(
                [base + i for i in done], [sampled[0][i] for i in done]
            )
        pending = [i for i in pending if computed[i] < len(prompts[i])]
    phases.peak_used = used()
    ones = [1] * trace["num_reqs"]
    for step in range(1, trace["steps"] + 1):
        tokens = sampled[step]
        start = clock()
        assert coordinator.allocate_batch(ids, computed, ones) == len(ids)
        computed = [count + 1 for count in computed]
        coordinator.append_token_ids_batch(ids, tokens)
        phases.seconds["decode"] += clock() - start
        phases.peak_used = max(phases.peak_used, used())
    phases.last_live = [
        sum(1 for block in coordinator.request_blocks(ids[-1], group) if block != 0)
        for group in range(coordinator.num_groups)
    ]
    return time_free(phases, coordinator.free_request, ids, used)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=3, help="alternated rounds per trace")
    parser.add_argument("--trace", choices=[*TRACES, "all"], default="all")
    parser.add_argument("--json", help="write every round's figures here")
    args = parser.parse_args()
    names = list(TRACES) if args.trace == "all" else [args.trace]
    report = {}
    for name in names:
        trace = TRACES[name]
        rounds = []
        for round_index in range(args.rounds):
            vllm, ours = run_vllm(trace), run_ours(trace)
            for key in ("hit_tokens", "peak_used", "last_live"):
                assert getattr(vllm, key) == getattr(ours, key), (name, key, vllm, ours)
            rounds.append((vllm.per_unit(trace), ours.per_unit(trace)))
            print(f"{name} round {round_index + 1}: hits {ours.hit_tokens}, peak {ours.peak_used}")
        print(f"\n{name}: vLLM, ours, vLLM/ours (median of {args.rounds} rounds [range])")
        for phase in rounds[0][0]:
            vllm_values = [v[phase] for v, _ in rounds]
            ours_values = [o[phase] for _, o in rounds]
            ratios = [v / o for v, o in zip(vllm_values, ours_values)]
            print(
                f"  {phase:24s} {statistics.median(vllm_values):10.2f} "
                f"{statistics.median(ours_values):10.2f}  {statistics.median(ratios):6.1f}x "
                f"[{min(ratios):.1f}..{max(ratios):.1f}]"
            )
        report[name] = [{"vllm": v, "ours": o} for v, o in rounds]
    if args.json:
        with open(args.json, "w") as out:
            json.dump(report, out, indent=1)


if __name__ == "__main__":
    main()
