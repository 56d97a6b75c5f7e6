"""`hybrid-cache bench serve`: load on a running server over real HTTP (aiohttp, async), in the
shape of `vllm bench serve`.

The prompts are the offline benchmark's (`workload.py`: seeded random token ids, the first
`prefix_len` shared; `multi_turn.py`: chat sessions resending their history, a wave per turn)
sent as token ids to `/v1/completions` with `stream`, greedy, `ignore_eos` and `max_tokens =
output_len`, so each request generates exactly `output_len` tokens whatever the weights.
Requests start at `request_rate` per second (Poisson arrivals, seeded; inf: all at once), at
most `max_concurrency` at a time.

The client is aiohttp (C-accelerated HTTP parsing), as `vllm bench serve`'s: on a machine where
the client shares the cores with the server, its own CPU time is taken from the engine's (httpx
took about three times as much CPU per streamed token; BENCHMARKS.md, "Serving").

Per request: TTFT (sending to the first chunk with tokens), ITL (between chunks with tokens),
TPOT ((latency - TTFT) / (tokens - 1)) and its tokens (`return_token_ids`); overall: requests
and output tokens per second over the run's wall time, and mean / median / p99 of each.
"""

from __future__ import annotations

import asyncio
import json
import random
import statistics
import time
from dataclasses import dataclass, field
from typing import Any, Optional

import aiohttp

from hybrid_cache.bench.errors import BenchConfigError
from hybrid_cache.bench.multi_turn import MultiTurnFeed
from hybrid_cache.bench.serve_settings import ServeBenchSettings
from hybrid_cache.bench.workload import RandomFeed, make_prompts


@dataclass
class RequestRecord:
    """One request as the client saw it (what `MultiTurnFeed.record` reads too)."""

    request_id: str
    prompt_token_ids: list[int]
    output_token_ids: list[int] = field(default_factory=list)
    num_cached_tokens: int = 0
    ttft_s: Optional[float] = None
    itl_s: list[float] = field(default_factory=list)
    latency_s: float = 0.0
    error: Optional[str] = None


def summary(values: list[float]) -> dict[str, Optional[float]]:
    """Mean, median and p99 in milliseconds (None without values)."""
    if not values:
        return {"mean_ms": None, "median_ms": None, "p99_ms": None}
    ordered = sorted(values)
    p99 = ordered[min(len(ordered) - 1, max(0, round(0.99 * len(ordered) + 0.5) - 1))]
    return {
        "mean_ms": 1000 * statistics.fmean(ordered),
        "median_ms": 1000 * statistics.median(ordered),
        "p99_ms": 1000 * p99,
    }


def results_of(
    settings: ServeBenchSettings, records: list[RequestRecord], elapsed_s: float, feed: Any
) -> dict[str, Any]:
    """The run's figures (the JSON document; `format_results` prints them)."""
    done = [record for record in records if record.error is None]
    output_tokens = sum(len(record.output_token_ids) for record in done)
    input_tokens = sum(len(record.prompt_token_ids) for record in done)
    tpot = [
        (record.latency_s - record.ttft_s) / (len(record.output_token_ids) - 1)
        for record in done
        if record.ttft_s is not None and len(record.output_token_ids) > 1
    ]
    shown = {key: value for key, value in settings.__dict__.items() if key != "api_key"}
    shown["request_rate"] = str(settings.request_rate)  # JSON has no inf
    if settings.multi_turn is not None:
        shown["multi_turn"] = dict(settings.multi_turn.__dict__)
    results: dict[str, Any] = {
        "settings": shown,
        "duration_s": elapsed_s,
        "completed": len(done),
        "failed": len(records) - len(done),
        "errors": sorted({record.error for record in records if record.error})[:10],
        "total_input_tokens": input_tokens,
        "total_output_tokens": output_tokens,
        "cached_prompt_tokens": sum(record.num_cached_tokens for record in done),
        "request_throughput": len(done) / elapsed_s,
        "output_throughput": output_tokens / elapsed_s,
        "total_token_throughput": (input_tokens + output_tokens) / elapsed_s,
        "ttft": summary([record.ttft_s for record in done if record.ttft_s is not None]),
        "tpot": summary(tpot),
        "itl": summary([gap for record in done for gap in record.itl_s]),
    }
    if feed.reuse is not None:
        results["multi_turn_reuse"] = feed.reuse.to_dict()
    return results


def format_results(results: dict[str, Any]) -> str:
    lines = [
        f"Successful requests:      {results['completed']} (failed: {results['failed']})",
        f"Duration:                 {results['duration_s']:.2f} s",
        f"Request throughput:       {results['request_throughput']:.2f} req/s",
        f"Output token throughput:  {results['output_throughput']:.1f} tok/s",
        f"Total token throughput:   {results['total_token_throughput']:.1f} tok/s",
        f"Cached prompt tokens:     {results['cached_prompt_tokens']}",
    ]
    for name, label in (("ttft", "TTFT"), ("tpot", "TPOT"), ("itl", "ITL")):
        figures = results[name]
        if figures["mean_ms"] is None:
            lines.append(f"{label:<5} (ms): none")
            continue
        lines.append(
            f"{label:<5} (ms): mean {figures['mean_ms']:.2f}  median {figures['median_ms']:.2f}  "
            f"p99 {figures['p99_ms']:.2f}"
        )
    reuse = results.get("multi_turn_reuse")
    if reuse and reuse["reusable_hit_rate"] is not None:
        lines.append(f"Multi-turn reusable-token hit rate: {reuse['reusable_hit_rate']:.1%}")
    for error in results["errors"]:
        lines.append(f"error: {error}")
    return "\n".join(lines)


def make_feed(settings: ServeBenchSettings, vocab_size: int) -> Any:
    """The prompts (`RandomFeed` or `MultiTurnFeed`, as the offline benchmark's)."""
    if settings.multi_turn is not None:
        return MultiTurnFeed(settings.multi_turn, vocab_size, settings.seed)
    prefix = settings.prefix_len if settings.workload == "shared-prefix" else 0
    prompts = make_prompts(
        settings.num_prompts, settings.input_len, prefix, vocab_size, settings.seed
    )
    return RandomFeed(prompts)


async def served_model(
    client: aiohttp.ClientSession, settings: ServeBenchSettings
) -> dict[str, Any]:
    """The `/v1/models` entry of the model to load (`--model`, else the first)."""
    try:
        async with client.get(_url(settings, "/v1/models")) as response:
            body = await response.text()
            status = response.status
    except (aiohttp.ClientError, asyncio.TimeoutError) as error:
        raise BenchConfigError(
            f"cannot reach {settings.base_url}: {type(error).__name__}: {error}"
        ) from error
    if status != 200:
        raise BenchConfigError(f"GET {settings.base_url}/v1/models answered {status}: {body}")
    models = json.loads(body)["data"]
    for entry in models:
        if settings.model is None or entry["id"] == settings.model:
            return entry
    names = ", ".join(entry["id"] for entry in models)
    raise BenchConfigError(f"the server does not serve {settings.model!r}; it serves {names}")


def _url(settings: ServeBenchSettings, path: str) -> str:
    return settings.base_url.rstrip("/") + path


async def send(
    client: aiohttp.ClientSession, model: str, settings: ServeBenchSettings, record: RequestRecord
) -> None:
    """One streaming completion; fills `record` (its `error` when it failed)."""
    payload = {
        "model": model,
        "prompt": record.prompt_token_ids,
        "max_tokens": settings.output_len,
        "temperature": 0.0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
        "return_token_ids": True,
    }
    start = time.perf_counter()
    last = start
    try:
        async with client.post(_url(settings, "/v1/completions"), json=payload) as response:
            if response.status != 200:
                body = (await response.read()).decode(errors="replace")
                record.error = f"HTTP {response.status}: {body[:200]}"
                return
            async for line in response.content:  # one SSE line at a time
                if not line.startswith(b"data: "):
                    continue
                data = line[6:].rstrip()
                if data == b"[DONE]":
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    record.error = chunk["error"]["message"]
                    return
                now = time.perf_counter()
                tokens = [t for choice in chunk["choices"] for t in choice.get("token_ids", ())]
                if tokens:
                    if record.ttft_s is None:
                        record.ttft_s = now - start
                    else:
                        record.itl_s.append(now - last)
                    last = now
                    record.output_token_ids += tokens
                if chunk.get("usage"):
                    details = chunk["usage"].get("prompt_tokens_details") or {}
                    record.num_cached_tokens = details.get("cached_tokens") or 0
    except (aiohttp.ClientError, asyncio.TimeoutError) as error:
        record.error = f"{type(error).__name__}: {error}"
    finally:
        record.latency_s = time.perf_counter() - start


async def run_serve_bench(settings: ServeBenchSettings) -> dict[str, Any]:
    """Runs the load and returns `results_of`."""
    settings.check()
    headers = {"Authorization": f"Bearer {settings.api_key}"} if settings.api_key else {}
    connector = aiohttp.TCPConnector(limit=settings.max_concurrency or 1000)
    async with aiohttp.ClientSession(
        headers=headers,
        timeout=aiohttp.ClientTimeout(total=settings.timeout_s),
        connector=connector,
    ) as client:
        entry = await served_model(client, settings)
        vocab_size = entry.get("vocab_size")
        if not isinstance(vocab_size, int):
            raise BenchConfigError(
                f"{settings.base_url}/v1/models gives no vocab_size: the prompts are token ids "
                "and need it (is this a hybrid-cache server?)"
            )
        feed = make_feed(settings, vocab_size)
        limit = asyncio.Semaphore(settings.max_concurrency or 1_000_000)
        generator = random.Random(settings.seed)
        records: list[RequestRecord] = []

        async def one(record: RequestRecord) -> None:
            async with limit:
                await send(client, entry["id"], settings, record)
            if record.error is None:
                feed.record(record)

        start = time.perf_counter()
        while not feed.exhausted:
            wave = feed.next_prompts()
            if not wave:
                raise BenchConfigError("a multi-turn wave failed: see the errors above")
            tasks = []
            for request_id, prompt in wave:
                record = RequestRecord(request_id, prompt)
                records.append(record)
                tasks.append(asyncio.ensure_future(one(record)))
                if settings.request_rate != float("inf"):
                    await asyncio.sleep(generator.expovariate(settings.request_rate))
            await asyncio.gather(*tasks)
            if any(record.error for record in records) and settings.multi_turn is not None:
                break  # a failed turn leaves its session without a history
        elapsed = time.perf_counter() - start
    return results_of(settings, records, elapsed, feed)
