"""Hostile input: each bad request gets the right status and an OpenAI-style error body
(`{"error": {"message", "type", "param", "code"}}`), and the server keeps answering."""

from __future__ import annotations

import json

import httpx
import pytest
from engine_hooks import fail_steps
from hybrid_cache.entrypoints.api_server import ServerSettings
from serve_harness import (
    MODEL_NAME,
    make_llm,
    metric,
    running_server,
    slow_steps,
    state_of,
    wait_idle,
)

LIMIT = 64 * 1024


@pytest.fixture(scope="module")
def server(serve_model_folder):
    folder = serve_model_folder
    settings = ServerSettings(max_request_bytes=LIMIT)
    with running_server(make_llm(folder), settings) as (url, running):
        yield url, running


def completion(**fields):
    return json.dumps({"model": MODEL_NAME, "prompt": "the cat", "max_tokens": 4, **fields})


def chat(**fields):
    body = {"model": MODEL_NAME, "messages": [{"role": "user", "content": "hi"}], **fields}
    return json.dumps(body)


# (route, body, status, param or None, what the message says)
CASES = [
    ("completions", "{not json", 400, None, "not valid JSON"),
    ("completions", "[1, 2]", 400, None, "JSON object"),
    ("completions", "", 400, None, "not valid JSON"),
    ("completions", completion(n="2"), 400, "n", "integer"),
    ("completions", completion(temperature="hot"), 400, "temperature", "number"),
    ("completions", completion(stream=1), 400, "stream", "boolean"),
    ("completions", completion(max_tokens=True), 400, "max_tokens", "integer"),
    ("completions", completion(prompt=5), 400, "prompt", ""),
    ("completions", completion(prompt=["a", 1]), 400, "prompt", ""),
    ("completions", completion(stop=[""]), 400, "stop", "non-empty"),
    ("completions", completion(max_tokens=-1), 400, "max_tokens", "at least 1"),
    ("completions", completion(n=0), 400, "n", "greater than or equal to 1"),
    ("completions", completion(temperature=-1), 400, "temperature", ">= 0"),
    ("completions", completion(top_p=0), 400, "top_p", "(0, 1]"),
    ("completions", completion(top_k=-5), 400, "top_k", "at least -1"),
    ("completions", completion(logprobs=-1), 400, "logprobs", "greater than or equal"),
    ("completions", completion(presence_penalty=9), 400, "presence_penalty", "[-2, 2]"),
    ("completions", completion(n=10**6), 400, "n", "less than or equal"),
    ("completions", completion(max_tokens=10**9), 400, None, "max_model_len"),
    ("completions", completion(seed=2**70), 400, "seed", "64-bit"),
    ("completions", completion(logprobs=10**4), 400, "logprobs", "less than or equal"),
    ("completions", completion(temperature=1e999), 400, "temperature", "finite"),
    ("completions", completion(n=2, temperature=0), 400, "n", "greedy"),
    ("completions", completion(foo=1), 400, "foo", "unknown field"),
    ("completions", completion(suffix="x"), 400, "suffix", "not supported"),
    ("completions", completion(logit_bias={"5": 10}), 400, "logit_bias", "not supported"),
    (
        "completions",
        completion(stream_options={"include_usage": True}),
        400,
        "stream_options",
        "stream",
    ),
    ("completions", completion(best_of=3, n=2, stream=True), 400, None, "cannot stream"),
    ("completions", completion(prompt=[]), 400, "prompt", "empty"),
    ("completions", completion(prompt=""), 400, None, "the prompt is empty"),
    ("completions", completion(prompt=[5, 10**6]), 400, None, "outside the vocabulary"),
    ("completions", completion(prompt="x " * 300), 400, None, "max_model_len"),
    ("completions", completion(prompt=list(range(3, 400))), 400, None, "max_model_len"),
    ("completions", completion(model="gpt-4"), 404, "model", "does not exist"),
    ("completions", '{"model": "tiny-serve", "prompt": "a\\ud800"}', 400, None, "JSON"),
    ("chat", chat(messages=[]), 400, "messages", "at least 1"),
    ("chat", chat(messages="hi"), 400, "messages", ""),
    ("chat", chat(messages=[{"role": 5, "content": "x"}]), 400, None, "role"),
    ("chat", chat(messages=[{"role": "user", "content": 5}]), 400, None, "content"),
    (
        "chat",
        chat(messages=[{"role": "user", "content": [{"type": "image_url", "image_url": "x"}]}]),
        400,
        None,
        "not supported",
    ),
    ("chat", chat(tools=[{"type": "function"}]), 400, "tools", "not supported"),
    (
        "chat",
        chat(response_format={"type": "json_object"}),
        400,
        "response_format",
        "not supported",
    ),
    ("chat", chat(top_logprobs=2), 400, "top_logprobs", "logprobs=true"),
    ("chat", chat(top_logprobs=100, logprobs=True), 400, "top_logprobs", "less than or equal"),
    ("chat", chat(chat_template="/etc/passwd"), 400, "chat_template", "Jinja template"),
    ("chat", chat(chat_template="{{ raise_exception('no') }}"), 400, None, "chat template"),
    ("chat", chat(add_generation_prompt=True, continue_final_message=True), 400, None, "exclude"),
    ("chat", chat(max_completion_tokens=1000), 400, None, "max_model_len"),
    ("chat", chat(model="nope"), 404, "model", "does not exist"),
]


@pytest.mark.parametrize("route, body, status, param, says", CASES)
def test_bad_input_gets_its_status_and_an_openai_error_body(
    server, route, body, status, param, says
):
    url, _ = server
    path = "/v1/completions" if route == "completions" else "/v1/chat/completions"
    response = httpx.post(url + path, content=body, headers={"Content-Type": "application/json"})
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] == "invalid_request_error"
    assert error["param"] == param, error
    assert says in error["message"], error
    if "max_model_len" in says:
        assert error["code"] == "context_length_exceeded"


def test_unicode_edge_cases_run(server):
    url, _ = server
    for text in ["\u0000nul", "emoji 🐈‍⬛ and 𝔘𝔫𝔦", "\u202eright-to-left", "é" * 50, "\ufeff"]:
        response = httpx.post(url + "/v1/completions", content=completion(prompt=text))
        assert response.status_code == 200, response.text
        assert isinstance(response.json()["choices"][0]["text"], str)
    raw = b'{"model": "tiny-serve", "prompt": "\xff\xfe"}'  # not UTF-8
    response = httpx.post(url + "/v1/completions", content=raw)
    assert response.status_code == 400 and "JSON" in response.json()["error"]["message"]


def test_bodies_over_the_limit_are_refused_whole_or_chunked(server):
    url, _ = server
    big = completion(prompt="a " * LIMIT)
    response = httpx.post(url + "/v1/completions", content=big)
    assert response.status_code == 413
    assert response.json()["error"]["code"] == "request_too_large"

    def chunks():  # no Content-Length: the server counts as it reads
        for _ in range(LIMIT // 1024 + 2):
            yield b" " * 1024

    response = httpx.post(url + "/v1/completions", content=chunks())
    assert response.status_code == 413


def test_unknown_routes_and_methods_get_openai_bodies(server):
    url, _ = server
    response = httpx.get(url + "/v1/nothing")
    assert response.status_code == 404 and response.json()["error"]["code"] == "not_found"
    response = httpx.get(url + "/v1/completions")
    assert response.status_code == 405
    assert response.json()["error"]["code"] == "method_not_allowed"


def test_the_server_still_answers_and_counted_the_errors(server):
    url, running = server
    before = metric(
        httpx.get(url + "/metrics").text, "hybrid_cache:http_error_responses_total", status="400"
    )
    for _ in range(3):
        assert httpx.post(url + "/v1/completions", content="{").status_code == 400
    response = httpx.post(url + "/v1/completions", content=completion())
    assert response.status_code == 200 and response.json()["usage"]["completion_tokens"] >= 1
    wait_idle(running)
    page = httpx.get(url + "/metrics").text
    assert metric(page, "hybrid_cache:http_error_responses_total", status="400") == before + 3
    assert state_of(running)["used_blocks"] == [0, 0]
    assert httpx.get(url + "/health").status_code == 200


def test_overloaded_and_dead_engines_answer_503(serve_model_folder):
    llm = make_llm(serve_model_folder)
    with running_server(llm, max_pending_requests=1) as (url, running):
        long_stream = {
            "model": MODEL_NAME,
            "prompt": [5, 6, 7],
            "max_tokens": 200,
            "ignore_eos": True,
            "stream": True,
        }
        with (
            slow_steps(running),
            httpx.stream("POST", url + "/v1/completions", json=long_stream) as stream,
        ):
            lines = stream.iter_lines()  # kept: a closed iterator closes the response
            next(lines)  # the request is running
            response = httpx.post(url + "/v1/completions", content=completion())
            assert response.status_code == 503
            assert response.json()["error"]["code"] == "engine_overloaded"
        wait_idle(running)

        running.engine.call_engine(fail_steps, 0, "the device fell over")
        response = httpx.post(url + "/v1/completions", content=completion())
        assert response.status_code == 503, response.text
        error = response.json()["error"]
        assert error["code"] == "engine_unhealthy" and "the device fell over" in error["message"]
        assert httpx.get(url + "/health").status_code == 503
        assert httpx.post(url + "/v1/chat/completions", content=chat()).status_code == 503
        page = httpx.get(url + "/metrics").text
        assert metric(page, "hybrid_cache:healthy") == 0


def test_a_model_without_tokenizer_takes_token_ids_only():
    from hybrid_cache import LLM

    llm = LLM("tiny-gemma3", kv_cache_memory="4MiB", max_model_len=128)
    with running_server(llm) as (url, _):
        ids = {"model": MODEL_NAME, "prompt": [5, 6, 7], "max_tokens": 3, "ignore_eos": True}
        response = httpx.post(url + "/v1/completions", json={**ids, "return_token_ids": True})
        assert response.status_code == 200
        choice = response.json()["choices"][0]
        assert choice["text"] == "" and len(choice["token_ids"]) == 3
        for path, body in [("/v1/completions", completion()), ("/v1/chat/completions", chat())]:
            response = httpx.post(url + path, content=body)
            assert response.status_code == 400
            assert "tokenizer" in response.json()["error"]["message"]
        response = httpx.post(url + "/v1/completions", json={**ids, "stop": ["x"]})
        assert response.status_code == 400 and "tokenizer" in response.json()["error"]["message"]
