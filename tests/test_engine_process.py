"""The engine process behind `AsyncLLM` and `hybrid-cache serve`: the same outputs as the
engine on a thread; an abort across the process boundary returns every block (as the
snapshots shipped from the engine say); a killed engine process fails every waiting caller
and turns `/health` unhealthy within a bounded time; no engine process outlives `shutdown`,
or `serve` stopped by SIGINT / SIGTERM, or killed."""

from __future__ import annotations

import asyncio
import os
import signal
import time

import httpx
import pytest
from engine_hooks import engine_state, set_step_delay
from hybrid_cache import SamplingParams
from hybrid_cache.engine.engine_config import EngineConfig
from hybrid_cache.entrypoints.async_llm import AsyncLLM
from hybrid_cache.errors import BudgetTooSmallError, EngineDeadError
from serve_harness import ENGINE, MODEL_NAME, metric, running_server
from test_serve_cli import start_serve

PROMPTS = ["the cat sat on the mat", "héllo wörld, naïve café", "numbers 0123 and (symbols)"]
# How long a dead engine process may take to reach every waiting caller.
DEATH_BOUND_S = 5.0


@pytest.fixture(scope="module")
def config(serve_model_folder):
    return EngineConfig.of(serve_model_folder, **ENGINE)


def run(coroutine, timeout: float = 30.0):
    return asyncio.run(asyncio.wait_for(coroutine, timeout))


def is_gone(pid: int) -> bool:
    """The process has exited (reaped, or a zombie nobody reaped yet)."""
    try:
        with open(f"/proc/{pid}/stat") as file:
            return file.read().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


def wait_gone(pid: int, timeout: float = 15.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if is_gone(pid):
            return True
        time.sleep(0.05)
    return False


async def everything(engine, prompt, params, request_id):
    """Per sample (text, token ids, logprob rows) over the request's outputs, and the final
    `RequestOutput`."""
    samples: dict[int, list] = {}
    final = None
    async for output in engine.generate(prompt, params, request_id):
        for delta in output.deltas:
            text, tokens, rows = samples.setdefault(delta.index, ["", [], []])
            samples[delta.index] = [text + delta.text, tokens + delta.token_ids, rows]
            rows += delta.logprobs or []
        final = output.output
    return samples, final


async def run_all(engine, params):
    return await asyncio.gather(
        *[
            everything(engine, prompt, sp, f"r{i}")
            for i, (prompt, sp) in enumerate(zip(PROMPTS, params))
        ]
    )


def test_the_engine_process_gives_the_outputs_of_the_engine_on_a_thread(config):
    params = [
        SamplingParams(max_tokens=20, temperature=0.9, seed=7, n=2, logprobs=2),
        SamplingParams(max_tokens=20, temperature=0.8, seed=3, stop=["e", "zz"]),
        SamplingParams(max_tokens=20, temperature=0.0, prompt_logprobs=1),
    ]
    results = {}
    for engine_process in (True, False):
        engine = AsyncLLM(config, engine_process=engine_process)
        try:
            assert (engine.engine_pid is not None) == engine_process

            results[engine_process] = run(run_all(engine, params))
        finally:
            engine.shutdown()
    # Tokens and text are equal; logprobs to float precision (the two engines may batch the
    # requests differently: the arrival order is the same, the steps they land in may not).
    for (samples, final), (thread_samples, thread_final) in zip(results[True], results[False]):
        assert samples.keys() == thread_samples.keys()
        for (text, tokens, rows), (thread_text, thread_tokens, thread_rows) in zip(
            samples.values(), thread_samples.values()
        ):
            assert (text, tokens) == (thread_text, thread_tokens)
            assert [row[0] for row in rows] == [row[0] for row in thread_rows]
            assert [row[1] for row in rows] == [pytest.approx(row[1]) for row in thread_rows]
        assert [o.token_ids for o in final.outputs] == [o.token_ids for o in thread_final.outputs]
        assert [o.text for o in final.outputs] == [o.text for o in thread_final.outputs]
        assert [o.finish_reason for o in final.outputs] == [
            o.finish_reason for o in thread_final.outputs
        ]
        assert final.prompt_token_ids == thread_final.prompt_token_ids
        assert (final.prompt_logprobs is None) == (thread_final.prompt_logprobs is None)
        for sample, output in zip(samples.values(), final.outputs):
            assert sample[0] == output.text and sample[1] == output.token_ids
    assert results[True][1][1].outputs[0].finish_reason == "stop"  # the stop string mattered


def test_an_abort_across_the_process_boundary_returns_every_block(config):
    engine = AsyncLLM(config)
    long = SamplingParams(max_tokens=200, temperature=0.0, ignore_eos=True)
    try:
        engine.call_engine(set_step_delay, 0.005)

        async def main():
            streams = [await engine.add_request(p, long, f"a{i}") for i, p in enumerate(PROMPTS)]
            firsts = [await stream.__anext__() for stream in streams]
            assert all(first.deltas for first in firsts)
            running = engine.snapshot  # shipped from the engine after a step
            await engine.abort("a0")  # by id
            streams[1].close()  # a consumer that leaves
            task = asyncio.ensure_future(streams[2].__anext__())
            await asyncio.sleep(0.02)
            task.cancel()  # a cancelled read
            rest = [output async for output in streams[0]]
            assert rest[-1].finished and rest[-1].output.outputs[0].finish_reason == "abort"
            for _ in range(500):
                snapshot = engine.snapshot
                if not snapshot.num_running and not snapshot.num_waiting:
                    break
                await asyncio.sleep(0.01)
            return running

        running = run(main())
        assert running.num_running == 3 and sum(running.num_used_blocks_per_group) > 0
        snapshot = engine.snapshot
        assert snapshot.num_used_blocks_per_group == (0, 0)
        assert snapshot.num_free_blocks == engine.info.num_usable_blocks
        assert engine.num_pending_requests == 0
        state = engine.call_engine(engine_state)
        assert state["used_blocks"] == [0, 0] and not state["unfinished"]
        with pytest.raises(AttributeError, match="no_such"):  # raised there, raised here
            engine.call_engine(getattr, "no_such_attribute")
    finally:
        engine.shutdown()


def test_a_killed_engine_process_fails_every_waiting_caller(config):
    engine = AsyncLLM(config)
    params = SamplingParams(max_tokens=200, temperature=0.0, ignore_eos=True)
    engine.call_engine(set_step_delay, 0.01)

    async def main():
        streams = [await engine.add_request(p, params, f"k{i}") for i, p in enumerate(PROMPTS)]
        await streams[0].__anext__()  # running
        pending = asyncio.ensure_future(engine.add_request(PROMPTS[0], params, "late"))
        os.kill(engine.engine_pid, signal.SIGKILL)
        start = time.monotonic()
        results = await asyncio.gather(
            *[consume(stream) for stream in streams], pending, return_exceptions=True
        )
        return results, time.monotonic() - start

    async def consume(stream):
        return [output async for output in stream]

    try:
        results, took = run(main(), 30)
        assert took < DEATH_BOUND_S
        # The late add raced the kill: refused as dead, or queued and then failed.
        late = results.pop()
        if not isinstance(late, EngineDeadError):  # queued before the kill: its stream fails
            with pytest.raises(EngineDeadError):
                run(consume(late), DEATH_BOUND_S)
        assert all(isinstance(result, EngineDeadError) for result in results), results
        assert "died" in str(results[0]) and "-9" in str(results[0])
        assert not engine.is_healthy
        with pytest.raises(EngineDeadError, match="died"):
            run(engine.add_request(PROMPTS[0], params, "after"))
    finally:
        engine.shutdown()
    assert wait_gone(engine.engine_pid)


def test_a_killed_engine_process_turns_health_unhealthy(config):
    with running_server(config) as (url, server):
        assert httpx.get(url + "/health").status_code == 200
        os.kill(server.engine.engine_pid, signal.SIGKILL)
        deadline = time.monotonic() + DEATH_BOUND_S
        while httpx.get(url + "/health").status_code == 200:
            assert time.monotonic() < deadline, "/health still says healthy"
            time.sleep(0.05)
        response = httpx.get(url + "/health")
        assert response.status_code == 503
        assert response.json()["error"]["code"] == "engine_unhealthy"
        body = {"model": MODEL_NAME, "prompt": [5, 6, 7], "max_tokens": 3}
        response = httpx.post(url + "/v1/completions", json=body)
        assert response.status_code == 503 and "died" in response.json()["error"]["message"]
        assert metric(httpx.get(url + "/metrics").text, "hybrid_cache:healthy") == 0


def test_a_build_that_fails_in_the_engine_process_raises_its_typed_error(config):
    with pytest.raises(BudgetTooSmallError, match="kv-cache-memory|at least"):
        AsyncLLM(EngineConfig.of(config, kv_cache_memory="1KiB"))


def test_shutdown_leaves_no_engine_process(config):
    engine = AsyncLLM(config)
    pid = engine.engine_pid
    assert not is_gone(pid)
    engine.shutdown()
    assert is_gone(pid)  # stopped and reaped before shutdown returned
    assert not engine.is_healthy


def engine_children(pid: int) -> list[int]:
    """The engine processes `serve` (process `pid`) started."""
    found = []
    for task in os.listdir(f"/proc/{pid}/task"):
        with open(f"/proc/{pid}/task/{task}/children") as file:
            for child in file.read().split():
                with open(f"/proc/{child}/cmdline", "rb") as cmdline:
                    if b"resource_tracker" not in cmdline.read():
                        found.append(int(child))
    return found


@pytest.mark.parametrize("stop", [signal.SIGINT, signal.SIGTERM, signal.SIGKILL])
def test_no_engine_process_outlives_serve(stop):
    process, url = start_serve(
        ["tiny-gemma3", "--kv-cache-memory", "4MiB", "--max-model-len", "128",
         "--num-threads", "1", "--log-level", "warning"]
    )  # fmt: skip
    try:
        (engine_pid,) = engine_children(process.pid)
        body = {"model": "tiny-gemma3", "prompt": [5, 6, 7], "max_tokens": 3}
        assert httpx.post(url + "/v1/completions", json=body).status_code == 200
    finally:
        process.send_signal(stop)
        output = process.communicate(timeout=30)[0]
    if stop != signal.SIGKILL:
        assert process.returncode == 0, output
    assert wait_gone(engine_pid), f"the engine process {engine_pid} survived {stop.name}"
