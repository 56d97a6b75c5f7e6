"""Decode attention on the CPU: the Rust kernel (reads K/V in place) against the batched torch
ops (gather, then matmuls), same rows, same caches, alternating, one torch thread.

    python scripts/bench_cpu_attention.py [--contexts 600 4096] [--batches 16 64] [--cold] [--window W]

Caches use the engine's layout (one slot tensor [num_blocks, 2, block_size, Hkv, D] per layer,
K and V views of it), blocks shuffled. Prints the median time per call of each and the ratio.
With `--cold` a 48 MiB buffer is written before every timed call (untimed), so the K/V come
from memory as in the engine, where the other layers and steps evict them between calls.
`--window W` gives every row a sliding window of W keys (the Gemma sliding layers' decode).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from hybrid_cache.attention import build_attention_metadata, cpu_kernel, torch_batched
from hybrid_cache.attention.params import AttentionParams

# (kv heads, query heads per kv head, head_dim, softcap): tiny-gemma3, tiny-gemma2, a 7B-like GQA
SHAPES = [(1, 4, 32, None), (2, 2, 16, 50.0), (8, 4, 32, None)]


def case(batch, context, num_kv_heads, group, head_dim, block_size=16, seed=0):
    generator = torch.Generator().manual_seed(seed)
    width = -(-context // block_size)
    num_blocks = 1 + batch * width
    slots = torch.randn(num_blocks, 2, block_size, num_kv_heads, head_dim, generator=generator)
    k_cache, v_cache = slots[:, 0], slots[:, 1]
    order = 1 + torch.randperm(num_blocks - 1, generator=generator)
    table = order.view(batch, width).to(torch.int32)
    metadata, _ = build_attention_metadata(
        [1] * batch, [context - 1] * batch, [table], [block_size]
    )
    q = torch.randn(batch, num_kv_heads * group, head_dim, generator=generator)
    return q, k_cache, v_cache, metadata


def timed(call, repeats, evict=None):
    times = []
    for _ in range(repeats):
        if evict is not None:
            evict.fill_(1.0)
        start = time.perf_counter()
        call()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--contexts", type=int, nargs="+", default=[600, 4096])
    parser.add_argument("--batches", type=int, nargs="+", default=[16, 64])
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--cold", action="store_true", help="evict the caches before each call")
    parser.add_argument("--window", type=int, help="sliding window of every row (keys)")
    args = parser.parse_args()
    evict = torch.empty(48 * 2**20 // 4) if args.cold else None
    torch.set_num_threads(1)
    print("| rows | context | Hkv x G x D | softcap | torch ops | Rust kernel | kernel / torch |")
    print("|---|---|---|---|---|---|---|")
    for context in args.contexts:
        for batch in args.batches:
            for num_kv_heads, group, head_dim, softcap in SHAPES:
                q, k_cache, v_cache, metadata = case(batch, context, num_kv_heads, group, head_dim)
                group_meta = metadata.groups[0]

                params = AttentionParams(0.17, sliding_window=args.window, softcap=softcap)

                def run(kernel, q=q, k=k_cache, v=v_cache, m=metadata, g=group_meta, p=params):
                    cpu_kernel.ENABLED = kernel
                    return torch_batched.paged_attention(q, k, v, m, g, p)

                assert torch.allclose(run(True), run(False), rtol=1e-4, atol=1e-5)
                times = {True: [], False: []}
                for _ in range(3):  # alternate, keep each side's best median
                    for kernel in (False, True):
                        times[kernel].append(timed(lambda k=kernel: run(k), args.repeats, evict))
                torch_s, kernel_s = min(times[False]), min(times[True])
                print(
                    f"| {batch} | {context} | {num_kv_heads} x {group} x {head_dim} | {softcap} "
                    f"| {torch_s * 1e3:.2f} ms "
                    f"| {kernel_s * 1e3:.2f} ms | {kernel_s / torch_s:.2f} |"
                )
    cpu_kernel.ENABLED = True


if __name__ == "__main__":
    main()
