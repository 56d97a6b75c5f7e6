"""`LLMEngine`: the step loop behind `LLM` — validate and add requests, schedule, run, collect.

`add_request` = `check_request` (validate, build the `Request`) + `enqueue`; a bad request
raises alone. One step = `Scheduler.schedule()` (which requests, how many tokens,
preemptions), then the runner's `execute()` (forward + sampling), then `Scheduler.update_from_output()` (tokens,
finishes, blocks returned). Finished requests (including failed and aborted ones) come back from
`step()`: a `Request`, or for a prompt with several samples (`n > 1`, `best_of`) its
`SampleGroup` once every sample has finished. A finished request's text is decoded then.

The runner is any `StepRunner` (step_runner.py). `LLMEngine.from_model` builds the real
`ModelRunner` (what `LLM` uses); `bench/simulate.py` passes one that runs no model.
"""

from __future__ import annotations

import logging
from collections import deque
from typing import Any, Optional, Union

import torch
from torch import nn

from hybrid_cache.engine.byte_level import byte_level_vocab
from hybrid_cache.engine.detokenizer import IncrementalDetokenizer
from hybrid_cache.engine.engine_config import SchedulerLimits
from hybrid_cache.engine.errors import (
    InvalidRequestError,
    PromptTooLongError,
    UnsupportedSamplingParamsError,
)
from hybrid_cache.engine.kv_cache import KVCacheManager, num_kv_tokens
from hybrid_cache.engine.model_runner import ModelRunner, StepBroadcaster
from hybrid_cache.engine.outputs import EngineStats, PrefixMisses, StepStats
from hybrid_cache.engine.parallel_sampling import (
    SampleGroup,
    child_params,
    child_request_id,
)
from hybrid_cache.engine.request import FinishReason, Request
from hybrid_cache.engine.sampler import Sampler
from hybrid_cache.engine.sampling_params import SamplingParams
from hybrid_cache.engine.scheduler import Scheduler
from hybrid_cache.engine.step_runner import StepRunner, StepRunnerFactory
from hybrid_cache.planner import KVCacheLayout

logger = logging.getLogger(__name__)

# Per-step figures kept for callers (plots, benchmarks). Bounded so a server that loops on
# `step()` without calling `reset_step_stats()` does not grow forever (about 270 B a step).
MAX_STEP_STATS = 100_000

# What `step()` returns for each finished prompt.
Finished = Union[Request, SampleGroup]


class LLMEngine:
    """Requests in, finished requests out; owns the KV-cache manager, scheduler and runner."""

    def __init__(
        self,
        layout: KVCacheLayout,
        limits: SchedulerLimits,
        vocab_size: int,
        eos_token_ids: tuple[int, ...],
        make_runner: StepRunnerFactory,
        seed: int = 0,
        tokenizer: Optional[Any] = None,
    ) -> None:
        """`make_runner(kv_cache, sampler)` builds the runner of every step; `from_model` is
        the usual way in. `tokenizer` (optional) decodes outputs and matches stop strings."""
        self.tokenizer: Optional[Any] = tokenizer
        if tokenizer is not None:
            # A byte-level tokenizer's token table (`byte_level.py`) is built now, not on the
            # first request that asks for text (about 0.3 s for a 128k vocabulary).
            byte_level_vocab(tokenizer, getattr(tokenizer, "backend_tokenizer", None), True)
        self.limits: SchedulerLimits = limits
        self.vocab_size: int = vocab_size
        self.eos_token_ids: tuple[int, ...] = eos_token_ids
        self.kv_cache: KVCacheManager = KVCacheManager.from_layout(
            layout,
            max_num_seqs=limits.max_num_seqs,
            max_model_len=limits.max_model_len,
            max_num_batched_tokens=limits.max_num_batched_tokens,
            enable_prefix_caching=limits.enable_prefix_caching,
            hash_seed=seed,
            tail_replay=limits.tail_replay,
            token_tails=limits.token_tails,
            protected_fraction=limits.protected_prefix_fraction,
        )
        self.scheduler: Scheduler = Scheduler(
            self.kv_cache,
            limits.max_num_seqs,
            limits.max_num_batched_tokens,
            policy=limits.scheduling_policy,
            hold_waiting_prefixes=limits.hold_waiting_prefixes,
            admission_headroom=limits.admission_headroom == "on"
            or (limits.admission_headroom == "auto" and self.kv_cache.has_windows),
        )
        self.sampler: Sampler = Sampler(seed)
        self.model_runner: StepRunner = make_runner(self.kv_cache, self.sampler)
        self.num_requests_added: int = 0
        self.unfinished_request_ids: set[str] = set()
        # Prompts with several samples, by their id and by each sample's engine id.
        self.groups: dict[str, SampleGroup] = {}
        self.group_of_child: dict[str, SampleGroup] = {}
        self.stats: EngineStats = EngineStats(
            max_used_blocks_per_group=[0] * self.kv_cache.num_groups
        )
        self.step_stats: deque[StepStats] = deque(maxlen=MAX_STEP_STATS)

    @classmethod
    def from_model(
        cls,
        model: nn.Module,
        layout: KVCacheLayout,
        limits: SchedulerLimits,
        vocab_size: int,
        eos_token_ids: tuple[int, ...],
        dtype: torch.dtype,
        device: torch.device,
        seed: int = 0,
        attention_backend: str = "auto",
        tokenizer: Optional[Any] = None,
        parallel: Optional[StepBroadcaster] = None,
        cuda_graphs: bool = False,
    ) -> LLMEngine:
        """An engine whose steps run `model` (a `ModelRunner`, with its KV tensors; `parallel`:
        rank 0's executor of a tensor-parallel engine, which sends each step to the others;
        `cuda_graphs`: pure-decode steps replay CUDA graphs where the model and device allow)."""

        def make_runner(kv_cache: KVCacheManager, sampler: Sampler) -> ModelRunner:
            return ModelRunner(
                model,
                kv_cache,
                layout,
                dtype,
                device,
                sampler,
                attention_backend,
                parallel,
                decode_graph_batch=limits.max_num_seqs if cuda_graphs else 0,
                max_model_len=limits.max_model_len,
            )

        return cls(layout, limits, vocab_size, eos_token_ids, make_runner, seed, tokenizer)

    def check_sampling_params(self, params: SamplingParams) -> None:
        """Raises `UnsupportedSamplingParamsError` for valid params this engine cannot honour:
        stop strings without a tokenizer, more logprobs than the vocabulary holds."""
        if params.stop and self.tokenizer is None:
            raise UnsupportedSamplingParamsError(
                f"stop strings {list(params.stop)} need a tokenizer and this model has none: "
                "use stop_token_ids, or a model folder with tokenizer files"
            )
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(params, name)
            if value is not None and value > self.vocab_size:
                raise UnsupportedSamplingParamsError(
                    f"{name}={value} is more than the vocabulary's {self.vocab_size} tokens: "
                    "lower it"
                )

    def add_request(
        self, request_id: str, prompt_token_ids: list[int], params: SamplingParams
    ) -> Finished:
        """Validates and queues a request (one per sample); raises a typed
        `InvalidRequestError` (nothing queued, other requests untouched) for a request id in
        use, an empty prompt, ids outside the vocabulary, a prompt over `max_model_len`, a
        request the pool can never hold, or sampling params the engine cannot honour. Returns
        the `Request`, or the `SampleGroup` of a prompt with several samples."""
        return self.enqueue(self.check_request(request_id, prompt_token_ids, params))

    def check_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        name: Optional[str] = None,
    ) -> Finished:
        """What `add_request` would queue, validated (the same errors) but not queued:
        `LLM.generate` checks a whole batch this way before queuing any of it. `name`: how
        error messages name the request (default "request '<id>'"; `LLM` names batch entries
        by index, since their ids are the engine's own)."""
        who = name or f"request {request_id!r}"
        if request_id in self.unfinished_request_ids or request_id in self.group_of_child:
            raise InvalidRequestError(f"request id {request_id!r} is already in use")
        if len(prompt_token_ids) == 0:
            raise InvalidRequestError(f"{who}: the prompt is empty")
        bad = [t for t in prompt_token_ids if not 0 <= t < self.vocab_size]
        if bad:
            raise InvalidRequestError(
                f"{who}: token ids {bad[:5]} are outside the vocabulary [0, {self.vocab_size})"
            )
        max_model_len = self.limits.max_model_len
        if len(prompt_token_ids) > max_model_len:
            raise PromptTooLongError(
                f"{who}: the prompt has {len(prompt_token_ids)} tokens, more "
                f"than max_model_len={max_model_len}; shorten it or raise max_model_len"
            )
        self.check_sampling_params(params)
        num_samples = params.num_samples
        if num_samples == 1 and params.n == 1:
            request = self._make_request(request_id, prompt_token_ids, params)
            if not self.kv_cache.can_ever_fit(num_kv_tokens(request)):
                raise self.kv_cache.does_not_fit(request, name=name)
            return request
        child_ids = [child_request_id(request_id, index) for index in range(num_samples)]
        in_use = [
            child_id
            for child_id in child_ids
            if child_id in self.unfinished_request_ids or child_id in self.group_of_child
        ]
        if in_use:
            raise InvalidRequestError(f"{who}: its samples' ids {in_use} are already in use")
        children = [
            self._make_request(
                child_id,
                prompt_token_ids,
                child_params(params, index),
                track_logprobs=num_samples > params.n,
            )
            for index, child_id in enumerate(child_ids)
        ]
        if not self.kv_cache.can_ever_fit(num_kv_tokens(children[0])):
            raise self.kv_cache.does_not_fit(children[0], name=name)
        return SampleGroup(request_id, params, children)

    def _make_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        track_logprobs: bool = False,
    ) -> Request:
        detokenizer = None
        if self.tokenizer is not None and params.detokenize:
            detokenizer = IncrementalDetokenizer(self.tokenizer, prompt_token_ids, params)
        return Request(
            request_id,
            prompt_token_ids,
            params,
            arrival_index=0,  # set when queued
            max_total_tokens=min(
                len(prompt_token_ids) + params.max_tokens, self.limits.max_model_len
            ),
            eos_token_ids=self.eos_token_ids,
            detokenizer=detokenizer,
            track_logprobs=track_logprobs,
            logprob_log=self.model_runner.logprob_log,
        )

    def enqueue(self, item: Finished) -> Finished:
        """Queues a request (or every sample of a group) from `check_request`; its arrival
        order is now. The samples go one after another: the first's prompt blocks come first."""
        ids = [item.request_id]
        if isinstance(item, SampleGroup):
            ids += [child.request_id for child in item.children]
        in_use = [i for i in ids if i in self.unfinished_request_ids or i in self.group_of_child]
        if in_use:
            raise InvalidRequestError(f"request ids {in_use} are already in use")
        if isinstance(item, SampleGroup):
            for child in item.children:
                self._queue(child)
                self.group_of_child[child.request_id] = item
            self.groups[item.request_id] = item
        else:
            self._queue(item)
        self.unfinished_request_ids.add(item.request_id)
        return item

    def _queue(self, request: Request) -> None:
        request.arrival_index = self.num_requests_added
        self.num_requests_added += 1
        self.scheduler.add_request(request)

    def abort_request(self, request_id: str) -> Optional[Finished]:
        """Stops a request (every sample of it: a sample's id stops its whole group) and
        returns its blocks; None when it is unknown or finished."""
        group = self.groups.get(request_id) or self.group_of_child.get(request_id)
        if group is not None:
            del self.groups[group.request_id]
            for child in group.children:
                if self.scheduler.abort_request(child.request_id) is not None:
                    self.sampler.free(child.request_id)
                    child.finish_text()
                self.group_of_child.pop(child.request_id, None)
            group.num_unfinished = 0
            self.unfinished_request_ids.discard(group.request_id)
            return group
        request = self.scheduler.abort_request(request_id)
        if request is not None:
            self.sampler.free(request_id)
            self.unfinished_request_ids.discard(request_id)
            request.finish_text()  # the text so far
        return request

    def reset_step_stats(self) -> None:
        """Forgets the per-step figures (totals in `stats` are kept)."""
        self.step_stats.clear()

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    def step(self) -> list[Finished]:
        """Runs one step; returns the requests that finished (or failed) in it: a `Request`,
        or a `SampleGroup` when its last sample finished."""
        output = self.scheduler.schedule()
        sampled = self.model_runner.execute(output)
        finished = output.failed + self.scheduler.update_from_output(output, sampled)
        results: list[Finished] = []
        group_of_child = self.group_of_child
        for request in finished:
            self.sampler.free(request.request_id)
            if request.finish_reason is not FinishReason.ERROR:
                request.finish_text()
            group = group_of_child.pop(request.request_id, None) if group_of_child else None
            if group is None:
                self.unfinished_request_ids.discard(request.request_id)
                results.append(request)
                continue
            group.num_unfinished -= 1
            if group.is_finished:
                del self.groups[group.request_id]
                self.unfinished_request_ids.discard(group.request_id)
                results.append(group)
        self._record_step(output.num_preemptions, len(output.requests), output.num_scheduled_tokens)
        return results

    def _record_step(
        self, num_preemptions: int, num_scheduled_requests: int, num_scheduled_tokens: int
    ) -> None:
        used = self.kv_cache.num_used_blocks_per_group()
        stats = self.stats
        stats.num_steps += 1
        stats.num_preemptions += num_preemptions
        # Every prefix-cache counter moves only with a lookup, which queries tokens: the
        # counters' dict is read only then.
        if self.kv_cache.num_prefix_queries != stats.num_prefix_query_tokens:
            core = self.kv_cache.stats()
            stats.num_prefix_query_tokens = core["prefix_queries"]
            stats.num_prefix_hit_tokens = core.get("prefix_hits", 0)
            stats.prefix_misses = PrefixMisses.from_core(core)
            stats.prefix_alone_hit_tokens_per_group = list(
                core.get("prefix_alone_hits_per_group", [])
            )
            stats.prefix_shortened_tokens_per_group = list(
                core.get("prefix_shortened_per_group", [])
            )
            stats.num_tail_replays = core.get("prefix_replays", 0)
            stats.num_tail_replay_tokens = core.get("prefix_replay_tokens", 0)
            stats.num_tail_replay_gain_tokens = core.get("prefix_replay_gain", 0)
            stats.num_token_tail_hits = core.get("prefix_tail_hits", 0)
            stats.num_token_tail_gain_tokens = core.get("prefix_tail_gain", 0)
        stats.max_used_blocks_per_group = list(map(max, stats.max_used_blocks_per_group, used))
        self.step_stats.append(
            StepStats(
                num_scheduled_requests=num_scheduled_requests,
                num_scheduled_tokens=num_scheduled_tokens,
                num_running=len(self.scheduler.running),
                num_waiting=len(self.scheduler.waiting),
                num_preemptions=num_preemptions,
                num_used_blocks_per_group=used,
                num_free_blocks=self.kv_cache.num_free_blocks,
                prefix_cache_hit_rate=stats.prefix_cache_hit_rate,
                prefix_misses=stats.prefix_misses,
            )
        )
