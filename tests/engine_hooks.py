"""What tests run where the engine runs, through `AsyncLLM.call_engine` (the engine process
imports this module from the tests' folder, which is on its path): the engine's own state to
assert on, and faults to inject into its step loop."""

from __future__ import annotations

import time
from typing import Any

from hybrid_cache.entrypoints import streaming

ORIGINAL_DELTA = streaming.SampleStream.delta


def engine_state(llm: Any) -> dict[str, Any]:
    """Blocks in use and free, and the requests the engine still holds."""
    engine = llm.engine
    return {
        "used_blocks": engine.kv_cache.num_used_blocks_per_group(),
        "free_blocks": engine.kv_cache.num_free_blocks,
        "num_blocks": engine.kv_cache.num_blocks,
        "unfinished": sorted(engine.unfinished_request_ids),
        "has_unfinished": engine.has_unfinished_requests(),
    }


def _runner_original(llm: Any) -> Any:
    runner = llm.engine.model_runner
    if "execute" in vars(runner):  # a hook is installed: the class's method is the original
        return type(runner).execute.__get__(runner)
    return runner.execute


def set_step_delay(llm: Any, seconds: float) -> None:
    """Each step takes at least `seconds` from now on (0: as fast as it goes again)."""
    runner = llm.engine.model_runner
    execute = _runner_original(llm)
    if seconds <= 0:
        vars(runner).pop("execute", None)
        return

    def slow(output: Any) -> Any:
        time.sleep(seconds)
        return execute(output)

    runner.execute = slow


def fail_steps(llm: Any, after: int, message: str) -> None:
    """The step after the next `after` ones raises `RuntimeError(message)`."""
    runner = llm.engine.model_runner
    execute = _runner_original(llm)
    calls = []

    def failing(output: Any) -> Any:
        calls.append(1)
        if len(calls) > after:
            raise RuntimeError(message)
        return execute(output)

    runner.execute = failing


def fail_stream_of(llm: Any, request_id: str, after_tokens: int, message: str) -> None:
    """Streaming request `request_id`'s outputs raises `RuntimeError(message)` once it has
    `after_tokens` tokens (until `restore_streams`)."""

    def delta(self: Any, request: Any) -> Any:
        if request.request_id == request_id and len(request.output_token_ids) >= after_tokens:
            raise RuntimeError(message)
        return ORIGINAL_DELTA(self, request)

    streaming.SampleStream.delta = delta


def restore_streams(llm: Any) -> None:
    streaming.SampleStream.delta = ORIGINAL_DELTA
