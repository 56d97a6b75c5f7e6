"""The logprobs' top k on the CPU: the native top k (`_core.top_k_rows_cpu`, what
`engine/logprobs.py` uses; it also counts the chosen token's rank, which the others do not)
against k + 1 numpy argmax passes (what it replaced) and `torch.topk`, on 64 rows of fresh log_softmax rows per call (16 different matrices in turn: one
matrix over and over trains the branch predictor and flatters every method), one thread.

    python scripts/bench_top_k.py [--k 5] [--vocab 512 32768]
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
import torch
from hybrid_cache._core import top_k_rows_cpu


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
        base = statistics.median(times["native"])
        print(
            f"64 x {vocab}, k = {k}: "
            + ", ".join(
                f"{name} {statistics.median(t) * 1e6:.0f} us ({statistics.median(t) / base:.2f}x)"
                for name, t in times.items()
            )
        )


if __name__ == "__main__":
    main()
