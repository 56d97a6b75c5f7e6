"""`hybrid-cache serve MODEL`: the OpenAI-compatible HTTP server (`entrypoints/api_server.py`).

    hybrid-cache serve path/to/hf-folder --port 8000 --api-key secret
    curl localhost:8000/v1/completions -H 'Authorization: Bearer secret' \\
        -H 'Content-Type: application/json' -d '{"model": "path/to/hf-folder", "prompt": "Hi"}'

MODEL is the engine's `--model` (a folder, or a preset: random weights, no tokenizer, so token
id prompts only); the engine flags are `generate`'s. Every flag is checked before the model
loads. The engine runs in a process of its own (`--no-engine-process`: on a thread of the
server's); the server runs until interrupted (Ctrl-C, SIGTERM), then stops the engine.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
from typing import Optional

from hybrid_cache.engine.engine_config import add_engine_arguments, engine_config_from_args
from hybrid_cache.entrypoints.server_config import (
    API_KEY_VARIABLE,
    DEFAULT_ENGINE_PROCESS,
    DEFAULT_HOST,
    DEFAULT_MAX_PENDING_REQUESTS,
    DEFAULT_MAX_REQUEST_BYTES,
    DEFAULT_PORT,
    DEFAULT_STREAM_INTERVAL,
)
from hybrid_cache.errors import ServerConfigError
from hybrid_cache.sizes import format_memory_size, parse_memory_size

LOG_LEVELS = ("critical", "error", "warning", "info", "debug")


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "serve",
        help="serve a model over an OpenAI-compatible HTTP API (completions, chat, streaming)",
        description="Runs the engine behind /v1/completions, /v1/chat/completions, "
        "/v1/models, /health, /version and /metrics until interrupted.",
    )
    parser.add_argument(
        "model_tag",
        nargs="?",
        metavar="MODEL",
        help="model folder with config.json, or preset (the same as --model)",
    )
    add_engine_arguments(
        parser, model=None, help_texts={"model": "the model, when MODEL is not given"}
    )
    parser.add_argument("--host", default=DEFAULT_HOST, help="address to listen on")
    parser.add_argument("--port", type=int, default=DEFAULT_PORT, help="port (0: any free one)")
    parser.add_argument(
        "--api-key",
        help=f"require 'Authorization: Bearer KEY' on every route but /health (default: "
        f"${API_KEY_VARIABLE} if set, else none)",
    )
    parser.add_argument(
        "--served-model-name",
        action="append",
        default=[],
        help="the model name requests give (repeat for aliases; default: MODEL as given)",
    )
    parser.add_argument(
        "--chat-template",
        help="a Jinja chat template, or a file holding one (default: the tokenizer's)",
    )
    parser.add_argument(
        "--max-request-bytes",
        default=format_memory_size(DEFAULT_MAX_REQUEST_BYTES),
        help="largest request body accepted, bytes or e.g. 64KiB (larger: HTTP 413)",
    )
    parser.add_argument(
        "--max-pending-requests",
        type=int,
        default=DEFAULT_MAX_PENDING_REQUESTS,
        help="requests queued or running before new ones get HTTP 503",
    )
    parser.add_argument(
        "--stream-interval",
        type=int,
        default=DEFAULT_STREAM_INTERVAL,
        help="tokens a stream gathers per chunk (the first goes at once); more: fewer chunks",
    )
    parser.add_argument(
        "--engine-process",
        action=argparse.BooleanOptionalAction,
        default=DEFAULT_ENGINE_PROCESS,
        help="run the engine in a process of its own (--no-engine-process: on a thread of "
        "the server's process, sharing its interpreter lock)",
    )
    parser.add_argument(
        "--num-threads", type=int, help="torch CPU threads of the engine (default: torch's)"
    )
    parser.add_argument("--log-level", choices=LOG_LEVELS, default="info", help="log level")
    parser.set_defaults(handler=run)


def model_of(args: argparse.Namespace) -> str:
    if args.model_tag and args.model and args.model_tag != args.model:
        raise ServerConfigError(
            f"MODEL {args.model_tag!r} and --model {args.model!r} differ: give one of them"
        )
    model: Optional[str] = args.model_tag or args.model
    if not model:
        raise ServerConfigError("give the model: hybrid-cache serve MODEL (a folder or preset)")
    return model


def check_flags(args: argparse.Namespace) -> int:
    """Checks the server's own flags; returns the body limit in bytes."""
    if not 0 <= args.port <= 65535:
        raise ServerConfigError(f"--port must be in [0, 65535], got {args.port}")
    if args.max_pending_requests <= 0:
        raise ServerConfigError(
            f"--max-pending-requests must be positive, got {args.max_pending_requests}"
        )
    if args.stream_interval <= 0:
        raise ServerConfigError(f"--stream-interval must be positive, got {args.stream_interval}")
    if args.num_threads is not None and args.num_threads <= 0:
        raise ServerConfigError(f"--num-threads must be positive, got {args.num_threads}")
    try:
        limit = parse_memory_size(args.max_request_bytes)
    except ValueError as error:
        raise ServerConfigError(f"--max-request-bytes: {error}") from error
    if limit <= 0:
        raise ServerConfigError(
            f"--max-request-bytes must be positive, got {args.max_request_bytes}"
        )
    if args.served_model_name and any(not name for name in args.served_model_name):
        raise ServerConfigError("--served-model-name must not be empty")
    return limit


def run(args: argparse.Namespace) -> int:
    model = model_of(args)
    limit = check_flags(args)
    config = engine_config_from_args(args, model=model)
    api_key = args.api_key if args.api_key is not None else os.environ.get(API_KEY_VARIABLE)

    import torch
    import uvicorn

    from hybrid_cache.entrypoints.api_server import ServerSettings, create_server, uvicorn_config

    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    if args.num_threads is not None:
        torch.set_num_threads(args.num_threads)
    settings = ServerSettings(api_key=api_key or None, max_request_bytes=limit)
    server = create_server(
        config,
        args.served_model_name,
        args.chat_template,
        settings,
        args.max_pending_requests,
        args.stream_interval,
        engine_process=args.engine_process,
    )
    names = ", ".join(server.context.model_names)
    logging.getLogger(__name__).info(
        "serving %s on http://%s:%d (body limit %s%s)",
        names,
        args.host,
        args.port,
        format_memory_size(limit),
        ", API key required" if api_key else "",
    )
    # uvicorn shuts down gracefully on SIGINT / SIGTERM, then raises the signal again: here
    # both end in KeyboardInterrupt, so the engine (process) is stopped before exiting.
    signal.signal(signal.SIGTERM, _interrupt)
    try:
        uvicorn.Server(uvicorn_config(server.app, args.host, args.port, args.log_level)).run()
    except KeyboardInterrupt:  # uvicorn shut down gracefully, then passes the signal on
        pass
    finally:
        server.shutdown()
    return 0


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt
