"""The typed calls a parent makes to its engine process, and the replies it gets back.

Every call carries a ``call_id`` its reply echoes, so a late reply (to a call that timed out)
is recognised and dropped instead of answering the next call. Messages travel pickled with the
executor's `dumps`/`loads`, which carry the engine's read-only mapping fields.
"""

from __future__ import annotations

import traceback
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from kvtransfer.engine.sampling_params import SamplingParams

Prompt = str | tuple[int, ...]


@dataclass(frozen=True)
class Generate:
    call_id: int
    request_ids: tuple[str, ...]
    prompts: tuple[Prompt, ...]
    sampling_params: tuple[SamplingParams, ...]
    kv_transfer_params: tuple[Mapping[str, Any] | None, ...]


@dataclass(frozen=True)
class Abort:
    call_id: int
    request_ids: tuple[str, ...]


@dataclass(frozen=True)
class Stats:
    call_id: int


@dataclass(frozen=True)
class CheckNoLeaks:
    call_id: int
    drain_timeout_s: float


@dataclass(frozen=True)
class Shutdown:
    call_id: int


Call = Generate | Abort | Stats | CheckNoLeaks | Shutdown


@dataclass(frozen=True)
class Ready:
    """Sent once, when the engine is built and the step loop starts."""

    pid: int
    engine_id: str | None
    handshake_address: str | None
    num_kv_blocks: int
    worker_pids: tuple[int, ...]


@dataclass(frozen=True)
class Reply:
    call_id: int
    value: Any


@dataclass(frozen=True)
class Failure:
    """An exception in the engine process, flattened to text (its class may not unpickle)."""

    call_id: int
    exc_type: str
    message: str
    traceback_text: str

    @classmethod
    def from_exception(cls, call_id: int, exc: BaseException) -> Failure:
        text = "".join(traceback.format_exception(exc))
        return cls(call_id, type(exc).__name__, str(exc), text)


# Startup failures have no call to answer; they use this id.
STARTUP_CALL_ID = -1
