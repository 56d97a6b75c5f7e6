"""The inference engine: `LLM`, `SamplingParams` and the parts behind them.

One job per file:

    llm.py            LLM: its EngineConfig, model + tokenizer, KV budget, plan, generate(), chat()
    prompts.py        the prompt forms generate() takes, chat conversations and their template
    generation_config.py  the folder's generation_config.json: EOS ids, default sampling values
    engine_config.py  EngineConfig (validated once, the defaults) and the shared CLI flags
    engine_args.py    device, dtype and end-of-sequence ids from the config, plan checks and logging
    llm_engine.py     LLMEngine: add_request / step / abort_request, per-step figures
    step_runner.py    StepRunner: the execute(SchedulerOutput) contract a step runs through
    scheduler.py      continuous batching, chunked prefill, preemption by recompute
    kv_cache.py       the engine's only user of the Rust Coordinator (zero-copy block table)
    model_runner.py   KV tensors per layout slot, batch + metadata, forward, sampling
    sampler.py        penalties, greedy / temperature / min-p / top-k / top-p, seeded generators
    penalties.py      repetition / frequency / presence penalties, min_tokens mask, min-p
    logprobs.py       top-k logprobs of raw logits and their output form
    detokenizer.py    incremental detokenization and stop strings
    parallel_sampling.py  SampleGroup: the n / best_of samples of one prompt
    request.py        per-request state;  sampling_params.py, outputs.py, errors.py, memory.py
    output_builder.py a finished request -> RequestOutput
    host_memory.py    the CPU KV pool on transparent huge pages;  tokenizer.py
    parallel/         tensor parallelism: worker processes, the step broadcast, failures

A request's life (every transition that drops blocks goes through `KVCacheManager.free`):

    add_request --> WAITING --admit (cache hit + allocate)--> RUNNING --finish--> FINISHED
                      ^                                          |      (stop / length / abort)
                      +------ preempted (blocks freed, ----------+
                              re-added later with prompt + output so far)

Names are imported on first use, so `import hybrid_cache.engine` does not import torch.
"""

from __future__ import annotations

import importlib
from typing import Any

_LAZY_NAMES = {
    "LLM": "hybrid_cache.engine.llm",
    "LLMEngine": "hybrid_cache.engine.llm_engine",
    "SamplingParams": "hybrid_cache.engine.sampling_params",
    "RequestOutput": "hybrid_cache.engine.outputs",
    "CompletionOutput": "hybrid_cache.engine.outputs",
    "Logprob": "hybrid_cache.engine.outputs",
    "RequestMetrics": "hybrid_cache.engine.outputs",
    "StepStats": "hybrid_cache.engine.outputs",
    "EngineStats": "hybrid_cache.engine.outputs",
}

__all__ = sorted(_LAZY_NAMES)


def __getattr__(name: str) -> Any:
    if name in _LAZY_NAMES:
        return getattr(importlib.import_module(_LAZY_NAMES[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
