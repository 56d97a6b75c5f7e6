"""Runs one scheduled step: builds the batch, runs the model over the paged KV cache, samples.

KV memory: one tensor per *layer slot*. The planner puts layers into groups of equal size;
slot j holds the j-th layer of every group, so all groups draw blocks from one pool and a block id
means the same bytes in every slot (in the per-type layout there is one slot, and each group's n
layers share its pages). Each layer views its slot with its own group's block size:

    slot tensor  [num_blocks, page_bytes / element size]     (the planner's one page size; on
                 the CPU on transparent huge pages where offered: `host_memory.py`)
    page         [2, n, block_size_g, kv_heads, head_dim]    (keys of the group's n layers in
                 this slot, then their values; n = 1 but in the per-type layout; the rest of
                 the page, if any, is the page padding the planner reports)
    layer view   [num_blocks, 2, block_size_g, kv_heads, head_dim] -> k = [:, 0], v = [:, 1]

The grouped block table is the core's memory (see `kv_cache.py`); per step the runner gathers the
scheduled rows (only the columns the batch can reach), and every per-token array (input ids,
positions, slot mappings) is built with tensor operations, not Python loops over tokens.
"""

from __future__ import annotations

import itertools
import logging
import operator
from collections.abc import Sequence
from dataclasses import dataclass, fields
from typing import Any, NamedTuple, Optional, Protocol

import numpy as np
import torch
from torch import nn

from hybrid_cache.attention import (
    Attention,
    AttentionMetadata,
    assign_layer_groups,
    attention_layers,
    build_attention_metadata,
    set_forward_context,
)
from hybrid_cache.attention.decode_inputs import DecodeInputBuffers
from hybrid_cache.attention.selector import (
    describe_attention_backends,
    select_attention_backends,
)
from hybrid_cache.engine import host_memory
from hybrid_cache.engine.decode_graphs import (
    DecodeGraphs,
    GraphCaptureError,
    supports_decode_graphs,
)
from hybrid_cache.engine.kv_cache import KVCacheManager
from hybrid_cache.engine.logprobs import LogprobLog, greedy_token_logprobs, token_logprobs
from hybrid_cache.engine.parallel.step_inputs import (
    PROMPT_LOGPROBS_CHUNK,
    StepInputs,
    gather_step_inputs,
    sampled_rows,
    step_batch,
)
from hybrid_cache.engine.request import Request, same_requests
from hybrid_cache.engine.sampler import Sampler, plain_greedy
from hybrid_cache.engine.scheduler import SchedulerOutput
from hybrid_cache.models.parallel_layers import is_vocab_parallel
from hybrid_cache.planner import KVCacheLayout

logger = logging.getLogger(__name__)


class StepBroadcaster(Protocol):
    """What a tensor-parallel runner needs of its executor (`engine/parallel/executor.py`)."""

    def send(self, inputs: StepInputs) -> None:
        """Sends the step to every other rank."""
        ...

    def collectives(self) -> Any:
        """A context in which a failed collective becomes a `WorkerFailedError`."""
        ...


def allocate_kv_caches(
    model: nn.Module, layout: KVCacheLayout, dtype: torch.dtype, device: torch.device
) -> tuple[list[torch.Tensor], list[tuple[torch.Tensor, torch.Tensor]]]:
    """Returns the layout's slot tensors and, per layer index, its (k_cache, v_cache) views."""
    layers_by_index = {layer.layer_index: layer for layer in attention_layers(model)}
    element_size = torch.empty((), dtype=dtype).element_size()
    assert layout.page_bytes % element_size == 0, "a page must hold whole elements"
    page_elements = layout.page_bytes // element_size
    shape = (layout.num_blocks, page_elements)
    slots = [
        host_memory.zeros(shape, dtype)
        if device.type == "cpu"
        else torch.zeros(shape, dtype=dtype, device=device)
        for _ in range(layout.layers_per_group)
    ]
    kv_caches: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
    for slot, layers in enumerate(layout.tensor_slots):
        for group, members in zip(layout.groups, layers):
            for part, layer_index in enumerate(members):  # none: a padded slot of a short group
                kv_caches[layer_index] = _layer_view(
                    slots[slot], layers_by_index[layer_index], group.block_size, part, len(members)
                )
    assert sorted(kv_caches) == sorted(layers_by_index), (
        "every attention layer needs a place in the layout"
    )
    return slots, [kv_caches[index] for index in sorted(kv_caches)]


def _layer_view(
    slot: torch.Tensor, layer: Attention, block_size: int, part: int, parts: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """(k_cache, v_cache) [num_blocks, block_size, kv_heads, head_dim] of the `part`-th of the
    `parts` layers sharing each page of `slot` [num_blocks, page elements]: keys of all parts,
    then values (see the module docstring)."""
    num_blocks, page_elements = slot.shape
    token = layer.num_kv_heads * layer.head_dim
    block = block_size * token
    assert 2 * parts * block <= page_elements, f"layer {layer.layer_index} does not fit its page"
    view = slot.as_strided(
        (num_blocks, 2, block_size, layer.num_kv_heads, layer.head_dim),
        (page_elements, parts * block, token, layer.head_dim, 1),
        slot.storage_offset() + part * block,
    )
    return view[:, 0], view[:, 1]


def bind_model(
    model: nn.Module,
    layout: KVCacheLayout,
    dtype: torch.dtype,
    device: torch.device,
    attention_backend: str = "auto",
) -> tuple[list[torch.Tensor], list[tuple[torch.Tensor, torch.Tensor]]]:
    """Readies `model` for `layout`: each attention layer told its group (checked), each
    group's backend selected, the KV tensors allocated; returns `allocate_kv_caches`'s
    (slot tensors, per-layer views). What every tensor-parallel rank does alike."""
    block_sizes = [group.block_size for group in layout.groups]
    layer_indices = [layer.layer_index for layer in attention_layers(model)]
    assign_layer_groups(
        model,
        [layout.layer_slot(index)[0] for index in layer_indices],
        layout.group_attention(),
        layout.full_accepts_reach,
    )
    # Per group: "auto" picks the fastest backend that can run it (see attention/selector.py).
    select_attention_backends(model, attention_backend, device, block_sizes, dtype=dtype)
    logger.info(describe_attention_backends(model, block_sizes))
    return allocate_kv_caches(model, layout, dtype, device)


def copy_blocks(
    slot_tensors: Sequence[torch.Tensor], copies: Sequence[tuple[int, int]], device: torch.device
) -> None:
    """Copies page `src` into page `dst` in every slot tensor: every layer's keys and values of
    that block, whichever group it belongs to."""
    pairs = torch.as_tensor(copies, dtype=torch.long).to(device)
    src, dst = pairs[:, 0], pairs[:, 1]
    for slot in slot_tensors:
        slot.index_copy_(0, dst, slot.index_select(0, src))


class ModelRunner:
    """Owns the model, its KV-cache tensors and the sampler; `execute` runs one step. Under
    tensor parallelism (`parallel`: the driver's `TensorParallelExecutor`) each step's inputs
    go to the other ranks first, and every rank builds its batch from them."""

    def __init__(
        self,
        model: nn.Module,
        kv_cache: KVCacheManager,
        layout: KVCacheLayout,
        dtype: torch.dtype,
        device: torch.device,
        sampler: Sampler,
        attention_backend: str = "auto",
        parallel: Optional[StepBroadcaster] = None,
        decode_graph_batch: int = 0,
        max_model_len: int = 0,
    ) -> None:
        """`decode_graph_batch` > 0: pure-decode steps of up to that many sequences replay CUDA
        graphs (`decode_graphs.py`; `max_model_len` sizes their block tables) where the model
        and device allow it; 0: every step runs eagerly."""
        self.model: nn.Module = model
        self.kv_cache: KVCacheManager = kv_cache
        self.device: torch.device = device
        self.sampler: Sampler = sampler
        # The sampled tokens' logprob rows, until their requests take them.
        self.logprob_log: LogprobLog = LogprobLog()
        self.parallel: Optional[StepBroadcaster] = parallel
        # A vocabulary-parallel LM head runs on every rank: the workers get its rows.
        self.vocab_parallel: bool = parallel is not None and is_vocab_parallel(model)
        self.block_sizes: list[int] = [group.block_size for group in kv_cache.groups]
        self.slot_tensors, self.kv_caches = bind_model(
            model, layout, dtype, device, attention_backend
        )
        # The core's grouped block table as numpy (shared memory): gathers rows faster.
        self.block_table_array: np.ndarray = kv_cache.block_table.numpy()
        self.one_block_size: bool = len(set(self.block_sizes)) == 1
        # Host buffers every decode step's metadata is written into (valid for one step).
        self.decode_buffers: DecodeInputBuffers = DecodeInputBuffers(self.block_sizes)
        # Groups a tail replay reads below its frontier without writing (full attention), and
        # whether the core may replay at all (else no step looks at the frontiers).
        self.full_groups: tuple[int, ...] = tuple(
            index for index, group in enumerate(kv_cache.groups) if group.kind == "full"
        )
        self.may_replay: bool = kv_cache.tail_replay_tokens is not None
        self.decode_graphs: Optional[DecodeGraphs] = None
        # A model may cap the batches its decode forward is recorded for.
        decode_graph_batch = min(
            decode_graph_batch, getattr(model, "max_cuda_graph_batch", decode_graph_batch)
        )
        if decode_graph_batch > 0 and parallel is None and supports_decode_graphs(model, device):
            assert max_model_len > 0, "decode graphs size their block tables by max_model_len"
            self.decode_graphs = DecodeGraphs(
                model, self.kv_caches, self.block_sizes, max_model_len, decode_graph_batch, device
            )
        # The last step's sampling columns and what they were taken from (`_columns`).
        self._last_columns: Optional[tuple[list[Request], list[bool], SamplingColumns]] = None
        # The last step's sampled tokens (int64), when every request of its batch sampled on
        # the CPU, with that batch's columns: a decode step of the same batch (the same
        # columns) computes exactly these tokens, which the scheduler appended in order.
        self._last_sampled: Optional[tuple[SamplingColumns, np.ndarray]] = None
        # The columns of the last batch none of whose requests wanted prompt logprobs: a
        # request never wants them again once recorded, so the same batch (the same columns)
        # needs no plan.
        self._no_prompt_logprobs: Optional[SamplingColumns] = None

    @property
    def kv_cache_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.slot_tensors)

    def execute(self, output: SchedulerOutput) -> list[int]:
        """Runs the scheduled tokens; returns the sampled token of each request that samples
        (in `output.scheduled` order). Logprobs are recorded for the requests that ask: the
        sampled tokens' in `logprob_log`, the prompt tokens' on the requests."""
        with _inference_mode():
            return self._execute(output)

    def _execute(self, output: SchedulerOutput) -> list[int]:
        if self.parallel is not None:
            return self._execute_parallel(output)
        if output.block_copies:
            self.copy_blocks(output.block_copies)
        if not output.requests:
            return []
        # Whole columns (C-level maps, no bytecode per request), all taken before the forward,
        # while the requests are in the CPU caches (the forward evicts them).
        requests, num_computed, query_lens = output.requests, output.num_computed, output.num_new
        columns = self._columns(output.samples, requests)
        last = self._last_sampled
        input_ids, metadata, positions = self._prepare_inputs(
            requests,
            output.rows,
            num_computed,
            query_lens,
            last[1] if last is not None and last[0] is columns else None,
        )
        prompt_plan = None
        if columns is not self._no_prompt_logprobs:
            prompt_plan = _prompt_logprob_plan(requests, num_computed, query_lens)
            if prompt_plan is None:
                self._no_prompt_logprobs = columns
        graphs = self.decode_graphs
        if graphs is not None and _graph_step(graphs, metadata, len(requests)):
            try:
                hidden = graphs.run(input_ids, positions, metadata)
            except GraphCaptureError as error:
                # This step and every later one run eagerly (its KV writes are idempotent).
                logger.warning("%s; decode steps run eagerly from now on", error)
                self.decode_graphs = None
            else:
                return self._sample(hidden, requests, query_lens, columns, prompt_plan)
        metadata = metadata_to(metadata, self.device)
        if self.device.type != "cpu":
            input_ids, positions = input_ids.to(self.device), positions.to(self.device)
        with set_forward_context(metadata, self.kv_caches):
            hidden = self.model(input_ids, positions)
        return self._sample(hidden, requests, query_lens, columns, prompt_plan)

    def _execute_parallel(self, output: SchedulerOutput) -> list[int]:
        """`execute` on rank 0 of a tensor-parallel engine: the step's inputs go to every rank,
        then all run the forward (its all-reduces join them) and rank 0 samples. A rank that
        dies or stops answering ends the step with the executor's `WorkerFailedError`."""
        requests, num_computed, query_lens = output.requests, output.num_computed, output.num_new
        frontiers, replaying = self._replay_frontiers(requests, num_computed)
        if requests:
            token_ids = (
                list(map(operator.getitem, map(_ALL_TOKEN_IDS, requests), num_computed))
                if sum(query_lens) == len(query_lens)
                else _input_token_ids(requests, num_computed, query_lens)
            )
        else:
            token_ids = []
        columns = self._columns(output.samples, requests)
        prompt_plan = _prompt_logprob_plan(requests, num_computed, query_lens)
        logit_rows: dict[str, Any] = {}
        if self.vocab_parallel and requests:
            logit_rows["prompt_rows"] = () if prompt_plan is None else prompt_plan.rows
            logit_rows["sample_rows"] = sampled_rows(query_lens, columns[0]) if columns[0] else ()
        inputs = gather_step_inputs(
            token_ids,
            num_computed,
            query_lens,
            output.rows,
            self.block_table_array,
            self.block_sizes,
            output.block_copies,
            **logit_rows,
            write_from=frontiers if replaying else None,
        )
        parallel = self.parallel
        with parallel.collectives():
            parallel.send(inputs)
            if output.block_copies:
                self.copy_blocks(output.block_copies)
            if not requests:
                return []
            input_ids, metadata, positions = step_batch(inputs, self.block_sizes, self.full_groups)
            metadata = metadata_to(metadata, self.device)
            with set_forward_context(metadata, self.kv_caches):
                hidden = self.model(input_ids.to(self.device), positions.to(self.device))
        return self._sample(hidden, requests, query_lens, columns, prompt_plan)

    def _columns(self, samples: list[bool], requests: list[Request]) -> SamplingColumns:
        """`_sampling_columns`, or the last step's when the batch is the same requests in the
        same order sampling alike (most decode steps): a request's id, params and logprob
        count never change, so neither do its columns. The check is two C-level passes."""
        last = self._last_columns
        if last is not None and last[1] == samples and same_requests(last[0], requests):
            return last[2]
        columns = _sampling_columns(samples, requests)
        self._last_columns = (list(requests), list(samples), columns)
        return columns

    def _compute_logits(self, rows: torch.Tensor) -> torch.Tensor:
        """The LM head over `rows` (a collective when it is vocabulary-parallel: a failed rank
        becomes the executor's `WorkerFailedError`)."""
        if not self.vocab_parallel:
            return self.model.compute_logits(rows)
        with self.parallel.collectives():
            return self.model.compute_logits(rows)

    def _sample(
        self,
        hidden: torch.Tensor,
        requests: list[Request],
        query_lens: list[int],
        columns: SamplingColumns,
        prompt_plan: Optional[PromptLogprobPlan],
    ) -> list[int]:
        """Logprobs of the prompts that ask, then the sampled token of each request that
        samples (from the LM head over the last hidden row of each). The LM head runs in
        this order on every rank when it is vocabulary-parallel (`worker.ShardRunner`)."""
        sample_indices, sampling, request_ids, params = columns[:4]
        self._last_sampled = None  # set again below when every request samples on the CPU
        if prompt_plan is not None:
            self._record_prompt_logprobs(hidden, requests, prompt_plan)
        if not sample_indices:
            return []
        logits = self._compute_logits(self._sampled_rows(hidden, query_lens, sample_indices))
        on_cpu = logits.device.type == "cpu"
        if not columns.needs_extras and not on_cpu:
            return self.sampler.sample(logits, request_ids, params).tolist()
        sampled: torch.Tensor | np.ndarray
        counts = columns.logprob_counts
        every_row = len(sample_indices) == len(requests)
        if on_cpu and columns.plain_greedy and counts and None not in counts:
            # Every row greedy and asking for logprobs: the pick and its logprobs in one pass.
            sampled, entries = greedy_token_logprobs(logits, counts, columns.max_logprobs)
            self.logprob_log.record(entries, request_ids)
            self._last_sampled = (columns, sampled) if every_row else None
            return sampled.tolist()
        if on_cpu:
            sampled = self.sampler.sample_cpu(logits, request_ids, params, sampling)
            self._last_sampled = (columns, sampled) if every_row else None
        else:
            sampled = self.sampler.sample(logits, request_ids, params, sampling)
        if not columns.needs_extras:
            return sampled.tolist()
        if None not in counts:  # every row: no gathers, no request touched
            self.logprob_log.record(token_logprobs(logits, sampled, counts), request_ids)
        else:
            rows = [row for row, count in enumerate(counts) if count is not None]
            if rows:
                entries = token_logprobs(logits[rows], sampled[rows], [counts[row] for row in rows])
                self.logprob_log.record(entries, [request_ids[row] for row in rows])
        return sampled.tolist()

    def _record_prompt_logprobs(
        self, hidden: torch.Tensor, requests: list[Request], plan: PromptLogprobPlan
    ) -> None:
        """Records the logprobs of the plan's prompt tokens (`_prompt_logprob_plan`)."""
        rows, targets, counts, owners = plan.rows, plan.targets, plan.counts, plan.owners
        for begin in range(0, len(rows), PROMPT_LOGPROBS_CHUNK):
            end = begin + PROMPT_LOGPROBS_CHUNK
            index = torch.tensor(rows[begin:end], device=hidden.device)
            logits = self._compute_logits(hidden[index])
            entries = token_logprobs(logits, torch.tensor(targets[begin:end]), counts[begin:end])
            for request, entry in zip(owners[begin:end], entries):
                request.prompt_logprobs.append(entry)
        for request in requests:
            if request.wants_prompt_logprobs:
                request.wants_prompt_logprobs = (
                    len(request.prompt_logprobs) < request.num_prompt_tokens - 1
                )

    def copy_blocks(self, copies: Sequence[tuple[int, int]]) -> None:
        """Copies page `src` into page `dst` in every slot tensor (`copy_blocks`)."""
        copy_blocks(self.slot_tensors, copies, self.device)

    def _prepare_inputs(
        self,
        requests: list[Request],
        rows: list[int],
        num_computed: list[int],
        query_lens: list[int],
        last_sampled: Optional[np.ndarray] = None,
    ) -> tuple[torch.Tensor, AttentionMetadata, torch.Tensor]:
        """The step's input ids, attention metadata and positions (on the CPU).
        `last_sampled`: the tokens the last step sampled for this same batch (`_execute`),
        the input of a decode step without reading a request's tokens."""
        frontiers, replaying = self._replay_frontiers(requests, num_computed)
        if sum(query_lens) == len(query_lens) and not replaying:
            # One token each (decode): no slices, no sums.
            metadata, positions = self.decode_buffers.build(
                num_computed, rows, self.block_table_array
            )
            if last_sampled is not None and len(last_sampled) == len(requests):
                return torch.from_numpy(last_sampled), metadata, positions
            token_ids = list(map(operator.getitem, map(_ALL_TOKEN_IDS, requests), num_computed))
        else:
            token_ids = _input_token_ids(requests, num_computed, query_lens)
            block_tables = self._gather_block_tables(
                rows, max(map(operator.add, num_computed, query_lens))
            )
            metadata, positions = build_attention_metadata(
                query_lens,
                num_computed,
                block_tables,
                self.block_sizes,
                write_from=frontiers if replaying else None,
                read_only_groups=self.full_groups,
            )
        return torch.from_numpy(np.array(token_ids, dtype=np.int64)), metadata, positions

    def _replay_frontiers(
        self, requests: list[Request], num_computed: list[int]
    ) -> tuple[list[int], bool]:
        """The requests' tail-replay frontiers, and whether one of them is still below its
        own (its full-attention KV there must not be written)."""
        if not self.may_replay:
            return [], False
        frontiers = list(map(_REPLAY_FRONTIER, requests))
        return frontiers, any(map(operator.gt, frontiers, num_computed))

    def _gather_block_tables(self, rows: list[int], max_seq_len: int) -> list[torch.Tensor]:
        """Each group's block-table rows of the batch, only the columns the batch can touch
        (the full width is max_model_len / block_size); gathered in numpy from the core's
        memory (a copy: backends and tests may write to their table)."""
        table = self.block_table_array
        block_sizes = self.block_sizes
        if self.one_block_size:  # one gather for every group's rows
            columns = -(-max_seq_len // block_sizes[0])
            return list(torch.from_numpy(table[:, rows, :columns]).unbind(0))
        return [
            torch.from_numpy(table[group, rows, : -(-max_seq_len // block_size)])
            for group, block_size in enumerate(block_sizes)
        ]

    def _sampled_rows(
        self, hidden: torch.Tensor, query_lens: list[int], sampling: Sequence[int]
    ) -> torch.Tensor:
        """The hidden rows of the sampled sequences' last tokens."""
        rows = sampled_rows(query_lens, sampling)
        if rows is None:
            # Every token is a sampled last token (a pure decode step): the rows are all of
            # `hidden`, in order; `contiguous` is the copy the gather would make, without it.
            return hidden.contiguous()
        return hidden[torch.tensor(rows, device=self.device)]


class SamplingColumns(NamedTuple):
    """Of the requests that sample: their batch indices, requests, ids and sampling params;
    whether one needs the sampler's slow path (`needs_sampling_extras`) and then each one's
    number of logprobs (`num_sample_logprobs`; else empty) and the most any asks for;
    whether every one is greedy without penalties or min_tokens (`plain_greedy`)."""

    sample_indices: list[int]
    sampling: list[Request]
    request_ids: list[str]
    params: list[Any]
    needs_extras: bool
    logprob_counts: list[Optional[int]]
    plain_greedy: bool
    max_logprobs: int


@dataclass
class PromptLogprobPlan:
    """The step's prompt-logprob positions: per position its hidden row, the prompt token it
    scores, the number of logprobs asked for and the request."""

    rows: list[int]
    targets: list[int]
    counts: list[int]
    owners: list[Request]


def _prompt_logprob_plan(
    requests: list[Request], num_computed: list[int], query_lens: list[int]
) -> Optional[PromptLogprobPlan]:
    """For the requests that want them, each prompt token whose previous position this step
    computes (positions recorded before a preemption are skipped); None when none asks."""
    if not any(map(_WANTS_PROMPT_LOGPROBS, requests)):
        return None
    plan = PromptLogprobPlan([], [], [], [])
    start = 0
    for request, computed, length in zip(requests, num_computed, query_lens):
        if request.wants_prompt_logprobs:
            # Position j's logits give prompt token j + 1's logprobs.
            first = max(computed, len(request.prompt_logprobs))
            last = min(computed + length, request.num_prompt_tokens - 1)
            k = request.sampling_params.prompt_logprobs
            for position in range(first, last):
                plan.rows.append(start + position - computed)
                plan.targets.append(request.prompt_token_ids[position + 1])
                plan.counts.append(k)
                plan.owners.append(request)
        start += length
    return plan


def _sampling_columns(samples: list[bool], requests: list[Request]) -> SamplingColumns:
    """The sampling requests' columns (`samples`: per request whether it samples), taken
    before the forward (while the requests are in the CPU caches)."""
    sampling = list(itertools.compress(requests, samples))
    needs_extras = any(map(_NEEDS_SAMPLING_EXTRAS, sampling))
    params = list(map(_SAMPLING_PARAMS, sampling))
    counts = list(map(_NUM_SAMPLE_LOGPROBS, sampling)) if needs_extras else []
    return SamplingColumns(
        list(itertools.compress(range(len(samples)), samples)),
        sampling,
        list(map(_REQUEST_ID, sampling)),
        params,
        needs_extras,
        counts,
        plain_greedy(params),
        max(filter(None, counts), default=0),
    )


def _input_token_ids(
    requests: list[Request], num_computed: list[int], query_lens: list[int]
) -> list[int]:
    """The tokens each scheduled request computes this step, concatenated."""
    # One C-level slice per request; no Python loop over tokens.
    return list(
        itertools.chain.from_iterable(
            request.all_token_ids[start : start + length]
            for request, start, length in zip(requests, num_computed, query_lens)
        )
    )


_REPLAY_FRONTIER = operator.attrgetter("replay_frontier")
_ALL_TOKEN_IDS = operator.attrgetter("all_token_ids")
_REQUEST_ID = operator.attrgetter("request_id")
_SAMPLING_PARAMS = operator.attrgetter("sampling_params")
_WANTS_PROMPT_LOGPROBS = operator.attrgetter("wants_prompt_logprobs")
_NUM_SAMPLE_LOGPROBS = operator.attrgetter("num_sample_logprobs")
_NEEDS_SAMPLING_EXTRAS = operator.attrgetter("needs_sampling_extras")


# torch's inference-mode guard itself, where this torch has it (see `_inference_mode`).
_INFERENCE_GUARD = getattr(torch._C, "_InferenceMode", None)


def _inference_mode() -> Any:
    """Inference mode for one step: torch's guard where this torch has it (about half the
    cost of `torch.inference_mode()`, whose Python wrapper each step paid with the CPU caches
    cold), else the public context manager. The same mode either way."""
    guard = _INFERENCE_GUARD
    return guard(True) if guard is not None else torch.inference_mode()


def _graph_step(graphs: DecodeGraphs, metadata: AttentionMetadata, num_seqs: int) -> bool:
    """Whether a step's forward can replay a decode graph: one new token per sequence (its
    metadata from the decode buffers), every token's KV written, a bucket that holds it."""
    return (
        metadata.max_query_len == 1
        and int(metadata.query_start_loc.shape[0]) == num_seqs + 1
        and all(group.write_rows is None for group in metadata.groups)
        and graphs.bucket_of(num_seqs) is not None
    )


def metadata_to(metadata: AttentionMetadata, device: torch.device) -> AttentionMetadata:
    """The same metadata with every tensor on `device` (a no-op on the CPU)."""
    if metadata.query_start_loc.device == device:
        return metadata
    for group in metadata.groups:
        for field in fields(group):
            value = getattr(group, field.name)
            if isinstance(value, torch.Tensor):
                setattr(group, field.name, value.to(device, non_blocking=True))
    metadata.query_start_loc = metadata.query_start_loc.to(device)
    metadata.seq_lens = metadata.seq_lens.to(device)
    return metadata
