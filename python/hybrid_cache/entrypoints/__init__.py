"""Serving: `AsyncLLM` (the engine stepped in a process of its own, or on a thread, outputs
streamed to asyncio callers) and the OpenAI-compatible HTTP server of `hybrid-cache serve`.

    async_llm.py     AsyncLLM: generate() / abort(), health, overload limit (the callers' side)
    engine_core.py   the engine's side: commands between steps, one batch of outputs per step
    engine_process.py  the engine process: spawn, socket pair, receiver thread, stop
    streaming.py     per-sample deltas (tokens, text held back for stop strings, logprobs)
    protocol.py      the request bodies (pydantic), checked strictly
    sampling.py      a request's SamplingParams (the model's generation defaults under it)
    formatting.py    logprobs, usage and server-sent events in OpenAI's shapes
    serving.py       what both endpoints share: context, checks, running a request's prompts
    completions.py   POST /v1/completions
    chat.py          POST /v1/chat/completions
    metrics.py       GET /metrics (Prometheus)
    api_server.py    the FastAPI app: routes, API key, body limit, error bodies; uvicorn
    server_config.py the server's defaults
    errors.py        typed errors and their HTTP status and OpenAI error body

The server's modules import fastapi, pydantic and prometheus_client (the `serve` extra);
`async_llm.py`, `engine_core.py`, `engine_process.py` and `streaming.py` need only the
engine.
"""
