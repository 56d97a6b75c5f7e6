"""The logprobs' top k on the CPU, on 64 fresh rows per call (16 different matrices in turn:
one matrix over and over trains the branch predictor and flatters every method), one thread:

- over log_softmax rows: the native top k (`_core.top_k_rows_cpu`; it also counts the chosen
  token's rank, which the others do not) against k + 1 numpy argmax passes and `torch.topk`;
- from the logits, what `engine/logprobs.py` runs: the native log-softmax with its top k
  (`_core.logprob_top_k_rows_cpu`) against torch's log_softmax then the native top k. With
  `--evict`, a 64 MiB buffer is written before each call, as the model's forward does before
  the engine samples (the code and rows are then out of the caches).

    python scripts/bench_top_k.py [--k 5] [--vocab 512 32768] [--evict]
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
import torch
from hybrid_cache._core import logprob_top_k_rows_cpu, top_k_rows_cpu


def numpy_passes(array: np.ndarray, k: int) -> np.ndarray:
    rows = np.arange(array.shape[0])
    ids = np.empty((array.shape[0], k + 2), dtype=np.int64)
    work = array.copy()
    for index in range(1, k + 2):
        best = ids[:, index] = work.argmax(axis=1)
        work[rows, best] = -np.inf
    return ids


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--k", type=int, default=5)
    parser.add_argument("--vocab", type=int, nargs="+", default=[512, 32768])
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--evict", action="store_true", help="write 64 MiB before each call")
    args = parser.parse_args()
    torch.set_num_threads(1)
    k = args.k
    for vocab in args.vocab:
        matrices = [torch.randn(64, vocab).log_softmax(dim=-1) for _ in range(16)]
        chosen = np.zeros(64, dtype=np.int64)
        ids = np.empty((64, k + 1), dtype=np.int64)
        values = np.empty((64, k + 1), dtype=np.float32)
        ranks = np.empty(64, dtype=np.int64)
        times: dict[str, list[float]] = {"native": [], "numpy argmax passes": [], "torch.topk": []}
        clock = time.perf_counter
        for _ in range(args.rounds):
            for matrix in matrices:
                array = matrix.numpy()
                start = clock()
                top_k_rows_cpu(array, k, chosen, ids, values, ranks)
                times["native"].append(clock() - start)
                start = clock()
                numpy_passes(array, k)
                times["numpy argmax passes"].append(clock() - start)
                start = clock()
                matrix.topk(k, dim=-1)
                times["torch.topk"].append(clock() - start)
        report(f"64 x {vocab} log_softmax rows, k = {k}", times)

        logits = [torch.randn(64, vocab) * 3 for _ in range(16)]
        times = {"native log-softmax and top k": [], "torch log_softmax, native top k": []}
        evicted = torch.zeros(16 << 20) if args.evict else None
        for _ in range(args.rounds):
            for matrix in logits:
                array = matrix.numpy()
                if evicted is not None:
                    evicted.add_(1.0)
                start = clock()
                logprob_top_k_rows_cpu(array, k, chosen, ids, values, ranks)
                times["native log-softmax and top k"].append(clock() - start)
                if evicted is not None:
                    evicted.add_(1.0)
                start = clock()
                top_k_rows_cpu(matrix.log_softmax(dim=-1).numpy(), k, chosen, ids, values, ranks)
                times["torch log_softmax, native top k"].append(clock() - start)
        caches = ", caches evicted" if args.evict else ""
        report(f"64 x {vocab} logits, k = {k}{caches}", times)


def report(case: str, times: dict[str, list[float]]) -> None:
    """Each method's median, and its ratio to the first's."""
    base = statistics.median(next(iter(times.values())))
    print(
        f"{case}: "
        + ", ".join(
            f"{name} {statistics.median(t) * 1e6:.0f} us ({statistics.median(t) / base:.2f}x)"
            for name, t in times.items()
        )
    )


if __name__ == "__main__":
    main()
