"""`AsyncLLM`: outputs stream as tokens arrive and join to `LLM.generate`'s; a consumer that
leaves aborts its request and its blocks come back; a request that fails fails alone; a step
loop that fails fails every waiting caller (no hang) and the engine reports unhealthy. The
engine runs in its own process (the default); the engine's state is read there
(`engine_hooks`) and faults are injected there."""

from __future__ import annotations

import asyncio

import pytest
from engine_hooks import engine_state, fail_steps, fail_stream_of, restore_streams
from hybrid_cache import SamplingParams
from hybrid_cache.entrypoints.async_llm import AsyncLLM
from hybrid_cache.errors import (
    EngineDeadError,
    EngineOverloadedError,
    InvalidRequestError,
    PromptTooLongError,
    ServerConfigError,
)
from serve_harness import make_llm

PROMPTS = ["the cat sat on the mat", "héllo wörld, naïve café", "numbers 0123 and (symbols)"]


@pytest.fixture(scope="module")
def folder(serve_model_folder):
    return serve_model_folder


@pytest.fixture(scope="module")
def llm(folder):
    return make_llm(folder)


@pytest.fixture(scope="module")
def engine(llm):
    """One engine (process) for the tests that leave it healthy and idle."""
    engine = AsyncLLM(llm)
    yield engine
    engine.shutdown()
    assert engine.snapshot.num_used_blocks_per_group == (0, 0)  # the engine's last word


def run(coroutine, timeout: float = 30.0):
    return asyncio.run(asyncio.wait_for(coroutine, timeout))


async def collect(engine, prompt, params, request_id, stream=True):
    outputs = [o async for o in engine.generate(prompt, params, request_id, stream=stream)]
    return outputs


def joined(outputs, index):
    """Sample `index`'s text, token ids and logprob rows over a request's outputs."""
    text, tokens, rows = "", [], []
    for output in outputs:
        for delta in output.deltas:
            if delta.index == index:
                text += delta.text
                tokens += delta.token_ids
                rows += delta.logprobs or []
    return text, tokens, rows


def test_streamed_outputs_join_to_the_offline_outputs(llm, engine):
    params = [
        SamplingParams(max_tokens=24, temperature=0.9, seed=7, n=2, logprobs=2),
        # The stop strings are pieces of what this request generates unstopped (below).
        SamplingParams(max_tokens=24, temperature=0.8, seed=3, stop=["ab"]),
        SamplingParams(max_tokens=24, temperature=0.0),
    ]
    unstopped = llm.generate(
        PROMPTS[1], SamplingParams(max_tokens=24, temperature=0.8, seed=3), use_tqdm=False
    )
    text = unstopped[0].text
    params[1] = SamplingParams(max_tokens=24, temperature=0.8, seed=3, stop=[text[8:11], "zzzz"])
    offline = llm.generate(PROMPTS, params, use_tqdm=False)

    async def main():
        return await asyncio.gather(
            *[collect(engine, p, sp, f"r{i}") for i, (p, sp) in enumerate(zip(PROMPTS, params))]
        )

    results = run(main())
    for outputs, expected, sp in zip(results, offline, params):
        assert outputs[-1].finished and all(not o.finished for o in outputs[:-1])
        assert len(outputs) > 2  # it streamed: several outputs, not one at the end
        final = outputs[-1].output
        for index, completion in enumerate(expected.outputs):
            text, tokens, rows = joined(outputs, index)
            assert tokens == completion.token_ids == final.outputs[index].token_ids
            assert text == completion.text == final.outputs[index].text
            assert completion.finish_reason == final.outputs[index].finish_reason
            if sp.logprobs is not None:
                assert [row[0][0] for row in rows] == completion.token_ids
                assert [row[1][0] for row in rows] == pytest.approx(
                    [completion.logprobs[i][t].logprob for i, t in enumerate(completion.token_ids)]
                )
    stopped = offline[1].outputs[0]
    assert stopped.finish_reason == "stop" and stopped.stop_reason == params[1].stop[0]


def test_stop_string_text_is_held_back_until_it_cannot_start_a_stop(llm, engine):
    """Nothing sent is ever cut: the text of each output is a prefix of the final text."""
    params = SamplingParams(max_tokens=40, temperature=1.0, seed=11, stop=["zzzz", "q9"])

    async def main():
        return await collect(engine, PROMPTS[2], params, "held")

    outputs = run(main())
    sent = ""
    for output in outputs[:-1]:
        sent += output.deltas[0].text if output.deltas else ""
        assert outputs[-1].output.text.startswith(sent)
    assert joined(outputs, 0)[0] == outputs[-1].output.text


def test_a_stream_interval_sends_fewer_larger_outputs(llm):
    engine = AsyncLLM(llm, stream_interval=4)
    params = SamplingParams(max_tokens=21, temperature=0.0, ignore_eos=True)
    (offline,) = llm.generate(PROMPTS[1], params, use_tqdm=False)
    try:
        outputs = run(collect(engine, PROMPTS[1], params, "interval"))
    finally:
        engine.shutdown()
    sizes = [len(output.deltas[0].token_ids) for output in outputs]
    # The first token, then 4 at a time (a consumer that lags reads several at once: on a
    # loaded machine even all 21 in one output, so the count is not bounded below; the sizes
    # still show the interval whenever more than one output arrives).
    assert 1 <= len(outputs) <= 7 and sum(sizes) == 21
    assert sizes[0] % 4 == 1 and all(size % 4 == 0 for size in sizes[1:-1])
    assert joined(outputs, 0)[:2] == (offline.outputs[0].text, offline.outputs[0].token_ids)


def test_non_streaming_yields_one_output_with_every_token(llm, engine):
    params = SamplingParams(max_tokens=12, temperature=0.9, seed=5, n=2, best_of=3)
    (offline,) = llm.generate(PROMPTS[0], params, use_tqdm=False)
    outputs = run(collect(engine, PROMPTS[0], params, "b", stream=False))
    assert len(outputs) == 1 and outputs[0].finished
    assert [d.token_ids for d in outputs[0].deltas] == [o.token_ids for o in offline.outputs]
    with pytest.raises(InvalidRequestError, match="cannot stream"):
        run(collect(engine, PROMPTS[0], params, "b2"))


def test_a_consumer_that_leaves_aborts_its_request_and_frees_its_blocks(llm, engine):
    params = SamplingParams(max_tokens=200, temperature=0.0, ignore_eos=True)

    async def main():
        seen = 0
        async for _ in engine.generate(PROMPTS[0], params, "leaver"):
            seen += 1
            if seen == 3:
                break  # the generator is closed: the request is aborted
        started = asyncio.Event()

        async def consume():
            async for _ in engine.generate(PROMPTS[1], params, "cancelled"):
                started.set()
                await asyncio.sleep(0.01)  # a slow client

        task = asyncio.ensure_future(consume())
        await started.wait()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        # The engine still serves.
        return await collect(engine, PROMPTS[2], SamplingParams(max_tokens=4), "after")

    outputs = run(main())
    assert outputs[-1].output.outputs[0].finish_reason == "length"
    wait_free(engine)


def wait_free(engine):
    async def idle():
        snapshot = engine.snapshot
        while engine.num_pending_requests or snapshot.num_running or snapshot.num_waiting:
            await asyncio.sleep(0.01)
            snapshot = engine.snapshot
        await asyncio.sleep(0.05)

    run(idle(), 10)
    assert engine.snapshot.num_used_blocks_per_group == (0, 0)
    state = engine.call_engine(engine_state)
    assert state["used_blocks"] == [0, 0] and not state["unfinished"]


def test_bad_requests_fail_alone_before_any_output(llm, engine):
    params = SamplingParams(max_tokens=8, temperature=0.0)

    async def main():
        good = asyncio.ensure_future(collect(engine, PROMPTS[0], params, "good"))
        with pytest.raises(PromptTooLongError):
            await collect(engine, {"prompt_token_ids": [5] * 300}, params, "long")
        with pytest.raises(InvalidRequestError, match="outside the vocabulary"):
            await collect(engine, {"prompt_token_ids": [5, 10**6]}, params, "vocab")
        with pytest.raises(InvalidRequestError, match="already in use"):
            await asyncio.gather(
                collect(engine, PROMPTS[1], params, "same"),
                collect(engine, PROMPTS[2], params, "same"),
            )
        return await good

    outputs = run(main())
    assert outputs[-1].output.outputs[0].finish_reason == "length"
    wait_free(engine)


def test_a_duplicate_id_that_is_refused_does_not_abort_the_first(llm, engine):
    params = SamplingParams(max_tokens=100, temperature=0.0, ignore_eos=True)

    async def main():
        outputs = []
        async for output in engine.generate(PROMPTS[0], params, "dup"):
            outputs.append(output)
            if len(outputs) == 1:  # running now: a second "dup" is refused
                with pytest.raises(InvalidRequestError, match="already in use"):
                    await collect(engine, PROMPTS[1], params, "dup")
        return outputs

    outputs = run(main())
    assert outputs[-1].output.outputs[0].finish_reason == "length"
    assert len(outputs[-1].output.outputs[0].token_ids) == 100


def test_an_error_while_streaming_one_request_fails_it_alone(engine):
    engine.call_engine(fail_stream_of, "bad", 3, "boom in one request")
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)

    async def main():
        good = asyncio.ensure_future(collect(engine, PROMPTS[0], params, "good"))
        with pytest.raises(RuntimeError, match="boom in one request"):
            await collect(engine, PROMPTS[1], params, "bad")
        return await good

    try:
        outputs = run(main())
    finally:
        engine.call_engine(restore_streams)
    assert len(outputs[-1].output.outputs[0].token_ids) == 16
    assert engine.is_healthy
    wait_free(engine)


def test_a_failing_step_fails_every_waiting_caller_and_the_engine_is_unhealthy(llm):
    engine = AsyncLLM(llm.config)  # an engine of its own (never the shared one) to break
    params = SamplingParams(max_tokens=50, temperature=0.0, ignore_eos=True)
    engine.call_engine(fail_steps, 3, "the device fell over")

    async def main():
        return await asyncio.gather(
            *[collect(engine, p, params, f"w{i}") for i, p in enumerate(PROMPTS)],
            return_exceptions=True,
        )

    results = run(main(), 10)
    assert all(isinstance(result, EngineDeadError) for result in results), results
    assert "the device fell over" in str(results[0])
    assert isinstance(results[0].__cause__, RuntimeError)
    assert not engine.is_healthy
    with pytest.raises(EngineDeadError):
        run(collect(engine, PROMPTS[0], params, "later"))
    # The loop gave the blocks back before it stopped (its last snapshot says so).
    assert engine.snapshot.num_used_blocks_per_group == (0, 0)
    assert engine.snapshot.stats.num_steps >= 3
    engine.shutdown()


def test_shutdown_fails_the_waiting_callers(llm):
    engine = AsyncLLM(llm)
    params = SamplingParams(max_tokens=200, temperature=0.0, ignore_eos=True)

    async def main():
        with pytest.raises(EngineDeadError, match="shut down"):
            async for _ in engine.generate(PROMPTS[0], params, "s"):
                engine.shutdown()  # with the request running

    run(main(), 10)
    assert not engine.is_healthy
    assert engine.snapshot.num_used_blocks_per_group == (0, 0)
    assert engine.snapshot.stats.num_steps > 0


def test_past_the_pending_limit_requests_are_refused(llm):
    engine = AsyncLLM(llm, max_pending_requests=2)
    params = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True)

    async def main():
        # A request is pending until its stream has been read to the end or closed.
        first = [await engine.add_request(PROMPTS[i], params, f"p{i}") for i in range(2)]
        with pytest.raises(EngineOverloadedError, match="max-pending-requests"):
            await collect(engine, PROMPTS[2], params, "p2")
        outputs = [output async for output in first[0]]
        assert outputs[-1].finished
        first[1].close()
        # Room again.
        return await collect(engine, PROMPTS[2], params, "p3")

    try:
        assert run(main())[-1].finished
        assert engine.num_pending_requests == 0
    finally:
        engine.shutdown()


@pytest.mark.parametrize("field", ["max_pending_requests", "stream_interval"])
@pytest.mark.parametrize("value", [0, -1, 1.5, True])
def test_bad_engine_limits_are_typed_errors(llm, field, value):
    with pytest.raises(ServerConfigError, match=field.replace("_", "-")):
        AsyncLLM(llm, **{field: value})


def test_requests_posted_with_the_shutdown_are_refused_not_left_waiting(llm):
    engine = AsyncLLM(llm)
    params = SamplingParams(max_tokens=50, ignore_eos=True)

    async def main():
        tasks = [
            asyncio.ensure_future(collect(engine, PROMPTS[0], params, f"late{i}")) for i in range(3)
        ]
        await asyncio.sleep(0)  # the adds are posted, not yet answered
        engine.shutdown()  # posted behind them: each still gets an answer
        return await asyncio.gather(*tasks, return_exceptions=True)

    results = run(main(), 10)
    assert all(isinstance(result, EngineDeadError) for result in results), results
