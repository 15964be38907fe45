"""Executors: run one `Worker` per ``(pp_rank, tp_rank)`` and drive them in lock step.

`Executor.create` picks `UniprocExecutor` for a single worker (in this process, no
torch.distributed) and `MultiprocExecutor` otherwise (one spawned process per global rank
``pp_rank * tp_size + tp_rank``, joined into one torch.distributed world by
`WorkerDistributed`). Both expose the same typed API; every call reaches every worker and
returns one result per global rank, in rank order.

Parent and workers exchange pickled request/reply dataclasses over one duplex pipe per worker
(`executor_messages`); each worker process runs `worker_process.worker_main`. A worker
exception becomes `WorkerError`, a vanished worker `WorkerDiedError`; either leaves the
executor failed and its processes torn down, because the surviving ranks may be stuck in a
collective with the lost one. The errors, `dumps`/`loads` and the worker-class helpers are
re-exported here, so this module stays the one import path for executor users.
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing as mp
import pickle
import shutil
import tempfile
import time
import weakref
from abc import ABC, abstractmethod
from multiprocessing.connection import Connection, wait
from pathlib import Path
from typing import Any

from kvtransfer.connector.metadata import PpTpRank
from kvtransfer.engine.config import EngineConfig
from kvtransfer.engine.executor.errors import (
    ExecutorClosedError,
    ExecutorError,
    WorkerDiedError,
    WorkerError,
    WorkerTimeoutError,
    describe_rank,
)
from kvtransfer.engine.executor.messages import (
    CheckHealth,
    Execute,
    Failed,
    Initialize,
    NumRequests,
    Ok,
    Shutdown,
    Sleep,
    WakeUp,
    WorkerRequest,
    dispatch,
    dumps,
    loads,
    request_name,
)
from kvtransfer.engine.executor.worker_process import (
    load_worker_cls,
    parse_worker_cls,
    spawn_environment,
    worker_main,
)
from kvtransfer.engine.outputs import ModelRunnerOutput
from kvtransfer.engine.parallel import ParallelRank
from kvtransfer.engine.runner.worker import WorkerInfo
from kvtransfer.engine.scheduler_output import SchedulerOutput
from kvtransfer.engine.wakeup import Wakeup

__all__ = [
    "DEFAULT_WORKER",
    "SHUTDOWN_TIMEOUT_S",
    "STARTUP_TIMEOUT_S",
    "Executor",
    "ExecutorClosedError",
    "ExecutorError",
    "MultiprocExecutor",
    "UniprocExecutor",
    "WorkerDiedError",
    "WorkerError",
    "WorkerInfo",
    "WorkerTimeoutError",
    "dumps",
    "load_worker_cls",
    "loads",
    "parallel_ranks",
    "parse_worker_cls",
]

logger = logging.getLogger(__name__)

DEFAULT_WORKER = "kvtransfer.engine.runner.worker:Worker"
STARTUP_TIMEOUT_S = 120.0
SHUTDOWN_TIMEOUT_S = 10.0
# How often a waiting parent wakes up to re-check deadlines (deaths wake it immediately).
_POLL_S = 1.0
# A failed executor's surviving workers are usually stuck in a collective: do not wait long.
_FAILED_SHUTDOWN_TIMEOUT_S = 2.0


def parallel_ranks(config: EngineConfig) -> list[ParallelRank]:
    """Every worker's rank, in global rank order."""
    tp, pp = config.tensor_parallel_size, config.pipeline_parallel_size
    return [ParallelRank(t, tp, p, pp) for p in range(pp) for t in range(tp)]


# ------------------------------------------------------------------------------ executors


class Executor(ABC):
    """Runs the workers of one engine; not thread-safe (one step loop drives it)."""

    def __init__(self, config: EngineConfig, worker_cls: str) -> None:
        parse_worker_cls(worker_cls)
        self.config = config
        self.worker_cls = worker_cls
        self.ranks: tuple[ParallelRank, ...] = tuple(parallel_ranks(config))
        self._initialized = False
        self._failed = False
        self._closed_reason: str | None = None
        # Set by the workers' connectors when a transfer finishes (`WorkerInfo.signals_kv_events`).
        self.kv_events = Wakeup()

    @staticmethod
    def create(config: EngineConfig, worker_cls: str = DEFAULT_WORKER) -> Executor:
        if config.world_size == 1:
            return UniprocExecutor(config, worker_cls)
        return MultiprocExecutor(config, worker_cls)

    @property
    def world_size(self) -> int:
        return self.config.world_size

    @property
    def output_rank(self) -> int:
        """Global rank whose output carries the sampled tokens (last stage, tp_rank 0)."""
        return (self.config.pipeline_parallel_size - 1) * self.config.tensor_parallel_size

    @property
    def is_closed(self) -> bool:
        return self._closed_reason is not None

    def initialize(self) -> list[WorkerInfo]:
        """Load every worker's model and KV cache; once, before anything else."""
        self._check_open()
        if self._initialized:
            raise ExecutorError("initialize() was already called")
        infos = self._call_all(Initialize())
        for rank, info in zip(self.ranks, infos, strict=True):
            if not isinstance(info, WorkerInfo) or info.rank != rank:
                self._fail(f"{describe_rank(rank)} returned {info!r} from initialize()")
                raise ExecutorError(
                    f"{describe_rank(rank)} returned {info!r} from initialize(), expected a "
                    f"WorkerInfo for {rank}"
                )
        self._initialized = True
        return infos

    def execute_model(self, scheduler_output: SchedulerOutput) -> list[ModelRunnerOutput | None]:
        """Run one step on every worker; one output per global rank."""
        self._check_ready("execute_model")
        return self._call_all(Execute(scheduler_output))

    def check_health(self) -> None:
        """Raise (`WorkerError`, `WorkerDiedError`) unless every worker is healthy."""
        self._check_ready("check_health")
        self._call_all(CheckHealth())

    def num_worker_requests(self) -> list[int]:
        """Per global rank, how many requests the worker still holds state for."""
        self._check_ready("num_worker_requests")
        return self._call_all(NumRequests())

    def sleep(self) -> None:
        """Every worker unregisters and frees its KV caches (`EngineCore.sleep`)."""
        self._check_ready("sleep")
        self._call_all(Sleep())

    def wake_up(self) -> list[dict[PpTpRank, Any] | None]:
        """Every worker maps and registers its KV caches again; their handshake metadata."""
        self._check_ready("wake_up")
        return self._call_all(WakeUp())

    def shutdown(self) -> None:
        """Stop every worker; safe to call more than once, also after a failure."""
        if self._closed_reason is None:
            self._closed_reason = "the executor was shut down"
        self._shutdown()

    def __enter__(self) -> Executor:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    def _check_open(self) -> None:
        if self._closed_reason is not None:
            raise ExecutorClosedError(f"executor is closed: {self._closed_reason}")

    def _check_ready(self, what: str) -> None:
        self._check_open()
        if not self._initialized:
            raise ExecutorError(f"call initialize() before {what}()")

    def _fail(self, reason: str) -> None:
        self._failed = True
        self._closed_reason = f"it failed earlier: {reason}"
        self._shutdown()

    @abstractmethod
    def _call_all(self, request: WorkerRequest) -> list[Any]:
        """Run ``request`` on every worker; raise the first failure after calling `_fail`."""

    @abstractmethod
    def _shutdown(self) -> None:
        """Release the workers; idempotent."""


class UniprocExecutor(Executor):
    """The single worker lives in this process and has no `WorkerDistributed`."""

    def __init__(self, config: EngineConfig, worker_cls: str = DEFAULT_WORKER) -> None:
        super().__init__(config, worker_cls)
        if config.world_size != 1:
            raise ValueError(f"UniprocExecutor needs world_size 1, got {config.world_size}")
        self._worker: Any = None
        self._shut_down = False

    def _call_all(self, request: WorkerRequest) -> list[Any]:
        rank = self.ranks[0]
        try:
            if self._worker is None:
                worker_cls = load_worker_cls(self.worker_cls)
                self._worker = worker_cls(self.config, rank, None, self.kv_events.signal)
            return [dispatch(self._worker, request)]
        except Exception as exc:
            error = Failed.from_exception(rank, exc).error()
            self._fail(str(error))
            raise error from exc

    def _shutdown(self) -> None:
        if self._shut_down:
            return
        self._shut_down = True
        if self._worker is not None:
            try:
                self._worker.shutdown()
            except Exception:
                logger.exception("%s: shutdown failed", describe_rank(self.ranks[0]))


class MultiprocExecutor(Executor):
    """One spawned process per global rank, joined into one torch.distributed world."""

    def __init__(
        self,
        config: EngineConfig,
        worker_cls: str = DEFAULT_WORKER,
        *,
        startup_timeout_s: float = STARTUP_TIMEOUT_S,
        shutdown_timeout_s: float = SHUTDOWN_TIMEOUT_S,
    ) -> None:
        super().__init__(config, worker_cls)
        if startup_timeout_s <= 0 or shutdown_timeout_s <= 0:
            raise ValueError(
                f"timeouts must be > 0, got startup_timeout_s={startup_timeout_s}, "
                f"shutdown_timeout_s={shutdown_timeout_s}"
            )
        self.startup_timeout_s = startup_timeout_s
        self.shutdown_timeout_s = shutdown_timeout_s
        self._procs: list[mp.process.BaseProcess] = []
        self._conns: list[Connection] = []
        # The rendezvous is a file in a private directory: no port to pick, none to collide.
        self._tmpdir = tempfile.mkdtemp(prefix="kvtransfer-dist-")
        init_method = (Path(self._tmpdir) / "rendezvous").as_uri()
        backend = "nccl" if config.device == "cuda" else "gloo"
        # Reaps the processes even if the owner never calls shutdown(); holds no ref to self.
        self._finalizer = weakref.finalize(self, _reap, self._procs, self._conns, self._tmpdir)
        ctx = mp.get_context("spawn")
        try:
            with spawn_environment(backend):
                for rank in self.ranks:
                    parent_conn, child_conn = ctx.Pipe(duplex=True)
                    proc = ctx.Process(
                        target=worker_main,
                        args=(
                            child_conn,
                            config,
                            rank,
                            init_method,
                            backend,
                            worker_cls,
                            self.kv_events.signal,
                        ),
                        name=f"kvtransfer-worker-pp{rank.pp_rank}-tp{rank.tp_rank}",
                        daemon=True,
                    )
                    proc.start()
                    # Only the child may hold its end, so its death reads as EOF here.
                    child_conn.close()
                    self._procs.append(proc)
                    self._conns.append(parent_conn)
        except BaseException:
            self._finalizer()
            raise

    @property
    def pids(self) -> list[int | None]:
        return [proc.pid for proc in self._procs]

    def _call_all(self, request: WorkerRequest) -> list[Any]:
        payload = dumps(request)  # before sending anything: a bad request leaves no trace
        timeout = self.startup_timeout_s if isinstance(request, Initialize) else None
        try:
            for conn in self._conns:
                # A dead worker is reported by the collection below, with its exit code.
                with contextlib.suppress(OSError):
                    conn.send_bytes(payload)
            return self._collect(request, timeout)
        except BaseException as exc:
            # Interrupted half way (KeyboardInterrupt...): replies still in flight would be
            # mistaken for the next call's, so this executor cannot be used any more.
            if not self.is_closed:
                self._fail(f"{request_name(request)} was interrupted by {exc!r}")
            raise

    def _collect(self, request: WorkerRequest, timeout_s: float | None) -> list[Any]:
        n = len(self._procs)
        results: list[Any] = [None] * n
        pending = set(range(n))
        failures: dict[int, Failed] = {}
        dead: set[int] = set()
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while pending and not failures and not dead:
            wait_s = _POLL_S
            if deadline is not None:
                wait_s = min(wait_s, deadline - time.monotonic())
                if wait_s <= 0:
                    error = WorkerTimeoutError(
                        [self.ranks[i] for i in sorted(pending)],
                        request_name(request),
                        timeout_s or 0.0,
                    )
                    self._fail(str(error))
                    raise error
            watched = {self._conns[i]: i for i in pending}
            watched.update({self._procs[i].sentinel: i for i in pending})
            ready = {watched[obj] for obj in wait(list(watched), timeout=wait_s)}
            for i in sorted(ready):
                reply = self._receive(i)
                if reply is None:
                    dead.add(i)
                elif isinstance(reply, Failed):
                    failures[i] = reply
                else:
                    results[i] = reply.value
                    pending.discard(i)
        if not failures and not dead:
            return results
        # A death is the root cause of any failure it provoked in its peers' collectives.
        sentinels = {proc.sentinel: i for i, proc in enumerate(self._procs)}
        dead |= {sentinels[s] for s in wait(list(sentinels), timeout=0)}
        if dead:
            i = min(dead)
            self._procs[i].join(timeout=_POLL_S)
            error: ExecutorError = WorkerDiedError(self.ranks[i], self._procs[i].exitcode)
        else:
            error = failures[min(failures)].error()
        self._fail(str(error))
        raise error

    def _receive(self, i: int) -> Ok | Failed | None:
        """The reply of worker ``i`` if one is waiting, ``None`` if the worker is gone."""
        conn = self._conns[i]
        try:
            if not conn.poll():
                return None
            reply = loads(conn.recv_bytes())
        except (EOFError, OSError):
            return None
        if not isinstance(reply, Ok | Failed):
            return Failed(self.ranks[i], "ProtocolError", f"unexpected reply {reply!r}", "")
        return reply

    def _shutdown(self) -> None:
        if not self._finalizer.alive:
            return
        timeout_s = self.shutdown_timeout_s
        failed = self._failed
        if failed:
            timeout_s = min(timeout_s, _FAILED_SHUTDOWN_TIMEOUT_S)
        for conn in self._conns:
            with contextlib.suppress(OSError):
                conn.send_bytes(dumps(Shutdown()))
        deadline = time.monotonic() + timeout_s
        alive = [proc for proc in self._procs if proc.is_alive()]
        while alive and (remaining := deadline - time.monotonic()) > 0:
            wait([proc.sentinel for proc in alive], timeout=remaining)
            alive = [proc for proc in alive if proc.is_alive()]
        # After a failure, the survivors' errors are mostly echoes of it (a peer vanished).
        level = logging.DEBUG if failed else logging.WARNING
        for conn in self._conns:
            _log_leftover_failures(conn, level)
        self._finalizer()


def _log_leftover_failures(conn: Connection, level: int) -> None:
    """Log the failures among replies nobody collected (shutdown, or steps cut short)."""
    with contextlib.suppress(EOFError, OSError, pickle.UnpicklingError):
        while conn.poll():
            reply = loads(conn.recv_bytes())
            if isinstance(reply, Failed):
                logger.log(level, "%s", reply.error())


def _reap(procs: list[mp.process.BaseProcess], conns: list[Connection], tmpdir: str) -> None:
    """Force every worker down and release what the executor holds."""
    for proc in procs:
        if proc.is_alive():
            proc.terminate()
    for proc in procs:
        proc.join(timeout=_POLL_S)
        if proc.is_alive():
            proc.kill()
            proc.join()
    for conn in conns:
        conn.close()
    shutil.rmtree(tmpdir, ignore_errors=True)
