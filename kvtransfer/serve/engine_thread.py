"""`EngineThread`: one thread owns the `EngineCore` and steps it; others send it calls.

The engine is not thread-safe, so gRPC handlers never touch it: they queue a callable that the
engine thread runs between two steps and wait (bounded) for its result. Outputs go to the sink
each request registered, on the engine thread, so sinks must only hand them over (e.g. to an
asyncio loop with ``call_soon_threadsafe``).
"""

from __future__ import annotations

import concurrent.futures
import logging
import queue
import threading
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from typing import Any, TypeVar

from kvtransfer.engine.engine_core import EngineCore
from kvtransfer.engine.sampling_params import SamplingParams
from kvtransfer.engine.scheduler.request import DuplicateRequestError, EngineCoreOutput
from kvtransfer.engine.wakeup import Wakeup

logger = logging.getLogger(__name__)

T = TypeVar("T")
OutputSink = Callable[[EngineCoreOutput], None]

# How long an idle loop sleeps on its queue before looking at the stop flag again.
_IDLE_WAIT_S = 0.1


# Finished outputs with params remembered until their call confirms delivery (or gives up).
_HANDED_OVER_MEMORY = 4096


class EngineUnavailable(RuntimeError):
    """The engine thread stopped, or a step raised and the engine is no longer usable."""


class EngineThread:
    def __init__(
        self,
        core: EngineCore,
        *,
        after_step: Callable[[EngineCore, list[EngineCoreOutput]], None] | None = None,
    ) -> None:
        self.core = core
        self._after_step = after_step
        # (run, future) pairs; the future is None for fire-and-forget calls.
        self._calls: queue.Queue[tuple[Callable[[], None], concurrent.futures.Future | None]] = (
            queue.Queue()
        )
        self._sinks: dict[str, OutputSink] = {}
        # KV handed over in finished outputs lately (request id -> params, delivered): for a
        # call abandoned before it carried them to its client, and for an operator's abort
        # (a client can vanish after the server sent the params but before it read them).
        self._handed_over: OrderedDict[str, tuple[Mapping[str, Any], bool]] = OrderedDict()
        self._stopping = threading.Event()
        # Set with every queued call: ends an idle step's wait for transfers at once.
        self._wake = Wakeup()
        core.add_interrupt(self._wake)
        core.early_output_sink = self._route
        self._thread = threading.Thread(target=self._run, name="kvtransfer-engine", daemon=True)
        self.broken: str | None = None

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout_s: float = 10.0) -> None:
        """Stop stepping (the core is not shut down); idempotent."""
        self._stopping.set()
        if self._thread.is_alive():
            self._thread.join(timeout_s)

    @property
    def is_running(self) -> bool:
        return self._thread.is_alive() and self.broken is None

    # ------------------------------------------------------------------ calls from other threads

    def _queue(self, item: tuple[Callable[[], None], concurrent.futures.Future | None]) -> None:
        self._calls.put(item)
        self._wake.set()

    def call(self, fn: Callable[[EngineCore], T], timeout_s: float = 30.0) -> T:
        """Run ``fn(core)`` on the engine thread between steps; its exception is re-raised."""
        future = self.submit(fn)
        try:
            return future.result(timeout_s)
        except concurrent.futures.TimeoutError:
            future.cancel()
            raise TimeoutError(f"the engine did not answer within {timeout_s:g} s") from None

    def submit(self, fn: Callable[[EngineCore], T]) -> concurrent.futures.Future[T]:
        """`call` without the wait: the future of ``fn(core)`` (an event loop awaits it with
        ``asyncio.wrap_future``, no thread of its own blocked on it)."""
        if not self.is_running:
            raise EngineUnavailable(self.broken or "the engine is not running")
        future: concurrent.futures.Future[T] = concurrent.futures.Future()

        def run() -> None:
            if not future.set_running_or_notify_cancel():
                return
            try:
                future.set_result(fn(self.core))
            except BaseException as exc:
                future.set_exception(exc)

        self._queue((run, future))
        return future

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: Sequence[int],
        sampling_params: SamplingParams,
        kv_transfer_params: Mapping[str, Any] | None,
        sink: OutputSink,
        generated_token_ids: Sequence[int] = (),
        awaits_generated: bool = False,
    ) -> concurrent.futures.Future[None]:
        """Queue a request; the future raises `ValueError` (bad input, duplicate id) from the
        engine."""

        def add(core: EngineCore) -> None:
            if request_id in self._sinks:
                raise DuplicateRequestError(f"request {request_id}: duplicate request id")
            core.add_request(
                request_id,
                prompt_token_ids,
                sampling_params,
                kv_transfer_params,
                generated_token_ids,
                awaits_generated,
            )
            self._sinks[request_id] = sink

        return self.submit(add)

    def abort(self, request_id: str) -> bool:
        """Abort a running request (its final output reaches its sink), or give back the KV it
        finished holding for a consumer; ``False`` if neither."""

        def abort(core: EngineCore) -> bool:
            if request_id in self._sinks:
                self._route(core.abort_request([request_id]))
                return True
            handed = self._handed_over.pop(request_id, None)
            return handed is not None and self._release(request_id, handed[0])

        return self.call(abort)

    def abort_all(self) -> int:
        """Abort every running request (each sink gets its final output); returns how many."""

        def abort(core: EngineCore) -> int:
            request_ids = list(self._sinks)
            self._route(core.abort_request(request_ids))
            return len(request_ids)

        return self.call(abort)

    def num_running(self) -> int:
        return len(self._sinks)

    def abandon(self, request_id: str) -> None:
        """Nobody will read ``request_id``'s output any more (a cancelled or broken call): abort
        it if it still runs, and give back KV it holds for a consumer that can never hear of it
        (whether the abort produced it or the request had finished just before). No wait."""

        def abandon() -> None:
            outputs: list[EngineCoreOutput] = []
            if self._sinks.pop(request_id, None) is not None:
                outputs = self.core.abort_request([request_id])
            handed = [o.kv_transfer_params for o in outputs if o.kv_transfer_params]
            earlier = self._handed_over.get(request_id)
            if earlier is not None and not earlier[1]:
                del self._handed_over[request_id]
                handed.append(earlier[0])
            for params in handed:
                self._release(request_id, params)

        if self.is_running:
            self._queue((abandon, None))

    def delivered(self, request_id: str) -> None:
        """The client has the final output (and any params in it): nothing to give back."""

        def mark() -> None:
            if (handed := self._handed_over.get(request_id)) is not None:
                self._handed_over[request_id] = (handed[0], True)

        if self.is_running:
            self._queue((mark, None))

    def _release(self, request_id: str, params: Mapping[str, Any]) -> bool:
        try:
            released = self.core.release_kv(params)
        except (ValueError, PermissionError) as exc:
            # Params this engine made itself; failing here is a bug, not an attack.
            logger.warning("could not release KV handed over: %s", exc)
            return False
        if released:
            logger.info("released KV no consumer will pull", extra={"request_id": request_id})
        return released

    # ------------------------------------------------------------------ the engine thread

    def _run(self) -> None:
        while not self._stopping.is_set():
            busy = self.core.has_pending_work()
            try:
                first = self._calls.get(timeout=None if busy else _IDLE_WAIT_S, block=not busy)
            except queue.Empty:
                first = None
            # Before running the calls: one queued after this still ends the next idle wait.
            self._wake.drain()
            while first is not None:
                first[0]()
                try:
                    first = self._calls.get_nowait()
                except queue.Empty:
                    first = None
            if not self.core.has_pending_work():
                continue
            try:
                outputs = self.core.step()
            except Exception as exc:
                self._break(exc)
                return
            self._route(outputs)
            if self._after_step is not None:
                self._after_step(self.core, outputs)
            # A call queued meanwhile interrupts the wait (`add_interrupt`).
            self.core.wait_if_idle()
        self._fail_calls("the engine stopped")

    def _route(self, outputs: list[EngineCoreOutput]) -> None:
        for output in outputs:
            sink = self._sinks.get(output.req_id)
            if sink is None:
                continue  # abandoned: nobody listens any more
            if output.finished:
                del self._sinks[output.req_id]
                if output.kv_transfer_params:
                    self._handed_over[output.req_id] = (output.kv_transfer_params, False)
                    while len(self._handed_over) > _HANDED_OVER_MEMORY:
                        self._handed_over.popitem(last=False)
            sink(output)

    def _break(self, exc: Exception) -> None:
        self.broken = f"the engine failed: {type(exc).__name__}: {exc}"
        logger.exception("engine step raised; failing %d request(s)", len(self._sinks))
        sinks, self._sinks = self._sinks, {}
        for request_id, sink in sinks.items():
            sink(
                EngineCoreOutput(
                    req_id=request_id, finished=True, finish_reason="error", error=self.broken
                )
            )
        self._fail_calls(self.broken)

    def _fail_calls(self, reason: str) -> None:
        # Calls queued after the loop ended would otherwise wait for their whole timeout.
        while True:
            try:
                _, future = self._calls.get_nowait()
            except queue.Empty:
                return
            if future is not None and future.set_running_or_notify_cancel():
                future.set_exception(EngineUnavailable(reason))
