"""The OpenAI-compatible HTTP server: a FastAPI app over one `AsyncLLM`, run by uvicorn.

Routes: `POST /v1/completions`, `POST /v1/chat/completions` (`stream: true` as server-sent
events), `GET /v1/models`, `GET /health` (200, or 503 once the engine loop has died),
`GET /version`, `GET /metrics` (Prometheus). With an API key every route but `/health` needs
`Authorization: Bearer <key>`. A body over `max_request_bytes` is refused (413) before it is
read whole. Every error is an OpenAI-style body (`errors.py`).

`serve_in_thread` runs the server on a background thread of this process (tests, benchmarks);
`hybrid-cache serve` runs it in the foreground.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import socket
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Callable, Optional, Union

import uvicorn
from fastapi import FastAPI, Request
from fastapi.exceptions import StarletteHTTPException
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ValidationError

from hybrid_cache._core import __version__
from hybrid_cache.engine.engine_config import EngineConfig
from hybrid_cache.engine.llm import LLM
from hybrid_cache.engine.prompts import resolve_chat_template
from hybrid_cache.entrypoints.async_llm import AsyncLLM
from hybrid_cache.entrypoints.chat import create_chat_completion
from hybrid_cache.entrypoints.completions import create_completion
from hybrid_cache.entrypoints.errors import error_body, error_of
from hybrid_cache.entrypoints.metrics import ServerMetrics
from hybrid_cache.entrypoints.protocol import ChatCompletionRequest, CompletionRequest
from hybrid_cache.entrypoints.server_config import (
    DEFAULT_ENGINE_PROCESS,
    DEFAULT_MAX_PENDING_REQUESTS,
    DEFAULT_MAX_REQUEST_BYTES,
    DEFAULT_STREAM_INTERVAL,
)
from hybrid_cache.entrypoints.serving import ServingContext
from hybrid_cache.errors import (
    AuthenticationError,
    EngineDeadError,
    HybridCacheError,
    InvalidFieldError,
    RequestBodyTooLargeError,
)

logger = logging.getLogger(__name__)

OPEN_ROUTES = frozenset({"/health"})


@dataclass
class ServerSettings:
    """What the app checks on every request."""

    api_key: Optional[str] = None
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES


@dataclass
class Server:
    """An engine and the app serving it (`create_server`)."""

    app: FastAPI
    engine: AsyncLLM
    context: ServingContext
    metrics: ServerMetrics

    def shutdown(self) -> None:
        self.engine.shutdown()


def create_server(
    llm: Union[LLM, EngineConfig],
    served_model_names: Sequence[str] = (),
    chat_template: Optional[str] = None,
    settings: Optional[ServerSettings] = None,
    max_pending_requests: int = DEFAULT_MAX_PENDING_REQUESTS,
    stream_interval: int = DEFAULT_STREAM_INTERVAL,
    engine_process: bool = DEFAULT_ENGINE_PROCESS,
) -> Server:
    """Starts an `AsyncLLM` over `llm` (an `EngineConfig`, or a built `LLM`: see `AsyncLLM`)
    and builds its app. The served name is the model's path or preset name unless
    `served_model_names` are given (the first is reported in the metrics); a `chat_template`
    (a template or a file) replaces the tokenizer's."""
    settings = settings or ServerSettings()
    engine = AsyncLLM(
        llm, max_pending_requests, None, stream_interval, engine_process=engine_process
    )
    info = engine.info
    names = tuple(served_model_names) or (info.model_root,)
    if chat_template is not None and engine.tokenizer is not None:
        chat_template = resolve_chat_template(engine.tokenizer, chat_template)
    metrics = ServerMetrics(
        lambda: engine.snapshot,
        info.group_kinds,
        info.num_usable_blocks,
        names[0],
        healthy=lambda: engine.is_healthy,
    )
    engine.listener = metrics
    context = ServingContext(
        engine, names, info.model_root, chat_template, dict(info.generation_sampling)
    )
    return Server(build_app(context, metrics, settings), engine, context, metrics)


def build_app(context: ServingContext, metrics: ServerMetrics, settings: ServerSettings) -> FastAPI:
    """The FastAPI app of one engine (see the module)."""
    app = FastAPI(title="hybrid-cache", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.context = context
    app.state.metrics = metrics

    def error_response(error: BaseException) -> JSONResponse:
        status, body = error_of(error)
        metrics.count_error(status)
        if status == 500:
            logger.error("request failed", exc_info=error)
        return JSONResponse(body, status_code=status)

    @app.exception_handler(HybridCacheError)
    async def on_typed_error(request: Request, error: HybridCacheError) -> JSONResponse:
        return error_response(error)

    @app.exception_handler(Exception)
    async def on_error(request: Request, error: Exception) -> JSONResponse:
        return error_response(error)

    @app.exception_handler(StarletteHTTPException)
    async def on_http_error(request: Request, error: StarletteHTTPException) -> JSONResponse:
        metrics.count_error(error.status_code)
        code = {404: "not_found", 405: "method_not_allowed"}.get(error.status_code)
        message = f"{request.method} {request.url.path}: {error.detail}"
        return JSONResponse(
            error_body(message, "invalid_request_error", None, code),
            status_code=error.status_code,
        )

    if settings.api_key:
        app.add_middleware(ApiKeyMiddleware, api_key=settings.api_key, on_error=error_response)

    @app.get("/health")
    async def health() -> Response:
        if not context.engine.is_healthy:
            dead = context.engine.dead_error or EngineDeadError("the engine is not running")
            return error_response(dead)
        return Response(status_code=200)

    @app.get("/version")
    async def version() -> dict[str, str]:
        return {"version": __version__}

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {
            "object": "list",
            "data": [
                {
                    "id": name,
                    "object": "model",
                    "created": context.created,
                    "owned_by": "hybrid-cache",
                    "root": context.model_root,
                    "max_model_len": context.max_model_len,
                    "vocab_size": context.vocab_size,
                }
                for name in context.model_names
            ],
        }

    @app.get("/metrics")
    async def metrics_route() -> Response:
        return Response(metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        body = await read_body(request, CompletionRequest, settings.max_request_bytes)
        result = await create_completion(context, body, disconnect_waiter(request))
        return respond(result)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        body = await read_body(request, ChatCompletionRequest, settings.max_request_bytes)
        result = await create_chat_completion(context, body, disconnect_waiter(request))
        return respond(result)

    return app


class ApiKeyMiddleware:
    """Refuses (401) every HTTP request but `/health` without `Authorization: Bearer <key>`."""

    def __init__(self, app: Any, api_key: str, on_error: Callable[[BaseException], Any]):
        self.app = app
        self.expected = f"Bearer {api_key}".encode()
        self.on_error = on_error

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "http" and scope["path"] not in OPEN_ROUTES:
            given = next(
                (value for name, value in scope["headers"] if name == b"authorization"), b""
            )
            if not hmac.compare_digest(given, self.expected):
                response = self.on_error(
                    AuthenticationError(
                        "missing or wrong API key: send the header 'Authorization: Bearer <key>'"
                    )
                )
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)


def respond(result: Any) -> Response:
    if isinstance(result, dict):
        return Response(
            json.dumps(result, ensure_ascii=False, separators=(",", ":")),
            media_type="application/json",
        )
    return StreamingResponse(result, media_type="text/event-stream")


async def read_body(request: Request, model: type[BaseModel], limit: int) -> Any:
    """The body parsed into `model`: `RequestBodyTooLargeError` over `limit` bytes (before
    reading past it), `InvalidFieldError` (naming the field) for bad JSON or a bad field."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise RequestBodyTooLargeError(
            f"the request body has {declared} bytes, over this server's limit of {limit} "
            "(--max-request-bytes)"
        )
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise RequestBodyTooLargeError(
                f"the request body is over this server's limit of {limit} bytes "
                "(--max-request-bytes)"
            )
        chunks.append(chunk)
    try:
        return model.model_validate_json(b"".join(chunks))
    except ValidationError as error:
        raise invalid_field(error) from None


def invalid_field(error: ValidationError) -> InvalidFieldError:
    """The first problem pydantic found, as an error naming its field."""
    first = error.errors(include_url=False)[0]
    location = [str(part) for part in first.get("loc", ())]
    kind = first.get("type", "")
    if kind == "json_invalid":
        return InvalidFieldError(f"the body is not valid JSON: {first.get('msg')}")
    if kind == "model_type" and not location:
        return InvalidFieldError("the body must be a JSON object")
    # A union's members appear in the location ("prompt.str"): keep the field's own path.
    path = ".".join(part for part in location if not _is_union_member(part))
    message = first.get("msg", "invalid value")
    if kind == "extra_forbidden":
        message = "unknown field (this server does not take it)"
    count = error.error_count()
    more = f" (and {count - 1} more problem{'s' if count > 2 else ''})" if count > 1 else ""
    return InvalidFieldError(f"{path or 'body'}: {message}{more}", path or None)


def _is_union_member(part: str) -> bool:
    return part in ("str", "int", "float", "bool", "dict", "list") or "[" in part


def disconnect_waiter(request: Request) -> Callable[[], Any]:
    """A coroutine function that returns once the client has disconnected (the body has been
    read, so the next ASGI message can only be the disconnect)."""

    async def wait() -> None:
        while True:
            message = await request.receive()
            if message["type"] == "http.disconnect":
                return

    return wait


@dataclass
class RunningServer:
    """A server on a background thread (`serve_in_thread`)."""

    server: uvicorn.Server
    thread: threading.Thread
    host: str
    port: int

    @property
    def base_url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def stop(self, timeout: float = 10.0) -> None:
        self.server.should_exit = True
        self.thread.join(timeout)


def uvicorn_config(app: FastAPI, host: str, port: int, log_level: str = "warning") -> Any:
    return uvicorn.Config(
        app,
        host=host,
        port=port,
        log_level=log_level,
        access_log=False,
        loop="auto",
        http="auto",
        lifespan="off",
        timeout_graceful_shutdown=5,
    )


def serve_in_thread(app: FastAPI, host: str = "127.0.0.1", port: int = 0) -> RunningServer:
    """Starts uvicorn on a thread of this process (port 0: an ephemeral port); returns once it
    accepts connections."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    server = uvicorn.Server(uvicorn_config(app, host, sock.getsockname()[1]))
    thread = threading.Thread(
        target=lambda: asyncio.run(server.serve(sockets=[sock])), name="uvicorn", daemon=True
    )
    thread.start()
    while not server.started:
        if not thread.is_alive():
            raise RuntimeError("the server thread ended before it started")
        thread.join(0.01)
    return RunningServer(server, thread, host, sock.getsockname()[1])
