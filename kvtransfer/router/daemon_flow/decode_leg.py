"""`DecodeLeg`: the decode call of one choice and the instance it is leased on."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Sequence
from typing import Any

from kvtransfer.router.daemon_flow.exchange import Exchange
from kvtransfer.router.daemon_flow.leases import Lease
from kvtransfer.router.daemon_flow.upstream import CallStream, PrefillResult, Upstream
from kvtransfer.router.errors import UpstreamError
from kvtransfer.router.fleet.instance import Instance
from kvtransfer.timeline import BOOK, now_ns
from kvtransfer.v1 import generation_pb2

_END = object()


class DecodeLeg:
    """The decode call of one choice and the instance it is leased on.

    Started early (`start_early`: the prefill announced its params, its KV is being computed),
    after the prefill returned (`continue_with`), or alone (`start_alone`). A task reads the
    call's messages into a queue as they come, so the runner sees the call end (``ended``)
    while it still waits for the prefill; `messages` hands them on. `restart` moves the leg to
    another instance after a call that failed before answering."""

    def __init__(self, upstream: Upstream, exchange: Exchange, lease: Lease) -> None:
        self._upstream = upstream
        self._exchange = exchange
        self._lease = lease
        self.tried: list[Instance] = [lease.instance]
        self.started_early = False
        self.alone = False
        # The prefill's stream when it announced its params (an early start's input).
        self._announced: generation_pb2.GenerateResponse | None = None
        self._stream: CallStream | None = None
        self._reader: asyncio.Task[None] | None = None
        self._queue: asyncio.Queue[Any] = asyncio.Queue()
        # How the current call failed, once it did; why none could be started.
        self._failure: UpstreamError | None = None
        self._unstarted: UpstreamError | None = None
        # Done when the current call's messages end (the call ended or failed).
        self.ended: asyncio.Future[None] = asyncio.get_running_loop().create_future()

    @property
    def instance(self) -> Instance:
        return self._lease.instance

    @property
    def address(self) -> str:
        return self._lease.instance.address

    @property
    def answered(self) -> bool:
        """Whether the current call sent a message (a retry would repeat it to the client)."""
        return self._stream is not None and self._stream.answered

    def start_early(self, prefill_so_far: generation_pb2.GenerateResponse) -> None:
        if self._stream is not None:
            return
        self._announced = prefill_so_far
        self.started_early = self._open(self._decode_call(prefill_so_far, None))

    def start_alone(self) -> None:
        exchange = self._exchange
        self.alone = True
        started = self._open(
            lambda: self._upstream.run_alone(
                self.instance, exchange.request_id, exchange.choice, exchange.deadline
            )
        )
        if not started:
            raise self._not_started()

    async def continue_with(self, prefill: PrefillResult | None) -> None:
        """Go on after the prefill's first token (``None``: the prefill failed after the decode
        was called; it computes its first token itself). Raises `UpstreamError` when the
        request's deadline ran out before a decode call could start."""
        exchange = self._exchange
        if self._stream is None:
            if prefill is None:
                raise RuntimeError("no decode call was started early")
            if not self._open(self._decode_call(prefill.final, prefill.final.token_ids)):
                raise self._not_started()
            return
        tokens = () if prefill is None else prefill.final.token_ids
        problem = await self._upstream.continue_decode(
            self.instance, exchange.request_id, tokens, exchange.deadline
        )
        if problem is not None:
            # The decode stream says what became of the request (e.g. its load failed).
            exchange.log.info("Continue on %s: %s", self.address, problem)

    def restart(self, lease: Lease, prefill: PrefillResult | None = None) -> None:
        """Drop the current call (it failed before answering) and its lease; call ``lease``'s
        instance instead: continuing after ``prefill``'s first token, or early from the
        announcement while the prefill still runs, or alone."""
        self._drop()
        self._lease.end()
        self._lease = lease
        self._queue = asyncio.Queue()
        self.ended = asyncio.get_running_loop().create_future()
        if self.alone:
            self.start_alone()
        elif prefill is not None:
            if not self._open(self._decode_call(prefill.final, prefill.final.token_ids)):
                raise self._not_started()
        elif self._announced is not None:
            self._open(self._decode_call(self._announced, None))

    def failure_before_answer(self) -> UpstreamError | None:
        """The retryable failure of the current call, if it failed without sending a message
        (`messages` still raises it)."""
        failure = self._failure
        if failure is None or self.answered or not failure.retryable:
            return None
        return failure

    async def messages(self) -> AsyncIterator[generation_pb2.GenerateResponse]:
        """The current call's messages; raises its failure."""
        while True:
            item = await self._queue.get()
            if item is _END:
                return
            if isinstance(item, BaseException):
                raise item
            yield item

    async def close(self) -> None:
        """Cancel the call if it still runs (its daemon aborts the request and lets go of the
        producer's KV) and end the lease."""
        reader, stream = self._reader, self._stream
        self._drop()
        try:
            if reader is not None:
                await asyncio.gather(reader, return_exceptions=True)
            if stream is not None:
                await stream.aclose()
        finally:
            # Even when the unwinding is cancelled again or the stream fails to close: a lease
            # that never ends keeps the instance busy forever (a half-open breaker waits for
            # it to be idle).
            self._lease.end()

    # ------------------------------------------------------------------

    def _decode_call(
        self, prefill: generation_pb2.GenerateResponse, generated: Sequence[int] | None
    ) -> Any:
        exchange = self._exchange
        return lambda: self._upstream.run_decode(
            self.instance,
            exchange.request_id,
            exchange.choice,
            prefill,
            exchange.deadline,
            generated,
        )

    def _open(self, start: Any) -> bool:
        """Start the call; False when the request's deadline ran out first."""
        try:
            stream: CallStream = start()
        except UpstreamError as exc:
            self._exchange.log.info("decode not started: %s", exc)
            self._unstarted = exc
            return False
        self._stream, self._failure = stream, None
        reading = self._read(stream, self._queue, self.ended, now_ns())
        self._reader = asyncio.get_running_loop().create_task(reading)
        return True

    def _not_started(self) -> UpstreamError:
        if self._unstarted is None:
            raise RuntimeError("unreachable: a decode call neither started nor refused")
        return self._unstarted

    async def _read(
        self,
        stream: CallStream,
        queue: asyncio.Queue[Any],
        ended: asyncio.Future[None],
        called: int,
    ) -> None:
        first: int | None = None
        try:
            async for message in stream:
                if first is None:
                    first = now_ns()
                    name = "decode_first_message"
                    BOOK.record(self._exchange.request_id, name, called, first)
                if message.finished:
                    # Before the message is queued: the timeline is built from it.
                    BOOK.record(
                        self._exchange.request_id,
                        "decode_call",
                        called,
                        now_ns(),
                        instance=self.address,
                    )
                queue.put_nowait(message)
            queue.put_nowait(_END)
        except UpstreamError as exc:
            if stream is self._stream:
                self._failure = exc
            queue.put_nowait(exc)
        finally:
            if not ended.done():
                ended.set_result(None)

    def _drop(self) -> None:
        reader, self._reader = self._reader, None
        stream, self._stream = self._stream, None
        if reader is not None:
            reader.cancel()
        if stream is not None:
            # Cancel the call now; the reader's own unwinding closes the generator.
            stream.cancel()
