"""One engine decode step of the allocator, timed from Python.

256 running requests with 2000-token prompts in two groups (full attention + sliding window 4096,
block size 16). Each step appends one sampled token per request (`append_token_ids_batch`) and
allocates one more slot for each (`allocate_batch`), which releases window-skipped blocks, takes
new blocks every 16 tokens and caches newly full blocks. Prints the median and mean wall time
per call, so the figure includes the Python -> Rust call and the numpy argument conversion.

    python scripts/bench_step_python.py [--steps 4000]
"""

import argparse
import time

import numpy as np
from hybrid_cache import Coordinator, GroupSpec

NUM_REQUESTS = 256
PROMPT_LEN = 2000


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=4000)
    args = parser.parse_args()

    groups = [GroupSpec("full", 16), GroupSpec("sliding_window", 16, window=4096)]
    coordinator = Coordinator(NUM_REQUESTS * 800, groups, NUM_REQUESTS, 8192, 2048)
    ids = np.arange(NUM_REQUESTS, dtype=np.int64)
    for request in ids:
        prompt = np.arange(PROMPT_LEN, dtype=np.int64) ^ (int(request) << 20)
        coordinator.add_request(int(request), prompt)
    prefill = np.full(NUM_REQUESTS, PROMPT_LEN, dtype=np.int64)
    assert coordinator.allocate_batch(ids, np.zeros_like(ids), prefill) == NUM_REQUESTS

    ones = np.ones(NUM_REQUESTS, dtype=np.int64)
    allocate_times, append_times = [], []
    for step in range(args.steps):
        computed = np.full(NUM_REQUESTS, PROMPT_LEN + step, dtype=np.int64)
        start = time.perf_counter()
        coordinator.append_token_ids_batch(ids, ones)
        middle = time.perf_counter()
        allocated = coordinator.allocate_batch(ids, computed, ones)
        end = time.perf_counter()
        assert allocated == NUM_REQUESTS, "the pool is sized so every step fits"
        append_times.append(middle - start)
        allocate_times.append(end - middle)

    for name, times in (
        ("allocate_batch", allocate_times),
        ("append_token_ids_batch", append_times),
    ):
        micros = np.asarray(times) * 1e6
        print(
            f"{name} ({NUM_REQUESTS} requests, full + window 4096, block 16): "
            f"median {np.median(micros):.1f} us, mean {micros.mean():.1f} us, "
            f"p90 {np.percentile(micros, 90):.1f} us over {args.steps} steps"
        )


if __name__ == "__main__":
    main()
