#!/usr/bin/env python3
"""Two or more builds of the Rust extension side by side in one process, on the allocator's phases.

Each build's `_core` shared object is loaded as its own module (CPython keys extension modules by
path), and the builds run the same workload in turn, round after round (the order reversed every
other round): on a noisy machine the per-round ratio against the first build is far steadier than
runs in separate processes. Workloads, through the binding on Python lists as the engine calls it
(pool of 131072 blocks of 16 tokens, a full-attention and a 4096-token window group, sha256):

- lookup: `add_request` + `find_cache_hit` of 64 prompts of `--tokens` tokens (random ids below
  32000), the prompts cached by the round before (every block hits), per request;
- read: `add_request` of 64 prompts of `--tokens` tokens built afresh every round (their int
  objects out of the caches, as a new prompt's are), prefix caching off: the list's conversion
  alone, per request;
- decode: 64 requests of 100 tokens decoding 2000 steps, each step's `allocate_batch` and
  `append_token_ids_batch` timed apart (the counts' update between them untimed), per request
  and step;
- prefill: 64 requests of 8192 tokens allocated in 512-token chunks (`allocate_batch`), then freed
  (`free_request`), per round;
- evict: as prefill, but with 64 new prompts every round on the same coordinator, so once the
  pool has gone round (the third round on) every block allocated evicts a cached one: the
  steady state of a server whose pool is full of cached blocks, per block allocated;
- T1, T2, T3: the scheduler traces of `scripts/bench_vllm_replay.py` (our side only, a new
  coordinator every round), per phase as that script reports them.

A build's `_core` comes from its wheel (`maturin build --release -o DIR`, then unzip the wheel's
`hybrid_cache/_core*.so`); this checkout's Python package is imported around it.

    python scripts/bench_core_ab.py OLD.so,NEW.so [--workload lookup|read|decode|prefill|evict]
        [--tokens 2048] [--rounds 40] [--per-round]
    python scripts/bench_core_ab.py OLD.so,NEW.so --workload T2 --rounds 20
"""

from __future__ import annotations

import argparse
import importlib.util
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "python"))

NUM_REQS = 64
clock = time.perf_counter


def load(path: str):
    # The package first (with its own `_core`): a build's module init imports it, which must
    # not start loading an extension while this one is being initialised.
    import hybrid_cache  # noqa: F401

    spec = importlib.util.spec_from_file_location("hybrid_cache._core", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def coordinator(core, max_len: int):
    groups = [core.GroupSpec("full", 16), core.GroupSpec("sliding_window", 16, window=4096)]
    return core.Coordinator(
        131072,
        groups,
        max_num_reqs=NUM_REQS,
        max_model_len=max_len + 600,
        max_num_batched_tokens=512,
        hash_algo="sha256",
    )


def lookup(c, prompts: list[list[int]], round_: int) -> dict[str, float]:
    spent = 0.0
    for i, prompt in enumerate(prompts):
        start = clock()
        c.add_request(i, prompt, max_total_tokens=len(prompt) + 200)
        c.find_cache_hit(i)
        spent += clock() - start
    for i in range(len(prompts)):
        c.free_request(i)
    return {"lookup us/request": spent / len(prompts) * 1e6}


def read(core, tokens: int, round_: int) -> dict[str, float]:
    rng = random.Random(round_)
    prompts = [[rng.randrange(32000) for _ in range(tokens)] for _ in range(NUM_REQS)]
    groups = [core.GroupSpec("full", 16)]
    c = core.Coordinator(131072, groups, NUM_REQS, tokens + 600, 512, enable_prefix_caching=False)
    start = clock()
    for i, prompt in enumerate(prompts):
        c.add_request(i, prompt)
    return {"read us/request": (clock() - start) / len(prompts) * 1e6}


def decode(core, steps: int = 2000) -> dict[str, float]:
    c = coordinator(core, 4100)
    rng = random.Random(1)
    ids = list(range(NUM_REQS))
    for i in ids:
        c.add_request(i, [rng.randrange(32000) for _ in range(100)], max_total_tokens=4100)
        c.find_cache_hit(i)
        assert c.allocate(i, 0, 100)
        c.append_token_ids_batch([i], [5])
    computed, ones = [100] * NUM_REQS, [1] * NUM_REQS
    sampled = [[rng.randrange(32000) for _ in ids] for _ in range(64)]
    allocating = appending = 0.0
    for step in range(steps):
        start = clock()
        assert c.allocate_batch(ids, computed, ones) == NUM_REQS
        allocating += clock() - start
        computed = [count + 1 for count in computed]
        start = clock()
        c.append_token_ids_batch(ids, sampled[step % 64])
        appending += clock() - start
    per = 1e9 / (steps * NUM_REQS)
    return {
        "allocate_batch ns/request-step": allocating * per,
        "append_token_ids_batch ns/request-step": appending * per,
    }


def prefill(c, prompts: list[list[int]], round_: int) -> dict[str, float]:
    ids = [round_ * NUM_REQS + i for i in range(len(prompts))]
    for request_id, prompt in zip(ids, prompts):
        c.add_request(request_id, prompt, max_total_tokens=len(prompt) + 200)
        c.find_cache_hit(request_id)
    spent = 0.0
    for chunk in range(0, len(prompts[0]), 512):
        start = clock()
        assert c.allocate_batch(ids, [chunk] * len(ids), [512] * len(ids)) == len(ids)
        spent += clock() - start
    start = clock()
    for request_id in ids:
        c.free_request(request_id)
    return {"prefill ms": spent * 1e3, "free ms": (clock() - start) * 1e3}


def evict(c, round_: int) -> dict[str, float]:
    rng = random.Random(1000 + round_)
    prompts = [[rng.randrange(32000) for _ in range(8192)] for _ in range(NUM_REQS)]
    ids = [round_ * NUM_REQS + i for i in range(NUM_REQS)]
    for request_id, prompt in zip(ids, prompts):
        c.add_request(request_id, prompt, max_total_tokens=len(prompt) + 200)
        assert c.find_cache_hit(request_id) == 0
    free_before = c.num_free_blocks
    spent, taken = 0.0, 0
    for chunk in range(0, 8192, 512):
        before = c.num_free_blocks
        start = clock()
        assert c.allocate_batch(ids, [chunk] * len(ids), [512] * len(ids)) == len(ids)
        spent += clock() - start
        taken += before - c.num_free_blocks
    assert taken == free_before - c.num_free_blocks
    for request_id in ids:
        c.free_request(request_id)
    return {"evicting prefill ns/block": spent / taken * 1e9}


def replay(name: str):
    """A workload running one round of trace `name` of `bench_vllm_replay.py` on a build."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import bench_vllm_replay as replay_script

    trace = replay_script.TRACES[name]

    def work(core, prompts, round_: int) -> dict[str, float]:
        return replay_script.run_ours(trace, core).per_unit(trace)

    return work


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("builds", help="comma-separated paths of _core shared objects")
    parser.add_argument(
        "--workload",
        choices=["lookup", "read", "decode", "prefill", "evict", "T1", "T2", "T3"],
        default="lookup",
    )
    parser.add_argument("--tokens", type=int, default=2048, help="prompt length (lookup, read)")
    parser.add_argument("--rounds", type=int, default=40)
    parser.add_argument(
        "--per-round", action="store_true", help="also print every round's figures per build"
    )
    args = parser.parse_args()
    paths = args.builds.split(",")
    if len(paths) < 2:
        parser.error("give at least two builds")
    if args.workload in ("T1", "T2", "T3"):
        work, prompts = replay(args.workload), []
        # A new coordinator every round: each build's slot holds its module.
        coordinators = [load(path) for path in paths]
    elif args.workload == "decode":
        prompts = []

        def work(core, prompts, round_: int) -> dict[str, float]:
            return decode(core)

        coordinators = [load(path) for path in paths]
    elif args.workload == "evict":
        prompts = []

        def work(c, prompts, round_: int) -> dict[str, float]:
            return evict(c, round_)

        coordinators = [coordinator(load(path), 8192) for path in paths]
    elif args.workload == "read":
        prompts = []

        def work(core, prompts, round_: int) -> dict[str, float]:
            return read(core, args.tokens, round_)

        coordinators = [load(path) for path in paths]
    else:
        tokens = args.tokens if args.workload == "lookup" else 8192
        rng = random.Random(7)
        prompts = [[rng.randrange(32000) for _ in range(tokens)] for _ in range(NUM_REQS)]
        work = lookup if args.workload == "lookup" else prefill
        coordinators = [coordinator(load(path), tokens) for path in paths]
    results: list[list[dict[str, float]]] = [[] for _ in paths]
    for round_ in range(args.rounds):
        order = range(len(paths)) if round_ % 2 == 0 else reversed(range(len(paths)))
        for k in order:
            results[k].append(work(coordinators[k], prompts, round_))
    if args.per_round:
        for key in results[0][0]:
            print(f"{key}, per round: " + ", ".join(paths))
            for round_ in range(args.rounds):
                row = "  ".join(f"{results[k][round_][key]:9.2f}" for k in range(len(paths)))
                print(f"  {round_:3d}  {row}")
    for key in results[0][0]:
        print(f"{key}: {paths[0]} median {statistics.median(r[key] for r in results[0]):.2f}")
        for k in range(1, len(paths)):
            ratios = sorted(b[key] / a[key] for a, b in zip(results[0], results[k]))
            tenth = len(ratios) // 10
            print(
                f"  {paths[k]}: median {statistics.median(r[key] for r in results[k]):.2f}, "
                f"ratio to the first {statistics.median(ratios):.3f} "
                f"[{ratios[tenth]:.2f}..{ratios[-1 - tenth]:.2f}] (median [10th..90th percentile])"
            )


if __name__ == "__main__":
    main()
