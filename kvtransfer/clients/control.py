"""Asyncio clients of the control plane: `HandshakeClient`, `AdminClient` and a per-loop cache.

Every call has a deadline (``timeout_s`` per attempt) and is retried with exponential back-off,
but only on UNAVAILABLE and DEADLINE_EXCEEDED (every RPC here is idempotent, so a retried call
that already ran does no harm); anything else fails at once with a typed error naming the peer.
gRPC channels belong to the event loop they were created on, hence one client per
(loop, address, TLS settings) in `ClientCache`. Every client takes ``tls`` (`TLSFiles`; ``None``
for plaintext); `AdminClient` also takes the server's admin ``token``.
"""

from __future__ import annotations

import asyncio
import random
import threading
import weakref
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kvtransfer.connector.metadata import KVConnectorHandshakeMetadata, PpTpRank, check_rank_key
from kvtransfer.control.admin import (
    EngineStatus,
    PeerInfo,
    TransferInfo,
    peer_from_proto,
    status_from_proto,
    transfer_from_proto,
)
from kvtransfer.control.compat import API_VERSION, CompatibilityInfo, FieldDifference
from kvtransfer.control.errors import (
    AdminAuthError,
    ControlPlaneError,
    EngineIdMismatchError,
    HandshakeCompatibilityError,
    HandshakeNotFoundError,
    HandshakePayloadError,
    InvalidArgumentError,
    PeerUnavailableError,
    RemoteCallError,
)
from kvtransfer.control.security import (
    TLSFiles,
    admin_token_metadata,
    channel_credentials,
    channel_options,
)
from kvtransfer.control.server import ENGINE_ID_METADATA_KEY
from kvtransfer.v1 import admin_pb2, admin_pb2_grpc, handshake_pb2, handshake_pb2_grpc

M = TypeVar("M", bound=KVConnectorHandshakeMetadata)

DEFAULT_TIMEOUT_S = 3.0
_RETRYABLE = frozenset({grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED})


@dataclass(frozen=True)
class RetryPolicy:
    """``max_attempts`` tries in all; the n-th wait is ``initial_backoff_s * multiplier**(n-1)``
    capped at ``max_backoff_s``, with +-20% jitter so peers restarting together spread out."""

    max_attempts: int = 3
    initial_backoff_s: float = 0.05
    max_backoff_s: float = 1.0
    multiplier: float = 2.0

    def __post_init__(self) -> None:
        if self.max_attempts < 1:
            raise ValueError(f"max_attempts must be >= 1, got {self.max_attempts}")
        if self.initial_backoff_s < 0 or self.max_backoff_s < 0:
            raise ValueError("back-off times must be >= 0")
        if self.multiplier < 1:
            raise ValueError(f"multiplier must be >= 1, got {self.multiplier}")

    def backoff_s(self, attempt: int) -> float:
        base = min(self.max_backoff_s, self.initial_backoff_s * self.multiplier ** (attempt - 1))
        return base * random.uniform(0.8, 1.2)


@dataclass(frozen=True)
class FetchedHandshake(Generic[M]):
    """A verified handshake: same engine id, generation and compatible compat on every payload."""

    address: str
    engine_id: str
    generation: int
    compat: CompatibilityInfo
    metadata: dict[PpTpRank, M] = field(default_factory=dict)


class _Peer:
    """One channel to one address, bound to the event loop that first used it."""

    def __init__(
        self,
        address: str,
        *,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        retry: RetryPolicy | None = None,
        options: Sequence[tuple[str, Any]] = (),
        tls: TLSFiles | None = None,
    ) -> None:
        if not address:
            raise ValueError("address must not be empty")
        if timeout_s <= 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
        self.address = address
        self.timeout_s = timeout_s
        self.retry = retry or RetryPolicy()
        # gRPC's own reconnect back-off starts at 1 s: a retry sooner than that would fail fast
        # on the broken channel without trying to reconnect. Pace it like our retries.
        reconnect = [
            (
                "grpc.initial_reconnect_backoff_ms",
                max(1, round(self.retry.initial_backoff_s * 1e3)),
            ),
            ("grpc.max_reconnect_backoff_ms", max(1, round(self.retry.max_backoff_s * 1e3))),
        ]
        self.tls = tls
        self._options = (*reconnect, *channel_options(tls), *options)
        self._metadata: tuple[tuple[str, str], ...] = ()
        self._channel: grpc.aio.Channel | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._closed = False

    @property
    def closed(self) -> bool:
        return self._closed

    def _get_channel(self) -> grpc.aio.Channel:
        loop = asyncio.get_running_loop()
        if self._closed:
            raise RuntimeError(f"{type(self).__name__} for {self.address} is closed")
        if self._channel is None:
            self._channel = _open_channel(self.address, self.tls, self._options)
            self._loop = loop
            self._on_channel(self._channel)
        elif self._loop is not loop:
            raise RuntimeError(
                f"{type(self).__name__} for {self.address} belongs to another event loop; "
                "use get_handshake_client() (one client per loop and address)"
            )
        return self._channel

    def _on_channel(self, channel: grpc.aio.Channel) -> None:
        """Build stubs for a new channel."""

    async def close(self) -> None:
        self._closed = True
        if self._channel is not None:
            channel, self._channel = self._channel, None
            await channel.close()

    async def _call(
        self,
        method: str,
        rpc: Callable[..., Awaitable[Any]],
        request: Any,
        timeout_s: float | None = None,
    ) -> Any:
        timeout = self.timeout_s if timeout_s is None else timeout_s
        attempts = self.retry.max_attempts
        for attempt in range(1, attempts + 1):
            try:
                if self._metadata:
                    return await rpc(request, timeout=timeout, metadata=self._metadata)
                return await rpc(request, timeout=timeout)
            except grpc.aio.AioRpcError as exc:
                if exc.code() not in _RETRYABLE:
                    raise self._translate(method, exc) from exc
                if attempt == attempts:
                    raise PeerUnavailableError(
                        address=self.address,
                        method=method,
                        attempts=attempts,
                        cause=exc,
                        hint=_tls_hint(self.tls, exc),
                    ) from exc
                await asyncio.sleep(self.retry.backoff_s(attempt))
        raise AssertionError("unreachable")  # the loop always returns or raises

    def _translate(self, method: str, exc: grpc.aio.AioRpcError) -> ControlPlaneError:
        code = exc.code()
        message = f"{method} to {self.address}: {code.name}: {exc.details()}"
        if code == grpc.StatusCode.NOT_FOUND:
            return HandshakeNotFoundError(message, address=self.address, cause=exc)
        if code == grpc.StatusCode.INVALID_ARGUMENT:
            return InvalidArgumentError(message, address=self.address, code=code, cause=exc)
        if code == grpc.StatusCode.UNAUTHENTICATED:
            return AdminAuthError(message, address=self.address, code=code, cause=exc)
        return RemoteCallError(message, address=self.address, code=code, cause=exc)


class HandshakeClient(_Peer):
    """Fetches and verifies handshake payloads from one engine; reuse it (the channel stays)."""

    _stub: handshake_pb2_grpc.KVHandshakeStub

    def _on_channel(self, channel: grpc.aio.Channel) -> None:
        self._stub = handshake_pb2_grpc.KVHandshakeStub(channel)

    async def fetch(
        self,
        expected_engine_id: str | None,
        local_compat: CompatibilityInfo,
        metadata_cls: type[M],
        ranks: Sequence[PpTpRank] | None = None,
        *,
        timeout_s: float | None = None,
    ) -> FetchedHandshake[M]:
        """Fetch the payloads of ``ranks`` (every worker when ``None``) and verify them.

        Raises `EngineIdMismatchError` when ``expected_engine_id`` is set and another engine
        answers, `HandshakeCompatibilityError` when its compat hash differs from
        ``local_compat``'s (checked before any metadata is decoded), `HandshakeNotFoundError`,
        `PeerUnavailableError` after the retries, `HandshakePayloadError` for a malformed reply.
        """
        requested = _check_ranks(ranks)
        local_hash = local_compat.compat_hash()
        request = handshake_pb2.GetHandshakeRequest(
            expected_engine_id=expected_engine_id or "",
            client_compat_hash=local_hash,
            all_ranks=requested is None,
            ranks=[handshake_pb2.WorkerRank(pp_rank=p, tp_rank=t) for p, t in requested or ()],
        )
        self._get_channel()
        try:
            response = await self._call("GetHandshake", self._stub.GetHandshake, request, timeout_s)
        except RemoteCallError as exc:
            mismatch = self._engine_id_mismatch(expected_engine_id, exc)
            if mismatch is None:
                raise
            raise mismatch from exc.cause
        return self._verify(
            response, expected_engine_id, local_compat, local_hash, metadata_cls, requested
        )

    def _engine_id_mismatch(
        self, expected: str | None, exc: RemoteCallError
    ) -> EngineIdMismatchError | None:
        if exc.code != grpc.StatusCode.FAILED_PRECONDITION or not expected:
            return None
        cause = exc.cause
        trailing = cause.trailing_metadata() if isinstance(cause, grpc.aio.AioRpcError) else None
        actual = dict(trailing or ()).get(ENGINE_ID_METADATA_KEY)
        if actual is None:
            return None
        return EngineIdMismatchError(
            expected=expected, actual=str(actual), address=self.address, cause=cause
        )

    def _verify(
        self,
        response: handshake_pb2.GetHandshakeResponse,
        expected_engine_id: str | None,
        local_compat: CompatibilityInfo,
        local_hash: str,
        metadata_cls: type[M],
        requested: list[PpTpRank] | None,
    ) -> FetchedHandshake[M]:
        if response.api_version != API_VERSION:
            raise self._payload_error(
                f"api_version {response.api_version}, this client speaks {API_VERSION}"
            )
        if not response.payloads:
            raise self._payload_error("no payloads in the reply")
        first = response.payloads[0]
        for payload in response.payloads:
            if expected_engine_id and payload.engine_id != expected_engine_id:
                raise EngineIdMismatchError(
                    expected=expected_engine_id, actual=payload.engine_id, address=self.address
                )
            if (payload.engine_id, payload.generation) != (first.engine_id, first.generation):
                raise self._payload_error("payloads disagree on engine id or generation")
            if payload.compat_hash != local_hash:
                raise HandshakeCompatibilityError(
                    self._differences(local_compat, local_hash, payload),
                    address=self.address,
                    remote_engine_id=payload.engine_id,
                )
        remote_compat = self._remote_compat(first)
        if remote_compat.compat_hash() != local_hash:
            raise self._payload_error("compat fields do not match the compat hash they carry")
        ranks = [(p.pp_rank, p.tp_rank) for p in response.payloads]
        duplicated = len(set(ranks)) != len(ranks)
        if duplicated or (requested is not None and set(ranks) != set(requested)):
            raise self._payload_error(f"asked for ranks {requested or 'all'}, got {ranks}")
        metadata: dict[PpTpRank, M] = {}
        for rank, payload in zip(ranks, response.payloads, strict=True):
            try:
                metadata[rank] = metadata_cls.decode(payload.metadata)  # type: ignore[assignment]
            except ValueError as exc:
                raise self._payload_error(f"metadata of (pp, tp)={rank}: {exc}") from exc
        return FetchedHandshake(
            address=self.address,
            engine_id=first.engine_id,
            generation=first.generation,
            compat=remote_compat,
            metadata=metadata,
        )

    def _differences(
        self,
        local_compat: CompatibilityInfo,
        local_hash: str,
        payload: handshake_pb2.HandshakePayload,
    ) -> list[FieldDifference]:
        differences = local_compat.differences(self._remote_compat(payload))
        # Same fields but another hash: the peer hashes differently, still not safe to use.
        return differences or [FieldDifference("compat_hash", local_hash, payload.compat_hash)]

    def _remote_compat(self, payload: handshake_pb2.HandshakePayload) -> CompatibilityInfo:
        try:
            return CompatibilityInfo.from_proto(payload.compat)
        except ValueError as exc:
            raise self._payload_error(str(exc)) from exc

    def _payload_error(self, problem: str) -> HandshakePayloadError:
        return HandshakePayloadError(
            f"unusable GetHandshake reply from {self.address}: {problem}", address=self.address
        )


class AdminClient(_Peer):
    """One method per `KVAdmin` RPC. ``token`` is sent with every call (servers started with
    an ``admin_token`` refuse calls without it: `AdminAuthError`)."""

    _stub: admin_pb2_grpc.KVAdminStub

    def __init__(
        self,
        address: str,
        *,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        retry: RetryPolicy | None = None,
        options: Sequence[tuple[str, Any]] = (),
        tls: TLSFiles | None = None,
        token: str | None = None,
    ) -> None:
        super().__init__(address, timeout_s=timeout_s, retry=retry, options=options, tls=tls)
        self._metadata = admin_token_metadata(token)

    def _on_channel(self, channel: grpc.aio.Channel) -> None:
        self._stub = admin_pb2_grpc.KVAdminStub(channel)

    async def _admin_call(self, method: str, request: Any) -> Any:
        self._get_channel()
        response = await self._call(method, getattr(self._stub, method), request)
        if response.api_version != API_VERSION:
            raise HandshakePayloadError(
                f"{method} to {self.address}: api_version {response.api_version}, this client "
                f"speaks {API_VERSION}",
                address=self.address,
            )
        return response

    async def status(self) -> EngineStatus:
        response = await self._admin_call("GetStatus", admin_pb2.GetStatusRequest())
        return status_from_proto(response)

    async def peers(self) -> list[PeerInfo]:
        response = await self._admin_call("ListPeers", admin_pb2.ListPeersRequest())
        return [peer_from_proto(p) for p in response.peers]

    async def transfers(self) -> list[TransferInfo]:
        response = await self._admin_call("ListTransfers", admin_pb2.ListTransfersRequest())
        return [transfer_from_proto(t) for t in response.transfers]

    async def abort(self, request_id: str) -> bool:
        """``True`` when the engine knew the request (and aborted it)."""
        request = admin_pb2.AbortRequestRequest(request_id=request_id)
        return (await self._admin_call("AbortRequest", request)).found

    async def drain(self) -> int:
        """Returns how many transfers were still in flight."""
        return (await self._admin_call("Drain", admin_pb2.DrainRequest())).num_in_flight_transfers

    async def set_log_level(self, level: str, logger: str = "") -> str:
        """Returns the previous level name; an unknown level raises `InvalidArgumentError`."""
        request = admin_pb2.SetLogLevelRequest(level=level, logger=logger)
        return (await self._admin_call("SetLogLevel", request)).previous_level


class ClientCache:
    """One `HandshakeClient` per (running event loop, address, tls), so channels are reused
    but a TLS and a plaintext client of the same address never share one."""

    def __init__(
        self, *, timeout_s: float = DEFAULT_TIMEOUT_S, retry: RetryPolicy | None = None
    ) -> None:
        self._timeout_s = timeout_s
        self._retry = retry
        self._lock = threading.Lock()  # engines may fetch from several threads, each its loop
        self._clients: weakref.WeakKeyDictionary[
            asyncio.AbstractEventLoop, dict[tuple[str, TLSFiles | None], HandshakeClient]
        ] = weakref.WeakKeyDictionary()

    def get(self, address: str, *, tls: TLSFiles | None = None) -> HandshakeClient:
        loop = asyncio.get_running_loop()
        key = (address, tls)
        with self._lock:
            per_loop = self._clients.setdefault(loop, {})
            client = per_loop.get(key)
            if client is None or client.closed:
                client = HandshakeClient(
                    address, timeout_s=self._timeout_s, retry=self._retry, tls=tls
                )
                per_loop[key] = client
            return client

    async def close_all(self) -> None:
        """Close the running loop's clients. Another loop's clients can only be closed on that
        loop; they are dropped with it."""
        loop = asyncio.get_running_loop()
        with self._lock:
            clients = list(self._clients.pop(loop, {}).values())
        await asyncio.gather(*(client.close() for client in clients))


_default_cache = ClientCache()


def get_handshake_client(address: str, *, tls: TLSFiles | None = None) -> HandshakeClient:
    """The shared client for ``address`` (over ``tls`` when given) on the running loop,
    created on first use."""
    return _default_cache.get(address, tls=tls)


async def close_all() -> None:
    """Close the shared clients of the running loop."""
    await _default_cache.close_all()


def fetch_handshake_sync(
    address: str,
    expected_engine_id: str | None,
    local_compat: CompatibilityInfo,
    metadata_cls: type[M],
    ranks: Sequence[PpTpRank] | None = None,
    *,
    timeout_s: float = DEFAULT_TIMEOUT_S,
    retry: RetryPolicy | None = None,
    tls: TLSFiles | None = None,
) -> FetchedHandshake[M]:
    """`HandshakeClient.fetch` for code without an event loop (e.g. an engine thread).

    Opens and closes its own channel: cheap enough for start-up handshakes; hot paths should
    keep an asyncio loop and use `get_handshake_client`.
    """
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        pass
    else:
        raise RuntimeError("fetch_handshake_sync called from a running event loop; await fetch")

    async def fetch() -> FetchedHandshake[M]:
        client = HandshakeClient(address, timeout_s=timeout_s, retry=retry, tls=tls)
        try:
            return await client.fetch(expected_engine_id, local_compat, metadata_cls, ranks)
        finally:
            await client.close()

    return asyncio.run(fetch())


def _tls_hint(tls: TLSFiles | None, exc: grpc.aio.AioRpcError) -> str | None:
    # A TLS server drops a plaintext client (or a client without the certificate an mTLS
    # server requires) with nothing but "Socket closed"; say what that usually means.
    details = exc.details() or ""
    if tls is not None and "WRONG_VERSION_NUMBER" in details:
        return "the server may not speak TLS: connect without it"
    if "Socket closed" not in details:
        return None
    if tls is None:
        return "if the server uses TLS, connect with TLS too"
    if tls.cert_file is None:
        return "if the server is mTLS, present a client certificate and key"
    return None


def _open_channel(
    address: str, tls: TLSFiles | None, options: Sequence[tuple[str, Any]] = ()
) -> grpc.aio.Channel:
    if tls is None:
        return grpc.aio.insecure_channel(address, options=list(options))
    return grpc.aio.secure_channel(address, channel_credentials(tls), options=list(options))


async def check_health(
    address: str, service: str = "", *, timeout_s: float = 1.0, tls: TLSFiles | None = None
) -> str:
    """The ``grpc.health.v1`` status name of ``service`` at ``address`` (e.g. "SERVING")."""
    async with _open_channel(address, tls, channel_options(tls)) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        try:
            response = await stub.Check(
                health_pb2.HealthCheckRequest(service=service), timeout=timeout_s
            )
        except grpc.aio.AioRpcError as exc:
            if exc.code() == grpc.StatusCode.NOT_FOUND:
                return "SERVICE_UNKNOWN"  # the health protocol's answer for an unknown service
            if exc.code() in _RETRYABLE:
                raise PeerUnavailableError(
                    address=address,
                    method="Health.Check",
                    attempts=1,
                    cause=exc,
                    hint=_tls_hint(tls, exc),
                ) from exc
            raise RemoteCallError(
                f"Health.Check to {address}: {exc.code().name}: {exc.details()}",
                address=address,
                code=exc.code(),
                cause=exc,
            ) from exc
    return health_pb2.HealthCheckResponse.ServingStatus.Name(response.status)


async def wait_until_serving(
    address: str,
    service: str = "",
    *,
    timeout_s: float = 10.0,
    poll_interval_s: float = 0.05,
    tls: TLSFiles | None = None,
) -> None:
    """Poll the health service until ``service`` is SERVING; `PeerUnavailableError` after
    ``timeout_s``."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    attempts = 0
    last_cause: BaseException | None = None
    while True:
        attempts += 1
        try:
            remaining = max(deadline - loop.time(), 0.01)
            status = await check_health(address, service, timeout_s=min(1.0, remaining), tls=tls)
        except PeerUnavailableError as exc:
            last_cause = exc.cause
        else:
            if status == "SERVING":
                return
            last_cause = RuntimeError(f"health status {status}")
        if loop.time() >= deadline:
            raise PeerUnavailableError(
                address=address, method="Health.Check", attempts=attempts, cause=last_cause
            )
        await asyncio.sleep(poll_interval_s)


def _check_ranks(ranks: Sequence[PpTpRank] | None) -> list[PpTpRank] | None:
    if ranks is None:
        return None
    for rank in ranks:
        check_rank_key(rank)
    if not ranks:
        raise ValueError("ranks must not be empty; pass None for every worker")
    return sorted(set(ranks))
