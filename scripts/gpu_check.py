"""GPU check for the Triton kernels: correctness at realistic sizes, then decode/prefill timings.

One command, a few minutes on one GPU:

    python scripts/gpu_check.py            # add --quick for a smaller run

Correctness first: mixed and decode-only batches against the torch reference, then decode rows
whose window (or chunk) is far shorter than their context, with the default split count and
with 4 and 16 splits; pages left of each window are the null block 0 and block 0 (and every
slot left of a window in its first page) is NaN, so a stray read fails the check.

Then a markdown table: kernel time launched eagerly (what a step pays without CUDA graphs:
Python checks and two launches included) and replayed from a CUDA graph (the kernels alone),
torch SDPA over already-gathered dense K/V, flash-attn's `flash_attn_with_kvcache` where
importable (its paged path needs block sizes that are multiples of 256), and the kernel's
achieved bandwidth (bytes of K/V/Q/out it must move, graph time) as a share of the device's
measured copy bandwidth, with windows much shorter than the context among the cases. Exits
non-zero if a correctness check fails.
"""

import argparse
import importlib
import os
import subprocess
import sys
import time
import types
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
# "cpu" only for --cpu-dry-run, which runs the script's own logic under TRITON_INTERPRET=1 with
# tiny shapes (timings then mean nothing).
DEVICE = "cuda"


def bench(triton, function) -> float:
    """Milliseconds per call."""
    if DEVICE == "cuda":
        return triton.testing.do_bench(function, warmup=10, rep=50)
    started = time.perf_counter()
    function()
    return (time.perf_counter() - started) * 1e3


def import_kernels():
    """hybrid_cache.kernels, building the extension first if it is missing (fresh machine)."""
    sys.path.insert(0, str(REPO_ROOT / "python"))
    try:
        return importlib.import_module("hybrid_cache.kernels")
    except ImportError as error:
        print(f"note: `import hybrid_cache.kernels` failed ({error}); trying `maturin develop`")
    try:
        subprocess.run(
            [sys.executable, "-m", "maturin", "develop", "--release", "-q"],
            cwd=REPO_ROOT,
            check=True,
            timeout=240,
        )
        for name in [name for name in sys.modules if name.startswith("hybrid_cache")]:
            del sys.modules[name]
        return importlib.import_module("hybrid_cache.kernels")
    except Exception as error:  # noqa: BLE001 - any failure here falls back to the stub below
        print(f"note: building the extension failed ({error}); using a stub hybrid_cache._core")
    # The kernels need only HybridCacheError from the extension; stand it in for this check.
    for name in [name for name in sys.modules if name.startswith("hybrid_cache")]:
        del sys.modules[name]
    package = types.ModuleType("hybrid_cache")
    package.__path__ = [str(REPO_ROOT / "python" / "hybrid_cache")]
    core = types.ModuleType("hybrid_cache._core")
    core.HybridCacheError = type("HybridCacheError", (Exception,), {})
    sys.modules["hybrid_cache"] = package
    sys.modules["hybrid_cache._core"] = core
    return importlib.import_module("hybrid_cache.kernels")


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def bench_graph(triton, function):
    """Milliseconds per call replayed from a CUDA graph (None where capture fails); the CPU dry
    run times one eager call instead."""
    if DEVICE != "cuda":
        return bench(triton, function)
    try:
        return triton.testing.do_bench_cudagraph(function, rep=50)
    except Exception as error:  # noqa: BLE001 - report and keep timing
        print(f"note: CUDA graph timing failed ({type(error).__name__}: {error})")
        return None


def visible_begin(first_position: int, window, chunk) -> int:
    begin = 0
    if window:
        begin = max(begin, first_position - window + 1)
    if chunk:
        begin = max(begin, first_position // chunk * chunk)
    return begin


def make_paged(
    torch, seq_lens, query_lens, heads, kv_heads, head_dim, block_size, dtype, window, chunk=None
):
    """Random paged batch; pages left of each sequence's window (or chunk) are the null block 0,
    NaN like the slots left of the window in its first page."""
    device = DEVICE
    pages = [cdiv(length, block_size) for length in seq_lens]
    num_blocks = sum(pages) + 1
    key_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim, device=device, dtype=dtype)
    value_cache = torch.randn_like(key_cache)
    key_cache[0] = float("nan")  # the null block: reading it would poison the output
    value_cache[0] = float("nan")
    block_table = torch.zeros(len(seq_lens), max(pages), dtype=torch.int32)
    order = (torch.randperm(num_blocks - 1) + 1).tolist()
    for seq, (seq_len, query_len) in enumerate(zip(seq_lens, query_lens)):
        begin = visible_begin(seq_len - query_len, window, chunk)
        for page_index in range(pages[seq]):
            page = order.pop()
            if (page_index + 1) * block_size > begin:
                block_table[seq, page_index] = page
                if page_index * block_size < begin:  # the window starts inside this page
                    key_cache[page, : begin - page_index * block_size] = float("nan")
                    value_cache[page, : begin - page_index * block_size] = float("nan")
    starts = [0]
    for query_len in query_lens:
        starts.append(starts[-1] + query_len)
    query = torch.randn(starts[-1], heads, head_dim, device=device, dtype=dtype)
    return dict(
        query=query,
        key_cache=key_cache,
        value_cache=value_cache,
        block_table=block_table.to(device),
        query_start_loc=torch.tensor(starts, dtype=torch.int32, device=device),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
    )


def copy_bandwidth(torch, triton) -> float:
    """Bytes per second of a large device-to-device copy (read + write counted)."""
    size = 1 << 30 if DEVICE == "cuda" else 1 << 20
    source = torch.empty(size, dtype=torch.uint8, device=DEVICE)
    target = torch.empty_like(source)
    milliseconds = bench(triton, lambda source=source, target=target: target.copy_(source))
    return 2 * size / (milliseconds * 1e-3)


# Per size: correctness (seq_lens, query_lens, window), benchmark shapes, benchmark windows.
SIZES = {
    "full": (
        ([1500, 37, 2048, 900], [1, 37, 512, 1], 1000),
        [("decode", 64, 4096, 1), ("decode", 16, 16384, 1), ("prefill", 4, 2048, 2048)],
        (4096, 1024),
    ),
    "quick": (
        ([300, 37, 500], [1, 37, 64], 100),
        [("decode", 16, 2048, 1), ("prefill", 2, 1024, 1024)],
        (1024, 256),
    ),
    "tiny": (
        ([20, 5, 33], [1, 5, 9], 10),
        [("decode", 2, 40, 1), ("prefill", 1, 24, 24)],
        (16,),
    ),
}
# Per size: decode rows whose window / chunk is far shorter than their context.
SHORT_WINDOWS = {
    "full": ([16384, 6000, 4100, 1500, 37], 256, 1024),
    "quick": ([4096, 700, 37], 128, 512),
    "tiny": ([90, 37, 5], 8, 16),
}


def correctness(torch, kernels, size: str) -> list:
    """Mixed prefill/decode batches (one split) and decode-only ones (1 and 8 kv splits)."""
    failures = []
    (seq_lens, query_lens, window_size), _, _ = SIZES[size]
    cases = [("mixed", query_lens, 1), ("decode", [1] * len(seq_lens), 1)]
    cases.append(("decode", [1] * len(seq_lens), 8))
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        for block_size in (16, 256):
            for window in (None, window_size):
                for kind, lengths, splits in cases:
                    batch = make_paged(
                        torch, seq_lens, lengths, 32, 4, 128, block_size, dtype, window
                    )
                    sinks = torch.randn(32, device=DEVICE)
                    options = dict(sliding_window=window, softcap=30.0, sinks=sinks)
                    out = torch.full_like(batch["query"], float("nan"))
                    kernels.unified_attention(**batch, out=out, num_kv_splits=splits, **options)
                    expected = kernels.reference_unified_attention(
                        **{
                            **batch,
                            "query": batch["query"].float(),
                            "key_cache": batch["key_cache"].float(),
                            "value_cache": batch["value_cache"].float(),
                        },
                        **options,
                    )
                    error = (out.float() - expected).abs().max().item()
                    bound = {torch.float32: 2e-3, torch.float16: 1e-2, torch.bfloat16: 4e-2}
                    status = "ok" if error <= bound[dtype] else "FAIL"
                    print(
                        f"correctness {str(dtype):15} block {block_size:3} window {window} "
                        f"{kind} splits {splits}: max abs error {error:.2e} "
                        f"(bound {bound[dtype]:.0e}) {status}"
                    )
                    if status != "ok":
                        failures.append((str(dtype), block_size, window, kind, splits, error))
    return failures + short_window_correctness(torch, kernels, size)


def short_window_correctness(torch, kernels, size: str) -> list:
    """Decode rows with a window (or chunk) far shorter than their context: default, 4 and 16
    KV splits, each row's splits over its own window only."""
    from hybrid_cache.kernels.paged_attention import _default_num_splits as default_num_splits

    failures = []
    seq_lens, window_size, chunk_size = SHORT_WINDOWS[size]
    bound = {torch.float32: 2e-3, torch.bfloat16: 4e-2}
    for dtype in (torch.bfloat16, torch.float32):
        for block_size in (16, 256):
            for window, chunk in ((window_size, None), (None, chunk_size)):
                batch = make_paged(
                    torch, seq_lens, [1] * len(seq_lens), 32, 4, 128, block_size, dtype,
                    window, chunk,
                )  # fmt: skip
                sinks = torch.randn(32, device=DEVICE)
                options = dict(sliding_window=window, chunk_size=chunk, softcap=30.0, sinks=sinks)
                expected = kernels.reference_unified_attention(
                    **{
                        **batch,
                        "query": batch["query"].float(),
                        "key_cache": batch["key_cache"].float(),
                        "value_cache": batch["value_cache"].float(),
                    },
                    **options,
                )
                default = default_num_splits(
                    torch.device(DEVICE), len(seq_lens), len(seq_lens), 4, num_query_heads=32,
                    sliding_window=window, chunk_size=chunk, max_seq_len=max(seq_lens),
                )  # fmt: skip
                for splits in (None, 4, 16):
                    out = torch.full_like(batch["query"], float("nan"))
                    kernels.unified_attention(
                        **batch, out=out, num_kv_splits=splits, max_seq_len=max(seq_lens), **options
                    )
                    error = (out.float() - expected).abs().max().item()
                    status = "ok" if error <= bound[dtype] else "FAIL"
                    label = f"{splits}" if splits else f"default ({default})"
                    print(
                        f"correctness {str(dtype):15} block {block_size:3} window {window} "
                        f"chunk {chunk} decode, contexts up to {max(seq_lens)}, splits {label}: "
                        f"max abs error {error:.2e} (bound {bound[dtype]:.0e}) {status}"
                    )
                    if status != "ok":
                        failures.append((str(dtype), block_size, window, chunk, splits, error))
    return failures


def flash_attn_callable(torch, batch, block_size, window, causal_queries):
    """A closure timing flash_attn_with_kvcache on the same paged cache, or a reason why not."""
    try:
        from flash_attn import flash_attn_with_kvcache
    except Exception as error:  # noqa: BLE001 - not installed or broken build
        return None, f"n/a ({type(error).__name__})"
    if block_size % 256:
        return None, "n/a (block % 256)"
    num_seqs = batch["seq_lens"].numel()
    query = batch["query"].view(num_seqs, causal_queries, *batch["query"].shape[1:])

    def run():
        return flash_attn_with_kvcache(
            query,
            batch["key_cache"],
            batch["value_cache"],
            cache_seqlens=batch["seq_lens"],
            block_table=batch["block_table"],
            causal=True,
            window_size=(window - 1, 0) if window else (-1, -1),
        )

    try:
        run()
    except Exception as error:  # noqa: BLE001 - report, keep timing the rest
        return None, f"error ({type(error).__name__})"
    return run, None


def benchmark(torch, triton, kernels, size: str, copy_bytes_per_second: float) -> list:
    from hybrid_cache.kernels.paged_attention import _default_num_splits as default_num_splits

    rows = []
    heads, kv_heads, head_dim, dtype = 32, 4, 128, torch.bfloat16
    element = torch.finfo(dtype).bits // 8
    _, shapes, window_sizes = SIZES[size]
    for kind, num_seqs, seq_len, query_len in shapes:
        for block_size in (16, 256):
            for window in (None, *window_sizes):
                batch = make_paged(
                    torch,
                    [seq_len] * num_seqs,
                    [query_len] * num_seqs,
                    heads,
                    kv_heads,
                    head_dim,
                    block_size,
                    dtype,
                    window,
                )

                def kernel(batch=batch, window=window, seq_len=seq_len):
                    return kernels.unified_attention(
                        **batch, sliding_window=window, max_seq_len=seq_len
                    )

                eager_ms = bench(triton, kernel)
                graph_ms = bench_graph(triton, kernel)
                kernel_ms = graph_ms if graph_ms is not None else eager_ms
                visible = min(seq_len, window + query_len - 1) if window else seq_len
                # Dense, already gathered K/V of exactly the visible keys, GQA expanded by SDPA.
                start = seq_len - visible
                dense_keys = torch.randn(
                    num_seqs, kv_heads, visible, head_dim, device=DEVICE, dtype=dtype
                )
                dense_values = torch.randn_like(dense_keys)
                dense_queries = batch["query"].view(num_seqs, query_len, heads, head_dim)
                dense_queries = dense_queries.transpose(1, 2)
                mask = None
                if query_len > 1:
                    query_positions = torch.arange(seq_len - query_len, seq_len, device=DEVICE)
                    key_positions = torch.arange(start, seq_len, device=DEVICE)
                    mask = key_positions[None, :] <= query_positions[:, None]
                    if window:
                        mask &= key_positions[None, :] > query_positions[:, None] - window

                def sdpa(q=dense_queries, k=dense_keys, v=dense_values, m=mask):
                    return torch.nn.functional.scaled_dot_product_attention(
                        q, k, v, attn_mask=m, enable_gqa=True
                    )

                try:
                    sdpa_ms = f"{bench(triton, sdpa):.3f}"
                except Exception as error:  # noqa: BLE001
                    sdpa_ms = f"error ({type(error).__name__})"
                flash, reason = flash_attn_callable(torch, batch, block_size, window, query_len)
                flash_ms = f"{bench(triton, flash):.3f}" if flash else reason
                moved = num_seqs * visible * kv_heads * head_dim * element * 2
                moved += 2 * batch["query"].numel() * element
                share = moved / (kernel_ms * 1e-3) / copy_bytes_per_second
                splits = default_num_splits(
                    torch.device(DEVICE), num_seqs * query_len, num_seqs, kv_heads,
                    num_query_heads=heads, sliding_window=window, max_seq_len=seq_len,
                )  # fmt: skip
                row = (
                    f"{kind} {num_seqs}x{seq_len}" + (f" q{query_len}" if query_len > 1 else ""),
                    block_size,
                    window or "-",
                    splits,
                    f"{eager_ms:.3f}",
                    "n/a" if graph_ms is None else f"{graph_ms:.3f}",
                    sdpa_ms,
                    flash_ms,
                    f"{moved / (kernel_ms * 1e-3) / 1e9:.0f}",
                    f"{share:.0%}",
                )
                rows.append(row)
                print("| " + " | ".join(str(cell) for cell in row) + " |", flush=True)
                torch.cuda.empty_cache()
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="smaller shapes, about a minute")
    parser.add_argument(
        "--cpu-dry-run",
        action="store_true",
        help="run this script's logic on the CPU under TRITON_INTERPRET=1 with tiny shapes",
    )
    arguments = parser.parse_args()
    started = time.time()
    size = "quick" if arguments.quick else "full"
    if arguments.cpu_dry_run:
        global DEVICE
        DEVICE, size = "cpu", "tiny"
        os.environ["TRITON_INTERPRET"] = "1"  # before Triton is imported
    import torch
    import triton

    if DEVICE == "cuda" and not torch.cuda.is_available():
        print("no CUDA device: this script checks the kernels on a GPU (tests cover the CPU)")
        return 2
    kernels = import_kernels()
    torch.manual_seed(0)
    name = torch.cuda.get_device_name() if DEVICE == "cuda" else "CPU (interpreter dry run)"
    print(f"device: {name}, torch {torch.__version__}, triton {triton.__version__}")
    failures = correctness(torch, kernels, size)
    copy_bytes_per_second = copy_bandwidth(torch, triton)
    print(f"device copy bandwidth: {copy_bytes_per_second / 1e9:.0f} GB/s")
    header = (
        "case",
        "block",
        "window",
        "kv splits",
        "kernel ms (eager)",
        "kernel ms (graph)",
        "SDPA ms (gathered)",
        "flash-attn ms",
        "kernel GB/s (graph)",
        "% of copy BW",
    )
    print()
    print("bf16, head_dim 128, 32 query heads / 4 kv heads (GQA 8:1)")
    print()
    print("| " + " | ".join(header) + " |")
    print("|" + "---|" * len(header), flush=True)
    benchmark(torch, triton, kernels, size, copy_bytes_per_second)  # prints each row as it goes
    print(f"\ntotal {time.time() - started:.0f} s")
    if failures:
        print(f"CORRECTNESS FAILURES: {failures}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
