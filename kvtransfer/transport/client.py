"""The pulling side: `PeerHandle`, `PullHandle` and the job that runs one pull.

A pull is split into messages of at most ``chunk_bytes`` (whole blocks, all requested layers
each). For every message the job posts two receives (header into a small host buffer, payload
into a pooled buffer on the cache's device), then sends the request; ``max_inflight_chunks``
messages are in flight at once so the server's gather, the wire and our scatter overlap. Only
a fully received, successful payload is scattered into the cache, under the pull's write lock,
so after `PullHandle.cancel` returns or a timeout is raised nothing more is written.

A timeout (or a failed send/receive) resets the endpoint to the peer: its posted receives are
cancelled, so their buffers are freed instead of waiting forever for a dead peer; other pulls
in flight to the same peer fail with `PeerUnreachable`; the next pull reconnects. A cancelled
pull leaves its receives posted: the (alive) server still answers, into the pull's private
buffers, which are then dropped. Reply tags are never reused, so an answer that arrives after
its receive was cancelled can never match another pull; UCX keeps it as an unexpected message.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass
from typing import Any

import torch

from kvtransfer.threads import enter_own_thread
from kvtransfer.transport.access import AccessDenied, LeaseAccess
from kvtransfer.transport.buffers import (
    BufferPool,
    RowView,
    payload_bytes,
    payload_checksum,
    row_view,
    scatter_from,
    synchronize,
)
from kvtransfer.transport.errors import (
    CorruptPayloadError,
    EndpointReset,
    ErrorCode,
    PeerUnreachable,
    RemoteTransferError,
    TransferCancelled,
    TransferTimeoutError,
    TransportClosed,
    TransportError,
)
from kvtransfer.transport.messages import (
    MAX_REPLY_SEQUENCE,
    REQUEST_TAG,
    RESPONSE_HEADER_BYTES,
    KeysRequestMessage,
    LayerRequest,
    PullRequestMessage,
    PullResponseHeader,
    PushNoticeMessage,
    WireFormatError,
    pack_block_ids,
    peer_name,
    reply_tags,
    segment_offsets,
)
from kvtransfer.transport.rma import MAX_KEYS_BYTES, ReadControl, RmaPeer, RmaReader
from kvtransfer.transport.rma_layout import LayerMemory
from kvtransfer.transport.spec import KVLayout, LayerPlan, PullSpec
from kvtransfer.transport.ucx import UcxLoop

logger = logging.getLogger(__name__)


@dataclass(frozen=True, repr=False)
class PeerHandle:
    """A connected peer agent. ``layouts`` (if the handshake gave them) enables local checks."""

    address: bytes
    ucx_address: bytes
    layouts: Mapping[str, KVLayout] | None = None
    # The peer offered one-sided reads (its handshake says data_plane "rma").
    one_sided: bool = False

    @property
    def name(self) -> str:
        """Short stable id for messages and logs."""
        return peer_name(self.ucx_address)

    def __repr__(self) -> str:
        return f"PeerHandle({self.name})"


@dataclass(frozen=True)
class PullResult:
    request_id: str
    num_blocks: int
    num_layers: int
    num_messages: int
    payload_bytes: int
    elapsed_s: float
    # Read one-sided (RMA mode) rather than served by the producer.
    one_sided: bool = False


# A keys request's wait checks its cancel flag and deadline this often.
_KEYS_POLL_S = 0.05


class _BrokenPeer(PeerUnreachable):
    """A send or receive with the peer failed: its endpoint is reset."""


def lease_fields(lease: LeaseAccess) -> tuple[str, str, str, int]:
    return lease.lease_id, lease.secret, lease.prompt_digest, lease.block_offset


def _cancelled(spec: PullSpec) -> TransferCancelled:
    return TransferCancelled(f"pull {spec.request_id!r} was cancelled")


def _segment_sizes(plans: list[LayerPlan], num_blocks: int) -> list[int]:
    """Payload bytes of each layer for ``num_blocks`` blocks, in plan order."""
    return [
        payload_bytes(num_blocks, len(p.local_heads), p.layout.head_elems, p.layout.element_size)
        for p in plans
    ]


class _PullState:
    """Shared between the job, the loop thread's callbacks and `PullHandle`."""

    def __init__(self) -> None:
        self.cond = threading.Condition()
        self.cancelled = False
        self.closed = False
        self.sent = 0
        self.received = 0
        self.write_lock = threading.Lock()
        # Set by an inline pull, which no job waits for: completes its future at the cancel.
        self.on_cancel: Callable[[], None] | None = None


class PullHandle:
    """The future of one pull; completes on a background thread."""

    def __init__(self, request_id: str, peer: PeerHandle, future: Future[PullResult]) -> None:
        self.request_id = request_id
        self.peer = peer
        self._future = future
        self._state = _PullState()

    @classmethod
    def failed(cls, request_id: str, peer: PeerHandle, error: BaseException) -> PullHandle:
        """A handle of a pull that failed before it started."""
        future: Future[PullResult] = Future()
        future.set_running_or_notify_cancel()
        future.set_exception(error)
        return cls(request_id, peer, future)

    def done(self) -> bool:
        return self._future.done()

    @property
    def messages_sent(self) -> int:
        """Request messages posted to the peer so far."""
        return self._state.sent

    @property
    def messages_received(self) -> int:
        """Responses received and written to the cache so far."""
        return self._state.received

    def result(self, timeout: float | None = None) -> PullResult:
        """Wait for the pull; raises its typed error (`TransferTimeoutError`, ...).

        If ``timeout`` runs out first, a plain `TimeoutError` is raised and the pull goes on.
        """
        try:
            return self._future.result(timeout)
        except FutureTimeout:
            # TransferTimeoutError is a TimeoutError too: only a wait that ran out is rewritten.
            if self._future.done():
                raise
            raise TimeoutError(
                f"pull {self.request_id!r} still in flight after waiting {timeout} s"
            ) from None

    def exception(self, timeout: float | None = None) -> BaseException | None:
        try:
            return self._future.exception(timeout)
        except FutureTimeout:
            raise TimeoutError(
                f"pull {self.request_id!r} still in flight after waiting {timeout} s"
            ) from None

    def cancel(self) -> bool:
        """Stop the pull; True if it had not completed. Nothing is written after this returns.

        Blocks already written by earlier messages of the pull stay written.
        """
        state = self._state
        # The flag first: a one-sided read holds the write lock while it reads and polls it.
        with state.cond:
            if self._future.done():
                return False
            state.cancelled = True
            state.cond.notify_all()
        # The job completes its future under the write lock, so done() here is exact.
        with state.write_lock:
            if not self._future.done():
                if state.on_cancel is not None:
                    state.on_cancel()
                return True
        # Completed meanwhile: by this cancel (the job saw the flag), or on its own.
        return isinstance(self._future.exception(), TransferCancelled | TransportClosed)


@dataclass(eq=False)
class _Exchange:
    """One request/response message pair of a pull."""

    first: int
    last: int
    header: Any
    payload: torch.Tensor
    payload_buffer: torch.Tensor
    pending: int = 2
    error: BaseException | None = None
    # An inline pull's completion, run once on the loop thread when the exchange finishes.
    on_finished: Callable[[], None] | None = None

    @property
    def finished(self) -> bool:
        return self.pending == 0 or self.error is not None

    def take_completion(self) -> Callable[[], None] | None:
        """``on_finished`` once the exchange is finished, exactly once (call under cond, run
        the result outside it: it takes the write lock, which `PullHandle.cancel` holds while
        taking cond)."""
        if not self.finished:
            return None
        callback, self.on_finished = self.on_finished, None
        return callback


class _Asked:
    """One request/answer exchange of a keys request or a push notice: the answer's buffers
    and its completion (the header and payload receives, or the first error)."""

    def __init__(self, header: Any, payload: Any) -> None:
        self.header = header
        self.payload = payload
        self.done = threading.Event()
        self.outcome: dict[str, object] = {}
        self.posted: Future[None] | None = None
        # Run once on the loop thread when the exchange ended (an answer nobody waits for).
        self.on_done: Callable[[], None] | None = None
        self._pending = 2

    def finish(self, error: BaseException | None) -> None:  # loop thread
        if error is not None:
            self.outcome.setdefault("error", error)
        else:
            self._pending -= 1
            if self._pending:
                return
        if self.done.is_set():
            return
        self.done.set()
        if self.on_done is not None:
            self.on_done()


class PullClient:
    """Runs pulls on a small thread pool against one `UcxLoop`."""

    def __init__(
        self,
        loop: UcxLoop,
        pool: BufferPool,
        *,
        chunk_bytes: int,
        max_inflight_chunks: int,
        max_blocks_per_message: int,
        threads: int,
        inline_bytes: int = 0,
    ) -> None:
        self._loop = loop
        self._inline_bytes = inline_bytes
        self._pool = pool
        self._chunk_bytes = chunk_bytes
        self._window = max_inflight_chunks
        self._max_blocks = max_blocks_per_message
        self._sequence = itertools.count()
        self._sequence_lock = threading.Lock()
        self._threads = threads
        self._workers: list[threading.Thread] = []
        self._jobs: deque[Callable[[], None] | None] = deque()
        self._jobs_cond = threading.Condition()
        self._active: set[PullHandle] = set()
        self._closed = False
        # Push notices sent without waiting, kept until their answer came.
        self._told: set[_Asked] = set()

    def submit(
        self,
        peer: PeerHandle,
        spec: PullSpec,
        plans: list[LayerPlan],
        caches: Mapping[str, torch.Tensor],
        timeout_s: float,
    ) -> PullHandle:
        future: Future[PullResult] = Future()
        handle = PullHandle(spec.request_id, peer, future)
        deadline = time.monotonic() + timeout_s
        started = time.perf_counter()
        if 0 < spec.num_blocks <= self._max_blocks and (
            spec.num_blocks * sum(_segment_sizes(plans, 1))
            <= min(self._inline_bytes, self._chunk_bytes)
        ):
            with self._jobs_cond:
                if self._closed:
                    raise TransportClosed("the transfer agent is closed")
                self._active.add(handle)
            self._start_inline(handle, spec, plans, caches, timeout_s, started)
            return handle

        def job() -> None:
            if not future.set_running_or_notify_cancel():
                return
            state = handle._state
            try:
                result = self._run(handle, spec, plans, caches, deadline, timeout_s, started)
                if state.cancelled:
                    raise _cancelled(spec)
            except BaseException as exc:
                if state.closed and isinstance(exc, TransferCancelled):
                    exc = TransportClosed(
                        f"pull {spec.request_id!r} aborted: the transfer agent was closed"
                    )
                with state.write_lock:
                    future.set_exception(exc)
            else:
                with state.write_lock:
                    if state.cancelled:
                        future.set_exception(_cancelled(spec))
                    else:
                        future.set_result(result)
            finally:
                with self._jobs_cond:
                    self._active.discard(handle)

        with self._jobs_cond:
            if self._closed:
                raise TransportClosed("the transfer agent is closed")
            self._active.add(handle)
            self._jobs.append(job)
            if len(self._workers) < self._threads:
                worker = threading.Thread(
                    target=self._work, name=f"kvtransfer-pull-{len(self._workers)}", daemon=True
                )
                self._workers.append(worker)
                worker.start()
            self._jobs_cond.notify()
        return handle

    def read_one_sided(
        self,
        peer: PeerHandle,
        rma: RmaPeer,
        reader: RmaReader,
        spec: PullSpec,
        plans: list[LayerPlan],
        memory: Mapping[str, LayerMemory],
        control: ReadControl,
        *,
        write: bool = False,
    ) -> PullHandle:
        """Run an RMA pull (``write``: a push into the peer's blocks) on the calling thread;
        the handle returned is complete."""
        future: Future[PullResult] = Future()
        future.set_running_or_notify_cancel()
        handle = PullHandle(spec.request_id, peer, future)
        state = handle._state
        stop = control.cancelled
        control.cancelled = lambda: state.cancelled or stop()
        started = time.perf_counter()
        with self._jobs_cond:
            if self._closed:
                raise TransportClosed("the transfer agent is closed")
            self._active.add(handle)
        address = peer.ucx_address
        try:
            with state.write_lock:
                if state.cancelled:
                    raise _cancelled(spec)
                try:
                    nbytes, runs = reader.read(
                        rma,
                        lambda: self._loop.endpoint_handle(address),
                        lambda: self._connect(peer, control),
                        spec,
                        plans,
                        memory,
                        control,
                        write=write,
                    )
                except (RemoteTransferError, AccessDenied):
                    raise  # decided before any read was posted, or after all completed
                except BaseException:
                    # Reads may be in flight: closing the endpoint ends them before the
                    # write lock (and with it `cancel`) returns. Not for a read that only
                    # waited for its turn: it posted nothing, and the reset would wait for
                    # the read ahead of it (closing takes the keys' lock) and break it.
                    if not control.queued_only:
                        self._reset_peer(peer, wait=True)
                    raise
                elapsed = time.perf_counter() - started
                future.set_result(
                    PullResult(
                        spec.request_id, spec.num_blocks, len(plans), runs, nbytes, elapsed, True
                    )
                )
        except BaseException as exc:
            if isinstance(exc, TransferCancelled) and state.closed:
                exc = TransportClosed(
                    f"pull {spec.request_id!r} aborted: the transfer agent was closed"
                )
            if not future.done():
                future.set_exception(exc)
        finally:
            with self._jobs_cond:
                self._active.discard(handle)
        return handle

    def fetch_keys(
        self,
        peer: PeerHandle,
        lease: LeaseAccess | None,
        control: ReadControl,
        *,
        push: bool = False,
    ) -> bytes:
        """Ask ``peer`` for its RMA keys (``push``: its write keys), presenting ``lease``; the
        encoded `RmaKeys`.

        `RemoteTransferError` with the peer's code if refused (``NOT_SERVING``: tagged only);
        waits within ``control`` (its deadline, cancel flag and liveness probe)."""
        what = "push keys" if push else "keys"

        def message(header_tag: int) -> bytes:
            fields = None if lease is None else lease_fields(lease)
            return KeysRequestMessage(header_tag, self._loop.address, fields, push).encode()

        answer, payload = self._ask(peer, message, control, what, MAX_KEYS_BYTES)
        if not 0 < answer.payload_bytes <= MAX_KEYS_BYTES:
            raise RemoteTransferError(
                f"{peer.name} announced {answer.payload_bytes} bytes of {what}",
                code=ErrorCode.BAD_REQUEST,
            )
        return payload[: answer.payload_bytes].tobytes()

    def ask(
        self,
        peer: PeerHandle,
        message: Callable[[int, bytes], bytes],
        control: ReadControl,
        what: str,
    ) -> None:
        """Send ``peer`` the request ``message(reply tag, reply address)`` and wait within
        ``control`` for its bare answer; `RemoteTransferError` with its code if refused."""
        self._ask(peer, lambda tag: message(tag, self._loop.address), control, what, 0)

    def notify_push(
        self,
        peer: PeerHandle,
        lease: LeaseAccess,
        phase: str,
        layers: tuple[str, ...],
        control: ReadControl | None,
        reason: str = "",
    ) -> None:
        """Tell ``peer`` (the consumer) that this producer begins writing ``lease``'s blocks,
        or that its writes landed or stopped. With ``control``: wait for the answer within it
        (`RemoteTransferError` if refused); without: send and return, the answer (a refusal is
        logged) absorbed when it comes: what a landed or stopped notice needs, the consumer
        being the one who waits for it."""

        def message(header_tag: int) -> bytes:
            return PushNoticeMessage(
                header_tag, self._loop.address, lease_fields(lease), phase, layers, reason
            ).encode()

        what = f"push notice ({phase})"
        if control is not None:
            self._ask(peer, message, control, what, 0)
            return
        exchange: _Asked

        def answered() -> None:  # loop thread
            self._told.discard(exchange)
            error = exchange.outcome.get("error")
            if isinstance(error, BaseException) and not self._loop.is_cancellation(error):
                # As `_ask` does: the next message to this peer gets a fresh endpoint. Queued,
                # not inline: this may run while the loop shuts down (then it is refused).
                self._reset_peer(peer)
            if error is None:
                try:
                    answer = PullResponseHeader.decode(exchange.header)
                except WireFormatError as exc:
                    error = exc
                else:
                    error = None if answer.status == ErrorCode.OK else answer.message
            if error is not None:
                logger.warning("%s of lease %r to %s: %s", what, lease.lease_id, peer.name, error)

        exchange = self._post_exchange(peer, message, 0, answered)
        self._told.add(exchange)

    def _post_exchange(
        self,
        peer: PeerHandle,
        message: Callable[[int], bytes],
        payload_max: int,
        on_done: Callable[[], None] | None = None,
    ) -> _Asked:
        """Post the receives of an answer, then send the request ``message(reply tag)``;
        ``on_done`` runs on the loop thread once the exchange ended."""
        header_tag, data_tag = reply_tags(self._next_sequence())
        exchange = _Asked(
            self._loop.new_host_buffer(RESPONSE_HEADER_BYTES),
            self._loop.new_host_buffer(max(payload_max, 1)),
        )
        exchange.on_done = on_done
        request = message(header_tag)

        def post() -> None:
            address = peer.ucx_address
            self._loop.recv(address, exchange.header, header_tag, exchange.finish)
            self._loop.recv(address, exchange.payload, data_tag, exchange.finish)
            self._loop.send(address, request, REQUEST_TAG, lambda e: e and exchange.finish(e))

        exchange.posted = self._loop.call(post)
        return exchange

    def _ask(
        self,
        peer: PeerHandle,
        message: Callable[[int], bytes],
        control: ReadControl,
        what: str,
        payload_max: int,
    ) -> tuple[PullResponseHeader, Any]:
        """Send the request ``message(reply tag)`` to ``peer`` and wait for its answer (header
        and a payload of at most ``payload_max`` bytes) within ``control``; `PeerUnreachable`
        if the exchange failed, `RemoteTransferError` with the peer's code if refused."""
        exchange = self._post_exchange(peer, message, payload_max)
        header, payload, done, outcome = (
            exchange.header,
            exchange.payload,
            exchange.done,
            exchange.outcome,
        )
        posted = exchange.posted
        # Within the read's deadline, and stopped by its cancel: a UCX loop thread that cannot
        # post (starved, or stuck in a send) must not hold a cancelled load for the timeout.
        while True:
            try:
                posted.result(_KEYS_POLL_S)
                break
            except FutureTimeout:
                pass
            except TransportError:
                raise
            except Exception as exc:
                raise PeerUnreachable(
                    f"cannot send {peer.name} a {what} request: {type(exc).__name__}: {exc}"
                ) from exc
            try:
                control.check(f"posting a {what} request to {peer.name}")
            except BaseException:
                # The post may still run: its receives are cancelled with the endpoint.
                self._reset_peer(peer)
                raise
        try:
            while not done.wait(_KEYS_POLL_S):
                control.check(f"{what} request to {peer.name}")
        except BaseException:
            # Frees the receives still posted for an answer that may never come.
            self._reset_peer(peer)
            raise
        error = outcome.get("error")
        if isinstance(error, BaseException):
            self._reset_peer(peer)
            raise PeerUnreachable(f"{what} request to {peer.name} failed: {error}") from error
        try:
            answer = PullResponseHeader.decode(header)
        except WireFormatError as exc:
            raise RemoteTransferError(
                f"{peer.name} sent an unreadable {what} answer: {exc}", code=exc.code
            ) from exc
        if answer.status != ErrorCode.OK:
            raise RemoteTransferError(
                f"{what} request refused by {peer.name} ({answer.status.name}): {answer.message}",
                code=answer.status,
            )
        return answer, payload

    def close(self, timeout_s: float = 10.0) -> None:
        """Cancel every pull, then stop the worker threads."""
        with self._jobs_cond:
            self._closed = True
            active = list(self._active)
            queued = [job for job in self._jobs if job is not None]
            self._jobs.clear()
            self._jobs.extend([None] * len(self._workers))
            self._jobs_cond.notify_all()
        for handle in active:
            handle._state.closed = True
            handle.cancel()
        # Queued jobs see the cancel flag and fail fast with TransferCancelled.
        for job in queued:
            job()
        for worker in self._workers:
            worker.join(timeout_s)

    # -- internals ----------------------------------------------------------------------------

    def _start_inline(
        self,
        handle: PullHandle,
        spec: PullSpec,
        plans: list[LayerPlan],
        caches: Mapping[str, torch.Tensor],
        timeout_s: float,
        started: float,
    ) -> None:
        """A one-message pull without a job: posted from here, received, checked and scattered
        on the loop thread, which completes the future (two thread hand-offs fewer)."""
        state = handle._state
        future = handle._future
        future.set_running_or_notify_cancel()
        peer = handle.peer

        def settle(error: BaseException | None, result: PullResult | None = None) -> None:
            with state.write_lock:
                if not future.done():
                    if error is not None:
                        future.set_exception(error)
                    else:
                        future.set_result(result)
            with self._jobs_cond:
                self._active.discard(handle)

        def cancelled() -> None:  # under the write lock, from `PullHandle.cancel`
            future.set_exception(
                TransportClosed(f"pull {spec.request_id!r} aborted: the transfer agent was closed")
                if state.closed
                else _cancelled(spec)
            )
            with self._jobs_cond:
                self._active.discard(handle)

        state.on_cancel = cancelled
        try:
            device = caches[plans[0].name].device
            local_ids = torch.tensor(spec.local_block_ids, dtype=torch.int64, device=device)
            exchange = self._start(
                state, peer, spec, plans, device, 0, spec.num_blocks, timeout_s=timeout_s
            )
        except BaseException as exc:
            settle(exc)
            return

        def finished() -> None:
            try:
                nbytes = self._finish(state, spec, peer, plans, caches, local_ids, exchange)
            except BaseException as exc:
                # A cancelled pull's receive left posted (its load gave up) that times out
                # later must not reset the endpoint under the pulls that use it by then.
                if isinstance(exc, TransferTimeoutError | _BrokenPeer) and not state.cancelled:
                    self._loop.reset_endpoint(peer.ucx_address)
                settle(exc)
                return
            state.received = 1
            elapsed = time.perf_counter() - started
            settle(
                None, PullResult(spec.request_id, spec.num_blocks, len(plans), 1, nbytes, elapsed)
            )

        with state.cond:
            exchange.on_finished = finished
            # Finished already if posting failed, or (the loop is fast) if the answer came.
            completion = exchange.take_completion()
        if completion is not None:
            completion()

    def _work(self) -> None:
        enter_own_thread(threading.current_thread().name)
        while True:
            with self._jobs_cond:
                while not self._jobs:
                    self._jobs_cond.wait()
                job = self._jobs.popleft()
            if job is None:
                return
            job()

    def _next_sequence(self) -> int:
        with self._sequence_lock:
            sequence = next(self._sequence)
        if sequence > MAX_REPLY_SEQUENCE:
            raise TransportError("reply tag space exhausted")
        return sequence

    def _run(
        self,
        handle: PullHandle,
        spec: PullSpec,
        plans: list[LayerPlan],
        caches: Mapping[str, torch.Tensor],
        deadline: float,
        timeout_s: float,
        started: float,
    ) -> PullResult:
        state = handle._state
        peer = handle.peer
        if spec.num_blocks == 0:
            return PullResult(spec.request_id, 0, len(plans), 0, 0, 0.0)
        device = caches[plans[0].name].device
        local_ids = torch.tensor(spec.local_block_ids, dtype=torch.int64, device=device)
        block_bytes = sum(_segment_sizes(plans, 1))
        per_message = max(1, min(self._max_blocks, self._chunk_bytes // block_bytes))
        bounds = [
            (first, min(first + per_message, spec.num_blocks))
            for first in range(0, spec.num_blocks, per_message)
        ]
        in_flight: deque[_Exchange] = deque()
        received = 0
        total_bytes = 0
        next_chunk = 0
        try:
            while next_chunk < len(bounds) or in_flight:
                if state.cancelled:
                    raise _cancelled(spec)
                while next_chunk < len(bounds) and len(in_flight) < self._window:
                    first, last = bounds[next_chunk]
                    in_flight.append(self._start(state, peer, spec, plans, device, first, last))
                    next_chunk += 1
                exchange = in_flight[0]
                with state.cond:
                    state.cond.wait_for(
                        lambda ex=exchange: ex.finished or state.cancelled,
                        max(0.0, deadline - time.monotonic()),
                    )
                    if state.cancelled:
                        raise _cancelled(spec)
                    if not exchange.finished:
                        raise self._timed_out(spec, peer, timeout_s, received, len(bounds))
                in_flight.popleft()
                total_bytes += self._finish(state, spec, peer, plans, caches, local_ids, exchange)
                received += 1
                state.received = received
        except (TransferTimeoutError, _BrokenPeer):
            # Frees the receives still posted to a peer that may never answer them.
            self._reset_peer(peer)
            raise
        return PullResult(
            request_id=spec.request_id,
            num_blocks=spec.num_blocks,
            num_layers=len(plans),
            num_messages=len(bounds),
            payload_bytes=total_bytes,
            elapsed_s=time.perf_counter() - started,
        )

    def _start(
        self,
        state: _PullState,
        peer: PeerHandle,
        spec: PullSpec,
        plans: list[LayerPlan],
        device: torch.device,
        first: int,
        last: int,
        *,
        timeout_s: float | None = None,
    ) -> _Exchange:
        """Post one exchange. With ``timeout_s`` (inline pulls, which no job waits for) its
        payload receive fails with `TransferTimeoutError` after that long."""
        _, total = segment_offsets(_segment_sizes(plans, last - first))
        header_tag, data_tag = reply_tags(self._next_sequence())
        message = PullRequestMessage(
            request_id=spec.request_id,
            reply_tag=header_tag,
            reply_address=self._loop.address,
            layers=tuple(
                LayerRequest(p.name, p.layout.dtype, p.layout.block_size, p.layout.head_dim)
                for p in plans
            ),
            remote_heads=None
            if spec.remote_heads is None
            else (spec.remote_heads.start, spec.remote_heads.stop),
            num_heads=len(plans[0].local_heads),
            block_ids=pack_block_ids(spec.remote_block_ids[first:last]),
            payload_bytes=total,
            lease=None if spec.lease is None else lease_fields(spec.lease.at(first)),
        ).encode()
        buffer = self._pool.acquire(total, device)
        exchange = _Exchange(
            first, last, self._loop.new_host_buffer(RESPONSE_HEADER_BYTES), buffer[:total], buffer
        )

        def update(error: BaseException | None, *, arrived: bool) -> None:
            with state.cond:
                if error is not None and exchange.error is None:
                    exchange.error = error
                if arrived:
                    exchange.pending -= 1
                state.cond.notify_all()
                completion = exchange.take_completion()
            if completion is not None:
                completion()

        def fail(error: BaseException) -> None:
            update(error, arrived=False)

        def received(error: BaseException | None) -> None:
            update(error, arrived=True)

        def sent(error: BaseException | None) -> None:
            if error is not None:
                fail(error)

        def timed_out() -> None:
            fail(self._timed_out(spec, peer, timeout_s or 0.0, 0, 1))

        def post() -> None:
            # Receives first, so the answer never arrives as an unexpected message.
            try:
                self._loop.recv(peer.ucx_address, exchange.header, header_tag, received)
                self._loop.recv(
                    peer.ucx_address,
                    exchange.payload,
                    data_tag,
                    received,
                    timeout_s=timeout_s,
                    on_timeout=None if timeout_s is None else timed_out,
                )
                self._loop.send(peer.ucx_address, message, REQUEST_TAG, sent)
            except Exception as exc:
                fail(
                    _BrokenPeer(
                        f"pull {spec.request_id!r}: cannot reach {peer.name}: "
                        f"{type(exc).__name__}: {exc}"
                    )
                )
            else:
                state.sent += 1

        # Not waited for: a failure to post lands in the exchange like any transfer failure.
        if self._loop.in_loop_thread():
            post()
        else:
            self._loop.call(post)
        return exchange

    def _finish(
        self,
        state: _PullState,
        spec: PullSpec,
        peer: PeerHandle,
        plans: list[LayerPlan],
        caches: Mapping[str, torch.Tensor],
        local_ids: torch.Tensor,
        exchange: _Exchange,
    ) -> int:
        if exchange.error is not None:
            raise self._transport_failure(spec, peer, exchange.error)
        try:
            header = PullResponseHeader.decode(exchange.header)
        except WireFormatError as exc:
            raise RemoteTransferError(
                f"pull {spec.request_id!r}: {peer.name} sent an unreadable response: {exc}",
                code=exc.code,
            ) from exc
        if header.status != ErrorCode.OK:
            raise RemoteTransferError(
                f"pull {spec.request_id!r} refused by {peer.name} "
                f"({header.status.name}): {header.message}",
                code=header.status,
            )
        total = exchange.payload.numel()
        if header.payload_bytes != total:
            raise RemoteTransferError(
                f"pull {spec.request_id!r}: {peer.name} sent {header.payload_bytes} payload "
                f"bytes, expected {total}",
                code=ErrorCode.LAYOUT_MISMATCH,
            )
        if header.checksum is not None:
            # A payload that does not hash to what the server sent is never scattered.
            got = payload_checksum(exchange.payload)
            if got is not None and got != header.checksum:
                self._pool.release(exchange.payload_buffer)
                raise CorruptPayloadError(
                    f"pull {spec.request_id!r}: payload from {peer.name} is corrupt "
                    f"(xxh3 {got:016x}, server sent {header.checksum:016x}); nothing was written"
                )
        ids = local_ids[exchange.first : exchange.last]
        sizes = _segment_sizes(plans, exchange.last - exchange.first)
        offsets, _ = segment_offsets(sizes)
        views: dict[tuple[int, int, int, int, bool], RowView] = {}
        with state.write_lock:
            if state.cancelled:
                raise _cancelled(spec)
            for plan, offset, size in zip(plans, offsets, sizes, strict=True):
                cache = caches[plan.name]
                head_elems = plan.layout.head_elems
                dense = cache.is_contiguous()
                key = (
                    plan.layout.num_kv_heads,
                    plan.local_heads.start,
                    len(plan.local_heads),
                    head_elems,
                    dense,
                )
                view = views.get(key)
                if view is None:
                    view = views[key] = row_view(
                        ids, plan.layout.num_kv_heads, plan.local_heads, head_elems, dense
                    )
                scatter_from(exchange.payload[offset : offset + size], cache, view)
            synchronize(exchange.payload.device)
        self._pool.release(exchange.payload_buffer)
        return total

    def _transport_failure(
        self, spec: PullSpec, peer: PeerHandle, error: BaseException
    ) -> TransportError:
        if isinstance(error, TransportError):
            return error
        if self._loop.is_cancellation(error):
            return EndpointReset(
                f"pull {spec.request_id!r}: connection to {peer.name} was reset "
                "(another pull to it timed out or the agent is closing)"
            )
        return _BrokenPeer(
            f"pull {spec.request_id!r}: transfer with {peer.name} failed: "
            f"{type(error).__name__}: {error}"
        )

    def _timed_out(
        self, spec: PullSpec, peer: PeerHandle, timeout_s: float, received: int, total: int
    ) -> TransferTimeoutError:
        return TransferTimeoutError(
            f"pull {spec.request_id!r} from {peer.name} timed out after {timeout_s} s "
            f"({received}/{total} messages received)"
        )

    def _reset_peer(self, peer: PeerHandle, *, wait: bool = False) -> None:
        with contextlib.suppress(TransportClosed):
            done = self._loop.call(lambda: self._loop.reset_endpoint(peer.ucx_address))
            if wait:
                with contextlib.suppress(TransportClosed):
                    done.result()

    def _connect(self, peer: PeerHandle, control: ReadControl) -> None:
        """Make sure an endpoint to ``peer`` exists (it was reset), on the loop thread; waits
        within ``control`` (the loop thread may be busy or starved)."""
        made = self._loop.call(lambda: self._loop.endpoint(peer.ucx_address))
        while True:
            try:
                made.result(_KEYS_POLL_S)
                return
            except FutureTimeout:
                control.check(f"connecting to {peer.name}")
