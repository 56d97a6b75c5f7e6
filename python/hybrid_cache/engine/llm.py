"""`LLM`: the user-facing front, in the shape vLLM users know.

    llm = LLM(model="path/to/hf-folder")            # or a preset name, e.g. "tiny-gemma3"
    outputs = llm.generate(["Hello", {"prompt_token_ids": [1, 2, 3]}], SamplingParams(max_tokens=8))

Construction: read the config (+ `hf_overrides`) into the `ModelSpec`, build the model from that
spec (weights from the folder, or seeded random weights with `load_format="dummy"`), size the KV cache (see `memory.py`), plan the
layout (`planner.plan_kv_cache`, logged), and start the engine.
"""

from __future__ import annotations

import itertools
import logging
import numbers
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Optional, Union

import torch

from hybrid_cache.config import ModelSpec, load_model_spec
from hybrid_cache.engine.engine_args import (
    check_choice,
    check_positive,
    eos_token_ids,
    log_plan,
    resolve_dtype,
)
from hybrid_cache.engine.errors import (
    EngineConfigError,
    InvalidRequestError,
    InvalidSamplingParamsError,
)
from hybrid_cache.engine.llm_engine import LLMEngine, SchedulerLimits
from hybrid_cache.engine.memory import kv_cache_budget
from hybrid_cache.engine.outputs import CompletionOutput, EngineStats, RequestOutput, StepStats
from hybrid_cache.engine.request import FinishReason, Request
from hybrid_cache.engine.sampling_params import SamplingParams
from hybrid_cache.engine.scheduler import SCHEDULING_POLICIES
from hybrid_cache.engine.tokenizer import load_tokenizer
from hybrid_cache.models import load_model
from hybrid_cache.planner import GROUP_LAYOUTS, KVCacheLayout, PlanOptions, plan_kv_cache
from hybrid_cache.sizes import MemorySize

logger = logging.getLogger(__name__)

Prompt = Union[str, Mapping[str, Any]]
DEFAULT_MAX_NUM_SEQS = 256
DEFAULT_MAX_NUM_BATCHED_TOKENS = 2048


class LLM:
    """An engine over one model. `generate` runs a batch of prompts to completion."""

    def __init__(
        self,
        model: str,
        load_format: str = "auto",
        kv_cache_memory: Optional[MemorySize] = None,
        max_model_len: Optional[int] = None,
        block_size: int = 16,
        kv_cache_mode: str = "hybrid",
        kv_group_layout: str = "auto",
        enable_prefix_caching: bool = True,
        max_num_seqs: int = DEFAULT_MAX_NUM_SEQS,
        max_num_batched_tokens: int = DEFAULT_MAX_NUM_BATCHED_TOKENS,
        hf_overrides: Optional[Mapping[str, Any]] = None,
        dtype: Union[str, torch.dtype, None] = None,
        device: Union[str, torch.device, None] = None,
        seed: int = 0,
        attention_backend: str = "auto",
        gpu_memory_utilization: float = 0.9,
        scheduling_policy: str = "fcfs",
        enforce_eager: bool = False,
    ) -> None:
        """`model`: a local Hugging Face folder (config.json + safetensors, tokenizer optional)
        or a built-in preset name (always random weights). `dtype` defaults to the config's on
        CUDA and float32 on the CPU; `device` to CUDA when available. `max_model_len` defaults to
        the model's `max_position_embeddings`. Without `kv_cache_memory` the budget is profiled
        on CUDA (`gpu_memory_utilization` of the device) and 512 MiB on the CPU.
        `kv_group_layout`: the planner's `group_layout` ("auto", "equal" or "per-type": equal-size
        KV-cache groups as vLLM makes them, or one group per layer type; see `planner`).
        `attention_backend`: "auto" (per KV-cache group, the fastest backend that can run it;
        always the vectorised torch backend on the CPU), or "torch" / "reference" / "triton" /
        "flash_attn" forced. `scheduling_policy`: "fcfs" (first come first served) or "lpm"
        (longest cached prefix first among the first waiting requests; see `scheduler`).
        `enforce_eager`: run every step eagerly. Every step runs eagerly today (CUDA graphs
        for pure-decode steps are not built yet); the flag is checked and kept
        (`self.enforce_eager`) so callers can already pass it."""
        check_choice("scheduling_policy", scheduling_policy, SCHEDULING_POLICIES)
        if not isinstance(enforce_eager, bool):
            raise EngineConfigError(f"enforce_eager must be True or False, got {enforce_eager!r}")
        self.enforce_eager: bool = enforce_eager
        check_choice("load_format", load_format, ("auto", "dummy"))
        check_choice("kv_cache_mode", kv_cache_mode, ("hybrid", "uniform"))
        check_choice("kv_group_layout", kv_group_layout, GROUP_LAYOUTS)
        for name, value in (
            ("max_num_seqs", max_num_seqs),
            ("max_num_batched_tokens", max_num_batched_tokens),
        ):
            check_positive(name, value)
        if max_model_len is not None:
            check_positive("max_model_len", max_model_len)
        if not 0.0 < gpu_memory_utilization <= 1.0:
            raise EngineConfigError(
                f"gpu_memory_utilization must be in (0, 1], got {gpu_memory_utilization}"
            )

        self.device: torch.device = torch.device(
            device or ("cuda" if torch.cuda.is_available() else "cpu")
        )
        self.spec: ModelSpec = load_model_spec(model, hf_overrides)
        self.dtype: torch.dtype = resolve_dtype(dtype, self.spec, self.device)
        self.max_model_len: int = max_model_len or self.spec.max_position_embeddings
        is_folder = Path(model).is_dir()
        if load_format == "auto" and not is_folder:
            logger.info("%s is a preset without weights: using random (dummy) weights", model)
        self.model = load_model(
            model if is_folder else None,
            spec=self.spec,
            load_format=load_format if is_folder else "dummy",
            dtype=self.dtype,
            device=self.device,
            seed=seed,
        )
        self.tokenizer = load_tokenizer(model) if is_folder else None

        budget = kv_cache_budget(
            self.model,
            self.device,
            kv_cache_memory,
            gpu_memory_utilization,
            max_num_batched_tokens,
            max_num_seqs,
        )
        options = PlanOptions(
            kv_cache_memory=budget,
            max_model_len=self.max_model_len,
            block_size=block_size,
            kv_cache_dtype=str(self.dtype).removeprefix("torch."),
            max_num_batched_tokens=max_num_batched_tokens,
            group_layout=kv_group_layout,
        )
        self.layout: KVCacheLayout = plan_kv_cache(self.spec, options, mode=kv_cache_mode)
        log_plan(self.layout, self.spec)
        self.engine: LLMEngine = LLMEngine.from_model(
            self.model,
            self.layout,
            SchedulerLimits(
                max_model_len=self.max_model_len,
                max_num_seqs=max_num_seqs,
                max_num_batched_tokens=max_num_batched_tokens,
                enable_prefix_caching=enable_prefix_caching,
                scheduling_policy=scheduling_policy,
            ),
            vocab_size=self.spec.vocab_size,
            eos_token_ids=eos_token_ids(self.spec.hf_config, self.tokenizer),
            dtype=self.dtype,
            device=self.device,
            seed=seed,
            attention_backend=attention_backend,
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
        requests: dict[str, Request] = {}
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

    def make_output(self, request: Request, prompt: Prompt) -> RequestOutput:
        reason = request.finish_reason
        assert reason is not None, f"{request} has not finished"
        text = None
        if self.tokenizer is not None and reason is not FinishReason.ERROR:
            text = self.tokenizer.decode(request.output_token_ids, skip_special_tokens=True)
        return RequestOutput(
            request_id=request.request_id,
            prompt=prompt if isinstance(prompt, str) else None,
            prompt_token_ids=request.prompt_token_ids,
            outputs=[CompletionOutput(0, list(request.output_token_ids), text, reason.value)],
            num_cached_tokens=request.num_cached_tokens,
            num_preemptions=request.num_preemptions,
            error=request.error,
        )


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
