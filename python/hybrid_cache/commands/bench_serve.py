"""`hybrid-cache bench serve`: load on a running `hybrid-cache serve` over HTTP
(`bench/serving.py`).

    hybrid-cache serve tiny-gemma3 --port 8000 &
    hybrid-cache bench serve --base-url http://127.0.0.1:8000 --num-prompts 200 \\
        --input-len 256 --output-len 64 --max-concurrency 32 --output-json serve.json

The CLI maps `bench serve` to this command (`cli.NESTED_COMMANDS`).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
from pathlib import Path

from hybrid_cache.bench.errors import BenchConfigError
from hybrid_cache.bench.multi_turn import MultiTurnShape
from hybrid_cache.bench.serve_settings import SERVE_WORKLOADS, ServeBenchSettings
from hybrid_cache.entrypoints.server_config import API_KEY_VARIABLE


def register(subparsers: argparse._SubParsersAction) -> None:
    # No `help=`: listed as `bench serve` in `bench`'s help, not as a command of its own.
    parser = subparsers.add_parser(
        "bench-serve",
        prog="hybrid-cache bench serve",
        description="Sends a seeded workload to a running server and prints request and "
        "token throughput and TTFT / TPOT / ITL (mean, median, p99).",
    )
    parser.add_argument("--base-url", required=True, help="the server, e.g. http://127.0.0.1:8000")
    parser.add_argument("--model", help="served model name (default: the server's first)")
    parser.add_argument(
        "--api-key", help=f"Bearer key (default: ${API_KEY_VARIABLE} if set, else none)"
    )
    parser.add_argument(
        "--workload",
        choices=SERVE_WORKLOADS,
        default="random",
        help="random prompts; shared-prefix: their first --prefix-len ids shared; multi-turn: "
        "chat sessions resending their history (--num-sessions, --num-turns, --system-len, "
        "--turn-input-len)",
    )
    parser.add_argument("--num-prompts", type=int, default=100, help="requests (not multi-turn)")
    parser.add_argument("--input-len", type=int, default=256, help="prompt tokens per request")
    parser.add_argument("--output-len", type=int, default=64, help="generated tokens each")
    parser.add_argument("--prefix-len", type=int, default=0, help="shared-prefix: shared ids")
    parser.add_argument("--num-sessions", type=int, default=12, help="multi-turn: sessions")
    parser.add_argument("--num-turns", type=int, default=4, help="multi-turn: turns each")
    parser.add_argument("--system-len", type=int, default=0, help="multi-turn: shared system ids")
    parser.add_argument("--turn-input-len", type=int, help="multi-turn: new user ids a turn")
    parser.add_argument(
        "--request-rate",
        type=float,
        default=float("inf"),
        help="requests started per second, Poisson arrivals (inf: all at once)",
    )
    parser.add_argument(
        "--max-concurrency", type=int, help="most requests in flight (default: no limit)"
    )
    parser.add_argument("--seed", type=int, default=0, help="prompts and arrival times")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds per request")
    parser.add_argument("--output-json", help="write the settings and figures here")
    parser.set_defaults(handler=run)


def settings_from_args(args: argparse.Namespace) -> ServeBenchSettings:
    shape = None
    if args.workload == "multi-turn":
        if args.turn_input_len is None:
            raise BenchConfigError("--workload multi-turn needs --turn-input-len")
        shape = MultiTurnShape(
            num_sessions=args.num_sessions,
            num_turns=args.num_turns,
            system_len=args.system_len,
            turn_input_len=args.turn_input_len,
            output_len=args.output_len,
        )
    elif args.turn_input_len is not None:
        raise BenchConfigError("--turn-input-len belongs to --workload multi-turn")
    settings = ServeBenchSettings(
        base_url=args.base_url.rstrip("/"),
        workload=args.workload,
        num_prompts=args.num_prompts,
        input_len=args.input_len,
        output_len=args.output_len,
        prefix_len=args.prefix_len,
        multi_turn=shape,
        request_rate=args.request_rate,
        max_concurrency=args.max_concurrency,
        model=args.model,
        api_key=args.api_key if args.api_key is not None else os.environ.get(API_KEY_VARIABLE),
        seed=args.seed,
        timeout_s=args.timeout,
    )
    settings.check()
    return settings


def run(args: argparse.Namespace) -> int:
    settings = settings_from_args(args)
    from hybrid_cache.bench.serving import format_results, run_serve_bench

    results = asyncio.run(run_serve_bench(settings))
    print(format_results(results))
    if args.output_json:
        Path(args.output_json).write_text(json.dumps(results, indent=2) + "\n", encoding="utf-8")
    return 1 if results["failed"] else 0
