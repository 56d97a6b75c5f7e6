"""Engine timing on one GPU: the same workload run twice (each run's warm-up, which compiles the
Triton kernels, timed apart from the run), and a pure-decode step against the time to read the
weights and the visible KV cache once at the measured copy bandwidth.

    python scripts/gpu_engine_timing.py                 # gemma-3-12b, bf16 dummy weights,
                                                        # 32 prompts x 4096 in / 128 out,
                                                        # a 24 GiB KV budget (all 32 at once)
    python scripts/gpu_engine_timing.py --cpu-dry-run   # tiny-gemma3 on the CPU: logic only

Prints per run its timed seconds and tokens/s, its warm-up and build seconds; then the first
run's time over the second's (target: within 1.10) and, for the pure-decode steps at the
largest batch, the median step time over the ideal (weights + visible KV) / bandwidth (target:
within 1.3). The visible KV is estimated from the workload: every running request at
input_len + output_len / 2 tokens, each layer reading min(that, its window or chunk). Those
steps are also split: the model forward (the device synchronised at both ends), the LM head,
the engine's own time, and the forward's issue time (from its start until the host returns
from it, before the device is waited for): an issue time close to the forward's means the host
(Python, launches) sets the pace, a much shorter one that the device does.
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import time
from pathlib import Path


def copy_bandwidth(torch) -> float:
    """Bytes per second of a 1 GiB device-to-device copy (read + write counted)."""
    size = 1 << 30
    source = torch.empty(size, dtype=torch.uint8, device="cuda")
    target = torch.empty_like(source)
    for _ in range(3):
        target.copy_(source)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(20):
        target.copy_(source)
    end.record()
    torch.cuda.synchronize()
    seconds = start.elapsed_time(end) / 1e3 / 20
    del source, target
    return 2 * size / seconds


def ideal_decode_bytes(llm, running: int, tokens_per_request: int) -> tuple[int, int]:
    """(weight bytes, visible KV bytes) one decode step of `running` requests must read."""
    from hybrid_cache.attention import attention_layers

    weights = sum(p.numel() * p.element_size() for p in llm.model.parameters())
    element = llm.dtype.itemsize
    kv = 0
    for layer in attention_layers(llm.model):
        reach = layer.sliding_window or layer.chunk or tokens_per_request
        visible = min(tokens_per_request, reach)
        kv += running * visible * 2 * layer.num_kv_heads * layer.head_dim * element
    return weights, kv


def decode_steps(result, issue_s: list[float]) -> tuple[int, dict[str, list[float]]]:
    """The largest pure-decode batch and, for its steps, the seconds of each: whole step,
    forward, LM head, engine (the rest) and the forward's issue time."""
    from hybrid_cache.bench.metrics import is_decode_step

    rows = [
        (running, step, forward, logits, issued)
        for running, tokens, step, forward, logits, issued in zip(
            result.running_per_step,
            result.tokens_per_step,
            result.step_time_s,
            result.forward_time_s,
            result.logits_time_s,
            issue_s,
        )
        if is_decode_step(running, tokens)
    ]
    if not rows:
        return 0, {}
    largest = max(row[0] for row in rows)
    at_largest = [row[1:] for row in rows if row[0] == largest]
    step, forward, logits, issued = (list(column) for column in zip(*at_largest))
    engine = [s - f - lm for s, f, lm in zip(step, forward, logits)]
    return largest, dict(step=step, forward=forward, lm_head=logits, engine=engine, issue=issued)


def one_run(settings, mode: str, bandwidth):
    from hybrid_cache.bench.engine_run import ModeRun

    built = time.perf_counter()
    run = ModeRun(settings, mode)
    setup_s = time.perf_counter() - built
    issue_s: list[float] = []
    started, started_cpu = time.perf_counter(), time.process_time()
    try:
        while not run.done:
            run.step()
            issue_s.append(run.forward_timer.take_issue())
    finally:
        run.close()
    result = run.finish(time.perf_counter() - started, time.process_time() - started_cpu)
    figures = {
        "elapsed_s": result.elapsed_s,
        "total_tokens_per_s": result.total_tokens_per_s,
        "warm_up_s": result.warm_up_s,
        "build_s": setup_s - (result.warm_up_s or 0.0),
        "num_steps": result.num_steps,
    }
    running, parts = decode_steps(result, issue_s)
    if parts:
        tokens = settings.input_len + settings.output_len // 2
        weights, kv = ideal_decode_bytes(run.llm, running, tokens)
        figures.update(
            decode_running=running,
            decode_steps=len(parts["step"]),
            decode_step_median_s=statistics.median(parts["step"]),
            decode_split_median_s={name: statistics.median(v) for name, v in parts.items()},
            weight_bytes=weights,
            visible_kv_bytes=kv,
        )
        if bandwidth:
            figures["ideal_decode_step_s"] = (weights + kv) / bandwidth
            figures["decode_step_over_ideal"] = (
                figures["decode_step_median_s"] / (figures["ideal_decode_step_s"])
            )
    del run
    gc.collect()
    return figures


def add_workload_arguments(parser: argparse.ArgumentParser, output_len: int) -> None:
    """The workload arguments of the GPU timing scripts (gemma-3-12b, 32 x 4096 tokens in)."""
    parser.add_argument("--model", default="gemma-3-12b")
    parser.add_argument("--input-len", type=int, default=4096)
    parser.add_argument("--output-len", type=int, default=output_len)
    parser.add_argument("--num-prompts", type=int, default=32)
    # Enough for all 32 requests at once (the decode target is a step of 32 running).
    parser.add_argument("--kv-cache-memory", default="24GiB")
    parser.add_argument("--mode", choices=("hybrid", "uniform"), default="hybrid")
    parser.add_argument("--output-json", help="write the figures here")
    parser.add_argument(
        "--cpu-dry-run", action="store_true", help="tiny-gemma3 on the CPU, tiny workload"
    )


def workload_settings(args: argparse.Namespace, dry_output_len: int, **flags):
    """The `BenchSettings` of the parsed workload; with `--cpu-dry-run`, tiny-gemma3 on three
    48-token prompts (written back to `args`)."""
    from hybrid_cache.bench.settings import BenchSettings

    if args.cpu_dry_run:
        args.model, args.input_len, args.output_len = "tiny-gemma3", 48, dry_output_len
        args.num_prompts, args.kv_cache_memory = 3, "2MiB"
    return BenchSettings(
        model=args.model,
        input_len=args.input_len,
        output_len=args.output_len,
        num_prompts=args.num_prompts,
        kv_cache_memory=args.kv_cache_memory,
        **flags,
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_workload_arguments(parser, output_len=128)
    parser.add_argument("--runs", type=int, default=2, help="timed runs, each with its warm-up")
    parser.add_argument("--enforce-eager", action="store_true")
    args = parser.parse_args()
    if args.runs < 1:
        parser.error("--runs must be at least 1")
    import torch

    if args.cpu_dry_run:
        bandwidth = None
    elif not torch.cuda.is_available():
        print("no CUDA device (use --cpu-dry-run to check the script on the CPU)")
        return 2
    else:
        bandwidth = copy_bandwidth(torch)
        print(f"device: {torch.cuda.get_device_name()}, copy bandwidth {bandwidth / 1e9:.0f} GB/s")
    settings = workload_settings(args, dry_output_len=6, enforce_eager=args.enforce_eager)
    print(
        f"{args.model} {args.mode}: {args.num_prompts} prompts x {args.input_len} in / "
        f"{args.output_len} out, KV {args.kv_cache_memory}"
    )
    runs = []
    for index in range(args.runs):
        figures = one_run(settings, args.mode, bandwidth)
        runs.append(figures)
        print(
            f"run {index + 1}: {figures['elapsed_s']:.2f} s timed "
            f"({figures['total_tokens_per_s']:.0f} tok/s, {figures['num_steps']} steps); "
            f"warm-up {figures['warm_up_s']:.2f} s (compiles), build {figures['build_s']:.2f} s"
        )
        if "decode_step_median_s" in figures:
            line = (
                f"  pure-decode steps at {figures['decode_running']} running: median "
                f"{figures['decode_step_median_s'] * 1e3:.2f} ms over {figures['decode_steps']}; "
                f"weights {figures['weight_bytes'] / 1e9:.2f} GB + visible KV "
                f"{figures['visible_kv_bytes'] / 1e9:.2f} GB"
            )
            if "ideal_decode_step_s" in figures:
                line += (
                    f" = {figures['ideal_decode_step_s'] * 1e3:.2f} ms at copy bandwidth: "
                    f"{figures['decode_step_over_ideal']:.2f}x (target <= 1.3)"
                )
            print(line)
            split = figures["decode_split_median_s"]
            print(
                "  their medians (ms): forward {forward:.2f} (issued in {issue:.2f}), LM head "
                "{lm_head:.2f}, engine {engine:.2f}".format(
                    **{name: seconds * 1e3 for name, seconds in split.items()}
                )
            )
    summary = {"settings": vars(args), "copy_bandwidth_bytes_per_s": bandwidth, "runs": runs}
    if len(runs) > 1:
        ratio = runs[0]["elapsed_s"] / runs[1]["elapsed_s"]
        summary["first_over_second"] = ratio
        print(f"first run / second run: {ratio:.3f} (target <= 1.10)")
    if args.output_json:
        Path(args.output_json).write_text(json.dumps(summary, indent=2) + "\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
