"""Serving overhead: output tok/s through `hybrid-cache serve` (streaming, at a fixed
concurrency, measured by `bench/serving.py` over HTTP) against offline `LLM.generate` on the
same model, weights (dummy, seeded), prompts and engine limits, side by side in one run.

The server runs in a subprocess, one per `--engine-modes` entry (`process`: the engine in a
process of its own, the default; `thread`: `--no-engine-process`); the offline engine and the
HTTP client run here, one side at a time (each round in a rotated order over `--repeat`
rounds; each side's best round counts). Then, per mode, TTFT at a request rate the engine
sustains (`--rate-share` of that mode's measured request throughput, Poisson arrivals, no
concurrency cap), against one decode step at the full batch plus the prefill of one prompt
alone (both timed offline). Each server round also reports the CPU seconds per 8192 streamed
tokens of the server's process, its engine process and the client (Linux `/proc`): on a
machine with few cores they share them, so what each costs is what the engine loses.

    python scripts/bench_serve_overhead.py --model tiny-gemma3 --concurrency 32
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import statistics
import subprocess
import sys
import time
import urllib.request

import torch
from hybrid_cache import LLM, SamplingParams
from hybrid_cache.bench.serve_settings import ServeBenchSettings
from hybrid_cache.bench.serving import run_serve_bench
from hybrid_cache.bench.workload import make_prompts

MODES = ("process", "thread")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def wait_healthy(url: str, process: subprocess.Popen, timeout: float = 120.0) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"the server exited with {process.returncode}")
        try:
            with urllib.request.urlopen(url + "/health", timeout=1) as response:
                if response.status == 200:
                    return
        except OSError:
            time.sleep(0.2)
    raise RuntimeError("the server did not start")


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of process `pid` so far (Linux `/proc`)."""
    with open(f"/proc/{pid}/stat", encoding="ascii") as file:
        fields = file.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def cpu_split(pid: int) -> list[float]:
    """CPU seconds so far of server process `pid`, of its children (the engine process in
    `process` mode) and of this process (the HTTP client)."""
    try:
        with open(f"/proc/{pid}/task/{pid}/children", encoding="ascii") as file:
            children = [int(child) for child in file.read().split()]
    except OSError:
        children = []
    return [cpu_seconds(pid), sum(map(cpu_seconds, children)), time.process_time()]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="tiny-gemma3")
    parser.add_argument("--hf-overrides", help="JSON merged into the model config (both sides)")
    parser.add_argument("--num-prompts", type=int, default=128)
    parser.add_argument("--input-len", type=int, default=256)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--num-threads", type=int, default=1)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--rate-share", type=float, default=0.5)
    parser.add_argument("--stream-interval", type=int, default=1, help="the server's")
    parser.add_argument(
        "--engine-modes", nargs="+", choices=MODES, default=list(MODES), help="servers compared"
    )
    parser.add_argument("--output-json")
    args = parser.parse_args()
    torch.set_num_threads(args.num_threads)
    max_model_len = args.input_len + args.output_len
    engine_flags = {
        "max_model_len": max_model_len,
        "max_num_seqs": args.concurrency,
        "load_format": "dummy",
    }
    overrides = json.loads(args.hf_overrides) if args.hf_overrides else None
    llm = LLM(args.model, hf_overrides=overrides, **engine_flags)
    vocab = llm.spec.vocab_size
    prompts = [
        {"prompt_token_ids": ids}
        for ids in make_prompts(args.num_prompts, args.input_len, 0, vocab, seed=0)
    ]
    params = SamplingParams(max_tokens=args.output_len, temperature=0.0, ignore_eos=True)
    llm.generate(prompts[: args.concurrency], params, use_tqdm=False)  # warm-up: a full batch

    servers: dict[str, tuple[subprocess.Popen, str]] = {}
    try:
        for mode in args.engine_modes:
            port = free_port()
            command = [
                sys.executable, "-m", "hybrid_cache", "serve", args.model, "--port", str(port),
                "--max-model-len", str(max_model_len), "--max-num-seqs", str(args.concurrency),
                "--load-format", "dummy", "--num-threads", str(args.num_threads),
                "--log-level", "warning", "--stream-interval", str(args.stream_interval),
                "--engine-process" if mode == "process" else "--no-engine-process",
            ]  # fmt: skip
            if args.hf_overrides:
                command += ["--hf-overrides", args.hf_overrides]
            servers[mode] = (
                subprocess.Popen(command, env=dict(os.environ)),
                f"http://127.0.0.1:{port}",
            )
        settings = {}
        for mode, (server, url) in servers.items():
            wait_healthy(url, server)
            settings[mode] = ServeBenchSettings(
                base_url=url,
                num_prompts=args.num_prompts,
                input_len=args.input_len,
                output_len=args.output_len,
                max_concurrency=args.concurrency,
            )
            warm_up = {**settings[mode].__dict__, "num_prompts": args.concurrency}
            asyncio.run(run_serve_bench(ServeBenchSettings(**warm_up)))
        sides = ["offline", *servers]
        offline: list[float] = []
        served: dict[str, list[float]] = {mode: [] for mode in servers}
        serve_results: dict[str, list[dict]] = {mode: [] for mode in servers}
        # Per round: CPU seconds per 8192 streamed tokens of the server's process, of its
        # children (the engine process in `process` mode) and of this one (the HTTP client).
        cpu: dict[str, list[list[float]]] = {mode: [] for mode in servers}
        for round_index in range(args.repeat):
            shift = round_index % len(sides)
            for side in sides[shift:] + sides[:shift]:
                if side == "offline":
                    start = time.perf_counter()
                    outputs = llm.generate(prompts, params, use_tqdm=False)
                    elapsed = time.perf_counter() - start
                    offline.append(sum(len(o.token_ids) for o in outputs) / elapsed)
                    steps = len(llm.step_stats)
                else:
                    before = cpu_split(servers[side][0].pid)
                    results = asyncio.run(run_serve_bench(settings[side]))
                    after = cpu_split(servers[side][0].pid)
                    per = 8192 / results["total_output_tokens"]
                    cpu[side].append([round((b - a) * per, 3) for a, b in zip(before, after)])
                    assert results["failed"] == 0, results["errors"]
                    served[side].append(results["output_throughput"])
                    serve_results[side].append(results)
        # One decode step at the full batch (the offline run's mean step) and one prompt's
        # prefill alone.
        decode_step_s = elapsed / steps
        prefill = []
        for _ in range(5):
            start = time.perf_counter()
            llm.generate(prompts[0], SamplingParams(max_tokens=1), use_tqdm=False)
            prefill.append(time.perf_counter() - start)
        prefill_s = statistics.median(prefill)
        modes = {}
        for mode in servers:
            best = max(range(len(served[mode])), key=served[mode].__getitem__)
            rate = args.rate_share * serve_results[mode][best]["request_throughput"]
            paced = asyncio.run(
                run_serve_bench(
                    ServeBenchSettings(
                        **{**settings[mode].__dict__, "max_concurrency": None, "request_rate": rate}
                    )
                )
            )
            modes[mode] = {
                "server_output_tok_s": served[mode],
                "ratio_best": max(served[mode]) / max(offline),
                # Server over offline within each round (run one after the other).
                "ratio_per_round": [server / alone for server, alone in zip(served[mode], offline)],
                "server_ttft_p99_ms_at_concurrency": serve_results[mode][best]["ttft"]["p99_ms"],
                "cpu_s_per_8192_tokens_server_engine_client": cpu[mode],
                "paced_request_rate": rate,
                "paced_ttft_p99_ms": paced["ttft"]["p99_ms"],
                "paced_ttft_median_ms": paced["ttft"]["median_ms"],
            }
    finally:
        for server, _ in servers.values():
            server.terminate()
        for server, _ in servers.values():
            server.wait(30)
    report = {
        "offline_output_tok_s": offline,
        "modes": modes,
        "decode_step_ms": 1000 * decode_step_s,
        "prefill_one_prompt_ms": 1000 * prefill_s,
        "ttft_bound_ms": 2000 * (decode_step_s + prefill_s),
        "args": vars(args),
    }
    if len(modes) == 2:
        report["process_over_thread_per_round"] = [
            a / b
            for a, b in zip(
                modes["process"]["server_output_tok_s"], modes["thread"]["server_output_tok_s"]
            )
        ]
    print(json.dumps(report, indent=2))
    if args.output_json:
        with open(args.output_json, "w", encoding="utf-8") as file:
            json.dump(report, file, indent=2)


if __name__ == "__main__":
    main()
