"""Executors: run one `Worker` per ``(pp_rank, tp_rank)`` and drive them in lock step.

`Executor.create` picks `UniprocExecutor` for a single worker (in this process, no
torch.distributed) and `MultiprocExecutor` otherwise (one spawned process per global rank
``pp_rank * tp_size + tp_rank``, joined into one torch.distributed world by
`WorkerDistributed`). Both expose the same typed API; every call reaches every worker and
returns one result per global rank, in rank order.

Parent and workers exchange pickled request/reply dataclasses over one duplex pipe per worker.
A worker exception becomes `WorkerError`, a vanished worker `WorkerDiedError`; either leaves the
executor failed and its processes torn down, because the surviving ranks may be stuck in a
collective with the lost one.
"""

from __future__ import annotations

import contextlib
import copyreg
import importlib
import io
import logging
import multiprocessing as mp
import os
import pickle
import shutil
import signal
import tempfile
import threading
import time
import traceback
import weakref
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from multiprocessing.connection import Connection, wait
from pathlib import Path
from types import MappingProxyType
from typing import Any

from kvtransfer.connector.metadata import KVConnectorHandshakeMetadata
from kvtransfer.engine.config import EngineConfig
from kvtransfer.engine.parallel import ParallelRank
from kvtransfer.engine.scheduler_output import SchedulerOutput
from kvtransfer.outputs import EMPTY_MODEL_RUNNER_OUTPUT, ModelRunnerOutput

logger = logging.getLogger(__name__)

DEFAULT_WORKER = "kvtransfer.engine.worker:Worker"
STARTUP_TIMEOUT_S = 120.0
SHUTDOWN_TIMEOUT_S = 10.0
# How often a waiting parent wakes up to re-check deadlines (deaths wake it immediately).
_POLL_S = 1.0
# A failed executor's surviving workers are usually stuck in a collective: do not wait long.
_FAILED_SHUTDOWN_TIMEOUT_S = 2.0


@dataclass(frozen=True)
class WorkerInfo:
    """What a worker reports once `Worker.initialize` loaded its model and KV cache."""

    rank: ParallelRank
    num_kv_blocks: int
    handshake_metadata: dict[tuple[int, int], KVConnectorHandshakeMetadata] | None
    layer_names: tuple[str, ...]


# ---------------------------------------------------------------------------------- errors


def _describe(rank: ParallelRank) -> str:
    return f"worker rank {rank.rank} (pp {rank.pp_rank}, tp {rank.tp_rank})"


class ExecutorError(RuntimeError):
    """Base of the executor's errors."""


class WorkerError(ExecutorError):
    """A worker raised; the worker's traceback is attached as a note and `traceback_text`."""

    def __init__(
        self, rank: ParallelRank, exc_type: str, message: str, traceback_text: str = ""
    ) -> None:
        super().__init__(f"{_describe(rank)} failed: {exc_type}: {message}")
        self.rank = rank
        self.exc_type = exc_type
        self.message = message
        self.traceback_text = traceback_text
        if traceback_text:
            self.add_note(f"traceback in {_describe(rank)}:\n{traceback_text.rstrip()}")


class WorkerDiedError(ExecutorError):
    """A worker process exited without being asked to (crash, signal, ``os._exit``)."""

    def __init__(self, rank: ParallelRank, exitcode: int | None) -> None:
        if exitcode is None:
            how = "closed its pipe (exit code unknown)"
        elif exitcode < 0:
            how = f"died with exit code {exitcode} ({signal.Signals(-exitcode).name})"
        else:
            how = f"died with exit code {exitcode}"
        super().__init__(f"{_describe(rank)} {how}")
        self.rank = rank
        self.exitcode = exitcode


class WorkerTimeoutError(ExecutorError):
    """Workers did not answer within the allowed time."""

    def __init__(self, ranks: Sequence[ParallelRank], what: str, timeout_s: float) -> None:
        names = ", ".join(_describe(r) for r in ranks)
        super().__init__(f"{names} did not answer {what} within {timeout_s:g} s")
        self.ranks = tuple(ranks)


class ExecutorClosedError(ExecutorError):
    """The executor was shut down, or failed earlier."""


# -------------------------------------------------------------------- request / reply types


@dataclass(frozen=True)
class _Initialize:
    pass


@dataclass(frozen=True)
class _Execute:
    scheduler_output: SchedulerOutput


@dataclass(frozen=True)
class _CheckHealth:
    pass


@dataclass(frozen=True)
class _NumRequests:
    pass


@dataclass(frozen=True)
class _Shutdown:
    pass


_Request = _Initialize | _Execute | _CheckHealth | _NumRequests | _Shutdown


@dataclass(frozen=True)
class _Ok:
    value: Any


@dataclass(frozen=True)
class _Failed:
    rank: ParallelRank
    exc_type: str
    message: str
    traceback_text: str

    @classmethod
    def from_exception(cls, rank: ParallelRank, exc: BaseException) -> _Failed:
        text = "".join(traceback.format_exception(exc))
        return cls(rank, type(exc).__name__, str(exc), text)

    def error(self) -> WorkerError:
        return WorkerError(self.rank, self.exc_type, self.message, self.traceback_text)


def _dispatch(worker: Any, request: _Request) -> Any:
    """Run ``request`` on ``worker``; shared by both executors so they behave alike."""
    if isinstance(request, _Initialize):
        return worker.initialize()
    if isinstance(request, _Execute):
        return worker.execute_model(request.scheduler_output)
    if isinstance(request, _CheckHealth):
        return worker.check_health()
    if isinstance(request, _NumRequests):
        return worker.num_requests()
    raise TypeError(f"unknown executor request {request!r}")


# ------------------------------------------------------------------------------ transport


def _as_mappingproxy(items: dict) -> MappingProxyType:
    return MappingProxyType(items)


def _reduce_mappingproxy(proxy: MappingProxyType) -> tuple[Callable, tuple[dict]]:
    return _as_mappingproxy, (dict(proxy),)


_EMPTY_OUTPUT_ID = "EMPTY_MODEL_RUNNER_OUTPUT"


class _Pickler(pickle.Pickler):
    # SchedulerOutput and ModelRunnerOutput default to read-only mappingproxy fields, which the
    # stock pickler refuses; they travel as dicts and are re-wrapped on arrival.
    dispatch_table = {**copyreg.dispatch_table, MappingProxyType: _reduce_mappingproxy}

    def persistent_id(self, obj: Any) -> str | None:
        # Keep the shared empty output a singleton across the pipe, as it is in-process.
        return _EMPTY_OUTPUT_ID if obj is EMPTY_MODEL_RUNNER_OUTPUT else None


class _Unpickler(pickle.Unpickler):
    def persistent_load(self, pid: Any) -> Any:
        if pid == _EMPTY_OUTPUT_ID:
            return EMPTY_MODEL_RUNNER_OUTPUT
        raise pickle.UnpicklingError(f"unknown persistent id {pid!r}")


def dumps(obj: Any) -> bytes:
    """Serialise ``obj`` the way executor messages travel between processes."""
    buffer = io.BytesIO()
    _Pickler(buffer, protocol=pickle.HIGHEST_PROTOCOL).dump(obj)
    return buffer.getvalue()


def loads(data: bytes) -> Any:
    """Inverse of `dumps`."""
    return _Unpickler(io.BytesIO(data)).load()


# ------------------------------------------------------------------------- worker classes


def parse_worker_cls(worker_cls: str) -> tuple[str, str]:
    """Split ``"package.module:Class"`` into module and class name."""
    module, sep, name = worker_cls.partition(":")
    if not sep or not module or not name or ":" in name:
        raise ValueError(f"worker_cls must look like 'package.module:Class', got {worker_cls!r}")
    return module, name


def load_worker_cls(worker_cls: str) -> type:
    module_name, name = parse_worker_cls(worker_cls)
    module = importlib.import_module(module_name)
    try:
        cls = getattr(module, name)
    except AttributeError:
        raise ImportError(f"module {module_name!r} has no attribute {name!r}") from None
    if not isinstance(cls, type):
        raise TypeError(f"worker_cls {worker_cls!r} is not a class")
    return cls


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
        infos = self._call_all(_Initialize())
        for rank, info in zip(self.ranks, infos, strict=True):
            if not isinstance(info, WorkerInfo) or info.rank != rank:
                self._fail(f"{_describe(rank)} returned {info!r} from initialize()")
                raise ExecutorError(
                    f"{_describe(rank)} returned {info!r} from initialize(), expected a "
                    f"WorkerInfo for {rank}"
                )
        self._initialized = True
        return infos

    def execute_model(self, scheduler_output: SchedulerOutput) -> list[ModelRunnerOutput | None]:
        """Run one step on every worker; one output per global rank."""
        self._check_ready("execute_model")
        return self._call_all(_Execute(scheduler_output))

    def check_health(self) -> None:
        """Raise (`WorkerError`, `WorkerDiedError`) unless every worker is healthy."""
        self._check_ready("check_health")
        self._call_all(_CheckHealth())

    def num_worker_requests(self) -> list[int]:
        """Per global rank, how many requests the worker still holds state for."""
        self._check_ready("num_worker_requests")
        return self._call_all(_NumRequests())

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
    def _call_all(self, request: _Request) -> list[Any]:
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

    def _call_all(self, request: _Request) -> list[Any]:
        rank = self.ranks[0]
        try:
            if self._worker is None:
                self._worker = load_worker_cls(self.worker_cls)(self.config, rank, None)
            return [_dispatch(self._worker, request)]
        except Exception as exc:
            error = _Failed.from_exception(rank, exc).error()
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
                logger.exception("%s: shutdown failed", _describe(self.ranks[0]))


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
            with _spawn_environment(backend):
                for rank in self.ranks:
                    parent_conn, child_conn = ctx.Pipe(duplex=True)
                    proc = ctx.Process(
                        target=_worker_main,
                        args=(child_conn, config, rank, init_method, backend, worker_cls),
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

    def _call_all(self, request: _Request) -> list[Any]:
        payload = dumps(request)  # before sending anything: a bad request leaves no trace
        timeout = self.startup_timeout_s if isinstance(request, _Initialize) else None
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
                self._fail(f"{type(request).__name__.lstrip('_')} was interrupted by {exc!r}")
            raise

    def _collect(self, request: _Request, timeout_s: float | None) -> list[Any]:
        n = len(self._procs)
        results: list[Any] = [None] * n
        pending = set(range(n))
        failures: dict[int, _Failed] = {}
        dead: set[int] = set()
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while pending and not failures and not dead:
            wait_s = _POLL_S
            if deadline is not None:
                wait_s = min(wait_s, deadline - time.monotonic())
                if wait_s <= 0:
                    error = WorkerTimeoutError(
                        [self.ranks[i] for i in sorted(pending)],
                        type(request).__name__.lstrip("_"),
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
                elif isinstance(reply, _Failed):
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

    def _receive(self, i: int) -> _Ok | _Failed | None:
        """The reply of worker ``i`` if one is waiting, ``None`` if the worker is gone."""
        conn = self._conns[i]
        try:
            if not conn.poll():
                return None
            reply = loads(conn.recv_bytes())
        except (EOFError, OSError):
            return None
        if not isinstance(reply, _Ok | _Failed):
            return _Failed(self.ranks[i], "ProtocolError", f"unexpected reply {reply!r}", "")
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
                conn.send_bytes(dumps(_Shutdown()))
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
            if isinstance(reply, _Failed):
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


_ENV_LOCK = threading.Lock()


@contextlib.contextmanager
def _spawn_environment(backend: str) -> Iterator[None]:
    """Set the children's environment while they are spawned (it is inherited at exec time,
    before the child imports torch)."""
    overrides = {"OMP_NUM_THREADS": "1"}
    if backend == "gloo" and "GLOO_SOCKET_IFNAME" not in os.environ:
        # Every worker is on this host; gloo's interface guess can pick an unreachable one.
        overrides["GLOO_SOCKET_IFNAME"] = "lo"
    with _ENV_LOCK:
        saved = {key: os.environ.get(key) for key in overrides}
        os.environ.update(overrides)
        try:
            yield
        finally:
            for key, value in saved.items():
                if value is None:
                    os.environ.pop(key, None)
                else:
                    os.environ[key] = value


# --------------------------------------------------------------------------- child process


def _exit_with_parent() -> None:
    parent = mp.parent_process()
    if parent is None:
        return

    def watch() -> None:
        wait([parent.sentinel])
        # The executor is gone (even killed -9): nobody will ever send _Shutdown.
        os._exit(1)

    threading.Thread(target=watch, name="kvtransfer-parent-watch", daemon=True).start()


def _worker_main(
    conn: Connection,
    config: EngineConfig,
    rank: ParallelRank,
    init_method: str,
    backend: str,
    worker_cls: str,
) -> None:
    """Entry point of a worker process: build the worker, then serve requests until told to
    stop. A start-up failure is kept and becomes the reply to every request."""
    _exit_with_parent()
    import torch

    torch.set_num_threads(1)
    worker: Any = None
    dist: Any = None
    startup_failure: _Failed | None = None
    try:
        cls = load_worker_cls(worker_cls)
        from kvtransfer.engine.distributed import WorkerDistributed

        if rank.world_size > 1:
            dist = WorkerDistributed.init(rank, init_method, backend)
        worker = cls(config, rank, dist)
    except Exception as exc:
        startup_failure = _Failed.from_exception(rank, exc)

    while True:
        try:
            request = loads(conn.recv_bytes())
        except (EOFError, OSError):
            break  # the parent is gone
        if isinstance(request, _Shutdown):
            reply = _stop_worker(rank, worker, dist)
            with contextlib.suppress(OSError):
                conn.send_bytes(dumps(reply))
            break
        if startup_failure is not None:
            reply = startup_failure
        else:
            try:
                reply = _Ok(_dispatch(worker, request))
            except Exception as exc:
                reply = _Failed.from_exception(rank, exc)
        try:
            payload = dumps(reply)
        except Exception as exc:
            payload = dumps(_Failed.from_exception(rank, exc))
        try:
            conn.send_bytes(payload)
        except OSError:
            break
    conn.close()


def _stop_worker(rank: ParallelRank, worker: Any, dist: Any) -> _Ok | _Failed:
    reply: _Ok | _Failed = _Ok(None)
    if worker is not None:
        try:
            worker.shutdown()
        except Exception as exc:
            reply = _Failed.from_exception(rank, exc)
    if dist is not None:
        try:
            dist.destroy()
        except Exception as exc:
            reply = _Failed.from_exception(rank, exc)
    return reply
