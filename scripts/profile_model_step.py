"""Step times of the CPU engine with the model's real forward: a prefill step (2048 prompt
tokens: four 512-token prompts) and a decode step at 16 and at 64 running requests.

These are the three quantities behind the hybrid/uniform ratio of `scripts/bench_cpu.sh`: both
modes pay the same prefill, uniform decodes ~16 requests per step and hybrid 64. Builds
`LLM(MODEL, load_format="dummy", kv_cache_memory="64MiB", max_model_len=1024)`, adds 64 (or 16)
random 512-token prompts (greedy, EOS ignored) and times each `llm.engine.step()`; prints the
median of each kind of step. The machine is noisy: compare versions with alternating runs.

    python scripts/profile_model_step.py [--model tiny-gemma3] [--num-threads 1]
    PYTHONPATH=/other/checkout/python python scripts/profile_model_step.py   # A/B a copy
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from hybrid_cache.engine.llm import LLM
from hybrid_cache.engine.sampling_params import SamplingParams

PROMPT_LEN = 512


def step_times(model: str, num_requests: int, decode_steps: int) -> tuple[list, list]:
    """(prefill step seconds, decode step seconds) for `num_requests` prompts."""
    llm = LLM(model, load_format="dummy", kv_cache_memory="64MiB", max_model_len=1024, seed=0)
    generator = torch.Generator().manual_seed(0)
    params = SamplingParams(max_tokens=decode_steps + 8, temperature=0.0, ignore_eos=True)
    for index in range(num_requests):
        prompt = torch.randint(3, llm.engine.vocab_size, (PROMPT_LEN,), generator=generator)
        llm.engine.add_request(str(index), prompt.tolist(), params)
    scheduler = llm.engine.scheduler

    def timed_step() -> float:
        start = time.perf_counter()
        llm.engine.step()
        return time.perf_counter() - start

    prefill = []
    while scheduler.waiting or any(
        r.num_computed_tokens < r.num_tokens - 1 for r in scheduler.running
    ):
        prefill.append(timed_step())
    assert len(scheduler.running) == num_requests, "every request should be decoding"
    decode = [timed_step() for _ in range(decode_steps)]
    # The first prefill step warms up; the last one also starts decoding (fewer prompt tokens).
    return prefill[1:-1], decode[3:]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="tiny-gemma3", help="preset (default tiny-gemma3)")
    parser.add_argument("--num-threads", type=int, default=1, help="torch CPU threads")
    parser.add_argument("--decode-steps", type=int, default=40)
    args = parser.parse_args()
    torch.set_num_threads(args.num_threads)
    prefill, decode_64 = step_times(args.model, 64, args.decode_steps)
    _, decode_16 = step_times(args.model, 16, args.decode_steps)
    print(
        f"{args.model}, {args.num_threads} thread(s): prefill step (2048 tokens) ms "
        f"{statistics.median(prefill) * 1e3:.1f}, decode step at 16 requests ms "
        f"{statistics.median(decode_16) * 1e3:.2f}, at 64 requests ms "
        f"{statistics.median(decode_64) * 1e3:.2f}"
    )


if __name__ == "__main__":
    main()
