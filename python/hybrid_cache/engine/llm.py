"""`LLM`: the user-facing front, in the shape vLLM users know.

    llm = LLM(model="path/to/hf-folder")            # or a preset name, e.g. "tiny-gemma3"
    outputs = llm.generate(["Hello", [1, 2, 3]], SamplingParams(max_tokens=8))
    outputs = llm.chat([{"role": "user", "content": "Hello"}])

Construction: the arguments become one validated `EngineConfig` (`llm.config`); then the device
is checked, the config (+ `hf_overrides`) read into the `ModelSpec` and the generation config
into the EOS ids and default sampling params (`generation_config.py`); where the KV budget is
known without the model, the plan is made and checked now (one `max_model_len` request must fit,
and the KV tensors must fit the device's free memory), so a bad budget fails before the weights
load. Then the model is built (weights from the folder, or seeded random weights with
`load_format="dummy"`), the KV cache sized (`memory.py`: profiled on CUDA), the layout planned
(`planner.plan_kv_cache`, logged) and checked, and the engine started.

`generate` and `chat` check their whole batch first (`prompts.py`) and raise one
`InvalidRequestsError` listing every bad prompt before anything runs; the step API
(`self.engine`, `LLMEngine.add_request` / `step`) fails one request alone.
"""

from __future__ import annotations

import atexit
import functools
import gc
import itertools
import logging
import os
from collections.abc import Mapping, Sequence
from typing import Any, Callable, Optional, Union

import torch

from hybrid_cache.config import ModelSpec, check_tensor_parallel
from hybrid_cache.engine.engine_args import (
    check_one_request_fits,
    eos_token_ids,
    load_engine_model,
    log_plan,
    needs_profile,
    rank_device,
    resolve_device,
    resolve_dtype,
)
from hybrid_cache.engine.engine_config import EngineConfig
from hybrid_cache.engine.errors import (
    InvalidRequestError,
    InvalidRequestsError,
    InvalidSamplingParamsError,
    NoTokenizerError,
)
from hybrid_cache.engine.generation_config import (
    GenerationDefaults,
    log_generation_defaults,
    read_generation_defaults,
)
from hybrid_cache.engine.llm_engine import Finished, LLMEngine
from hybrid_cache.engine.memory import check_kv_cache_fits, kv_cache_budget
from hybrid_cache.engine.output_builder import request_output
from hybrid_cache.engine.outputs import EngineStats, RequestOutput, StepStats
from hybrid_cache.engine.parallel.executor import (
    READY,
    TensorParallelExecutor,
    is_torchrun_worker,
)
from hybrid_cache.engine.parallel.process_group import local_rank
from hybrid_cache.engine.parallel.worker import serve_torchrun_rank
from hybrid_cache.engine.prompts import (
    render_chat,
    resolve_chat_template,
    split_conversations,
    split_prompts,
    tokenize_prompt,
)
from hybrid_cache.engine.sampling_params import SamplingParams
from hybrid_cache.engine.tokenizer import load_tokenizer
from hybrid_cache.models.parallel_layers import NO_SHARD
from hybrid_cache.planner import KVCacheLayout, plan_kv_cache

logger = logging.getLogger(__name__)
# What `LLM` freezes is unfrozen at exit, so the last collection sees everything again.
atexit.register(gc.unfreeze)

TP_HINT = " (LLM argument tensor_parallel_size)"
Prompt = Union[str, Sequence[int], Mapping[str, Any]]
Message = Mapping[str, Any]
# A checked batch: per prompt, its request (validated, not yet queued) and its text.
CheckedBatch = list[tuple[Finished, Optional[str]]]


class LLM:
    """An engine over one model. `generate` runs a batch of prompts to completion."""

    def __init__(self, model: Union[str, os.PathLike, EngineConfig], **kwargs: Any) -> None:
        """`model`: a local Hugging Face folder (config.json + safetensors, tokenizer and
        generation_config.json optional) or a built-in preset name (always random weights), or
        an `EngineConfig`; `kwargs`: the `EngineConfig` fields (`kv_cache_memory`,
        `max_model_len`, `block_size`, `kv_cache_mode`, `kv_group_layout`, `max_num_seqs`,
        `max_num_batched_tokens`, `enable_prefix_caching`, `scheduling_policy`, `hf_overrides`,
        `generation_config`, `load_format`, `dtype`, `device`, `seed`, `attention_backend`,
        `gpu_memory_utilization`, `enforce_eager`, `tensor_parallel_size`,
        `distributed_timeout`, `vocab_parallel`; see there for their defaults), or with an `EngineConfig`, the
        fields to replace. Every argument is checked before any work: a bad one raises a typed
        `EngineConfigError` (or `PlanError`, `MemorySizeError`, `ConfigError`) naming it; a
        device the machine lacks is a `DeviceUnavailableError`, a budget the device cannot
        give a `KVCacheMemoryError`, a budget below one `max_model_len` request a
        `BudgetTooSmallError`, a `tensor_parallel_size` that does not shard the model (or
        more ranks than GPUs) a `TensorParallelConfigError`. With `tensor_parallel_size` N > 1
        the worker processes start here (`engine/parallel/`); a rank that fails to start, and
        later one that dies or hangs, raises `WorkerFailedError`; `shutdown()` stops them."""
        self.config: EngineConfig = EngineConfig.of(model, **kwargs)
        config = self.config
        if config.tensor_parallel_size > 1 and is_torchrun_worker():
            serve_torchrun_rank(config)  # returns when rank 0 shuts down
            raise SystemExit(0)
        # On CUDA, pure-decode steps replay CUDA graphs unless this is set (`decode_graphs.py`).
        self.enforce_eager: bool = config.enforce_eager
        self.device: torch.device = resolve_device(config.device)
        self.spec: ModelSpec = config.model_spec()
        tensor_parallel_size = config.tensor_parallel_size
        if tensor_parallel_size > 1:
            check_tensor_parallel(self.spec, tensor_parallel_size, TP_HINT)
            self.device = rank_device(self.device, 0, tensor_parallel_size, local_rank())
        # The KV cache is planned per rank: each rank holds its share of the KV heads.
        self.kv_spec: ModelSpec = self.spec.per_rank(tensor_parallel_size)
        self.dtype: torch.dtype = resolve_dtype(config.dtype, self.spec, self.device)
        self.max_model_len: int = config.resolved_max_model_len(self.spec)
        self.generation_defaults: GenerationDefaults = read_generation_defaults(
            config.model, config.generation_config
        )
        # A budget that needs no profile run is planned and checked before the weights load.
        layout = None
        if not needs_profile(config, self.device):
            layout = self.plan_layout(self.kv_budget(None))
        self.parallel: Optional[TensorParallelExecutor] = None
        if tensor_parallel_size > 1:
            self.parallel = TensorParallelExecutor.start(config, self.device)
        try:
            self._build(layout)
        except BaseException:
            self.shutdown()
            raise
        self.request_counter: itertools.count[int] = itertools.count()
        # Everything alive now (the model, the imported libraries: hundreds of thousands of
        # objects) lives as long as the engine: out of the garbage collector's full passes,
        # which would otherwise walk all of it whenever a step makes many objects (a
        # `Logprob` per token and position). The engine's objects hold no reference cycles,
        # so a dropped `LLM` is still freed (by reference counting). vLLM does the same.
        gc.freeze()

    def _build(self, layout: Optional[KVCacheLayout]) -> None:
        """Loads the model (this rank's shard), plans the KV cache where the budget needed the
        model, and starts the engine; under tensor parallelism each stage in step with the
        workers (`engine/parallel/worker.py` mirrors it)."""
        config, parallel = self.config, self.parallel
        shard = NO_SHARD if parallel is None else parallel.shard
        self.model = load_engine_model(config, self.spec, self.dtype, self.device, shard)
        if parallel is not None:
            parallel.confirm("loaded")
        self.tokenizer = load_tokenizer(config.tokenizer_source)
        if layout is None:
            budget = self.kv_budget(self.model)
            if parallel is not None:
                budget = parallel.agree_budget(budget)
            layout = self.plan_layout(budget)
        else:  # again, now that the weights hold their share of the memory
            check_kv_cache_fits(layout.tensor_bytes * layout.layers_per_group, self.device)
        if parallel is not None:
            parallel.share_layout(layout)
        self.layout: KVCacheLayout = layout
        log_plan(self.layout, self.kv_spec)
        log_generation_defaults(self.generation_defaults, config.generation_config)
        self.engine: LLMEngine = LLMEngine.from_model(
            self.model,
            self.layout,
            config.scheduler_limits(self.max_model_len),
            vocab_size=self.spec.vocab_size,
            eos_token_ids=eos_token_ids(
                self.spec.hf_config, self.tokenizer, self.generation_defaults.eos_token_ids
            ),
            dtype=self.dtype,
            device=self.device,
            seed=config.seed,
            attention_backend=config.attention_backend,
            tokenizer=self.tokenizer,
            parallel=parallel,
            cuda_graphs=not config.enforce_eager,
        )
        if parallel is not None:
            parallel.confirm(READY)

    def shutdown(self) -> None:
        """Stops the tensor-parallel worker processes (a no-op on one rank); the engine cannot
        run steps after it. Also runs at interpreter exit, and on leaving a `with LLM(...)`."""
        if getattr(self, "parallel", None) is not None:
            self.parallel.shutdown()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc_info: Any) -> None:
        self.shutdown()

    def kv_budget(self, model: Optional[torch.nn.Module]) -> int:
        """Bytes for the KV cache (`memory.kv_cache_budget`; `model` is needed only to profile
        a CUDA device)."""
        config = self.config
        return kv_cache_budget(
            model,
            self.device,
            config.kv_cache_memory,
            config.gpu_memory_utilization,
            config.max_num_batched_tokens,
            config.max_num_seqs,
        )

    def plan_layout(self, budget: int) -> KVCacheLayout:
        """The plan of `budget`, checked: one `max_model_len` request fits, and the KV tensors
        fit the device's free memory."""
        options = self.config.plan_options(
            budget, self.max_model_len, kv_cache_dtype=str(self.dtype).removeprefix("torch.")
        )
        layout = plan_kv_cache(self.kv_spec, options, mode=self.config.kv_cache_mode)
        check_one_request_fits(layout, self.kv_spec, budget)
        check_kv_cache_fits(layout.tensor_bytes * layout.layers_per_group, self.device)
        return layout

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

    def get_tokenizer(self) -> Any:
        """The model folder's tokenizer; `NoTokenizerError` for a preset or a folder without
        tokenizer files."""
        if self.tokenizer is None:
            raise NoTokenizerError(
                f"{self.config.model} has no tokenizer (a preset, a folder without tokenizer "
                "files, or transformers is not installed)"
            )
        return self.tokenizer

    def get_default_sampling_params(self) -> SamplingParams:
        """The params of a `generate` / `chat` call that passes none: `SamplingParams()` with
        the generation config's values (`generation_config="vllm"`: without them)."""
        return self.generation_defaults.sampling_params()

    def generate(
        self,
        prompts: Union[Prompt, Sequence[Prompt]],
        sampling_params: Union[SamplingParams, Sequence[SamplingParams], None] = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Runs every prompt to completion and returns one output per prompt, in order.

        `prompts`: one prompt or a list (`prompts.py`: text, `{"prompt": text}`, token ids,
        `{"prompt_token_ids": ids}`); `sampling_params`: one for all, one each, or None for
        `get_default_sampling_params()`.

        Errors, all raised before anything runs: a `sampling_params` list of the wrong length
        or an entry that is not a `SamplingParams` raises `InvalidSamplingParamsError`; bad
        prompts (empty, not a prompt, text without a tokenizer, ids outside the vocabulary,
        longer than `max_model_len` or than the whole KV pool can hold) raise one
        `InvalidRequestsError` whose `errors` lists each one's index and typed error.
        """
        batch = split_prompts(prompts)
        params = broadcast_params(self.params_or_default(sampling_params), len(batch))
        tokenized = [functools.partial(tokenize_prompt, p, self.tokenizer) for p in batch]
        return self.run_batch(self.check_batch(tokenized, params), use_tqdm)

    def chat(
        self,
        messages: Union[Sequence[Message], Sequence[Sequence[Message]]],
        sampling_params: Union[SamplingParams, Sequence[SamplingParams], None] = None,
        use_tqdm: bool = True,
        chat_template: Optional[str] = None,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        tools: Optional[list[Any]] = None,
        chat_template_kwargs: Optional[Mapping[str, Any]] = None,
    ) -> list[RequestOutput]:
        """Generates the next message of a conversation (a list of `{"role", "content"}`
        dicts) or of each of a list of conversations, as `generate` does for prompts.

        The tokenizer's chat template (or `chat_template`: a Jinja string or a file) renders
        each conversation; `add_generation_prompt` opens the assistant's turn,
        `continue_final_message` leaves the last message open instead; `tools` and
        `chat_template_kwargs` go to the template. The text is tokenized without special
        tokens (the template writes the BOS). A model without a tokenizer raises
        `NoTokenizerError`, a tokenizer without a template `InvalidRequestError`; bad
        conversations raise one `InvalidRequestsError` before anything runs."""
        template = resolve_chat_template(self.tokenizer, chat_template)
        if add_generation_prompt and continue_final_message:
            raise InvalidRequestError(
                "add_generation_prompt and continue_final_message exclude each other: the one "
                "opens a new assistant turn, the other continues the last message"
            )
        conversations = split_conversations(messages)
        params = broadcast_params(self.params_or_default(sampling_params), len(conversations))

        rendered = [
            functools.partial(
                render_chat,
                self.tokenizer,
                conversation,
                template,
                add_generation_prompt,
                continue_final_message,
                tools,
                chat_template_kwargs,
            )
            for conversation in conversations
        ]
        return self.run_batch(self.check_batch(rendered, params), use_tqdm)

    def params_or_default(
        self, sampling_params: Union[SamplingParams, Sequence[SamplingParams], None]
    ) -> Union[SamplingParams, Sequence[SamplingParams]]:
        return self.get_default_sampling_params() if sampling_params is None else sampling_params

    def check_batch(
        self,
        prompts: Sequence[Callable[[], tuple[Optional[str], list[int]]]],
        params: Sequence[SamplingParams],
    ) -> CheckedBatch:
        """Each prompt's text and ids (from its callable) as a validated request, nothing
        queued; `InvalidRequestsError` listing every prompt that failed."""
        checked: CheckedBatch = []
        errors: list[tuple[int, InvalidRequestError]] = []
        for index, (tokens, prompt_params) in enumerate(zip(prompts, params)):
            try:
                text, token_ids = tokens()
                request_id = str(next(self.request_counter))
                checked.append(
                    (
                        self.engine.check_request(
                            request_id, token_ids, prompt_params, name=f"prompt {index}"
                        ),
                        text,
                    )
                )
            except InvalidRequestError as error:
                errors.append((index, error))
        if errors:
            raise InvalidRequestsError(errors, len(prompts))
        return checked

    def run_batch(self, checked: CheckedBatch, use_tqdm: bool) -> list[RequestOutput]:
        """Queues the checked requests, steps until each has finished, returns their outputs
        in order (a request that fails while running, which a checked one should not, has
        `finish_reason == "error"` and its error in `output.error`)."""
        self.engine.reset_step_stats()
        index_of = {request.request_id: index for index, (request, _) in enumerate(checked)}
        outputs: list[Optional[RequestOutput]] = [None] * len(checked)
        progress = make_progress_bar(use_tqdm, len(checked))
        try:
            for request, _ in checked:
                self.engine.enqueue(request)
            while self.engine.has_unfinished_requests():
                for request in self.engine.step():
                    index = index_of.get(request.request_id)
                    if index is None:
                        continue  # added through `self.engine` directly, not by this call
                    outputs[index] = self.make_output(request, checked[index][1])
                    if progress is not None:
                        progress.update(1)
        except BaseException:
            for request, _ in checked:
                self.engine.abort_request(request.request_id)  # give every block back
            raise
        finally:
            if progress is not None:
                progress.close()
        assert all(output is not None for output in outputs), "every prompt gets an output"
        return outputs  # type: ignore[return-value]

    def tokenize(self, prompt: Prompt) -> list[int]:
        """Token ids of one prompt (any form `generate` takes); `InvalidRequestError` if bad."""
        return tokenize_prompt(prompt, self.tokenizer)[1]

    def make_output(self, request: Finished, prompt: Optional[str]) -> RequestOutput:
        """The output of a finished request (or of all the samples of one prompt)."""
        return request_output(request, prompt, self.tokenizer)


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
