"""A tensor-parallel worker: ranks 1..N-1, in a spawned process (`worker_main`) or in a process
torchrun started (`serve`, from `LLM(...)` on a rank other than 0).

A worker holds its shard of the model and its share of every KV tensor, and no scheduler,
allocator or sampler: the driver (rank 0) owns those. Setup mirrors the driver's, collective
for collective: load the shard, report (`exchange_status`), profile the device and agree on the
smallest budget (CUDA without `kv_cache_memory`), take the driver's layout, allocate, report
again. Then, per step: receive the `StepInputs`, copy the step's blocks, run the forward (its
all-reduces join the driver's) and, when the LM head is vocabulary-parallel, the head over the
step's logit rows (its gathers join the driver's; the logits stay on rank 0); until the driver
says stop.

A worker that fails reports its traceback to the driver (a queue, when spawned) and exits; a
spawned worker whose driver died exits too (a watchdog thread checks the parent process).
"""

from __future__ import annotations

import logging
import os
import threading
import time
import traceback
from dataclasses import dataclass
from typing import Any, Callable, Optional

import numpy as np
import torch
from torch import nn

from hybrid_cache.attention import set_forward_context
from hybrid_cache.engine.engine_args import (
    load_engine_model,
    needs_profile,
    rank_device,
    resolve_device,
    resolve_dtype,
)
from hybrid_cache.engine.engine_config import EngineConfig
from hybrid_cache.engine.memory import kv_cache_budget
from hybrid_cache.engine.model_runner import bind_model, copy_blocks, metadata_to
from hybrid_cache.engine.parallel.process_group import (
    RankGroups,
    Rendezvous,
    join,
    leave,
    local_rank,
    world_backend,
)
from hybrid_cache.engine.parallel.step_broadcast import (
    StepReceiver,
    agree_budget,
    exchange_status,
    share_object,
)
from hybrid_cache.engine.parallel.step_inputs import (
    PROMPT_LOGPROBS_CHUNK,
    StepInputs,
    step_batch,
)
from hybrid_cache.models.parallel_layers import TensorShard, is_vocab_parallel, set_collectives
from hybrid_cache.planner import KVCacheLayout

logger = logging.getLogger(__name__)

# How often a spawned worker checks that its driver still runs.
PARENT_CHECK_S = 1.0
# For tests only: "RANK:STEP" makes worker RANK raise in its STEP-th step (counted from 1), so a
# test can check that a worker's traceback reaches rank 0's `WorkerFailedError`. Unset otherwise.
TEST_FAULT_ENV = "HYBRID_CACHE_TEST_WORKER_FAULT"


@dataclass
class WorkerArgs:
    """What a spawned worker is started with (pickled to the new process)."""

    config: EngineConfig
    rendezvous: Rendezvous
    rank: int
    entered: Optional[torch.Tensor]  # shared [N] int64: collectives entered per rank
    started: Optional[torch.Tensor]  # shared [N] int64: set by each worker on entry
    clock: Optional[torch.Tensor]  # shared [N] float64: `StepSender`'s and `StepReceiver`'s
    errors: Any  # a multiprocessing SimpleQueue of (rank, traceback text)
    parent_pid: int
    num_threads: int


class ShardRunner:
    """One rank's forward over its shard and its KV tensors, and its share of the LM head when
    that is vocabulary-parallel (in the driver's order: `ModelRunner._sample`); no sampling."""

    def __init__(
        self,
        model: nn.Module,
        layout: KVCacheLayout,
        dtype: torch.dtype,
        device: torch.device,
        attention_backend: str,
    ) -> None:
        self.model = model
        self.device = device
        self.block_sizes = [group.block_size for group in layout.groups]
        self.full_groups = [group.group_id for group in layout.groups if group.kind == "full"]
        self.vocab_parallel = is_vocab_parallel(model)
        self.slot_tensors, self.kv_caches = bind_model(
            model, layout, dtype, device, attention_backend
        )

    @torch.inference_mode()
    def run(self, inputs: StepInputs) -> None:
        if len(inputs.block_copies):
            copy_blocks(self.slot_tensors, inputs.block_copies, self.device)
        if inputs.num_seqs == 0:
            return
        input_ids, metadata, positions = step_batch(inputs, self.block_sizes, self.full_groups)
        with set_forward_context(metadata_to(metadata, self.device), self.kv_caches):
            hidden = self.model(input_ids.to(self.device), positions.to(self.device))
        if self.vocab_parallel:
            self._logits(hidden, inputs)

    def _logits(self, hidden: torch.Tensor, inputs: StepInputs) -> None:
        """The LM head over the prompt-logprob rows (in the driver's chunks), then over the
        sampled rows."""
        prompt_rows = torch.from_numpy(inputs.prompt_rows).to(self.device)
        for begin in range(0, len(prompt_rows), PROMPT_LOGPROBS_CHUNK):
            self.model.compute_logits(hidden[prompt_rows[begin : begin + PROMPT_LOGPROBS_CHUNK]])
        if inputs.sample_rows is None:
            self.model.compute_logits(hidden.contiguous())
        elif len(inputs.sample_rows):
            self.model.compute_logits(hidden[torch.from_numpy(inputs.sample_rows).to(self.device)])


def serve(
    config: EngineConfig,
    groups: RankGroups,
    report: Callable[[str], None],
    clock: Optional[np.ndarray] = None,
) -> None:
    """Runs this worker rank until the driver stops (see the module docstring). A failure in
    setup is reported (`report`) and ends the worker after the status exchange; `clock`: the
    shared step-latency clock (`StepReceiver`)."""
    rank, size = groups.rank, groups.size
    spec = config.model_spec()
    device = rank_device(resolve_device(config.device), rank, size, local_rank())
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dtype = resolve_dtype(config.dtype, spec, device)
    model = _attempt(
        report,
        lambda: load_engine_model(
            config, spec, dtype, device, TensorShard(rank, size, config.vocab_parallel)
        ),
    )
    if not all(exchange_status(groups, model is not None)):
        return
    if needs_profile(config, device):
        budget = kv_cache_budget(
            model,
            device,
            None,
            config.gpu_memory_utilization,
            config.max_num_batched_tokens,
            config.max_num_seqs,
        )
        agree_budget(groups, budget)
    layout: KVCacheLayout = share_object(groups)
    runner = _attempt(
        report, lambda: ShardRunner(model, layout, dtype, device, config.attention_backend)
    )
    if not all(exchange_status(groups, runner is not None)):
        return
    receiver = StepReceiver(groups, clock)
    fault_step, step = _test_fault_step(rank), 0
    while (inputs := receiver.receive()) is not None:
        step += 1
        if step == fault_step:
            raise RuntimeError(f"test fault in rank {rank}'s step {step} ({TEST_FAULT_ENV})")
        runner.run(inputs)


def _test_fault_step(rank: int) -> Optional[int]:
    """The step `TEST_FAULT_ENV` makes this rank fail in (tests only; None: no fault)."""
    value = os.environ.get(TEST_FAULT_ENV)
    if not value:
        return None
    fault_rank, step = map(int, value.split(":"))
    return step if fault_rank == rank else None


def _attempt(report: Callable[[str], None], build: Callable[[], Any]) -> Any:
    try:
        return build()
    except Exception:
        report(traceback.format_exc())
        return None


def worker_main(args: WorkerArgs) -> None:
    """The entry point of a spawned worker process."""
    torch.set_num_threads(args.num_threads)
    _watch_parent(args.parent_pid)
    if args.started is not None:
        args.started[args.rank] = 1  # imports done: the driver joins the rendezvous now
    entered = None if args.entered is None else args.entered.numpy()
    clock = None if args.clock is None else args.clock.numpy()

    def report(text: str) -> None:
        args.errors.put((args.rank, text))

    try:
        groups = join(args.rendezvous, args.rank)
        _serve_in_groups(args.config, groups, entered, report, clock)
        del groups
    except BaseException:
        report(traceback.format_exc())
        os._exit(1)
    leave()
    os._exit(0)  # nothing left to flush; skips the interpreter's teardown (most of a second)


def _serve_in_groups(
    config: EngineConfig,
    groups: RankGroups,
    entered: Any,
    report: Callable[[str], None],
    clock: Optional[np.ndarray] = None,
) -> None:
    """`serve` with `all_reduce` on `groups`; no reference to them outlives the call (the
    caller destroys them next)."""
    set_collectives(groups.world, groups.rank, entered)
    try:
        serve(config, groups, report, clock)
    finally:
        set_collectives(None, 0, None)


def _watch_parent(parent_pid: int) -> None:
    """Exits this process when its driver is gone (it would otherwise wait for a step)."""

    def watch() -> None:
        while True:
            time.sleep(PARENT_CHECK_S)
            if os.getppid() != parent_pid:
                os._exit(1)

    threading.Thread(target=watch, name="hybrid-cache-parent-watchdog", daemon=True).start()


def serve_torchrun_rank(config: EngineConfig) -> None:
    """Runs this torchrun rank (not 0) as a worker until rank 0 shuts down: `LLM(...)` calls
    it on those ranks, so one script serves every rank."""
    device = resolve_device(config.device)
    rendezvous = Rendezvous(
        "env://", config.tensor_parallel_size, world_backend(device), config.distributed_timeout
    )
    try:
        _serve_in_groups(
            config, join(rendezvous, None), None, lambda text: logger.error("worker: %s", text)
        )
    finally:
        leave()
