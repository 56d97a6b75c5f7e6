"""The server through the official `openai` client: completions and chat, streaming and not,
`n=2`, stop strings, logprobs, echo, usage (cached prompt tokens too). Streamed text equals
the non-streamed text and the offline `LLM.generate` / `LLM.chat` text for the same seed."""

from __future__ import annotations

import httpx
import openai
import pytest
from hybrid_cache import SamplingParams
from hybrid_cache._core import __version__
from hybrid_cache.entrypoints.api_server import ServerSettings
from serve_harness import MODEL_NAME, make_llm, metric, running_server, slow_steps, wait_idle

API_KEY = "test-key"
PROMPT = "the cat sat on the mat and héllo"
MESSAGES = [{"role": "user", "content": "the dog ran far"}]


@pytest.fixture(scope="module")
def folder(serve_model_folder):
    return serve_model_folder


@pytest.fixture(scope="module")
def offline(folder):
    return make_llm(folder)


@pytest.fixture(scope="module")
def server(folder):
    with running_server(make_llm(folder), ServerSettings(api_key=API_KEY)) as (url, server):
        yield url, server


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server[0] + "/v1", api_key=API_KEY, max_retries=0)


def streamed_texts(chunks) -> tuple[dict[int, str], dict[int, str], list]:
    texts: dict[int, str] = {}
    reasons: dict[int, str] = {}
    usages = []
    for chunk in chunks:
        if chunk.usage is not None:
            usages.append(chunk.usage)
        for choice in chunk.choices:
            piece = choice.text if hasattr(choice, "text") else (choice.delta.content or "")
            texts[choice.index] = texts.get(choice.index, "") + piece
            if choice.finish_reason is not None:
                reasons[choice.index] = choice.finish_reason
    return texts, reasons, usages


def test_completions_streamed_equal_non_streamed_equal_offline(client, offline):
    unstopped = offline.generate(
        PROMPT, SamplingParams(max_tokens=20, temperature=0.9, seed=4, n=2), use_tqdm=False
    )[0]
    stop = unstopped.outputs[1].text[5:8]  # cuts sample 1, perhaps sample 0 too
    params = SamplingParams(max_tokens=20, temperature=0.9, seed=4, n=2, stop=[stop])
    (expected,) = offline.generate(PROMPT, params, use_tqdm=False)
    args = dict(model=MODEL_NAME, prompt=PROMPT, max_tokens=20, temperature=0.9, seed=4, n=2)
    response = client.completions.create(stop=[stop], **args)
    chunks = list(
        client.completions.create(
            stop=[stop], stream=True, stream_options={"include_usage": True}, **args
        )
    )
    texts, reasons, usages = streamed_texts(chunks)
    assert len(chunks) > 4  # it streamed
    for index, completion in enumerate(expected.outputs):
        choice = response.choices[index]
        assert choice.index == index
        assert choice.text == texts[index] == completion.text
        assert choice.finish_reason == reasons[index] == completion.finish_reason
    assert response.choices[1].finish_reason == "stop"
    completion_tokens = sum(len(c.token_ids) for c in expected.outputs)
    (usage,) = usages
    for found in (response.usage, usage):
        assert found.prompt_tokens == len(expected.prompt_token_ids)
        assert found.completion_tokens == completion_tokens
        assert found.total_tokens == found.prompt_tokens + completion_tokens
    assert chunks[-1].choices == []  # the usage chunk comes last, alone


def test_completions_logprobs_and_echo(client, offline):
    params = SamplingParams(max_tokens=8, temperature=0.0, logprobs=2, prompt_logprobs=2)
    (expected,) = offline.generate(PROMPT, params, use_tqdm=False)
    completion = expected.outputs[0]
    response = client.completions.create(
        model=MODEL_NAME, prompt=PROMPT, max_tokens=8, temperature=0.0, logprobs=2, echo=True
    )
    choice = response.choices[0]
    assert choice.text == PROMPT + completion.text
    logprobs = choice.logprobs
    num_prompt = len(expected.prompt_token_ids)
    assert len(logprobs.tokens) == num_prompt + len(completion.token_ids)
    assert logprobs.token_logprobs[0] is None  # the first prompt token has none
    want = [
        entry[token].logprob
        for entry, token in zip(expected.prompt_logprobs[1:], expected.prompt_token_ids[1:])
    ] + [entry[token].logprob for entry, token in zip(completion.logprobs, completion.token_ids)]
    assert logprobs.token_logprobs[1:] == pytest.approx(want, abs=1e-5)
    assert all(len(top) in (2, 3) for top in logprobs.top_logprobs[1:])  # top 2 + the chosen
    assert logprobs.text_offset[0] == 0 and logprobs.text_offset == sorted(logprobs.text_offset)
    # Streamed: the same text and logprobs, pieced together.
    chunks = list(
        client.completions.create(
            model=MODEL_NAME,
            prompt=PROMPT,
            max_tokens=8,
            temperature=0.0,
            logprobs=2,
            echo=True,
            stream=True,
        )
    )
    streamed = [lp for chunk in chunks for lp in chunk.choices[0].logprobs.token_logprobs]
    assert "".join(chunk.choices[0].text for chunk in chunks) == choice.text
    assert streamed[1:] == pytest.approx(logprobs.token_logprobs[1:], abs=1e-6)


def test_completions_of_token_ids_and_several_prompts(client, offline):
    prompts = [[5, 6, 7, 8, 9], [40, 41, 42]]
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    expected = offline.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    response = client.completions.create(
        model=MODEL_NAME,
        prompt=prompts,
        max_tokens=6,
        temperature=0.0,
        extra_body={"ignore_eos": True, "return_token_ids": True},
    )
    assert [c.index for c in response.choices] == [0, 1]
    for choice, output in zip(response.choices, expected):
        assert choice.model_extra["token_ids"] == output.outputs[0].token_ids
        assert choice.model_extra["prompt_token_ids"] == output.prompt_token_ids
        assert choice.text == output.outputs[0].text
    assert response.usage.prompt_tokens == 8 and response.usage.completion_tokens == 12


def test_several_prompts_stream_as_one(client, offline):
    prompts = ["the cat sat", "a dog ran far"]
    params = SamplingParams(max_tokens=10, temperature=1.0, seed=2, n=2)
    expected = offline.generate(prompts, params, use_tqdm=False)
    args = dict(model=MODEL_NAME, prompt=prompts, max_tokens=10, temperature=1.0, seed=2, n=2)
    texts, reasons, _ = streamed_texts(client.completions.create(stream=True, **args))
    response = client.completions.create(**args)
    want = [completion.text for output in expected for completion in output.outputs]
    assert [texts[i] for i in range(4)] == [c.text for c in response.choices] == want


def test_the_gauges_follow_a_running_request(server):
    url, running = server
    headers = {"Authorization": f"Bearer {API_KEY}"}
    body = {"model": MODEL_NAME, "prompt": list(range(3, 40)), "max_tokens": 200}
    body.update(ignore_eos=True, stream=True)
    with (
        slow_steps(running),
        httpx.stream("POST", url + "/v1/completions", json=body, headers=headers) as stream,
    ):
        lines = stream.iter_lines()  # kept: a closed iterator closes the response
        next(lines)  # running now
        page = httpx.get(url + "/metrics", headers=headers).text
    assert metric(page, "hybrid_cache:num_requests_running") == 1
    assert metric(page, "hybrid_cache:kv_cache_blocks_used", kind="full") >= 3  # 38+ tokens
    assert metric(page, "hybrid_cache:kv_cache_blocks_used_by_kind", kind="sliding_window") >= 1


def test_chat_streamed_equal_non_streamed_equal_offline(client, offline):
    params = SamplingParams(max_tokens=16, temperature=0.8, seed=9, n=2, logprobs=3)
    (expected,) = offline.chat(MESSAGES, params, use_tqdm=False)
    args = dict(
        model=MODEL_NAME,
        messages=MESSAGES,
        max_tokens=16,
        temperature=0.8,
        seed=9,
        n=2,
        logprobs=True,
        top_logprobs=3,
    )
    response = client.chat.completions.create(**args)
    chunks = list(
        client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **args)
    )
    texts, reasons, usages = streamed_texts(chunks)
    first_deltas = {}
    for chunk in chunks:
        for choice in chunk.choices:
            first_deltas.setdefault(choice.index, choice.delta)
    for index, completion in enumerate(expected.outputs):
        choice = response.choices[index]
        assert choice.message.role == "assistant" and first_deltas[index].role == "assistant"
        assert choice.message.content == texts[index] == completion.text
        assert choice.finish_reason == reasons[index] == completion.finish_reason
        content = choice.logprobs.content
        assert [entry.logprob for entry in content] == pytest.approx(
            [completion.logprobs[i][t].logprob for i, t in enumerate(completion.token_ids)],
            abs=1e-5,
        )
        assert all(len(entry.top_logprobs) == 3 for entry in content)
        assert all(
            entry.top_logprobs[0].logprob >= entry.top_logprobs[-1].logprob for entry in content
        )
    (usage,) = usages
    assert usage.prompt_tokens == response.usage.prompt_tokens == len(expected.prompt_token_ids)
    assert usage.completion_tokens == sum(len(c.token_ids) for c in expected.outputs)


def test_usage_counts_cached_prompt_tokens(client, folder):
    """A prompt sent twice: the second is served from the prefix cache, as offline."""
    llm = make_llm(folder)
    prompt = [3 + (i * 7) % 300 for i in range(70)]
    params = SamplingParams(max_tokens=2, temperature=0.0)
    offline_cached = [
        llm.generate({"prompt_token_ids": prompt}, params, use_tqdm=False)[0].num_cached_tokens
        for _ in range(2)
    ]
    served = [
        client.completions.create(
            model=MODEL_NAME, prompt=prompt, max_tokens=2, temperature=0.0
        ).usage.prompt_tokens_details.cached_tokens
        for _ in range(2)
    ]
    assert offline_cached[1] > 0
    assert served == offline_cached


def test_models_health_version_metrics(server, client):
    url, running = server
    models = client.models.list()
    (entry,) = models.data
    assert entry.id == MODEL_NAME and entry.model_extra["max_model_len"] == 256
    assert httpx.get(url + "/health").status_code == 200  # no key needed
    headers = {"Authorization": f"Bearer {API_KEY}"}
    assert httpx.get(url + "/version", headers=headers).json() == {"version": __version__}
    # One request, so the engine has sent a snapshot even when this test runs alone.
    client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=2, temperature=0.0)
    wait_idle(running)
    page = httpx.get(url + "/metrics", headers=headers).text
    assert metric(page, "hybrid_cache:healthy") == 1
    assert metric(page, "hybrid_cache:num_requests_running") == 0
    assert metric(page, "hybrid_cache:kv_cache_blocks_used", kind="full") == 0
    assert metric(page, "hybrid_cache:kv_cache_blocks_used_by_kind", kind="sliding_window") == 0
    snapshot = running.engine.snapshot
    stats = snapshot.stats
    # The finished request's chain is protected (the default fraction), and the gauge says so.
    assert snapshot.num_protected_blocks > 0
    assert metric(page, "hybrid_cache:kv_cache_blocks_protected") == snapshot.num_protected_blocks
    assert metric(page, "hybrid_cache:prefix_cache_queries_total") == stats.num_prefix_query_tokens
    assert metric(page, "hybrid_cache:prefix_cache_hits_total") == stats.num_prefix_hit_tokens
    assert metric(page, "hybrid_cache:prefix_cache_misses_total") == stats.prefix_misses.total
    assert (
        metric(page, "hybrid_cache:prefix_cache_token_tail_hits_total") == stats.num_token_tail_hits
    )
    assert metric(page, "hybrid_cache:prefix_cache_tail_replays_total") == stats.num_tail_replays
    assert (
        metric(page, "hybrid_cache:prefix_cache_group_hits_total", group="0")
        == (stats.prefix_alone_hit_tokens_per_group[0])
    )
    assert metric(page, "hybrid_cache:time_to_first_token_seconds_count") > 0
    assert metric(page, "hybrid_cache:inter_token_latency_seconds_count") > 0


def test_the_api_key_is_checked_on_every_route_but_health(server):
    url, _ = server
    for method, path in [("GET", "/v1/models"), ("GET", "/metrics"), ("POST", "/v1/completions")]:
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": API_KEY}):
            response = httpx.request(method, url + path, headers=headers, json={})
            assert response.status_code == 401, (path, headers)
            assert response.json()["error"]["type"] == "authentication_error"
    wrong = openai.OpenAI(base_url=url + "/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        wrong.models.list()
