"""The errors an `EngineProcess` or `PDPair` raises; each names the engine it is about."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from kvtransfer.engine.executor.errors import describe_death

if TYPE_CHECKING:
    from kvtransfer.engine.llm import RequestOutput


class EngineProcessError(RuntimeError):
    """Base of the harness's errors."""


class EngineProcessDied(EngineProcessError):
    """The engine process exited without being asked to (killed, crashed)."""

    def __init__(self, name: str, exitcode: int | None) -> None:
        super().__init__(f"engine process {name!r} {describe_death(exitcode)}")
        self.name = name
        self.exitcode = exitcode


class EngineProcessTimeout(EngineProcessError):
    """The engine process did not answer a call within its bound."""

    def __init__(self, name: str, what: str, timeout_s: float) -> None:
        super().__init__(f"engine process {name!r} did not answer {what} within {timeout_s:g} s")
        self.name = name
        self.what = what
        self.timeout_s = timeout_s


class EngineProcessClosed(EngineProcessError):
    """The engine process was shut down."""


class RemoteEngineError(EngineProcessError):
    """The engine raised inside its process; its class travels as text, with the traceback."""

    def __init__(self, name: str, exc_type: str, message: str, traceback_text: str = "") -> None:
        super().__init__(f"engine process {name!r} failed: {exc_type}: {message}")
        self.name = name
        self.exc_type = exc_type
        self.message = message
        self.traceback_text = traceback_text
        if traceback_text:
            self.add_note(f"traceback in engine process {name!r}:\n{traceback_text.rstrip()}")


class EngineLeakError(RemoteEngineError):
    """`check_no_leaks` found blocks or request state left after draining."""


class KVTransferFailed(EngineProcessError):
    """Decode requests ended with an error (a failed KV load under ``kv_load_failure_policy=
    "fail"``, malformed params...); ``outputs`` holds every request's output, failed or not."""

    def __init__(self, outputs: Sequence[RequestOutput]) -> None:
        failed = [o for o in outputs if o.finish_reason == "error"]
        details = "; ".join(f"{o.request_id}: {o.error}" for o in failed)
        super().__init__(f"{len(failed)} of {len(outputs)} decode request(s) failed: {details}")
        self.outputs = list(outputs)
        self.failed = failed
