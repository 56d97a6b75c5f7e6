"""The engine's per-step Python cost at many running decode requests, without the model.

Builds `LLM(MODEL, load_format="dummy", kv_cache_memory="128MiB", max_model_len=1024)` (MODEL:
`--model`, default tiny-llama),
adds `--requests` requests of 512 random tokens (greedy, `max_tokens=300`, EOS ignored), steps
until every request is decoding, then times `--steps` `llm.engine.step()` calls. The model's
forward is replaced by one returning a fixed hidden state (logits and sampling still run, on
distinct values), so the figure is the engine: scheduling, batch metadata, sampling, token bookkeeping, step figures.

    python scripts/profile_engine_step.py [--model tiny-gemma3] [--requests 64] [--steps 100]
    PYTHONPATH=/other/checkout/python python scripts/profile_engine_step.py   # A/B a copy
    python scripts/profile_engine_step.py --profile 30     # cProfile, top 30 by cumulative time
    python scripts/profile_engine_step.py --real-forward   # the real model; step minus model time
    python scripts/profile_engine_step.py --tokenizer /tmp/tok --stop @@never --logprobs 5

With `--real-forward` the model runs and the figure is the step's time outside the model's
forward and LM head (as `hybrid-cache bench` measures it): higher than the zero-forward figure,
since the forward evicts the engine's code and data from the CPU caches every step.
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import statistics
import time
from collections.abc import Sequence
from typing import Optional

import torch
from hybrid_cache.bench.engine_run import ForwardTimer, LogitsTimer
from hybrid_cache.engine.llm import LLM
from hybrid_cache.engine.sampling_params import SamplingParams

PROMPT_LEN = 512


def decoding_llm(
    num_requests: int,
    model: str = "tiny-llama",
    zero: bool = True,
    tokenizer: Optional[str] = None,
    stop: Sequence[str] = (),
    logprobs: Optional[int] = None,
) -> LLM:
    """An LLM whose `num_requests` requests are all decoding, with a zero forward unless
    `zero` is False; each request checks `stop` and asks for `logprobs` (these need
    `tokenizer`, a tokenizer folder, for text)."""
    llm = LLM(
        model,
        load_format="dummy",
        kv_cache_memory="128MiB",
        max_model_len=1024,
        seed=0,
        tokenizer=tokenizer,
    )
    generator = torch.Generator().manual_seed(0)
    vocab_size = llm.engine.vocab_size
    params = SamplingParams(
        max_tokens=300, temperature=0.0, ignore_eos=True, stop=list(stop), logprobs=logprobs
    )
    for index in range(num_requests):
        prompt = torch.randint(0, vocab_size, (PROMPT_LEN,), generator=generator).tolist()
        llm.engine.add_request(str(index), prompt, params)

    hidden_size = llm.spec.hidden_size  # 64 for tiny-llama
    # A fixed hidden state per row, not zeros: zero rows give all-equal logits, whose ties send
    # every row's top k down the exact fallback, unlike any real model's.
    fixed = torch.randn(4096, hidden_size, generator=generator).to(llm.dtype)

    def zero_forward(input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return fixed[: input_ids.shape[0]]

    if zero:
        llm.model.forward = zero_forward
    scheduler = llm.engine.scheduler
    while scheduler.waiting or any(
        r.num_computed_tokens < r.num_tokens - 1 for r in scheduler.running
    ):
        llm.engine.step()
    assert len(scheduler.running) == num_requests, "every request should be decoding"
    return llm


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="tiny-llama", help="preset (default tiny-llama)")
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--repeats", type=int, default=5, help="timed runs of --steps steps")
    parser.add_argument("--profile", type=int, default=0, help="cProfile; print the top N")
    parser.add_argument(
        "--real-forward", action="store_true", help="run the model; time the step outside it"
    )
    parser.add_argument("--tokenizer", default=None, help="a tokenizer folder (for --stop)")
    parser.add_argument("--stop", action="append", default=[], help="a stop string (repeat)")
    parser.add_argument("--logprobs", type=int, default=None, help="top logprobs per token")
    args = parser.parse_args()
    torch.set_num_threads(1)
    options = dict(tokenizer=args.tokenizer, stop=args.stop, logprobs=args.logprobs)

    if args.profile:
        llm = decoding_llm(args.requests, args.model, zero=not args.real_forward, **options)
        profiler = cProfile.Profile()
        profiler.enable()
        for _ in range(args.steps):
            llm.engine.step()
        profiler.disable()
        stats = pstats.Stats(profiler).sort_stats("cumulative")
        stats.print_stats(args.profile)
        return

    per_step_ms = []  # per run: the median step (robust to other processes' bursts)
    mean_step_ms = []
    clock = time.perf_counter
    for _ in range(args.repeats):
        llm = decoding_llm(args.requests, args.model, zero=not args.real_forward, **options)
        step = llm.engine.step
        for _ in range(5):  # warm-up
            step()
        model_timers = (
            [ForwardTimer(llm.model), LogitsTimer(llm.model)] if args.real_forward else []
        )
        times = []
        for _ in range(args.steps):
            start = clock()
            step()
            times.append(clock() - start - sum(timer.take() for timer in model_timers))
        per_step_ms.append(statistics.median(times) * 1e3)
        mean_step_ms.append(sum(times) * 1e3 / len(times))
    forward = "step outside the model" if args.real_forward else "zero forward"
    print(
        f"engine-only step ({args.requests} decoding requests, {forward}): "
        f"median {statistics.median(per_step_ms):.3f} ms (mean {statistics.median(mean_step_ms):.3f}"
        f" ms) over {args.repeats} runs of {args.steps} steps; run medians "
        + ", ".join(f"{ms:.3f}" for ms in per_step_ms)
    )


if __name__ == "__main__":
    main()
