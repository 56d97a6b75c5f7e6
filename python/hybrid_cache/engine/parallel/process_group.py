"""The torch.distributed groups of one tensor-parallel engine, joined the same way on every rank.

    world    the default group: gloo on the CPU, NCCL on CUDA; the model's all-reduces
    control  gloo (the world group itself on the CPU): a step's payload, setup exchanges
    idle     gloo with a timeout of `IDLE_TIMEOUT`: a step's header, which a worker waits for
             between steps however long the driver stays idle

Every collective but the header wait is bounded by the engine's `distributed_timeout`
(`init_process_group(timeout=...)`); the driver bounds its side of the header by waiting on the
async work with that timeout, so no rank waits forever on another. The rendezvous is
`file://` (a fresh file per engine) for spawned workers and `env://` under `torchrun`.
"""

from __future__ import annotations

import datetime
import os
from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.distributed as dist

from hybrid_cache.errors import TensorParallelError

# A worker between steps waits on the header this long at most (a year: never, in practice;
# a dead driver closes its sockets, which ends the wait at once).
IDLE_TIMEOUT = datetime.timedelta(days=365)
# torchrun's variables: the launch is torchrun's when WORLD_SIZE is set.
TORCHRUN_VARIABLES = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


@dataclass(frozen=True)
class Rendezvous:
    """How the ranks find each other: `init_method` ("file://..." or "env://"), the backend
    of the world group and the collective timeout in seconds."""

    init_method: str
    world_size: int
    backend: str
    timeout_s: float


@dataclass
class RankGroups:
    """The groups of one rank (see the module docstring)."""

    rank: int
    size: int
    world: Any
    control: Any
    idle: Any
    timeout: datetime.timedelta


def under_torchrun() -> bool:
    """Whether this process was started by torchrun (or another `env://` launcher)."""
    return "WORLD_SIZE" in os.environ and "RANK" in os.environ


def torchrun_rank() -> int:
    return int(os.environ["RANK"])


def local_rank() -> Optional[int]:
    """This process's index on its host under torchrun (`LOCAL_RANK`), else None."""
    return int(os.environ.get("LOCAL_RANK", "0")) if under_torchrun() else None


def world_backend(device: torch.device) -> str:
    return "nccl" if device.type == "cuda" else "gloo"


def join(rendezvous: Rendezvous, rank: Optional[int]) -> RankGroups:
    """Initialises torch.distributed on this rank (`rank` None: from the environment, as
    torchrun sets it) and creates the control and idle groups; every rank calls this."""
    if dist.is_initialized():
        raise TensorParallelError(
            "torch.distributed is already initialised in this process: one tensor-parallel "
            "engine per process; shut the other down first (LLM.shutdown())"
        )
    timeout = datetime.timedelta(seconds=rendezvous.timeout_s)
    kwargs: dict[str, Any] = {}
    if rank is not None:
        kwargs = {"rank": rank, "world_size": rendezvous.world_size}
    dist.init_process_group(
        rendezvous.backend, init_method=rendezvous.init_method, timeout=timeout, **kwargs
    )
    world = dist.group.WORLD
    if rendezvous.backend == "gloo":
        control = world
    else:
        control = dist.new_group(backend="gloo", timeout=timeout)
    idle = dist.new_group(backend="gloo", timeout=IDLE_TIMEOUT)
    return RankGroups(dist.get_rank(), dist.get_world_size(), world, control, idle, timeout)


def leave() -> None:
    """Destroys this process's groups (a no-op when none)."""
    if dist.is_initialized():
        dist.destroy_process_group()
