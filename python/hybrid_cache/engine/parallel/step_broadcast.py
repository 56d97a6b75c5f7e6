"""The step broadcast: rank 0 sends each step's `StepInputs` to the workers, and the setup
exchanges every rank takes part in once.

A step is one broadcast of a fixed int32 buffer (`HEADER_FIELDS` + `INLINE_VALUES`) on the idle
group, the payload inside it when it fits, else a second broadcast of the payload on the
control group; rank 0 posts them and goes on (`StepSender`). A buffer of tensors, not pickled objects: `broadcast_object_list` costs about
three times as much per step. Each rank counts the collectives it enters
(`parallel_layers.count_collective`), so that on a timeout the driver can tell which rank
stopped.
"""

from __future__ import annotations

import datetime
import time
from typing import Any, Callable, Optional

import numpy as np
import torch
import torch.distributed as dist

from hybrid_cache.engine.parallel.process_group import RankGroups
from hybrid_cache.engine.parallel.step_inputs import (
    HEADER_FIELDS,
    OP_STEP,
    OP_STOP,
    StepInputs,
    pack,
    payload_length,
    unpack,
)
from hybrid_cache.models.parallel_layers import count_collective

# Payload values carried inside the header message (decode steps of a few hundred requests).
INLINE_VALUES = 8192


class StepSender:
    """Rank 0's side: `send(inputs)` each step, `stop()` once at shutdown.

    A step's broadcast is posted and not waited for: rank 0 goes on to its own forward while
    the message travels (the workers' first all-reduce of the step waits for it anyway). The
    next `send` (or `stop`) first waits for the previous broadcast, with `wait` (the caller's
    bound), before reusing its buffer. `clock` (shared memory, optional): rank 0 writes each
    step's posting time in entry 0 (`StepReceiver` measures from it)."""

    def __init__(
        self, groups: RankGroups, wait: Callable[[Any], None], clock: Optional[np.ndarray] = None
    ) -> None:
        self.groups = groups
        self.wait = wait
        self.clock = clock
        self.header = torch.zeros(HEADER_FIELDS + INLINE_VALUES, dtype=torch.int32)
        self.header_array = self.header.numpy()
        self.pending: list[Any] = []  # the works of the last step's broadcasts
        self.payload: Optional[torch.Tensor] = None  # kept alive until its broadcast is done

    def send(self, inputs: StepInputs) -> None:
        self.flush()
        payload = pack(inputs, self.header_array)
        if self.clock is not None:
            self.clock[0] = time.perf_counter()  # CLOCK_MONOTONIC: one clock for the host
        self._post(self.header, self.groups.idle)
        if len(payload) > INLINE_VALUES:
            self.payload = torch.from_numpy(payload)
            self._post(self.payload, self.groups.control)

    def stop(self) -> None:
        """Tells the workers to stop, and waits until every one has the message (a barrier:
        no rank tears its groups down while another still reads from them)."""
        self.flush()
        self.header_array[:HEADER_FIELDS] = 0
        self.header_array[0] = OP_STOP
        self._post(self.header, self.groups.idle)
        self.flush()
        count_collective()
        self.wait(dist.barrier(group=self.groups.idle, async_op=True))

    def flush(self) -> None:
        """Waits for the broadcasts posted last (bounded by `wait`)."""
        pending, self.pending = self.pending, []
        for work in pending:
            self.wait(work)
        self.payload = None

    def _post(self, tensor: torch.Tensor, group: Any) -> None:
        count_collective()
        self.pending.append(dist.broadcast(tensor, 0, group=group, async_op=True))


class StepReceiver:
    """A worker's side: `receive()` waits for the next step (None: the driver stopped).
    `clock` (shared memory, optional): entry `rank` accumulates how long after rank 0 posted
    each step this rank had it (the broadcast's latency)."""

    def __init__(self, groups: RankGroups, clock: Optional[np.ndarray] = None) -> None:
        self.groups = groups
        self.clock = clock
        self.header = torch.zeros(HEADER_FIELDS + INLINE_VALUES, dtype=torch.int32)
        self.header_array = self.header.numpy()

    def receive(self) -> Optional[StepInputs]:
        count_collective()
        dist.broadcast(self.header, 0, group=self.groups.idle)
        header = self.header_array
        if header[0] == OP_STOP:
            count_collective()
            dist.barrier(group=self.groups.idle)  # `StepSender.stop`'s
            return None
        assert header[0] == OP_STEP, f"unknown step operation {header[0]}"
        length = payload_length(header)
        if length <= INLINE_VALUES:
            inputs = unpack(header, header[HEADER_FIELDS:])
        else:
            payload = torch.empty(length, dtype=torch.int32)
            count_collective()
            dist.broadcast(payload, 0, group=self.groups.control)
            inputs = unpack(header, payload.numpy())
        if self.clock is not None:
            self.clock[self.groups.rank] += time.perf_counter() - self.clock[0]
        return inputs


# ---------------------------------------------------------------------------------------------
# Setup exchanges (once per engine; every rank calls each, in this order).


def exchange_status(
    groups: RankGroups, ok: bool, wait: Optional[Callable[[Any], None]] = None
) -> list[bool]:
    """Every rank's `ok` (rank order), on the idle group: ranks reach this after loading their
    shard, which takes as long as it takes. `wait` (the driver's) bounds the wait and watches
    the workers; a worker waits plainly."""
    mine = torch.tensor([1 if ok else 0], dtype=torch.int32)
    every = [torch.zeros(1, dtype=torch.int32) for _ in range(groups.size)]
    count_collective()
    work = dist.all_gather(every, mine, group=groups.idle, async_op=True)
    (wait or _plain_wait)(work)
    return [bool(value.item()) for value in every]


def agree_budget(groups: RankGroups, budget: int) -> int:
    """The smallest of the ranks' KV budgets (each rank profiles its own device)."""
    value = torch.tensor([budget], dtype=torch.int64)
    count_collective()
    dist.all_reduce(value, op=dist.ReduceOp.MIN, group=groups.control)
    return int(value.item())


def share_object(groups: RankGroups, value: Any = None) -> Any:
    """Rank 0's `value` on every rank (the KV-cache layout; once, so pickling is fine)."""
    box = [value]
    count_collective()
    dist.broadcast_object_list(box, 0, group=groups.control)
    return box[0]


def _plain_wait(work: Any) -> None:
    work.wait()


def bounded_wait(timeout: datetime.timedelta) -> Callable[[Any], None]:
    """`work.wait(timeout)`: raises when the collective does not finish in time."""

    def wait(work: Any) -> None:
        work.wait(timeout=timeout)

    return wait
