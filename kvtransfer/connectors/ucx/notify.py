"""Consumer -> producer completion messages over the producer's control-plane port.

Service ``kvtransfer.v1.UcxConnectorNotify`` (JSON bodies, no protobuf, nothing executable):

* ``Release {engine_id, generation, done: [{request_id, num_blocks, secret}]}``: the consumer
  is done with these requests (loaded, failed, aborted or not needed): the producer may free
  their blocks;
* ``KeepAlive {engine_id, generation, leases: [{request_id, secret}]}``: the consumer still
  waits to pull them: extend their leases.

Both answer ``{known, lease_s}``: the ids the producer still held and its lease length, from
which the consumer paces its keep-alives. A message for another handshake generation (the
producer restarted since; request ids may repeat) is answered but not acted on. Every request
named must come with the secret its params carried (``remote_kv_secret``): a message with a
wrong secret for a held request is refused whole with PERMISSION_DENIED, so nobody can free or
pin another request's KV by naming it.

The producer serves it next to `KVHandshake` (`notify_handler`). On the consumer, a `Notifier`
sends from a background event loop, so the step thread never waits on the network: the
scheduler half's releases and keep-alives, and the workers' "is it still held?" questions while
a load waits on a producer (`Notifier.ask_held`, see `liveness`).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import threading
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any, TypeVar

import grpc
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from kvtransfer.connectors.ucx.leases import LeaseBook, LeaseSecretMismatch
from kvtransfer.connectors.ucx.metadata import RemotePrefill
from kvtransfer.control.security import TLSFiles, channel_credentials, channel_options
from kvtransfer.threads import enter_own_thread

logger = logging.getLogger(__name__)

T = TypeVar("T")

SERVICE = "kvtransfer.v1.UcxConnectorNotify"
RELEASE = f"/{SERVICE}/Release"
KEEP_ALIVE = f"/{SERVICE}/KeepAlive"

# Keep-alive pace before a producer told us its lease, and its bounds after.
DEFAULT_KEEP_ALIVE_S = 1.0
MIN_KEEP_ALIVE_S = 0.02
_RELEASE_ATTEMPTS = 3
_RETRYABLE = frozenset({grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED})


class _Message(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class LeaseRef(_Message):
    request_id: str = Field(min_length=1)
    secret: str = Field(min_length=1, repr=False)


class Done(LeaseRef):
    num_blocks: int = Field(ge=0)


class ReleaseRequest(_Message):
    engine_id: str = Field(min_length=1)
    generation: int | None = None
    done: tuple[Done, ...]


class KeepAliveRequest(_Message):
    engine_id: str = Field(min_length=1)
    generation: int | None = None
    leases: tuple[LeaseRef, ...]


class NotifyReply(_Message):
    known: tuple[str, ...]
    lease_s: float = Field(gt=0)


# ---------------------------------------------------------------------------- producer side


def notify_handler(engine_id: str, generation: int, leases: LeaseBook) -> grpc.GenericRpcHandler:
    """The producer's side of the service, for `ControlServerThread(handlers=...)`."""

    def current(message: ReleaseRequest | KeepAliveRequest) -> bool:
        return message.generation is None or message.generation == generation

    def reply(known: list[str]) -> bytes:
        return NotifyReply(known=tuple(known), lease_s=leases.lease_s).model_dump_json().encode()

    async def release(body: bytes, context: grpc.aio.ServicerContext) -> bytes:
        message = await _parse(ReleaseRequest, body, engine_id, context)
        if not current(message):
            return reply([])
        done = [(d.request_id, d.num_blocks, d.secret) for d in message.done]
        return reply(await _authorised(context, lambda: leases.finish(done)))

    async def keep_alive(body: bytes, context: grpc.aio.ServicerContext) -> bytes:
        message = await _parse(KeepAliveRequest, body, engine_id, context)
        if not current(message):
            return reply([])
        claims = [(ref.request_id, ref.secret) for ref in message.leases]
        return reply(await _authorised(context, lambda: leases.extend(claims)))

    return grpc.method_handlers_generic_handler(
        SERVICE,
        {
            "Release": grpc.unary_unary_rpc_method_handler(release),
            "KeepAlive": grpc.unary_unary_rpc_method_handler(keep_alive),
        },
    )


async def _authorised(context: grpc.aio.ServicerContext, act: Callable[[], list[str]]) -> list[str]:
    try:
        return act()
    except LeaseSecretMismatch as exc:
        logger.warning("refused a notify message: %s", exc)
        await context.abort(grpc.StatusCode.PERMISSION_DENIED, str(exc))
        raise  # abort raises; this keeps type checkers honest


async def _parse(
    cls: type[ReleaseRequest] | type[KeepAliveRequest],
    body: bytes,
    engine_id: str,
    context: grpc.aio.ServicerContext,
) -> Any:
    try:
        message = cls.model_validate_json(body)
    except ValidationError as exc:
        await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"malformed {cls.__name__}: {exc}")
    if message.engine_id != engine_id:
        await context.abort(
            grpc.StatusCode.FAILED_PRECONDITION,
            f"this is engine {engine_id!r}, not {message.engine_id!r}",
        )
    return message


# ---------------------------------------------------------------------------- consumer side

# Where a keep-alive goes: (address, engine id, generation).
_Producer = tuple[str, str, int | None]
# What it names: (request id, secret).
_Claim = tuple[str, str]


def _key(remote: RemotePrefill) -> _Producer:
    return remote.address, remote.engine_id, remote.generation


class Notifier:
    """Talks to producers from a private event loop thread: Release and KeepAlive messages
    (scheduler half), and "is this request still held?" questions (`ask_held`, workers).

    Keep-alives go to each producer with watched loads at a quarter of its lease (learned from
    its first reply), batched per producer. Fire and forget: a producer that cannot be reached
    only loses a message it no longer needs (its lease frees the blocks). `close` waits up to
    ``flush_timeout_s`` for releases in flight.
    """

    def __init__(self, timeout_s: float, *, tls: TLSFiles | None = None) -> None:
        self._timeout_s = timeout_s
        self._tls = tls
        self._lock = threading.Lock()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._closed = False
        # Loads waiting on a producer: our request id -> the producer's params.
        self._watched: dict[str, RemotePrefill] = {}
        # Loop-thread state: leases learned per address, next keep-alive per producer.
        self._lease_s: dict[str, float] = {}
        self._due: dict[_Producer, float] = {}
        self._changed: asyncio.Event | None = None
        self._channels: dict[str, grpc.aio.Channel] = {}
        self._tasks: set[asyncio.Task[Any]] = set()

    # -- any thread ---------------------------------------------------------------------------

    def watch(self, req_id: str, remote: RemotePrefill) -> None:
        """Keep ``remote``'s lease alive until `unwatch`; a new producer hears from us now."""
        with self._lock:
            self._watched[req_id] = remote
        self._submit(self._wake)

    def unwatch(self, req_id: str) -> None:
        with self._lock:
            self._watched.pop(req_id, None)

    def release(self, remote: RemotePrefill, num_blocks: int) -> None:
        message = ReleaseRequest(
            engine_id=remote.engine_id,
            generation=remote.generation,
            done=(Done(request_id=remote.request_id, num_blocks=num_blocks, secret=remote.secret),),
        )
        self._submit(lambda: self._spawn(self._release(remote.address, message)))

    def ask_held(self, remote: RemotePrefill) -> concurrent.futures.Future[bool]:
        """Whether the producer still holds ``remote``'s request (one KeepAlive round trip,
        which also renews the lease); the future fails with the gRPC error when the producer
        cannot be asked. Used to notice a producer that restarted while a load waits."""
        body = KeepAliveRequest(
            engine_id=remote.engine_id,
            generation=remote.generation,
            leases=(LeaseRef(request_id=remote.request_id, secret=remote.secret),),
        )

        async def ask() -> bool:
            reply = await self._call(remote.address, KEEP_ALIVE, body.model_dump_json().encode())
            return remote.request_id in reply.known

        return self._run(ask())

    def close(self, flush_timeout_s: float = 2.0) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            loop, thread = self._loop, self._thread
        if loop is None or thread is None:
            return
        with contextlib.suppress(Exception):
            asyncio.run_coroutine_threadsafe(self._shutdown(flush_timeout_s), loop).result(
                flush_timeout_s + 5.0
            )
        loop.call_soon_threadsafe(loop.stop)
        thread.join(timeout=flush_timeout_s + 5.0)

    # -- internals ------------------------------------------------------------------------------

    def start(self) -> None:
        """Start the event loop thread now (else the first message starts it, and waits for
        it to run); idempotent."""
        with self._lock:
            if not self._closed and self._loop is None:
                self._start()

    def _submit(self, callback: Callable[[], None]) -> None:
        with self._lock:
            if self._closed:
                return
            loop = self._loop or self._start()
        loop.call_soon_threadsafe(callback)

    def _run(self, coroutine: Coroutine[Any, Any, T]) -> concurrent.futures.Future[T]:
        with self._lock:
            if self._closed:
                coroutine.close()
                raise RuntimeError("the notifier is closed")
            loop = self._loop or self._start()
        return asyncio.run_coroutine_threadsafe(coroutine, loop)

    def _start(self) -> asyncio.AbstractEventLoop:
        loop = asyncio.new_event_loop()
        ready = threading.Event()

        def run() -> None:
            enter_own_thread("kvtransfer-ucx-notify")
            asyncio.set_event_loop(loop)
            self._changed = asyncio.Event()
            heartbeat = loop.create_task(self._heartbeat())
            ready.set()
            try:
                loop.run_forever()
            finally:
                heartbeat.cancel()
                with contextlib.suppress(BaseException):
                    loop.run_until_complete(asyncio.gather(heartbeat, return_exceptions=True))
                loop.close()

        self._thread = threading.Thread(target=run, name="kvtransfer-ucx-notify", daemon=True)
        self._thread.start()
        ready.wait()
        self._loop = loop
        return loop

    def _spawn(self, coroutine: Awaitable[Any]) -> None:
        task = asyncio.ensure_future(coroutine)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _wake(self) -> None:
        if self._changed is not None:
            self._changed.set()

    async def _shutdown(self, flush_timeout_s: float) -> None:
        pending = [t for t in self._tasks if not t.done()]
        if pending:
            await asyncio.wait(pending, timeout=flush_timeout_s)
        for task in pending:
            task.cancel()
        channels, self._channels = list(self._channels.values()), {}
        for channel in channels:
            await channel.close()

    def _interval_s(self, address: str) -> float:
        lease = self._lease_s.get(address)
        if lease is None:
            return DEFAULT_KEEP_ALIVE_S
        return max(MIN_KEEP_ALIVE_S, min(DEFAULT_KEEP_ALIVE_S, lease / 4))

    async def _heartbeat(self) -> None:
        loop = asyncio.get_running_loop()
        changed = self._changed
        if changed is None:
            raise RuntimeError("the notifier loop started without its event")
        while True:
            now = loop.time()
            with self._lock:
                groups: dict[_Producer, list[_Claim]] = {}
                for remote in self._watched.values():
                    groups.setdefault(_key(remote), []).append((remote.request_id, remote.secret))
            for key in [k for k in self._due if k not in groups]:
                del self._due[key]
            for key, claims in groups.items():
                # A producer not heard from yet is due now.
                if now >= self._due.setdefault(key, now):
                    self._due[key] = now + self._interval_s(key[0])
                    self._spawn(self._keep_alive(key, claims))
            wake = min(self._due.values(), default=now + DEFAULT_KEEP_ALIVE_S)
            changed.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(changed.wait(), max(MIN_KEEP_ALIVE_S, wake - now))

    def _channel(self, address: str) -> grpc.aio.Channel:
        channel = self._channels.get(address)
        if channel is None:
            channel = self._channels[address] = _open_channel(address, self._tls)
        return channel

    async def _call(
        self, address: str, method: str, body: bytes, *, wait_for_ready: bool = False
    ) -> NotifyReply:
        rpc = self._channel(address).unary_unary(method)
        answer = await rpc(body, timeout=self._timeout_s, wait_for_ready=wait_for_ready)
        reply = NotifyReply.model_validate_json(answer)
        if self._lease_s.get(address) != reply.lease_s:
            self._lease_s[address] = reply.lease_s
            # Bring every keep-alive to this producer in line with its lease.
            now = asyncio.get_running_loop().time()
            for key, due in self._due.items():
                if key[0] == address:
                    self._due[key] = min(due, now + self._interval_s(address))
            self._wake()
        return reply

    async def _keep_alive(self, key: _Producer, claims: list[_Claim]) -> None:
        address, engine_id, generation = key
        body = KeepAliveRequest(
            engine_id=engine_id,
            generation=generation,
            leases=tuple(LeaseRef(request_id=r, secret=s) for r, s in claims),
        )
        try:
            await self._call(address, KEEP_ALIVE, body.model_dump_json().encode())
        except (grpc.aio.AioRpcError, ValidationError) as exc:
            logger.debug("KeepAlive to engine %s at %s failed: %s", engine_id, address, exc)

    async def _release(self, address: str, message: ReleaseRequest) -> None:
        body = message.model_dump_json().encode()
        for attempt in range(1, _RELEASE_ATTEMPTS + 1):
            try:
                # A producer restarting on its port is waited for (within the timeout) rather
                # than failed at once: the release would otherwise leave KV to the lease.
                await self._call(address, RELEASE, body, wait_for_ready=True)
                return
            except grpc.aio.AioRpcError as exc:
                if exc.code() not in _RETRYABLE or attempt == _RELEASE_ATTEMPTS:
                    logger.warning(
                        "Release of %s to engine %s at %s failed (its lease will free the "
                        "blocks): %s",
                        [d.request_id for d in message.done],
                        message.engine_id,
                        address,
                        exc.details(),
                    )
                    return
                await asyncio.sleep(0.05 * attempt)
            except ValidationError as exc:
                logger.warning("unreadable Release reply from %s: %s", address, exc)
                return


# gRPC backs off reconnecting to a producer that went away for up to two minutes by default; a
# restarted producer must hear releases and keep-alives within about a second.
_RECONNECT_OPTIONS = [
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.min_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 1000),
]


def _open_channel(address: str, tls: TLSFiles | None) -> grpc.aio.Channel:
    if tls is None:
        return grpc.aio.insecure_channel(address, options=_RECONNECT_OPTIONS)
    return grpc.aio.secure_channel(
        address, channel_credentials(tls), options=[*_RECONNECT_OPTIONS, *channel_options(tls)]
    )
