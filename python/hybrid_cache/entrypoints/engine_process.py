"""The engine process: `AsyncLLM`'s step loop (`engine_core.run_loop`) in a child process of
its own, so that the server's event loop and the engine do not share one interpreter lock.

    EngineProcess.start(config, stream_interval, deliver)   # spawns; returns once it is ready

The child (multiprocessing "spawn") builds the `LLM` from the config, reports its
`EngineInfo` (or the error that stopped the build), then loops: it drains the commands waiting
on its end of a socket pair between steps, blocks on it only when idle, and sends one pickled
`Batch` per pass (every request's news of that step in one message). In this process a
receiver thread reads the batches and hands each to `deliver`; when the child dies (its end
closes), `deliver` gets a last batch with `dead` set, so no caller waits for ever. The child
ignores SIGINT (the server shuts it down) and exits when this process's end closes (this
process died). `stop()` asks it to stop, then terminates, then kills it.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import pickle
import signal
import socket
import threading
from multiprocessing.connection import Connection, wait
from typing import Any, Callable, Optional

import torch

from hybrid_cache.engine.engine_config import EngineConfig
from hybrid_cache.engine.llm import LLM
from hybrid_cache.entrypoints.engine_core import Batch, EngineCore, EngineInfo, run_loop
from hybrid_cache.errors import EngineDeadError

logger = logging.getLogger(__name__)

# How long a stopped engine process gets to exit before it is terminated, then killed.
STOP_GRACE_S = 5.0
PROTOCOL = pickle.HIGHEST_PROTOCOL
# Bytes each end of the socket pair buffers (the kernel caps it at net.core.wmem_max): the
# engine's writes do not wait for a server that reads late (a batch is a few KiB).
SOCKET_BUFFER_BYTES = 4 * 1024**2


def portable(error: BaseException) -> BaseException:
    """`error` if it survives pickling, else a `RuntimeError` with its type and message."""
    try:
        pickle.loads(pickle.dumps(error, PROTOCOL))
        return error
    except Exception:
        return RuntimeError(f"{type(error).__name__}: {error}")


def engine_main(
    conn: Connection, config: EngineConfig, stream_interval: int, num_threads: int, log_level: int
) -> None:
    """The engine process (see the module)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    logging.basicConfig(level=log_level, format="%(levelname)s %(name)s [engine]: %(message)s")
    torch.set_num_threads(num_threads)
    try:
        llm = LLM(config)
    except BaseException as error:
        conn.send_bytes(pickle.dumps(("failed", portable(error)), PROTOCOL))
        return
    conn.send_bytes(pickle.dumps(("ready", EngineInfo.of(llm)), PROTOCOL))
    core = EngineCore(llm, stream_interval, portable)
    recv, poll = conn.recv_bytes, conn.poll

    def next_commands(idle: bool) -> Optional[list[tuple[Any, ...]]]:
        commands: list[tuple[Any, ...]] = []
        try:
            if idle:
                poll(None)
            while poll(0):
                commands.extend(pickle.loads(recv()))
        except (EOFError, OSError):  # the server's process is gone
            return None
        return commands

    def send(batch: Batch) -> None:
        conn.send_bytes(pickle.dumps(batch, PROTOCOL))

    try:
        run_loop(core, next_commands, send)
    except (BrokenPipeError, ConnectionResetError):  # the server's process is gone
        pass
    finally:
        llm.shutdown()


class EngineProcess:
    """This process's handle on the engine process (see the module)."""

    def __init__(
        self,
        process: Any,
        conn: Connection,
        info: EngineInfo,
        deliver: Callable[[Batch], None],
    ) -> None:
        self.process = process
        self.conn: Connection = conn
        self.info: EngineInfo = info
        self.deliver = deliver
        self._send_lock = threading.Lock()
        self._stopping = False
        self._receiver = threading.Thread(
            target=self._receive, name="hybrid-cache-engine-receiver", daemon=True
        )
        self._receiver.start()

    @classmethod
    def start(
        cls,
        config: EngineConfig,
        stream_interval: int,
        deliver: Callable[[Batch], None],
        num_threads: int,
    ) -> EngineProcess:
        """Spawns the engine process and waits until its `LLM` is built; raises the build's
        error (typed, as `LLM(config)` raises it) or `EngineDeadError` if the child died."""
        context = multiprocessing.get_context("spawn")
        ours, theirs = context.Pipe(duplex=True)
        for conn in (ours, theirs):
            _grow_buffers(conn)
        process = context.Process(
            target=engine_main,
            args=(theirs, config, stream_interval, num_threads, logging.getLogger().level),
            name="hybrid-cache-engine",
            daemon=False,  # it may start tensor-parallel workers of its own
        )
        process.start()
        theirs.close()
        try:
            wait([ours, process.sentinel])
            try:
                kind, value = pickle.loads(ours.recv_bytes())
            except (EOFError, OSError):
                process.join(STOP_GRACE_S)
                raise EngineDeadError(
                    f"the engine process exited (code {process.exitcode}) before it was ready"
                ) from None
        except BaseException:
            _end(process)
            ours.close()
            raise
        if kind == "failed":
            process.join(STOP_GRACE_S)
            _end(process)
            ours.close()
            raise value
        return cls(process, ours, value, deliver)

    @property
    def pid(self) -> Optional[int]:
        return self.process.pid

    def send(self, commands: list[tuple[Any, ...]]) -> None:
        """Posts commands to the engine (raises `OSError` once it is gone)."""
        data = pickle.dumps(commands, PROTOCOL)
        with self._send_lock:
            self.conn.send_bytes(data)

    def stop(self, timeout: float = STOP_GRACE_S) -> None:
        """Asks the engine to stop (it fails its requests and exits), then ends it."""
        self._stopping = True
        try:
            self.send([("stop",)])
        except OSError:
            pass
        self.process.join(timeout)
        _end(self.process)
        self._receiver.join(timeout)
        self.conn.close()

    def _receive(self) -> None:
        recv, deliver = self.conn.recv_bytes, self.deliver
        while True:
            try:
                data = recv()
            except (EOFError, OSError):
                break
            try:
                batch = pickle.loads(data)
            except Exception as error:  # nothing more can be trusted
                logger.exception("a batch from the engine process could not be read")
                deliver(Batch([], [], None, (f"a bad batch: {error}", None)))
                return
            deliver(batch)
            if batch.dead is not None:
                return
        self.process.join(1.0)
        code = self.process.exitcode
        reason = "was shut down" if self._stopping else "died"
        message = f"the engine process {reason} (exit code {code})"
        if not self._stopping:
            logger.error("%s", message)
        deliver(Batch([], [], None, (message, None)))


def _grow_buffers(conn: Connection) -> None:
    with socket.socket(fileno=os.dup(conn.fileno())) as sock:
        for option in (socket.SO_SNDBUF, socket.SO_RCVBUF):
            sock.setsockopt(socket.SOL_SOCKET, option, SOCKET_BUFFER_BYTES)


def _end(process: Any) -> None:
    """Terminates, then kills, an engine process that has not exited."""
    if process.is_alive():
        process.terminate()
        process.join(STOP_GRACE_S)
    if process.is_alive():
        process.kill()
        process.join(STOP_GRACE_S)
