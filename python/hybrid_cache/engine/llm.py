"""`LLM`: the user-facing front, in the shape vLLM users know.

    llm = LLM(model="path/to/hf-folder")            # or a preset name, e.g. "tiny-gemma3"
    outputs = llm.generate(["Hello", {"prompt_token_ids": [1, 2, 3]}], SamplingParams(max_tokens=8))

Construction: the arguments become one validated `EngineConfig` (`llm.config`), then read the
config (+ `hf_overrides`) into the `ModelSpec`, build the model from that spec (weights from the
folder, or seeded random weights with `load_format="dummy"`), size the KV cache (see
`memory.py`), plan the layout (`planner.plan_kv_cache`, logged), and start the engine.
"""

from __future__ import annotations

import itertools
import logging
import numbers
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Optional, Union

import torch

from hybrid_cache.config import ModelSpec
from hybrid_cache.engine.engine_args import eos_token_ids, log_plan, resolve_dtype
from hybrid_cache.engine.engine_config import EngineConfig
from hybrid_cache.engine.errors import InvalidRequestError, InvalidSamplingParamsError
from hybrid_cache.engine.llm_engine import Finished, LLMEngine
from hybrid_cache.engine.memory import kv_cache_budget
from hybrid_cache.engine.output_builder import request_output
from hybrid_cache.engine.outputs import CompletionOutput, EngineStats, RequestOutput, StepStats
from hybrid_cache.engine.request import FinishReason
from hybrid_cache.engine.sampling_params import SamplingParams
from hybrid_cache.engine.tokenizer import load_tokenizer
from hybrid_cache.models import load_model
from hybrid_cache.planner import KVCacheLayout, plan_kv_cache

logger = logging.getLogger(__name__)

Prompt = Union[str, Mapping[str, Any]]


class LLM:
    """An engine over one model. `generate` runs a batch of prompts to completion."""

    def __init__(self, model: Union[str, os.PathLike, EngineConfig], **kwargs: Any) -> None:
        """`model`: a local Hugging Face folder (config.json + safetensors, tokenizer optional)
        or a built-in preset name (always random weights), or an `EngineConfig`; `kwargs`: the
        `EngineConfig` fields (`kv_cache_memory`, `max_model_len`, `block_size`,
        `kv_cache_mode`, `kv_group_layout`, `max_num_seqs`, `max_num_batched_tokens`,
        `enable_prefix_caching`, `scheduling_policy`, `hf_overrides`, `load_format`, `dtype`,
        `device`, `seed`, `attention_backend`, `gpu_memory_utilization`, `enforce_eager`; see
        there for their defaults), or with an
        `EngineConfig`, the fields to replace. Every argument is checked before any work: a bad
        one raises a typed `EngineConfigError` (or `PlanError`, `MemorySizeError`,
        `ConfigError`) naming it."""
        self.config: EngineConfig = EngineConfig.of(model, **kwargs)
        config = self.config
        # Every step runs eagerly today (no CUDA graphs yet); kept so callers can pass it.
        self.enforce_eager: bool = config.enforce_eager
        self.device: torch.device = torch.device(
            config.device or ("cuda" if torch.cuda.is_available() else "cpu")
        )
        self.spec: ModelSpec = config.model_spec()
        self.dtype: torch.dtype = resolve_dtype(config.dtype, self.spec, self.device)
        self.max_model_len: int = config.resolved_max_model_len(self.spec)
        is_folder = Path(config.model).is_dir()
        if config.load_format == "auto" and not is_folder:
            logger.info("%s is a preset without weights: using random (dummy) weights", model)
        self.model = load_model(
            config.model if is_folder else None,
            spec=self.spec,
            load_format=config.load_format if is_folder else "dummy",
            dtype=self.dtype,
            device=self.device,
            seed=config.seed,
        )
        self.tokenizer = load_tokenizer(config.model) if is_folder else None

        budget = kv_cache_budget(
            self.model,
            self.device,
            config.kv_cache_memory,
            config.gpu_memory_utilization,
            config.max_num_batched_tokens,
            config.max_num_seqs,
        )
        options = config.plan_options(
            budget, self.max_model_len, kv_cache_dtype=str(self.dtype).removeprefix("torch.")
        )
        self.layout: KVCacheLayout = plan_kv_cache(self.spec, options, mode=config.kv_cache_mode)
        log_plan(self.layout, self.spec)
        self.engine: LLMEngine = LLMEngine.from_model(
            self.model,
            self.layout,
            config.scheduler_limits(self.max_model_len),
            vocab_size=self.spec.vocab_size,
            eos_token_ids=eos_token_ids(self.spec.hf_config, self.tokenizer),
            dtype=self.dtype,
            device=self.device,
            seed=config.seed,
            attention_backend=config.attention_backend,
            tokenizer=self.tokenizer,
        )
        self.request_counter: itertools.count[int] = itertools.count()

    @property
    def step_stats(self) -> list[StepStats]:
        """Figures of every step of the last `generate` call: blocks used per group,
        preemptions, prefix-cache hit rate, batch sizes (the last `MAX_STEP_STATS` steps)."""
        return list(self.engine.step_stats)

    @property
    def stats(self) -> EngineStats:
        """Totals since the engine started (steps, preemptions, prefix-cache hits, peak blocks)."""
        return self.engine.stats

    def reset_prefix_cache(self) -> bool:
        """Empties the prefix cache (e.g. between benchmark runs); False while requests run."""
        return self.engine.kv_cache.reset_prefix_cache()

    def generate(
        self,
        prompts: Union[Prompt, Sequence[Prompt]],
        sampling_params: Union[SamplingParams, Sequence[SamplingParams], None] = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Runs every prompt to completion and returns one output per prompt, in order.

        Errors: a problem with the call itself (a `sampling_params` list of the wrong length, or
        an entry that is not a `SamplingParams`) raises before any work. A problem with one
        prompt (empty, not tokenizable, ids outside the vocabulary, longer than
        `max_model_len` or than the whole KV pool can hold) does not stop the others: that
        prompt's output has `finish_reason == "error"`, no tokens, and the typed exception
        (an `InvalidRequestError` subclass) in `output.error`; `output.raise_for_error()`
        re-raises it.
        """
        prompt_list = [prompts] if isinstance(prompts, (str, Mapping)) else list(prompts)
        params_list = broadcast_params(sampling_params, len(prompt_list))
        self.engine.reset_step_stats()
        outputs: list[Optional[RequestOutput]] = [None] * len(prompt_list)
        index_of: dict[str, int] = {}
        requests: dict[str, Finished] = {}
        for index, (prompt, params) in enumerate(zip(prompt_list, params_list)):
            request_id = str(next(self.request_counter))
            text = prompt if isinstance(prompt, str) else None
            token_ids: list[int] = []
            try:
                token_ids = self.tokenize(prompt)
                requests[request_id] = self.engine.add_request(request_id, token_ids, params)
                index_of[request_id] = index
            except InvalidRequestError as error:
                outputs[index] = failed_output(request_id, text, token_ids, error)

        progress = make_progress_bar(use_tqdm, len(requests))
        try:
            while self.engine.has_unfinished_requests():
                for request in self.engine.step():
                    index = index_of.get(request.request_id)
                    if index is None:
                        continue  # added through `self.engine` directly, not by this call
                    outputs[index] = self.make_output(request, prompt_list[index])
                    if progress is not None:
                        progress.update(1)
        except BaseException:
            for request_id in requests:
                self.engine.abort_request(request_id)  # give every block back
            raise
        finally:
            if progress is not None:
                progress.close()
        assert all(output is not None for output in outputs), "every prompt gets an output"
        return outputs  # type: ignore[return-value]

    def tokenize(self, prompt: Prompt) -> list[int]:
        """Token ids of a prompt: a string (needs a tokenizer) or {"prompt_token_ids": [...]}."""
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise InvalidRequestError(
                    "this model has no tokenizer: pass {'prompt_token_ids': [...]} instead of text"
                )
            return list(self.tokenizer.encode(prompt))
        if isinstance(prompt, Mapping) and "prompt_token_ids" in prompt:
            token_ids = prompt["prompt_token_ids"]
            if hasattr(token_ids, "tolist"):  # a torch tensor or numpy array
                token_ids = token_ids.tolist()
            if not isinstance(token_ids, Sequence) or not all(
                isinstance(t, numbers.Integral) and not isinstance(t, bool) for t in token_ids
            ):
                raise InvalidRequestError("prompt_token_ids must be a list of ints")
            return [int(t) for t in token_ids]
        raise InvalidRequestError(
            f"a prompt is a string or {{'prompt_token_ids': [...]}}, got {type(prompt).__name__}"
        )

    def make_output(self, request: Finished, prompt: Prompt) -> RequestOutput:
        """The output of a finished request (or of all the samples of one prompt)."""
        return request_output(request, prompt if isinstance(prompt, str) else None, self.tokenizer)


def failed_output(
    request_id: str, prompt: Optional[str], token_ids: list[int], error: Exception
) -> RequestOutput:
    return RequestOutput(
        request_id=request_id,
        prompt=prompt,
        prompt_token_ids=token_ids,
        outputs=[CompletionOutput(0, [], None, FinishReason.ERROR.value)],
        error=error,
    )


def broadcast_params(
    sampling_params: Union[SamplingParams, Sequence[SamplingParams], None], num_prompts: int
) -> list[SamplingParams]:
    if sampling_params is None:
        return [SamplingParams()] * num_prompts
    if isinstance(sampling_params, SamplingParams):
        return [sampling_params] * num_prompts
    params = list(sampling_params)
    if len(params) != num_prompts:
        raise InvalidSamplingParamsError(
            f"got {len(params)} sampling params for {num_prompts} prompts: pass one, or one each"
        )
    for item in params:
        if not isinstance(item, SamplingParams):
            raise InvalidSamplingParamsError(
                f"sampling params must be SamplingParams, got {type(item).__name__}"
            )
    return params


def make_progress_bar(use_tqdm: bool, total: int) -> Any:
    if not use_tqdm or total == 0:
        return None
    from tqdm.auto import tqdm

    return tqdm(total=total, desc="generate", unit="req")
