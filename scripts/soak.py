"""Soak: many requests of mixed lengths, with random aborts, through the engine on a tiny preset
with random (dummy) weights. Reports the process RSS after warm-up and at the end, and the
blocks leaked (must be 0).

    python scripts/soak.py                       # 10,000 requests on tiny-gemma3
    python scripts/soak.py --requests 2000 --preset tiny-llama

`LLMEngine.step_stats` keeps one `StepStats` per step, the last `MAX_STEP_STATS` of them, until
`reset_step_stats()` (`generate` resets it per call): about 270 B a step. The soak drops them
after each step unless `--keep-step-stats`, so that what it measures is the engine's own state.

Requests share a few prompt prefixes (so prefix-cache hits happen), the pool is small (so
requests are preempted and recomputed), and at every step a live request is aborted with
probability `--abort-probability`. Exits 1 when a block leaks, a request is left behind, or the
RSS grows by more than `--max-rss-growth-mib` after warm-up.
"""

from __future__ import annotations

import argparse
import gc
import random
import sys
import time
from collections import Counter


def rss_mib() -> float:
    """Resident set size of this process, from /proc (Linux)."""
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise RuntimeError("no VmRSS in /proc/self/status")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=10_000)
    parser.add_argument("--preset", default="tiny-gemma3")
    parser.add_argument("--kv-cache-memory", default="512KiB")
    parser.add_argument("--max-model-len", type=int, default=128)
    parser.add_argument("--block-size", type=int, default=4)
    parser.add_argument("--max-num-seqs", type=int, default=16)
    parser.add_argument("--max-num-batched-tokens", type=int, default=64)
    parser.add_argument("--in-flight", type=int, default=24, help="requests queued at once")
    parser.add_argument("--abort-probability", type=float, default=0.1)
    parser.add_argument("--warmup-fraction", type=float, default=0.1)
    parser.add_argument("--max-rss-growth-mib", type=float, default=32.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--keep-step-stats",
        action="store_true",
        help="keep the StepStats (up to MAX_STEP_STATS, as one endless generate would); by default "
        "they are dropped after each step, as a server that consumes them would",
    )
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    import torch
    from hybrid_cache.engine.errors import InsufficientKVCacheError
    from hybrid_cache.engine.llm import LLM
    from hybrid_cache.engine.sampling_params import SamplingParams

    torch.set_num_threads(1)
    rng = random.Random(args.seed)
    llm = LLM(
        args.preset,
        kv_cache_memory=args.kv_cache_memory,
        max_model_len=args.max_model_len,
        block_size=args.block_size,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        device="cpu",
        seed=args.seed,
    )
    engine = llm.engine
    kv_cache = engine.kv_cache
    vocab = llm.spec.vocab_size
    prefixes = [[rng.randrange(vocab) for _ in range(48)] for _ in range(4)]
    print(
        f"soak: {args.requests} requests on {args.preset}, {kv_cache.num_blocks} blocks "
        f"x {kv_cache.num_groups} groups, abort p={args.abort_probability}/step",
        flush=True,
    )

    outcomes: Counter[str] = Counter()
    live: list[str] = []
    num_added = 0
    num_done = 0
    warmup_done = max(1, int(args.requests * args.warmup_fraction))
    rss_after_warmup = None
    rss_samples: list[tuple[int, float]] = []
    num_steps = 0
    start = time.perf_counter()
    while num_done < args.requests:
        while num_added < args.requests and len(live) < args.in_flight:
            prefix = rng.choice(prefixes)[: rng.randrange(0, 49)]
            own = [rng.randrange(vocab) for _ in range(rng.randrange(1, 64))]
            prompt = (prefix + own)[: args.max_model_len]
            params = SamplingParams(
                max_tokens=rng.randrange(1, 32),
                temperature=rng.choice([0.0, 0.8]),
                ignore_eos=rng.random() < 0.5,
                seed=rng.randrange(1 << 30),
            )
            request_id = f"soak-{num_added}"
            num_added += 1
            try:
                engine.add_request(request_id, prompt, params)
                live.append(request_id)
            except InsufficientKVCacheError:
                outcomes["refused (never fits)"] += 1
                num_done += 1
        if live and rng.random() < args.abort_probability:
            victim = live.pop(rng.randrange(len(live)))
            aborted = engine.abort_request(victim)
            assert aborted is not None, f"{victim} is live"
            outcomes["aborted"] += 1
            num_done += 1
        for request in engine.step():
            live.remove(request.request_id)
            outcomes[request.finish_reason.value] += 1
            num_done += 1
        num_steps += 1
        if not args.keep_step_stats:
            engine.reset_step_stats()
        if rss_after_warmup is None and num_done >= warmup_done:
            gc.collect()
            rss_after_warmup = rss_mib()
            rss_samples.append((num_done, rss_after_warmup))
        elif rss_samples and num_done - rss_samples[-1][0] >= max(1, args.requests // 10):
            gc.collect()
            rss_samples.append((num_done, rss_mib()))
    while engine.has_unfinished_requests():  # nothing should be left, but drain anyway
        engine.step()
    elapsed = time.perf_counter() - start
    gc.collect()
    rss_end = rss_mib()
    rss_after_warmup = rss_after_warmup if rss_after_warmup is not None else rss_end

    leaked = kv_cache.num_blocks - 1 - kv_cache.num_free_blocks
    left_behind = len(engine.unfinished_request_ids)
    reset_ok = llm.reset_prefix_cache()
    stats = kv_cache.stats()
    growth = rss_end - rss_after_warmup
    print(
        f"requests: {num_done} in {elapsed:.1f} s ({num_steps} steps); outcomes: {dict(outcomes)}"
    )
    print(f"engine totals: {llm.stats}")
    print(f"prefix cache: {stats}")
    print("rss MiB by requests done: " + ", ".join(f"{n}: {r:.1f}" for n, r in rss_samples))
    print(
        f"rss after warm-up ({warmup_done} requests): {rss_after_warmup:.1f} MiB; "
        f"at the end: {rss_end:.1f} MiB; growth {growth:+.1f} MiB"
    )
    print(
        f"leaked blocks: {leaked}; requests left behind: {left_behind}; "
        f"prefix-cache reset after the run: {reset_ok}"
    )
    failed = leaked != 0 or left_behind != 0 or not reset_ok or growth > args.max_rss_growth_mib
    print("soak: FAILED" if failed else "soak: ok")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
