"""Real producer/consumer engines on the tiny built-in model, talking `UcxConnector` (the
shared pieces, colocated reference included: `engine_helpers.builtin`).

A producer's blocks stay until its consumer's Release arrives, so `Stepping` keeps a producer
engine stepping on a background thread while the consumer runs in the test's thread (the engine
is not thread-safe: nothing else touches it until the context exits).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

from engine_helpers.builtin import DECODE, PREFILL, REMOTE_DECODE, finish

from kvtransfer.connector.config import KVTransferConfig
from kvtransfer.connectors.ucx import UcxConnector
from kvtransfer.connectors.ucx.scheduler import UcxScheduler
from kvtransfer.connectors.ucx.worker import UcxWorker
from kvtransfer.engine.engine_core import EngineCore
from kvtransfer.engine.llm import LLM, RequestOutput


def kv_config(role: str, engine_id: str, policy: str = "fail", **extra: Any) -> KVTransferConfig:
    return KVTransferConfig(
        kv_connector="UcxConnector",
        kv_role=role,
        engine_id=engine_id,
        kv_load_failure_policy=policy,
        kv_connector_extra_config=extra,
    )


def prefill(llm: LLM, prompts: Sequence[list[int]]) -> list[RequestOutput]:
    """One token per prompt on a producer; the prompts' blocks stay for the consumer."""
    return llm.generate(list(prompts), PREFILL, [REMOTE_DECODE] * len(prompts))


@contextmanager
def stepping(core: EngineCore, idle_s: float = 0.002) -> Iterator[None]:
    """Keep ``core`` stepping in the background (only while it has pending work)."""
    stop = threading.Event()
    errors: list[BaseException] = []

    def run() -> None:
        try:
            while not stop.is_set():
                # A producer that only waits for its consumers yields the interpreter, as a
                # serving loop would; spinning would starve the transfer threads of the GIL.
                # (An idle pause of the loop under test, not synchronisation.)
                if not core.has_pending_work() or not core.step():
                    time.sleep(idle_s)
        except BaseException as exc:
            errors.append(exc)

    thread = threading.Thread(target=run, name="producer-stepper", daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join(timeout=60)
    if thread.is_alive():
        raise RuntimeError("the producer's stepping thread did not stop")
    if errors:
        raise errors[0]


def pd_run(
    producer: LLM,
    consumer: LLM,
    prompts: Sequence[list[int]],
    params: Sequence[dict[str, Any] | None] | None = None,
) -> list[RequestOutput]:
    """Prefill ``prompts`` (unless ``params`` are given), decode them while the producer keeps
    stepping, then drain both engines and check neither leaks."""
    if params is None:
        params = [o.kv_transfer_params for o in prefill(producer, prompts)]
    with stepping(producer.engine):
        results = consumer.generate(list(prompts), DECODE, list(params))
        consumer.engine.drain()
    finish(consumer.engine, producer.engine)
    return results


def scheduler_half(core: EngineCore) -> UcxScheduler:
    connector = core.connector
    if not isinstance(connector, UcxConnector):
        raise TypeError(f"engine runs {type(connector).__name__}, not UcxConnector")
    return connector.scheduler_half


def worker_half(core: EngineCore) -> UcxWorker:
    """The in-process worker's half (single-worker engines only)."""
    connector = core.executor._worker.kv_connector.connector
    return connector.worker_half
