"""A real server for tests: `create_server` over an `LLM` of the tiny serve model
(`serve_model.py`), uvicorn on a thread of the test process on an ephemeral 127.0.0.1 port.
Tests read the engine's state where it runs (`engine_hooks.engine_state`) after the server
is idle."""

from __future__ import annotations

import contextlib
import re
import time
from collections.abc import Iterator
from typing import Any, Optional

from engine_hooks import engine_state, set_step_delay
from hybrid_cache import LLM
from hybrid_cache.entrypoints.api_server import (
    Server,
    ServerSettings,
    create_server,
    serve_in_thread,
)

MODEL_NAME = "tiny-serve"
# Small, so tests see chunked prefill, a shared pool and prefix-cache hits.
ENGINE = dict(
    kv_cache_memory="2MiB",
    max_model_len=256,
    block_size=16,
    max_num_seqs=16,
    max_num_batched_tokens=128,
)


def make_llm(folder: str, **overrides: Any) -> LLM:
    return LLM(folder, **{**ENGINE, **overrides})


@contextlib.contextmanager
def running_server(
    llm: LLM, settings: Optional[ServerSettings] = None, **kwargs: Any
) -> Iterator[tuple[str, Server]]:
    """(base URL, server) while the block runs; the engine is shut down after."""
    server = create_server(llm, [MODEL_NAME], settings=settings, **kwargs)
    running = serve_in_thread(server.app)
    try:
        yield running.base_url, server
    finally:
        running.stop()
        server.shutdown()


@contextlib.contextmanager
def slow_steps(server: Server, seconds: float = 0.01) -> Iterator[None]:
    """Each engine step takes at least `seconds` (a request stays running long enough to be
    looked at while it runs)."""
    server.engine.call_engine(set_step_delay, seconds)
    try:
        yield
    finally:
        if server.engine.is_healthy:
            server.engine.call_engine(set_step_delay, 0.0)


def state_of(server: Server) -> dict[str, Any]:
    """The engine's blocks and requests, read where it runs."""
    return server.engine.call_engine(engine_state)


def wait_idle(server: Server, timeout: float = 10.0) -> None:
    """Until no request is pending in the async engine and none is queued or running."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        snapshot = server.engine.snapshot
        if (
            server.engine.num_pending_requests == 0
            and snapshot.num_running == 0
            and snapshot.num_waiting == 0
        ):
            return
        time.sleep(0.02)
    raise AssertionError(f"the server is not idle: {server.engine.snapshot}")


def metric(text: str, name: str, default: Optional[float] = None, **labels: str) -> float:
    """One sample of a Prometheus text page (labels matched as given, others ignored; summed
    over the samples that match); `default` when none does, else `KeyError`."""
    total = None
    for line in text.splitlines():
        if line.startswith("#"):
            continue
        match = re.match(r"([^{\s]+)(?:\{([^}]*)\})?\s+(\S+)", line)
        if not match or match.group(1) != name:
            continue
        found = dict(re.findall(r'(\w+)="([^"]*)"', match.group(2) or ""))
        if all(found.get(key) == value for key, value in labels.items()):
            total = (total or 0.0) + float(match.group(3))
    if total is None and default is not None:
        return default
    if total is None:
        raise KeyError(f"{name} {labels} is not on the metrics page")
    return total
