"""A bounded load test on loopback: 64 concurrent streaming clients, a quarter of them
disconnecting mid-stream, non-streaming clients that give up, malformed bodies. Afterwards
every block is free, nothing runs, the server still answers, and `/metrics` agrees with what
the clients saw."""

from __future__ import annotations

import asyncio
import json
import random

import httpx
import pytest
from serve_harness import MODEL_NAME, make_llm, metric, running_server, state_of, wait_idle

NUM_STREAMS = 64
NUM_LEAVERS = NUM_STREAMS // 4
NUM_IMPATIENT = 4
NUM_MALFORMED = 8
MAX_TOKENS = 24


@pytest.fixture(scope="module")
def server(serve_model_folder):
    folder = serve_model_folder
    with running_server(make_llm(folder)) as (url, running):
        yield url, running


def prompt_of(index: int) -> list[int]:
    generator = random.Random(index)
    # Half share a 32-token prefix (prefix-cache hits under load).
    shared = [7 + i for i in range(32)] if index % 2 else []
    # At most 55 tokens: with 200 to generate, within the 256 of `max_model_len`.
    return shared + [generator.randrange(3, 300) for _ in range(8 + index % 16)]


async def stream_client(client: httpx.AsyncClient, index: int, leave_after: int) -> dict:
    """Reads the stream; with `leave_after`, closes the connection after that many chunks."""
    body = {
        "model": MODEL_NAME,
        "prompt": prompt_of(index),
        "max_tokens": 200 if leave_after else MAX_TOKENS,
        "temperature": 0.8,
        "seed": index,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
        "return_token_ids": True,
    }
    seen = {"tokens": 0, "usage": None, "done": False, "chunks": 0}
    async with client.stream("POST", "/v1/completions", json=body) as response:
        assert response.status_code == 200
        async for line in response.aiter_lines():
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                seen["done"] = True
                break
            chunk = json.loads(line[6:])
            assert "error" not in chunk, chunk
            seen["chunks"] += 1
            seen["tokens"] += sum(len(c["token_ids"]) for c in chunk["choices"])
            if chunk.get("usage"):
                seen["usage"] = chunk["usage"]
            if leave_after and seen["chunks"] == leave_after:
                break  # leaving the block closes the connection mid-stream
    return seen


async def impatient_client(client: httpx.AsyncClient, index: int) -> bool:
    """A non-streaming request given up after a moment; True when it still completed."""
    body = {"model": MODEL_NAME, "prompt": prompt_of(index), "max_tokens": 200, "ignore_eos": True}
    try:
        response = await client.post("/v1/completions", json=body, timeout=0.05)
    except httpx.TimeoutException:
        return False
    assert response.status_code == 200
    return True


async def malformed_client(client: httpx.AsyncClient, index: int) -> int:
    bodies = ['{"model":', '{"model": "tiny-serve", "prompt": 5}', "[]", '{"prompt": "x"}']
    response = await client.post("/v1/completions", content=bodies[index % len(bodies)])
    assert "error" in response.json()
    return response.status_code


def test_load_with_disconnects_and_malformed_bodies(server):
    url, running = server

    async def load():
        limits = httpx.Limits(max_connections=200)
        async with httpx.AsyncClient(base_url=url, limits=limits, timeout=60) as client:
            streams = [
                stream_client(client, i, leave_after=3 if i < NUM_LEAVERS else 0)
                for i in range(NUM_STREAMS)
            ]
            impatient = [impatient_client(client, NUM_STREAMS + i) for i in range(NUM_IMPATIENT)]
            malformed = [malformed_client(client, i) for i in range(NUM_MALFORMED)]
            return await asyncio.gather(
                asyncio.gather(*streams), asyncio.gather(*impatient), asyncio.gather(*malformed)
            )

    streams, impatient, malformed = asyncio.run(asyncio.wait_for(load(), 60))
    assert malformed == [400] * NUM_MALFORMED
    finished = streams[NUM_LEAVERS:]
    assert all(s["done"] and s["tokens"] == MAX_TOKENS for s in finished)
    assert all(s["usage"]["completion_tokens"] == MAX_TOKENS for s in finished)
    assert all(not s["done"] and s["tokens"] >= 3 for s in streams[:NUM_LEAVERS])

    wait_idle(running)
    state = state_of(running)
    assert state["used_blocks"] == [0, 0]
    assert state["free_blocks"] == state["num_blocks"] - 1
    assert not state["unfinished"] and not state["has_unfinished"]
    assert running.engine.snapshot.num_used_blocks_per_group == (0, 0)  # shipped from it

    page = httpx.get(url + "/metrics").text
    completed = len(finished) + sum(impatient)
    given_up = NUM_LEAVERS + NUM_IMPATIENT - sum(impatient)
    assert metric(page, "hybrid_cache:request_success_total", finished_reason="length") == completed
    assert metric(page, "hybrid_cache:request_success_total", finished_reason="abort") == given_up
    assert metric(page, "hybrid_cache:request_success_total", finished_reason="error") == 0
    assert metric(page, "hybrid_cache:http_error_responses_total", status="400") == NUM_MALFORMED
    gave_up = NUM_IMPATIENT - sum(impatient)  # answered 499 (client closed request)
    assert metric(page, "hybrid_cache:http_error_responses_total", 0, status="499") == gave_up
    prompt_tokens = sum(len(prompt_of(i)) for i in range(NUM_STREAMS + NUM_IMPATIENT))
    assert metric(page, "hybrid_cache:prompt_tokens_total") == prompt_tokens
    generated = metric(page, "hybrid_cache:generation_tokens_total")
    seen_by_leavers = sum(s["tokens"] for s in streams[:NUM_LEAVERS])
    assert generated >= MAX_TOKENS * len(finished) + 200 * sum(impatient) + seen_by_leavers
    assert metric(page, "hybrid_cache:e2e_request_latency_seconds_count") == completed + given_up
    assert metric(page, "hybrid_cache:num_requests_running") == 0
    assert metric(page, "hybrid_cache:kv_cache_blocks_used") == 0
    assert metric(page, "hybrid_cache:prefix_cache_hits_total") > 0  # the shared prefixes

    # Still answers.
    response = httpx.post(
        url + "/v1/completions",
        json={"model": MODEL_NAME, "prompt": [5, 6, 7], "max_tokens": 3, "ignore_eos": True},
    )
    assert response.status_code == 200 and response.json()["usage"]["completion_tokens"] == 3
