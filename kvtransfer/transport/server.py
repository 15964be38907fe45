"""The serving side: answer pull requests from the registered KV caches.

The loop thread receives each request (any size, probed). One whose payload is at most
``inline_bytes`` is served right there: decoded, validated, gathered into one pooled buffer with
one `index_select` per layer and sent, with no thread hand-off (what a small pull's latency is
made of). A larger one is queued to a handler thread, which does the same and hands the sends
back to the loop thread without waiting for them, so the next request's gather overlaps this
one's transfer and the loop thread keeps progressing other peers meanwhile. A request that
fails validation is answered with an error header (and an empty payload, so the client's posted
payload receive completes too); the server keeps serving.

A send that does not complete within ``send_timeout_s`` means the client died or stopped
reading: its endpoint is reset. Such a send cannot be cancelled, so its buffer is never reused.

With `LeaseGrants` the server serves leased KV only (see `access`): each request must present
its lease and secret, and is gathered while the lease is held open, so a lease revoked by the
engine is never read afterwards. A request whose grant has not arrived yet is parked (not
blocking the handler threads) until the grant comes or ``grant_wait_s`` passes. With
``checksum`` every payload carries its xxh3-64 in the response header (host memory only).
"""

from __future__ import annotations

import contextlib
import logging
import queue
import threading
import time
from collections.abc import Callable, Mapping
from concurrent.futures import Future
from typing import Any

import torch

from kvtransfer.threads import enter_own_thread
from kvtransfer.transport.access import AccessDenied, LeaseAccess, LeaseGrants
from kvtransfer.transport.buffers import (
    BufferPool,
    RowView,
    gather_into,
    payload_bytes,
    payload_checksum,
    row_view,
    synchronize,
)
from kvtransfer.transport.errors import ErrorCode, TransportClosed
from kvtransfer.transport.messages import (
    KIND_KEYS,
    KIND_PUSH,
    KIND_PUSH_ASK,
    REQUEST_TAG,
    KeysRequestMessage,
    PullRequestMessage,
    PullResponseHeader,
    PushAskMessage,
    PushNoticeMessage,
    RequestEnvelope,
    WireFormatError,
    payload_tag,
    peek_request,
    peer_name,
    segment_offsets,
    unpack_block_ids,
)
from kvtransfer.transport.spec import KVLayout
from kvtransfer.transport.ucx import UcxLoop

logger = logging.getLogger(__name__)

# Layer names quoted in an error message before it is cut.
_NAMES_IN_ERRORS = 8
# Requests waiting for their grant at once; beyond this they are refused (no unbounded memory).
MAX_PARKED = 1024


class _Rejected(Exception):
    def __init__(self, code: ErrorCode, message: str) -> None:
        super().__init__(message)
        self.code = code


def _refusal(error: Exception, what: str) -> PullResponseHeader:
    """The answer to a request that failed: its typed code, or INTERNAL (logged) for a bug."""
    if isinstance(error, AccessDenied | WireFormatError | _Rejected):
        return PullResponseHeader(error.code, 0, str(error))
    logger.exception("%s request failed on the server", what)
    return PullResponseHeader(ErrorCode.INTERNAL, 0, f"{type(error).__name__}: {error}")


def _names(names: list[str]) -> str:
    shown = ", ".join(repr(n) for n in names[:_NAMES_IN_ERRORS])
    more = len(names) - _NAMES_IN_ERRORS
    return shown + (f" and {more} more" if more > 0 else "")


class KVServer:
    """Serves pulls on ``loop`` from the caches ``caches()`` returns at each request."""

    def __init__(
        self,
        loop: UcxLoop,
        pool: BufferPool,
        caches: Callable[[], Mapping[str, torch.Tensor]],
        *,
        send_timeout_s: float,
        threads: int = 1,
        grants: LeaseGrants | None = None,
        checksum: bool = True,
        inline_bytes: int = 0,
        rma_keys: bytes | None = None,
        push_grants: LeaseGrants | None = None,
        push_keys: bytes | None = None,
        push_asks: Callable[[PushAskMessage], bool] | None = None,
    ) -> None:
        self._loop = loop
        # Push data plane: where the asks of consumers to be written to go (None: refused).
        self._push_asks = push_asks
        # RMA mode: the encoded `RmaKeys` handed to peers that authenticate (None: tagged only).
        self._rma_keys = rma_keys
        # Push: the grants of this agent's blocks to producers, and the write keys handed to
        # a producer presenting one (None: this agent takes no pushes).
        self._push_grants = push_grants
        self._push_keys = push_keys
        self._inline_bytes = inline_bytes
        self._pool = pool
        self._caches = caches
        self._send_timeout_s = send_timeout_s
        self._queue: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._threads = [
            threading.Thread(target=self._serve, name=f"kvtransfer-serve-{i}", daemon=True)
            for i in range(threads)
        ]
        self._grants = grants
        self._checksum = checksum
        self._parked: list[tuple[float, Any]] = []
        self._parked_lock = threading.Lock()
        if grants is not None:
            self._threads.append(
                threading.Thread(target=self._unpark, name="kvtransfer-serve-park", daemon=True)
            )
        self._started = False
        self._stats_lock = threading.Lock()
        self.requests_served = 0
        self.requests_rejected = 0
        # Keys requests answered with the keys: peers that may now read one-sided.
        self.keys_served = 0
        # Payload bytes of the requests served: what this server put on the wire.
        self.bytes_served = 0
        # Every message that reached this server's code, answered or not: one-sided reads
        # never do (tests hold RMA mode to it).
        self.messages_received = 0

    def start(self) -> None:
        if self._started:
            return
        self._started = True
        for thread in self._threads:
            thread.start()
        self._loop.call(lambda: self._loop.listen(REQUEST_TAG, self._on_request)).result()

    def stop(self, timeout_s: float = 10.0) -> None:
        """Stop accepting requests and join the handler threads; idempotent."""
        if not self._started:
            return
        self._started = False
        if self._loop.running:
            try:
                self._loop.call(lambda: self._loop.unlisten(REQUEST_TAG)).result(timeout_s)
            except Exception:
                logger.debug("could not unlisten; the loop is closing", exc_info=True)
        for _ in self._threads:
            self._queue.put(None)
        if self._grants is not None:
            self._grants.wake()  # the parking thread, else it sleeps up to a second more
        for thread in self._threads:
            thread.join(timeout_s)
        with self._parked_lock:
            self._parked.clear()

    # -- loop thread --------------------------------------------------------------------------

    def _on_request(self, data: Any, error: BaseException | None) -> None:
        with self._stats_lock:
            self.messages_received += 1
        if error is not None:
            logger.warning("failed to receive a pull request: %s", error)
            return
        try:
            self._handle(data, inline=True)
        except Exception:
            logger.exception("pull request handling failed")

    # -- handler threads ----------------------------------------------------------------------

    def _serve(self) -> None:
        enter_own_thread(threading.current_thread().name)
        while True:
            item = self._queue.get()
            if item is None:
                return
            data, may_park = item
            try:
                self._handle(data, may_park)
            except Exception:
                logger.exception("pull request handling failed")

    def _unpark(self) -> None:
        """Requeue parked requests once their grant (or revocation) came, or their wait ran out."""
        enter_own_thread("kvtransfer-serve-park")
        grants = self._grants
        if grants is None:
            return
        while self._started:
            with self._parked_lock:
                parked = self._parked
                soonest = min((at for at, _ in parked), default=time.monotonic() + 1.0)
            grants.wait_for_change(min(1.0, soonest - time.monotonic()))
            now = time.monotonic()
            with self._parked_lock:
                ready, waiting = [], []
                for entry in self._parked:
                    at, (lease_id, names, _) = entry
                    # A granted lease whose layers are being computed waits for them (or for
                    # its revocation); only a grant that never came times out.
                    go = grants.ready(lease_id, names) or (at <= now and not grants.known(lease_id))
                    (ready if go else waiting).append(entry)
                self._parked = waiting
            for _, (_, _, data) in ready:
                try:
                    self._loop.call(lambda data=data: self._on_unparked(data))
                except TransportClosed:
                    return

    def _on_unparked(self, data: Any) -> None:
        try:
            self._handle(data, may_park=False, inline=True)
        except Exception:
            logger.exception("pull request handling failed")

    def _park(self, lease_id: str, layer_names: tuple[str, ...], data: Any) -> bool:
        if self._grants is None:
            return False
        with self._parked_lock:
            if len(self._parked) >= MAX_PARKED:
                return False
            deadline = time.monotonic() + self._grants.grant_wait_s
            # The parking thread wakes at least every second: deadlines are met within that.
            self._parked.append((deadline, (lease_id, layer_names, data)))
        return True

    def _handle(self, data: Any, may_park: bool = True, *, inline: bool = False) -> None:
        try:
            envelope = peek_request(data)
        except WireFormatError as exc:
            # Without a reply tag and address there is nobody to answer.
            logger.warning("dropping unanswerable pull request: %s", exc)
            return
        if envelope.kind == KIND_KEYS:
            self._answer_keys(data, envelope, may_park)
            return
        if envelope.kind == KIND_PUSH:
            self._answer_push_notice(data, envelope)
            return
        if envelope.kind == KIND_PUSH_ASK:
            self._answer_push_ask(data, envelope)
            return
        payload: torch.Tensor | None = None
        buffer: torch.Tensor | None = None
        try:
            request = PullRequestMessage.decode(data)
            if inline and request.payload_bytes > self._inline_bytes:
                self._queue.put((data, may_park))
                return
            access = None if request.lease is None else LeaseAccess(*request.lease)
            names = tuple(layer.name for layer in request.layers)
            if (
                may_park
                and access is not None
                and self._grants is not None
                and not self._grants.ready(access.lease_id, names)
                and self._park(access.lease_id, names, data)
            ):
                return
            buffer, payload = self._gather_leased(request, access)
            checksum = payload_checksum(payload) if self._checksum else None
            header = PullResponseHeader(ErrorCode.OK, payload.numel(), checksum=checksum)
        except Exception as exc:
            header = _refusal(exc, "pull")
        self._count(header, keys=False)
        self._reply(envelope.reply_address, envelope.reply_tag, header, buffer, payload)

    def _answer_keys(self, data: Any, envelope: RequestEnvelope, may_park: bool) -> None:
        """A keys request: the same lease check as a pull, then the keys (RMA mode only)."""
        payload: torch.Tensor | None = None
        try:
            request = KeysRequestMessage.decode(data)
            if request.push:
                self._answer_push_keys(request, envelope)
                return
            if self._rma_keys is None:
                raise _Rejected(
                    ErrorCode.NOT_SERVING,
                    "this agent serves tagged reads only (data_plane 'tagged'): no one-sided keys",
                )
            access = None if request.lease is None else LeaseAccess(*request.lease)
            if self._grants is not None:
                if (
                    may_park
                    and access is not None
                    and not self._grants.ready(access.lease_id, ())
                    and self._park(access.lease_id, (), data)
                ):
                    return
                self._grants.authenticate(access)
            payload = torch.frombuffer(bytearray(self._rma_keys), dtype=torch.uint8)
            header = PullResponseHeader(ErrorCode.OK, payload.numel())
        except Exception as exc:
            header = _refusal(exc, "keys")
        self._count(header, keys=True)
        self._reply(envelope.reply_address, envelope.reply_tag, header, None, payload)

    def _answer_push_keys(self, request: KeysRequestMessage, envelope: RequestEnvelope) -> None:
        """A producer asks for the write keys, presenting a push lease of this agent's."""
        payload: torch.Tensor | None = None
        try:
            if self._push_grants is None or self._push_keys is None:
                raise _Rejected(
                    ErrorCode.NOT_SERVING, "this agent takes no pushes (no push grants)"
                )
            access = None if request.lease is None else LeaseAccess(*request.lease)
            self._push_grants.authenticate(access)
            payload = torch.frombuffer(bytearray(self._push_keys), dtype=torch.uint8)
            header = PullResponseHeader(ErrorCode.OK, payload.numel())
        except Exception as exc:
            header = _refusal(exc, "push keys")
        self._count(header, keys=True)
        self._reply(envelope.reply_address, envelope.reply_tag, header, None, payload)

    def _answer_push_notice(self, data: Any, envelope: RequestEnvelope) -> None:
        """A producer begins, or has ended, its writes of a push lease."""
        try:
            notice = PushNoticeMessage.decode(data)
            if self._push_grants is None:
                raise _Rejected(ErrorCode.NOT_SERVING, "this agent takes no pushes")
            access = LeaseAccess(*notice.lease)
            if notice.phase == "begin":
                self._push_grants.begin_write(access)
            else:
                stopped = notice.phase == "stopped"
                self._push_grants.end_write(
                    access,
                    () if stopped else notice.layers,
                    stopped=(notice.reason or "no reason given") if stopped else "",
                )
            header = PullResponseHeader(ErrorCode.OK, 0)
        except Exception as exc:
            header = _refusal(exc, "push notice")
        self._count(header, keys=False)
        self._reply(envelope.reply_address, envelope.reply_tag, header, None, None)

    def _answer_push_ask(self, data: Any, envelope: RequestEnvelope) -> None:
        """A consumer asks to be written a request's KV: the same lease check as a pull, then
        the ask is queued for the pusher (the writes' outcome reaches it as push notices)."""
        try:
            ask = PushAskMessage.decode(data)
            if self._push_asks is None or self._grants is None:
                raise _Rejected(
                    ErrorCode.NOT_SERVING, "this agent pushes no KV (data_plane is not 'push')"
                )
            # The lease, its secret and prompt, and the blocks at its positions, as a pull's.
            with self._grants.reading(LeaseAccess(*ask.lease), ask.block_ids):
                pass
            if not self._push_asks(ask):
                raise _Rejected(
                    ErrorCode.NOT_SERVING,
                    "too many push asks queued or running on this agent; ask again later",
                )
            header = PullResponseHeader(ErrorCode.OK, 0)
        except Exception as exc:
            header = _refusal(exc, "push ask")
        self._count(header, keys=True)
        self._reply(envelope.reply_address, envelope.reply_tag, header, None, None)

    def _count(self, header: PullResponseHeader, *, keys: bool) -> None:
        with self._stats_lock:
            if header.status != ErrorCode.OK:
                self.requests_rejected += 1
            elif keys:
                self.keys_served += 1
            else:
                self.requests_served += 1
                self.bytes_served += header.payload_bytes

    def _gather_leased(
        self, request: PullRequestMessage, access: LeaseAccess | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if self._grants is None:
            return self._gather(request)
        ids = unpack_block_ids(request.block_ids)
        names = [layer.name for layer in request.layers]
        with self._grants.reading(access, ids, names):
            return self._gather(request)

    def _gather(self, request: PullRequestMessage) -> tuple[torch.Tensor, torch.Tensor]:
        caches = self._caches()
        unknown = [layer.name for layer in request.layers if layer.name not in caches]
        if unknown:
            raise _Rejected(
                ErrorCode.UNKNOWN_LAYER,
                f"unknown layer(s) {_names(unknown)}; this server holds {len(caches)} layers",
            )
        if request.num_blocks == 0:
            raise _Rejected(ErrorCode.BAD_REQUEST, "request has no blocks")
        first = caches[request.layers[0].name]
        ids = torch.frombuffer(unpack_block_ids(request.block_ids), dtype=torch.int64)
        low, high = int(ids.min()), int(ids.max())
        ids = ids.to(first.device)
        plans = [
            self._check_layer(request, caches[layer.name], layer, low, high)
            for layer in request.layers
        ]
        sizes = [
            payload_bytes(request.num_blocks, len(h), lay.head_elems, lay.element_size)
            for lay, h in plans
        ]
        offsets, total = segment_offsets(sizes)
        if total != request.payload_bytes:
            raise _Rejected(
                ErrorCode.LAYOUT_MISMATCH,
                f"payload would be {total} bytes, the client expects {request.payload_bytes}",
            )
        buffer = self._pool.acquire(total, first.device)
        payload = buffer[:total]
        views: dict[tuple[int, int, int, int, bool], RowView] = {}
        for layer, (layout, heads), offset, size in zip(
            request.layers, plans, offsets, sizes, strict=True
        ):
            cache = caches[layer.name]
            dense = cache.is_contiguous()
            key = (layout.num_kv_heads, heads.start, len(heads), layout.head_elems, dense)
            view = views.get(key)
            if view is None:
                view = views[key] = row_view(
                    ids, layout.num_kv_heads, heads, layout.head_elems, dense
                )
            gather_into(payload[offset : offset + size], cache, view)
        synchronize(payload.device)
        return buffer, payload

    def _check_layer(
        self, request: PullRequestMessage, cache: torch.Tensor, layer: Any, low: int, high: int
    ) -> tuple[KVLayout, range]:
        layout = KVLayout.of(cache)
        for field, wanted in (
            ("dtype", layer.dtype),
            ("block_size", layer.block_size),
            ("head_dim", layer.head_dim),
        ):
            have = getattr(layout, field)
            if have != wanted:
                raise _Rejected(
                    ErrorCode.LAYOUT_MISMATCH,
                    f"layer {layer.name!r} {field} mismatch: request "
                    f"expects {wanted}, server has {have}",
                )
        if request.remote_heads is None:
            heads = range(layout.num_kv_heads)
        else:
            start, stop = request.remote_heads
            if not 0 <= start < stop <= layout.num_kv_heads:
                raise _Rejected(
                    ErrorCode.HEAD_RANGE,
                    f"head range [{start},{stop}) out of bounds for layer "
                    f"{layer.name!r} with {layout.num_kv_heads} heads",
                )
            heads = range(start, stop)
        if len(heads) != request.num_heads:
            raise _Rejected(
                ErrorCode.HEAD_RANGE,
                f"layer {layer.name!r} serves {len(heads)} heads "
                f"[{heads.start},{heads.stop}) but the client writes {request.num_heads}",
            )
        if low < 0 or high >= layout.num_blocks:
            bad = low if low < 0 else high
            raise _Rejected(
                ErrorCode.BLOCK_OUT_OF_RANGE,
                f"block id {bad} out of range for layer {layer.name!r} "
                f"with {layout.num_blocks} blocks",
            )
        return layout, heads

    def _reply(
        self,
        address: bytes,
        tag: int,
        header: PullResponseHeader,
        buffer: torch.Tensor | None,
        payload: torch.Tensor | None,
    ) -> None:
        loop = self._loop
        body = payload if payload is not None else torch.empty(0, dtype=torch.uint8)
        state = {"failed": False}

        def payload_sent(error: BaseException | None) -> None:
            if error is None and not state["failed"] and buffer is not None:
                self._pool.release(buffer)
            elif error is not None:
                logger.warning("pull response to %s failed: %s", peer_name(address), error)
                if not loop.is_cancellation(error):
                    # The endpoint failed (a partition timed it out, its peer reset it): the
                    # next answer to that peer gets a fresh one instead of the same error.
                    # Queued, not inline: refused once the loop shuts down.
                    with contextlib.suppress(TransportClosed):
                        loop.call(lambda: loop.reset_endpoint(address))

        def timed_out() -> None:
            state["failed"] = True
            logger.warning(
                "pull response to %s not taken within %s s; resetting the connection",
                peer_name(address),
                self._send_timeout_s,
            )
            loop.reset_endpoint(address)

        def send() -> None:
            loop.send(address, header.encode(), tag)
            loop.send(
                address,
                body,
                payload_tag(tag),
                payload_sent,
                timeout_s=self._send_timeout_s,
                on_timeout=timed_out,
            )

        def posted(future: Future[None]) -> None:
            error = future.exception()
            if error is not None:
                logger.warning("cannot answer pull request from %s: %s", peer_name(address), error)

        try:
            if loop.in_loop_thread():
                send()
            else:
                loop.call(send).add_done_callback(posted)
        except Exception as exc:
            logger.warning("cannot answer pull request from %s: %s", peer_name(address), exc)
