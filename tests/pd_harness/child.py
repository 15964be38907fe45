"""The engine process: build the engine, then step it while serving the parent's calls.

The loop steps whenever the engine has pending work (unfinished requests, or blocks a
connector still lends to a peer: a producer must keep stepping while its consumer pulls) and
otherwise waits on the pipe for a short while, so an idle engine costs no CPU. A `Generate`
call is answered once all of its requests finished; other calls are answered at once.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import time
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from typing import Any

from kvtransfer.engine.config import EngineConfig
from kvtransfer.engine.executor.executor import MultiprocExecutor, dumps, loads
from kvtransfer.engine.executor.worker_process import exit_with_parent
from kvtransfer.engine.llm import LLM, RequestOutput
from pd_harness.messages import (
    STARTUP_CALL_ID,
    Abort,
    Call,
    CheckNoLeaks,
    Failure,
    Generate,
    Ready,
    Reply,
    Shutdown,
    Stats,
)

# How long an idle loop waits on the pipe: short enough to pick up a call promptly, long enough
# not to spin on two cores.
IDLE_WAIT_S = 0.005


def engine_main(conn: Connection, config: EngineConfig, worker_cls: str) -> None:
    """Entry point of the engine process."""
    exit_with_parent()
    import torch

    # Two cores are shared by both engines of a pair and their workers.
    torch.set_num_threads(1)
    try:
        llm = LLM(config, worker_cls)
    except Exception as exc:
        with contextlib.suppress(OSError):
            conn.send_bytes(dumps(Failure.from_exception(STARTUP_CALL_ID, exc)))
        conn.close()
        return
    try:
        _EngineLoop(conn, llm).run()
    finally:
        llm.shutdown()
        conn.close()


@dataclass
class _PendingGenerate:
    call_id: int
    outputs: dict[str, RequestOutput]
    unfinished: set[str] = field(default_factory=set)


class _EngineLoop:
    def __init__(self, conn: Connection, llm: LLM) -> None:
        self.conn = conn
        self.llm = llm
        self.core = llm.engine
        self.pending: dict[int, _PendingGenerate] = {}
        self.call_of_request: dict[str, int] = {}
        # After a failed step the engine's workers are gone: every later call gets this error.
        self.broken: Failure | None = None
        self.stopping = False

    def run(self) -> None:
        self._send(self._ready())
        while not self.stopping:
            busy = self.broken is None and self.core.has_pending_work()
            try:
                has_call = self.conn.poll(0 if busy else IDLE_WAIT_S)
                call = loads(self.conn.recv_bytes()) if has_call else None
            except (EOFError, OSError):
                return  # the parent is gone
            if call is not None:
                self._handle(call)
            if not self.stopping and self.broken is None and self.core.has_pending_work():
                self._step()

    def _ready(self) -> Ready:
        half = getattr(self.core.connector, "scheduler_half", None)
        executor = self.core.executor
        worker_pids = executor.pids if isinstance(executor, MultiprocExecutor) else []
        kv = self.core.config.kv_transfer_config
        return Ready(
            pid=os.getpid(),
            engine_id=kv.engine_id if kv is not None else None,
            handshake_address=getattr(half, "address", None),
            num_kv_blocks=self.core.num_kv_blocks,
            worker_pids=tuple(pid for pid in worker_pids if pid is not None),
        )

    def _send(self, message: Reply | Failure | Ready) -> None:
        try:
            payload = dumps(message)
        except Exception as exc:
            call_id = getattr(message, "call_id", STARTUP_CALL_ID)
            payload = dumps(Failure.from_exception(call_id, exc))
        with contextlib.suppress(OSError):
            self.conn.send_bytes(payload)

    def _handle(self, call: Call) -> None:
        if isinstance(call, Shutdown):
            self.stopping = True
            self._send(Reply(call.call_id, None))
            return
        if self.broken is not None and not isinstance(call, Stats):
            self._send(dataclasses.replace(self.broken, call_id=call.call_id))
            return
        try:
            if isinstance(call, Generate):
                self._generate(call)
            elif isinstance(call, Abort):
                self._route(self.core.abort_request(call.request_ids))
                self._send(Reply(call.call_id, None))
            elif isinstance(call, Stats):
                self._send(Reply(call.call_id, self._stats()))
            elif isinstance(call, CheckNoLeaks):
                self._drain(call.drain_timeout_s)
                self.core.check_no_leaks()
                self._send(Reply(call.call_id, None))
            else:
                raise TypeError(f"unknown call {call!r}")
        except Exception as exc:
            self._send(Failure.from_exception(call.call_id, exc))

    def _generate(self, call: Generate) -> None:
        job = _PendingGenerate(call.call_id, {})
        try:
            for request_id, prompt, sp, params in zip(
                call.request_ids,
                call.prompts,
                call.sampling_params,
                call.kv_transfer_params,
                strict=True,
            ):
                if request_id in self.call_of_request:
                    raise ValueError(f"request id {request_id!r} is already running")
                tokens = self.llm.tokenizer.encode(prompt) if isinstance(prompt, str) else prompt
                self.core.add_request(request_id, tokens, sp, params)
                job.outputs[request_id] = RequestOutput(request_id, list(tokens))
                job.unfinished.add(request_id)
                self.call_of_request[request_id] = call.call_id
        except Exception:
            for request_id in job.unfinished:
                del self.call_of_request[request_id]
            self.core.abort_request(list(job.unfinished))
            raise
        self.pending[call.call_id] = job

    def _step(self) -> None:
        try:
            outputs = self.core.step()
        except Exception as exc:
            self.broken = Failure.from_exception(STARTUP_CALL_ID, exc)
            for call_id in list(self.pending):
                self._send(dataclasses.replace(self.broken, call_id=call_id))
            self.pending.clear()
            self.call_of_request.clear()
            return
        self._route(outputs)
        self.core.wait_if_idle()

    def _route(self, step_outputs: list[Any]) -> None:
        for step_output in step_outputs:
            call_id = self.call_of_request.get(step_output.req_id)
            if call_id is None:
                continue  # a request whose call was already answered (aborted after a timeout)
            job = self.pending[call_id]
            LLM._merge(job.outputs[step_output.req_id], step_output)
            if not step_output.finished:
                continue
            job.unfinished.discard(step_output.req_id)
            del self.call_of_request[step_output.req_id]
            if not job.unfinished:
                del self.pending[call_id]
                for output in job.outputs.values():
                    output.text = self.llm.tokenizer.decode(output.token_ids)
                self._send(Reply(call_id, list(job.outputs.values())))

    def _drain(self, timeout_s: float) -> None:
        """Step until nothing is pending, plus one step so the workers hear of every finished
        request; outputs still reach their calls."""
        deadline = time.monotonic() + timeout_s
        while True:
            pending = self.core.has_pending_work()
            if pending and time.monotonic() > deadline:
                raise TimeoutError(
                    f"engine still has pending work after {timeout_s:g} s: "
                    f"{self.core.scheduler.block_manager.num_used_blocks} blocks in use"
                )
            self._step()
            if self.broken is not None:
                raise RuntimeError(f"the engine failed while draining: {self.broken.message}")
            if not pending:
                return

    def _stats(self) -> dict[str, Any]:
        blocks = self.core.scheduler.block_manager
        half = getattr(self.core.connector, "scheduler_half", None)
        return {
            "num_blocks": blocks.num_blocks,
            "num_used_blocks": blocks.num_used_blocks,
            "num_free_blocks": blocks.num_free_blocks,
            "num_unfinished_requests": len(self.call_of_request),
            "num_loading_remote_kvs": len(self.core.scheduler.requests_loading_remote_kvs()),
            "has_pending_work": self.broken is None and self.core.has_pending_work(),
            "broken": self.broken.message if self.broken is not None else None,
            "scheduler": dataclasses.asdict(self.core.scheduler.stats),
            "connector": dict(getattr(half, "stats_totals", {}) or {}),
        }
