"""The wire protocol between an executor and its workers: typed requests and replies, and the
pickling that carries them over a pipe.

The parent sends one request to every worker and reads one reply (`Ok` or `Failed`) per
worker. `dispatch` maps a request to the `Worker` method it stands for; the in-process executor
uses it too, so both executors run a request the same way. `kvtransfer.engine.executor.executor`
re-exports `dumps`/`loads`.
"""

from __future__ import annotations

import copyreg
import io
import pickle
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

from kvtransfer.engine.executor.errors import WorkerError
from kvtransfer.engine.outputs import EMPTY_MODEL_RUNNER_OUTPUT
from kvtransfer.engine.parallel import ParallelRank
from kvtransfer.engine.scheduler_output import SchedulerOutput

# ---------------------------------------------------------------------------------- requests


@dataclass(frozen=True)
class Initialize:
    pass


@dataclass(frozen=True)
class Execute:
    scheduler_output: SchedulerOutput


@dataclass(frozen=True)
class CheckHealth:
    pass


@dataclass(frozen=True)
class NumRequests:
    pass


@dataclass(frozen=True)
class Sleep:
    """Unregister the KV caches from the connector, then free their memory."""


@dataclass(frozen=True)
class WakeUp:
    """Map the KV caches again (zeroed) and register them; replies the new handshake metadata."""


@dataclass(frozen=True)
class Shutdown:
    """Handled by the worker process itself (stop the worker, leave the world), never by
    `dispatch`."""


WorkerRequest = Initialize | Execute | CheckHealth | NumRequests | Sleep | WakeUp | Shutdown


def request_name(request: WorkerRequest) -> str:
    """How error messages name a request, e.g. ``Initialize``."""
    return type(request).__name__


def dispatch(worker: Any, request: WorkerRequest) -> Any:
    """Run ``request`` on ``worker``."""
    if isinstance(request, Initialize):
        return worker.initialize()
    if isinstance(request, Execute):
        return worker.execute_model(request.scheduler_output)
    if isinstance(request, CheckHealth):
        return worker.check_health()
    if isinstance(request, NumRequests):
        return worker.num_requests()
    if isinstance(request, Sleep):
        return worker.sleep()
    if isinstance(request, WakeUp):
        return worker.wake_up()
    raise TypeError(f"unknown executor request {request!r}")


# ----------------------------------------------------------------------------------- replies


@dataclass(frozen=True)
class Ok:
    value: Any


@dataclass(frozen=True)
class Failed:
    """A worker-side exception, flattened to text: its class may not unpickle in the parent."""

    rank: ParallelRank
    exc_type: str
    message: str
    traceback_text: str

    @classmethod
    def from_exception(cls, rank: ParallelRank, exc: BaseException) -> Failed:
        text = "".join(traceback.format_exception(exc))
        return cls(rank, type(exc).__name__, str(exc), text)

    def error(self) -> WorkerError:
        return WorkerError(self.rank, self.exc_type, self.message, self.traceback_text)


# --------------------------------------------------------------------------------- transport


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
