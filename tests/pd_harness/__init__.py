"""A programmatic prefill/decode harness: engines in their own OS processes, paired over UCX.

`EngineProcess` runs one engine (scheduler plus its TPxPP workers) in a spawned process that keeps
stepping while it serves typed calls from its parent; `PDPair` starts a `UcxConnector` producer
and consumer and runs prefill-then-decode generation across them.
"""

from __future__ import annotations

from pd_harness.engine_process import EngineProcess
from pd_harness.errors import (
    EngineLeakError,
    EngineProcessClosed,
    EngineProcessDied,
    EngineProcessError,
    EngineProcessTimeout,
    KVTransferFailed,
    RemoteEngineError,
)
from pd_harness.harness import PDPair

__all__ = [
    "EngineLeakError",
    "EngineProcess",
    "EngineProcessClosed",
    "EngineProcessDied",
    "EngineProcessError",
    "EngineProcessTimeout",
    "KVTransferFailed",
    "PDPair",
    "RemoteEngineError",
]
