"""`EngineProcess`: one engine (scheduler plus its TPxPP workers) in its own spawned process.

The parent talks to it over one duplex pipe with the typed calls of `messages`. Every wait is
on the pipe and the process sentinel together, bounded, so a dead engine never hangs its
parent: it becomes `EngineProcessDied` for the call under way and every later one. Calls may
come from several threads; one thread reads the pipe at a time and hands other calls' replies
over.
"""

from __future__ import annotations

import contextlib
import itertools
import multiprocessing as mp
import os
import signal
import threading
import time
import weakref
from collections.abc import Mapping, Sequence
from multiprocessing.connection import Connection, wait
from typing import Any

from kvtransfer.engine.config import EngineConfig
from kvtransfer.engine.executor.executor import DEFAULT_WORKER, dumps, loads
from kvtransfer.engine.executor.worker_process import spawn_environment
from kvtransfer.engine.llm import RequestOutput
from kvtransfer.engine.sampling_params import SamplingParams
from pd_harness.child import engine_main
from pd_harness.errors import (
    EngineLeakError,
    EngineProcessClosed,
    EngineProcessDied,
    EngineProcessTimeout,
    RemoteEngineError,
)
from pd_harness.messages import (
    STARTUP_CALL_ID,
    Abort,
    Call,
    CheckNoLeaks,
    Failure,
    Generate,
    Prompt,
    Ready,
    Reply,
    Shutdown,
    Stats,
)

STARTUP_TIMEOUT_S = 120.0
SHUTDOWN_TIMEOUT_S = 15.0
CALL_TIMEOUT_S = 30.0
# How often a waiting parent wakes up to re-check its deadline (a death wakes it at once).
_POLL_S = 0.5

PromptInput = str | Sequence[int]


class EngineProcess:
    """One engine in a child process; a context manager that shuts it down on exit.

    ``generate`` blocks until every request of the call finished, while the child keeps
    stepping on its own (a producer goes on serving pulls between calls). Request ids are
    ``"<name>-<n>"`` unless the caller names them.
    """

    def __init__(
        self,
        config: EngineConfig,
        *,
        name: str,
        startup_timeout_s: float = STARTUP_TIMEOUT_S,
        worker_cls: str = DEFAULT_WORKER,
        wait_ready: bool = True,
    ) -> None:
        if not name:
            raise ValueError("EngineProcess needs a non-empty name")
        if not startup_timeout_s > 0:
            raise ValueError(f"startup_timeout_s must be > 0, got {startup_timeout_s}")
        self.config = config
        self.name = name
        self.startup_timeout_s = startup_timeout_s
        self._ids = itertools.count()
        self._call_ids = itertools.count()
        self._cond = threading.Condition()
        self._send_lock = threading.Lock()
        self._reading = False
        self._replies: dict[int, Reply | Failure] = {}
        self._abandoned: set[int] = set()
        self._dead: EngineProcessDied | None = None
        self._closed = False
        self._ready: Ready | None = None
        ctx = mp.get_context("spawn")
        self._conn, child_conn = ctx.Pipe(duplex=True)
        backend = "nccl" if config.device == "cuda" else "gloo"
        # Not daemonic: a daemonic process may not start the engine's worker processes. The
        # child exits with its parent instead (it watches the parent's sentinel), and the
        # finalizer reaps it if the owner never calls shutdown().
        self._proc = ctx.Process(
            target=engine_main,
            args=(child_conn, config, worker_cls),
            name=f"kvtransfer-engine-{name}",
            daemon=False,
        )
        with spawn_environment(backend):
            self._proc.start()
        # Only the child may hold its end, so its death reads as EOF here.
        child_conn.close()
        self._finalizer = weakref.finalize(self, _reap, self._proc, self._conn)
        if wait_ready:
            self.wait_ready()

    # ------------------------------------------------------------------------------ life cycle

    def wait_ready(self) -> Ready:
        """Block until the engine is built (or raise why it is not); idempotent."""
        if self._ready is not None:
            return self._ready
        try:
            message = self._receive_startup()
        except BaseException:
            self._finalizer()
            raise
        self._ready = message
        return message

    @property
    def pid(self) -> int | None:
        return self._proc.pid

    @property
    def ready_info(self) -> Ready:
        return self.wait_ready()

    @property
    def handshake_address(self) -> str | None:
        """``host:port`` of the engine's KV handshake server, if its connector serves one."""
        return self.wait_ready().handshake_address

    def is_alive(self) -> bool:
        return self._proc.is_alive()

    def kill(self) -> None:
        """SIGKILL the engine process (fault tests); its workers follow it. Every later call
        raises `EngineProcessDied`."""
        if self._proc.pid is not None and self._proc.is_alive():
            with contextlib.suppress(ProcessLookupError):
                os.kill(self._proc.pid, signal.SIGKILL)
        self._proc.join(timeout=SHUTDOWN_TIMEOUT_S)
        with self._cond:
            self._dead = EngineProcessDied(self.name, self._proc.exitcode)
            self._cond.notify_all()

    def shutdown(self, timeout_s: float = SHUTDOWN_TIMEOUT_S) -> None:
        """Stop the engine gracefully within ``timeout_s``, then force it; idempotent."""
        if self._closed:
            return
        self._closed = True
        if self._dead is None and self._proc.is_alive():
            with contextlib.suppress(EngineProcessDied, EngineProcessTimeout, RemoteEngineError):
                self._call(Shutdown(next(self._call_ids)), "Shutdown", timeout_s, check=False)
            self._proc.join(timeout=timeout_s)
        self._finalizer()

    def __enter__(self) -> EngineProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    # ---------------------------------------------------------------------------------- calls

    def generate(
        self,
        prompts: PromptInput | Sequence[PromptInput],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        kv_transfer_params: Sequence[Mapping[str, Any] | None] | None = None,
        timeout_s: float = 120.0,
        *,
        request_ids: Sequence[str] | None = None,
    ) -> list[RequestOutput]:
        """Run every prompt to completion; outputs in prompt order. On timeout the requests
        are aborted and `EngineProcessTimeout` raised."""
        batch = _as_prompt_list(prompts)
        params = sampling_params or SamplingParams()
        per_prompt = [params] * len(batch) if isinstance(params, SamplingParams) else list(params)
        transfer = list(kv_transfer_params) if kv_transfer_params is not None else None
        if transfer is None:
            transfer = [None] * len(batch)
        if request_ids is None:
            request_ids = [f"{self.name}-{next(self._ids)}" for _ in batch]
        if not len(per_prompt) == len(transfer) == len(request_ids) == len(batch):
            raise ValueError(
                f"got {len(batch)} prompts, {len(per_prompt)} sampling params, "
                f"{len(transfer)} kv_transfer_params and {len(request_ids)} request ids; "
                "they must match"
            )
        if len(set(request_ids)) != len(request_ids):
            raise ValueError(f"request ids must be unique, got {list(request_ids)}")
        call = Generate(
            next(self._call_ids),
            tuple(request_ids),
            tuple(batch),
            tuple(per_prompt),
            tuple(dict(p) if p is not None else None for p in transfer),
        )
        try:
            return self._call(call, "Generate", timeout_s)
        except EngineProcessTimeout:
            self._abandon(Abort(next(self._call_ids), tuple(request_ids)))
            raise

    def abort(self, request_ids: Sequence[str], timeout_s: float = CALL_TIMEOUT_S) -> None:
        self._call(Abort(next(self._call_ids), tuple(request_ids)), "Abort", timeout_s)

    def stats(self, timeout_s: float = CALL_TIMEOUT_S) -> dict[str, Any]:
        """Blocks used/free, unfinished requests, scheduler and connector counters."""
        return self._call(Stats(next(self._call_ids)), "Stats", timeout_s)

    def check_no_leaks(self, drain_timeout_s: float = 30.0) -> None:
        """Drain the engine (transfers finish or time out), then raise `EngineLeakError` with
        the engine's message unless every block is free and no worker holds request state."""
        call = CheckNoLeaks(next(self._call_ids), drain_timeout_s)
        try:
            self._call(call, "CheckNoLeaks", drain_timeout_s + CALL_TIMEOUT_S)
        except RemoteEngineError as exc:
            raise EngineLeakError(
                self.name, exc.exc_type, exc.message, exc.traceback_text
            ) from None

    # ------------------------------------------------------------------------------- plumbing

    def _check_usable(self) -> None:
        if self._dead is not None:
            raise self._dead
        if self._closed:
            raise EngineProcessClosed(f"engine process {self.name!r} was shut down")

    def _send(self, call: Call) -> None:
        payload = dumps(call)
        # A dead child is reported by the read that follows, with its exit code.
        with self._send_lock, contextlib.suppress(OSError):
            self._conn.send_bytes(payload)

    def _abandon(self, call: Call) -> None:
        """Send ``call`` without waiting; its reply is dropped when it arrives."""
        if self._dead is not None or not self._proc.is_alive():
            return
        with self._cond:
            self._abandoned.add(call.call_id)
        self._send(call)

    def _call(self, call: Call, what: str, timeout_s: float, check: bool = True) -> Any:
        if check:
            self._check_usable()
        self.wait_ready()
        self._send(call)
        deadline = time.monotonic() + timeout_s
        while True:
            with self._cond:
                reply = self._replies.pop(call.call_id, None)
                if reply is None:
                    if self._dead is not None:
                        raise self._dead
                    remaining = deadline - time.monotonic()
                    if remaining <= 0:
                        self._abandoned.add(call.call_id)
                        raise EngineProcessTimeout(self.name, what, timeout_s)
                    if self._reading:
                        self._cond.wait(min(remaining, _POLL_S))
                        continue
                    self._reading = True
            if reply is not None:
                if isinstance(reply, Failure):
                    raise RemoteEngineError(
                        self.name, reply.exc_type, reply.message, reply.traceback_text
                    )
                return reply.value
            message: Reply | Failure | None = None
            try:
                message = self._read_one(min(remaining, _POLL_S))
            finally:
                with self._cond:
                    self._reading = False
                    if message is not None and message.call_id not in self._abandoned:
                        self._replies[message.call_id] = message
                    elif message is not None:
                        self._abandoned.discard(message.call_id)
                    self._cond.notify_all()

    def _read_one(self, timeout_s: float) -> Any:
        """One message from the child within ``timeout_s`` (``None`` if none came); marks the
        process dead and raises when it is gone."""
        ready = wait([self._conn, self._proc.sentinel], timeout=timeout_s)
        if not ready:
            return None
        try:
            if self._conn.poll():
                return loads(self._conn.recv_bytes())
        except (EOFError, OSError):
            pass
        self._proc.join(timeout=_POLL_S)
        with self._cond:
            if self._dead is None:
                self._dead = EngineProcessDied(self.name, self._proc.exitcode)
            raise self._dead

    def _receive_startup(self) -> Ready:
        deadline = time.monotonic() + self.startup_timeout_s
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise EngineProcessTimeout(self.name, "startup", self.startup_timeout_s)
            message = self._read_one(min(remaining, _POLL_S))
            if message is None:
                continue
            if isinstance(message, Ready):
                return message
            if isinstance(message, Failure) and message.call_id == STARTUP_CALL_ID:
                raise RemoteEngineError(
                    self.name, message.exc_type, message.message, message.traceback_text
                )
            raise RemoteEngineError(self.name, "ProtocolError", f"unexpected {message!r}")


def _as_prompt_list(prompts: PromptInput | Sequence[PromptInput]) -> list[Prompt]:
    if isinstance(prompts, str):
        return [prompts]
    if isinstance(prompts, Sequence) and prompts and isinstance(prompts[0], int):
        return [tuple(prompts)]  # type: ignore[arg-type]
    return [p if isinstance(p, str) else tuple(p) for p in prompts]  # type: ignore[union-attr]


def _reap(proc: mp.process.BaseProcess, conn: Connection) -> None:
    """Force the engine process down and release the pipe."""
    if proc.is_alive():
        proc.terminate()
        proc.join(timeout=SHUTDOWN_TIMEOUT_S)
    if proc.is_alive():
        proc.kill()
        proc.join()
    conn.close()
