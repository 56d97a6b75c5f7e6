"""The driver's side of tensor parallelism (rank 0, in the `LLM`'s process).

`TensorParallelExecutor.start(config)` spawns ranks 1..N-1 (torch.multiprocessing, "spawn";
or, under torchrun, finds them already running) and joins the process groups. The `LLM` then
mirrors the workers' setup (`worker.py`): `confirm("loaded")` after its own shard loaded,
`agree_budget` when every rank profiled its device, `share_layout`, `confirm("ready")`. Each
step, the `ModelRunner` calls `send(inputs)` inside `collectives()`.

Failure is never a hang: before each step the executor checks that every spawned worker lives;
the driver's wait for the step header is bounded by `distributed_timeout`, as is every other
collective (the process group's timeout). A failure (a worker dead, hung or raising) shuts the
engine down (every worker stopped) and raises `WorkerFailedError` naming the rank: the one that
exited (its exit code and, when it raised, its traceback), or the one that entered fewer
collectives than the driver (the shared per-rank counter), or, when neither tells (under
torchrun), none. Later steps raise the same error. `shutdown()` (also at interpreter exit, or
when the executor is collected) stops every worker: a stop message, then terminate, then kill.
"""

from __future__ import annotations

import contextlib
import datetime
import logging
import os
import tempfile
import time
import weakref
from collections.abc import Iterator
from typing import Any, Optional

import torch
import torch.multiprocessing as mp

from hybrid_cache.engine.engine_config import EngineConfig
from hybrid_cache.engine.parallel.process_group import (
    RankGroups,
    Rendezvous,
    join,
    leave,
    torchrun_rank,
    under_torchrun,
    world_backend,
)
from hybrid_cache.engine.parallel.step_broadcast import (
    StepSender,
    agree_budget,
    bounded_wait,
    exchange_status,
    share_object,
)
from hybrid_cache.engine.parallel.step_inputs import StepInputs
from hybrid_cache.engine.parallel.worker import WorkerArgs, worker_main
from hybrid_cache.errors import (
    EngineShutDownError,
    TensorParallelConfigError,
    TensorParallelError,
    WorkerFailedError,
)
from hybrid_cache.models.parallel_layers import TensorShard, set_collectives
from hybrid_cache.planner import KVCacheLayout

logger = logging.getLogger(__name__)

# The last setup stage; until every rank reached it, shutting down kills the workers (they wait
# in a setup exchange, not for a step).
READY = "ready"
# How long a stopped worker gets to exit before it is terminated, then killed.
STOP_GRACE_S = 5.0
# After a failed collective, how long a worker that lost its connection may take to be reaped
# (its exit code then names the failure).
DEATH_WAIT_S = 0.5
# How often a setup wait (which lasts as long as the slowest rank's loading) checks the workers.
SETUP_POLL_S = 0.05
# How often the start checks that the spawned workers reached their entry point.
START_POLL_S = 0.01


class TensorParallelExecutor:
    """Rank 0's handle on the other ranks (see the module docstring)."""

    def __init__(
        self,
        config: EngineConfig,
        groups: RankGroups,
        processes: list[Any],
        entered: Optional[torch.Tensor],
        errors: Any,
        rendezvous_file: Optional[str],
        num_threads: Optional[int] = None,
        clock: Optional[torch.Tensor] = None,
    ) -> None:
        self.config = config
        self.size = groups.size
        self.shard = TensorShard(0, groups.size, config.vocab_parallel)
        self.timeout = datetime.timedelta(seconds=config.distributed_timeout)
        self.processes = processes  # rank r is processes[r - 1]; empty under torchrun
        self.entered = None if entered is None else entered.numpy()
        self.errors = errors
        self.reports: dict[int, str] = {}  # per rank: the traceback it reported
        self.failure: Optional[TensorParallelError] = None
        self.clock = None if clock is None else clock.numpy()
        self.sender = StepSender(groups, bounded_wait(self.timeout), self.clock)
        self._state = _Shutdown(processes, rendezvous_file, num_threads)
        # Runs on `shutdown()`, when the executor is collected, or at interpreter exit.
        self._finalizer = weakref.finalize(self, self._state.run, self.sender)

    # -- start -----------------------------------------------------------------------------

    @classmethod
    def start(cls, config: EngineConfig, device: torch.device) -> TensorParallelExecutor:
        """Spawns the workers (or, under torchrun, meets them) and joins the groups."""
        size = config.tensor_parallel_size
        backend = world_backend(device)
        if device.type == "cuda":
            torch.cuda.set_device(device)  # NCCL binds each rank to its current device
        if under_torchrun():
            world = int(os.environ["WORLD_SIZE"])
            if world != size:
                raise TensorParallelConfigError(
                    f"torchrun started {world} processes but --tensor-parallel-size is {size}: "
                    "give torchrun --nproc-per-node (times --nnodes) equal to it (LLM "
                    "argument tensor_parallel_size)"
                )
            rendezvous = Rendezvous("env://", size, backend, config.distributed_timeout)
            groups = join(rendezvous, None)
            set_collectives(groups.world, 0, None)
            return cls(config, groups, [], None, None, None)
        handle, path = tempfile.mkstemp(prefix="hybrid-cache-rendezvous-")
        os.close(handle)
        os.unlink(path)  # the store creates it; a fresh name per engine
        rendezvous = Rendezvous(f"file://{path}", size, backend, config.distributed_timeout)
        # Every rank on this host talks over the loopback device unless told otherwise.
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
        # CPU ranks share this host's cores: each rank (this one too, until shutdown) takes its
        # share of torch's threads, so no rank's spinning threads starve another's.
        threads = torch.get_num_threads()
        if device.type == "cpu":
            torch.set_num_threads(max(1, threads // size))
        context = mp.get_context("spawn")
        entered = torch.zeros(size, dtype=torch.int64).share_memory_()
        started = torch.zeros(size, dtype=torch.int64).share_memory_()
        clock = torch.zeros(size, dtype=torch.float64).share_memory_()
        errors = context.SimpleQueue()
        processes = []
        try:
            for rank in range(1, size):
                args = WorkerArgs(
                    config,
                    rendezvous,
                    rank,
                    entered,
                    started,
                    clock,
                    errors,
                    os.getpid(),
                    torch.get_num_threads(),
                )
                process = context.Process(
                    target=worker_main, args=(args,), name=f"hybrid-cache-rank{rank}", daemon=True
                )
                process.start()
                processes.append(process)
            # The rendezvous is bounded by the collective timeout: it starts once every worker
            # has imported its modules (seconds on a busy host), so a short timeout still holds.
            _wait_started(processes, started.numpy())
            groups = join(rendezvous, 0)
        except BaseException:
            _Shutdown(processes, path, threads).run(None)
            raise
        set_collectives(groups.world, 0, entered.numpy())
        return cls(config, groups, processes, entered, errors, path, threads, clock)

    @property
    def groups(self) -> RankGroups:
        """The process groups (held by the sender alone, so shutdown drops the last
        reference to them: a group outliving `destroy_process_group` can abort the process
        at exit)."""
        return self.sender.groups

    # -- setup exchanges (the same order as `worker.serve`) ----------------------------------

    def confirm(self, stage: str, ok: bool = True) -> None:
        """Every rank reports whether its `stage` ("loaded", "ready") succeeded; a rank that
        failed (or died) ends the engine with `WorkerFailedError` naming it."""
        with self.collectives():
            statuses = exchange_status(self.groups, ok, self._wait_setup)
        failed = [rank for rank, status in enumerate(statuses) if not status and rank > 0]
        if not failed and stage == READY:
            self._state.ready = True  # from now on the workers wait for steps (or a stop)
        if failed:
            rank = failed[0]
            raise self._fail(
                WorkerFailedError(
                    f"tensor-parallel rank {rank} failed to get {stage}; the engine is shut "
                    f"down{self._traceback(rank)}",
                    rank,
                )
            )

    def agree_budget(self, budget: int) -> int:
        """The smallest KV budget any rank's profile gave."""
        with self.collectives():
            return agree_budget(self.groups, budget)

    def share_layout(self, layout: KVCacheLayout) -> None:
        with self.collectives():
            share_object(self.groups, layout)

    # -- steps -------------------------------------------------------------------------------

    def send(self, inputs: StepInputs) -> None:
        """Sends a step to every worker (call inside `collectives()`)."""
        if self.failure is not None:
            raise self.failure
        dead = self._dead_rank()
        if dead is not None:
            raise self._fail(self._died(dead))
        self.sender.send(inputs)

    @contextlib.contextmanager
    def collectives(self) -> Iterator[None]:
        """Turns a failed collective inside into this engine's `WorkerFailedError`."""
        if self.failure is not None:
            raise self.failure
        try:
            yield
        except TensorParallelError as error:
            raise self._fail(error) from None
        except RuntimeError as error:  # gloo and NCCL report timeouts and lost peers so
            raise self._fail(self._diagnose(error)) from error
        except BaseException:  # interrupted mid-step: the ranks no longer agree on the step
            self._fail(
                EngineShutDownError(
                    "a tensor-parallel step was interrupted; the workers are stopped: build a "
                    "new LLM"
                )
            )
            raise

    # -- failure -----------------------------------------------------------------------------

    def _wait_setup(self, work: Any) -> None:
        """Waits as long as the slowest rank takes to load, watching that every worker lives."""
        while not work.is_completed():
            dead = self._dead_rank()
            if dead is not None:
                raise self._died(dead)
            time.sleep(SETUP_POLL_S)
        work.wait()

    def _dead_rank(self) -> Optional[int]:
        for rank, process in enumerate(self.processes, start=1):
            if process.exitcode is not None:
                return rank
        return None

    def _died(self, rank: int) -> WorkerFailedError:
        how = _how_it_ended(self.processes[rank - 1].exitcode)
        return WorkerFailedError(
            f"tensor-parallel rank {rank} {how}; the engine is shut down: build a new LLM"
            f"{self._traceback(rank)}",
            rank,
        )

    def _diagnose(self, error: BaseException) -> TensorParallelError:
        # A lost connection comes a moment before the dying process can be reaped.
        deadline = time.monotonic() + DEATH_WAIT_S
        dead = self._dead_rank()
        while dead is None and self.processes and time.monotonic() < deadline:
            time.sleep(SETUP_POLL_S)
            dead = self._dead_rank()
        if dead is not None:
            return self._died(dead)
        if self.entered is not None:
            behind = [r for r in range(1, self.size) if self.entered[r] < self.entered[0]]
            if behind:
                rank = behind[0]
                return WorkerFailedError(
                    f"tensor-parallel rank {rank} did not answer within --distributed-timeout "
                    f"{self.config.distributed_timeout:g} s (it hangs; {error}); the engine is "
                    "shut down: build a new LLM (a slow first step may need a longer "
                    "--distributed-timeout, LLM argument distributed_timeout)",
                    rank,
                )
        return WorkerFailedError(
            f"a tensor-parallel collective failed ({error}); which rank stopped is not known "
            "here (under torchrun, see its logs); the engine is shut down: build a new LLM"
        )

    def _traceback(self, rank: int) -> str:
        """The worker's traceback after a line break, when it reported an error (it writes the
        report before it exits, so a dead worker's is already there)."""
        if self.errors is None:
            return ""
        while not self.errors.empty():
            sender, text = self.errors.get()
            self.reports.setdefault(sender, text)
        text = self.reports.get(rank)
        return "" if text is None else f"; rank {rank} raised:\n{text.rstrip()}"

    def _fail(self, failure: TensorParallelError) -> TensorParallelError:
        """Records the failure (later steps raise it) and stops every process."""
        if self.failure is None:
            self.failure = failure
            logger.error("%s", failure)
            self._finalizer.detach()
            self._state.run(None)
            self.sender.groups = None
        return self.failure

    def shutdown(self) -> None:
        """Stops every worker and leaves the groups; steps raise `EngineShutDownError` after."""
        if self.failure is None:
            self.failure = EngineShutDownError(
                "the tensor-parallel engine was shut down (LLM.shutdown()); build a new LLM"
            )
        self._finalizer()

    def broadcast_latency_s(self) -> Optional[float]:
        """Seconds, summed over the steps so far, from rank 0 posting a step to the slowest
        worker having it (None under torchrun, where the ranks share no memory)."""
        return None if self.clock is None else float(self.clock[1:].max())

    @property
    def alive(self) -> bool:
        return self.failure is None


class _Shutdown:
    """Stops the workers once: the stop message (when `sender` is given, setup finished and they
    are alive), then terminate, then kill (at once otherwise); then the groups are destroyed, the rendezvous file removed and
    this process's torch threads restored (`num_threads`, when the executor changed them)."""

    def __init__(
        self, processes: list[Any], rendezvous_file: Optional[str], num_threads: Optional[int]
    ) -> None:
        self.processes = processes
        self.rendezvous_file = rendezvous_file
        self.num_threads = num_threads
        self.ready = False  # set once every rank finished setup (`confirm(READY)`)
        self.done = False

    def run(self, sender: Optional[StepSender]) -> None:
        if self.done:
            return
        self.done = True
        stopped = False
        alive = all(p.exitcode is None for p in self.processes)
        if sender is not None and self.ready and alive:
            with contextlib.suppress(Exception):
                sender.stop()
                stopped = True
        if stopped:
            deadline = time.monotonic() + STOP_GRACE_S
            for process in self.processes:
                process.join(max(0.0, deadline - time.monotonic()))
            for process in self.processes:
                if process.exitcode is None:
                    process.terminate()
                    process.join(1.0)
        for process in self.processes:  # after a failure at once: a hung rank ignores SIGTERM
            if process.exitcode is None:
                process.kill()
                process.join()
        set_collectives(None, 0, None)
        if sender is not None:
            sender.groups = None  # no reference outlives the groups (destroyed next)
        with contextlib.suppress(Exception):
            leave()
        if self.rendezvous_file is not None:
            with contextlib.suppress(OSError):
                os.unlink(self.rendezvous_file)
        if self.num_threads is not None:
            torch.set_num_threads(self.num_threads)


def _how_it_ended(exitcode: int) -> str:
    """A dead process's end, as the errors word it."""
    return f"was killed by signal {-exitcode}" if exitcode < 0 else f"exited with code {exitcode}"


def _wait_started(processes: list[Any], started: Any) -> None:
    """Waits until every spawned worker runs its entry point (`started[rank]` set), as long as
    that takes while each lives; one that exits first ends the start with `WorkerFailedError`
    (what it printed is on this process's stderr: it had not reached its error report yet)."""
    while not started[1:].all():
        for rank, process in enumerate(processes, start=1):
            if process.exitcode is not None and not started[rank]:
                how = _how_it_ended(process.exitcode)
                raise WorkerFailedError(
                    f"tensor-parallel rank {rank} {how} while starting, before its entry point "
                    "(its output above says why: an import failing in a spawned process?)",
                    rank,
                )
        time.sleep(START_POLL_S)


def is_torchrun_worker() -> bool:
    """Whether this process is a torchrun rank other than 0 (it serves rank 0's steps)."""
    return under_torchrun() and torchrun_rank() != 0
