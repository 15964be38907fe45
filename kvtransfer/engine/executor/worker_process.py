"""The life of one spawned worker process, and how the executor finds the worker class.

`MultiprocExecutor` starts `worker_main` in a fresh ``spawn`` process (inside
`spawn_environment`); it builds the worker from its ``"package.module:Class"`` path, joins the
torch.distributed world, then answers pipe requests (`executor_messages`) until it is told to
shut down, its parent vanishes, or the pipe closes. `kvtransfer.engine.executor.executor` re-exports
`parse_worker_cls`/`load_worker_cls`.
"""

from __future__ import annotations

import contextlib
import importlib
import multiprocessing as mp
import os
import threading
from collections.abc import Callable, Iterator
from multiprocessing.connection import Connection, wait
from typing import Any

from kvtransfer.engine.config import EngineConfig
from kvtransfer.engine.executor.messages import Failed, Ok, Shutdown, dispatch, dumps, loads
from kvtransfer.engine.parallel import ParallelRank

# ----------------------------------------------------------------------------- worker classes


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


# ---------------------------------------------------------------------------------- spawning

_ENV_LOCK = threading.Lock()


@contextlib.contextmanager
def spawn_environment(backend: str) -> Iterator[None]:
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


# ----------------------------------------------------------------------------- child process


def exit_with_parent() -> None:
    parent = mp.parent_process()
    if parent is None:
        return

    def watch() -> None:
        wait([parent.sentinel])
        # The executor is gone (even killed -9): nobody will ever send Shutdown.
        os._exit(1)

    threading.Thread(target=watch, name="kvtransfer-parent-watch", daemon=True).start()


def worker_main(
    conn: Connection,
    config: EngineConfig,
    rank: ParallelRank,
    init_method: str,
    backend: str,
    worker_cls: str,
    kv_event_signal: Callable[[], None] | None = None,
) -> None:
    """Entry point of a worker process: build the worker, then serve requests until told to
    stop. A start-up failure is kept and becomes the reply to every request."""
    exit_with_parent()
    import torch

    torch.set_num_threads(1)
    worker: Any = None
    dist: Any = None
    startup_failure: Failed | None = None
    try:
        cls = load_worker_cls(worker_cls)
        from kvtransfer.engine.runner.distributed import WorkerDistributed

        if rank.world_size > 1:
            dist = WorkerDistributed.init(rank, init_method, backend)
        worker = cls(config, rank, dist, kv_event_signal)
    except Exception as exc:
        startup_failure = Failed.from_exception(rank, exc)

    while True:
        try:
            request = loads(conn.recv_bytes())
        except (EOFError, OSError):
            break  # the parent is gone
        if isinstance(request, Shutdown):
            reply = _stop_worker(rank, worker, dist)
            with contextlib.suppress(OSError):
                conn.send_bytes(dumps(reply))
            break
        if startup_failure is not None:
            reply = startup_failure
        else:
            try:
                reply = Ok(dispatch(worker, request))
            except Exception as exc:
                reply = Failed.from_exception(rank, exc)
        try:
            payload = dumps(reply)
        except Exception as exc:
            payload = dumps(Failed.from_exception(rank, exc))
        try:
            conn.send_bytes(payload)
        except OSError:
            break
    conn.close()


def _stop_worker(rank: ParallelRank, worker: Any, dist: Any) -> Ok | Failed:
    reply: Ok | Failed = Ok(None)
    if worker is not None:
        try:
            worker.shutdown()
        except Exception as exc:
            reply = Failed.from_exception(rank, exc)
    if dist is not None:
        try:
            dist.destroy()
        except Exception as exc:
            reply = Failed.from_exception(rank, exc)
    return reply
