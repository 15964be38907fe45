"""The control-plane gRPC server: `KVHandshake`, `KVAdmin`, health and reflection on one port.

`start_control_server` runs on the caller's asyncio loop. Engines are synchronous, so
`ControlServerThread` runs the same server on a private loop in a daemon thread.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
from collections.abc import Callable, Sequence
from typing import Any

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from kvtransfer.connector.serving import HandshakeSource
from kvtransfer.control.admin import (
    AdminBackend,
    peer_to_proto,
    status_to_proto,
    transfer_to_proto,
)
from kvtransfer.control.compat import API_VERSION
from kvtransfer.control.errors import HandshakeNotFoundError
from kvtransfer.control.security import AdminTokenInterceptor, TLSFiles, server_credentials
from kvtransfer.v1 import admin_pb2, admin_pb2_grpc, handshake_pb2, handshake_pb2_grpc

logger = logging.getLogger(__name__)

ENGINE_ID_METADATA_KEY = "kvtransfer-engine-id"
"""Trailing metadata of a FAILED_PRECONDITION GetHandshake: the id of the engine that answered."""

DEFAULT_LOG_LEVEL_LOGGER = "kvtransfer"

HANDSHAKE_SERVICE = handshake_pb2.DESCRIPTOR.services_by_name["KVHandshake"].full_name
ADMIN_SERVICE = admin_pb2.DESCRIPTOR.services_by_name["KVAdmin"].full_name


class _HandshakeServicer(handshake_pb2_grpc.KVHandshakeServicer):
    def __init__(self, book: HandshakeSource) -> None:
        self._book = book

    async def GetHandshake(
        self, request: handshake_pb2.GetHandshakeRequest, context: grpc.aio.ServicerContext
    ) -> handshake_pb2.GetHandshakeResponse:
        book = self._book
        if request.expected_engine_id and request.expected_engine_id != book.engine_id:
            await context.abort(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"this is engine {book.engine_id!r}, not {request.expected_engine_id!r}",
                trailing_metadata=((ENGINE_ID_METADATA_KEY, book.engine_id),),
            )
        if request.all_ranks == bool(request.ranks):
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                "set exactly one of all_ranks and ranks in GetHandshakeRequest",
            )
        if request.client_compat_hash and request.client_compat_hash != book.compat_hash:
            # The client rejects the payload itself (and explains why); this is just a trace.
            logger.debug(
                "GetHandshake from %s with compat hash %s (ours: %s)",
                context.peer(),
                request.client_compat_hash,
                book.compat_hash,
            )
        ranks = None if request.all_ranks else [(r.pp_rank, r.tp_rank) for r in request.ranks]
        try:
            payloads = book.payloads(ranks)
        except HandshakeNotFoundError as exc:
            await context.abort(grpc.StatusCode.NOT_FOUND, str(exc))
        return handshake_pb2.GetHandshakeResponse(api_version=API_VERSION, payloads=payloads)


class _AdminServicer(admin_pb2_grpc.KVAdminServicer):
    # Backend methods may take engine locks: run them off the loop so handshakes keep flowing.

    def __init__(self, backend: AdminBackend, log_level_logger: str) -> None:
        self._backend = backend
        self._log_level_logger = log_level_logger

    async def GetStatus(
        self, request: admin_pb2.GetStatusRequest, context: grpc.aio.ServicerContext
    ) -> admin_pb2.GetStatusResponse:
        status = await asyncio.to_thread(self._backend.status)
        return status_to_proto(status, API_VERSION)

    async def ListPeers(
        self, request: admin_pb2.ListPeersRequest, context: grpc.aio.ServicerContext
    ) -> admin_pb2.ListPeersResponse:
        peers = await asyncio.to_thread(self._backend.peers)
        return admin_pb2.ListPeersResponse(
            api_version=API_VERSION, peers=[peer_to_proto(p) for p in peers]
        )

    async def ListTransfers(
        self, request: admin_pb2.ListTransfersRequest, context: grpc.aio.ServicerContext
    ) -> admin_pb2.ListTransfersResponse:
        transfers = await asyncio.to_thread(self._backend.transfers)
        return admin_pb2.ListTransfersResponse(
            api_version=API_VERSION, transfers=[transfer_to_proto(t) for t in transfers]
        )

    async def AbortRequest(
        self, request: admin_pb2.AbortRequestRequest, context: grpc.aio.ServicerContext
    ) -> admin_pb2.AbortRequestResponse:
        if not request.request_id:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "request_id must not be empty")
        found = await asyncio.to_thread(self._backend.abort, request.request_id)
        return admin_pb2.AbortRequestResponse(api_version=API_VERSION, found=found)

    async def Drain(
        self, request: admin_pb2.DrainRequest, context: grpc.aio.ServicerContext
    ) -> admin_pb2.DrainResponse:
        in_flight = await asyncio.to_thread(self._backend.drain)
        return admin_pb2.DrainResponse(api_version=API_VERSION, num_in_flight_transfers=in_flight)

    async def SetLogLevel(
        self, request: admin_pb2.SetLogLevelRequest, context: grpc.aio.ServicerContext
    ) -> admin_pb2.SetLogLevelResponse:
        levels = logging.getLevelNamesMapping()
        name = request.level.strip().upper()
        if name not in levels:
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"unknown log level {request.level!r}; expected one of "
                "DEBUG, INFO, WARNING, ERROR, CRITICAL, NOTSET",
            )
        target = logging.getLogger(request.logger or self._log_level_logger)
        # The logger's own level, not the effective one: setting it back restores inheritance.
        previous = logging.getLevelName(target.level)
        target.setLevel(levels[name])
        logger.info("log level of %r set to %s (was %s)", target.name, name, previous)
        return admin_pb2.SetLogLevelResponse(api_version=API_VERSION, previous_level=previous)


def format_address(host: str, port: int) -> str:
    if ":" in host and not host.startswith("["):
        return f"[{host}]:{port}"
    return f"{host}:{port}"


class ControlServer:
    """A started server; ``address`` is what clients dial (the OS-chosen port when 0 was asked)."""

    def __init__(
        self,
        server: grpc.aio.Server,
        health_servicer: health.aio.HealthServicer,
        host: str,
        port: int,
        services: Sequence[str],
    ) -> None:
        self._server = server
        self._health = health_servicer
        self.host = host
        self.port = port
        self.services = tuple(services)

    @property
    def address(self) -> str:
        return format_address(self.host, self.port)

    async def set_serving(self, serving: bool) -> None:
        """Health of "" and every service: SERVING, or NOT_SERVING while draining."""
        status = (
            health_pb2.HealthCheckResponse.SERVING
            if serving
            else health_pb2.HealthCheckResponse.NOT_SERVING
        )
        for service in ("", *self.services):
            await self._health.set(service, status)

    async def stop(self, grace: float | None = 1.0) -> None:
        """Report NOT_SERVING, then let in-flight calls finish for up to ``grace`` seconds."""
        await self._health.enter_graceful_shutdown()
        await self._server.stop(grace)

    async def wait_for_termination(self) -> None:
        await self._server.wait_for_termination()


async def start_control_server(
    host: str = "127.0.0.1",
    port: int = 0,
    *,
    book: HandshakeSource | None = None,
    admin: AdminBackend | None = None,
    log_level_logger: str = DEFAULT_LOG_LEVEL_LOGGER,
    options: Sequence[tuple[str, Any]] = (),
    handlers: Sequence[grpc.GenericRpcHandler] = (),
    services: Sequence[tuple[str, Callable[[grpc.aio.Server], None]]] = (),
    tls: TLSFiles | None = None,
    admin_token: str | None = None,
) -> ControlServer:
    """Start serving on ``host:port`` (port 0: let the OS choose) on the running loop.

    Serves `KVHandshake` when given a ``book``, `KVAdmin` when given an ``admin`` backend, and
    always the standard health (SERVING for "" and each service) and reflection services.
    `SetLogLevel` changes ``log_level_logger`` unless the request names another logger.
    ``handlers`` adds services of their own (e.g. a connector's completion messages) on the
    same port; they are not listed in reflection. ``services`` are ``(full service name,
    register)`` pairs, e.g. a daemon's Generation servicer: listed in health and reflection.
    ``tls`` serves TLS only (mTLS when it has a ``ca_file``). ``admin_token`` makes every
    `KVAdmin` call carry ``authorization: Bearer <token>`` (UNAUTHENTICATED otherwise);
    handshakes, health, reflection, ``handlers`` and ``services`` stay open.
    """
    if book is None and admin is None and not services:
        raise ValueError("a control server needs a HandshakeBook, an AdminBackend or a service")
    if not 0 <= port < 65536:
        raise ValueError(f"port must be in [0, 65535], got {port}")
    # Built before the server so that bad TLS files or a bad token fail with nothing bound.
    credentials = server_credentials(tls) if tls is not None else None
    interceptors = (
        [AdminTokenInterceptor(ADMIN_SERVICE, admin_token)] if admin_token is not None else []
    )
    # gRPC enables SO_REUSEPORT by default: a second engine on the same port would silently
    # share it with the first (and answer half its handshakes). Fail to bind instead. The
    # router pings its channels every health interval to find connections a partition left
    # hanging; gRPC's default policy would answer such pings with GOAWAY ("too_many_pings").
    server = grpc.aio.server(
        options=[("grpc.so_reuseport", 0), ("grpc.http2.max_ping_strikes", 0), *options],
        interceptors=interceptors,
    )
    if handlers:
        server.add_generic_rpc_handlers(tuple(handlers))
    names: list[str] = []
    for name, register in services:
        register(server)
        names.append(name)
    if book is not None:
        handshake_pb2_grpc.add_KVHandshakeServicer_to_server(_HandshakeServicer(book), server)
        names.append(HANDSHAKE_SERVICE)
    if admin is not None:
        admin_pb2_grpc.add_KVAdminServicer_to_server(
            _AdminServicer(admin, log_level_logger), server
        )
        names.append(ADMIN_SERVICE)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection(
        [*names, health.SERVICE_NAME, reflection.SERVICE_NAME], server
    )
    try:
        address = format_address(host, port)
        if credentials is not None:
            bound_port = server.add_secure_port(address, credentials)
        else:
            bound_port = server.add_insecure_port(address)
    except RuntimeError as exc:
        raise OSError(f"cannot bind the control server to {format_address(host, port)}") from exc
    if bound_port == 0:
        raise OSError(f"cannot bind the control server to {format_address(host, port)}")
    await server.start()
    control = ControlServer(server, health_servicer, host, bound_port, names)
    await control.set_serving(True)
    logger.info(
        "control server on %s (%s%s) serving %s",
        control.address,
        "plaintext" if tls is None else "mTLS" if tls.ca_file is not None else "TLS",
        ", admin token required" if admin_token is not None else "",
        ", ".join(names),
    )
    return control


class ControlServerThread:
    """`start_control_server` for synchronous code: a private event loop in a daemon thread.

    ``start()`` blocks until the server is bound and returns its address; ``stop()`` shuts it
    down and joins the thread. Also a context manager. ``on_tick`` is called from the server's
    loop every ``tick_s`` while it serves: a caller learns when the loop could not run (see
    `kvtransfer.connectors.ucx.leases`).
    """

    def __init__(
        self,
        host: str = "127.0.0.1",
        port: int = 0,
        *,
        book: HandshakeSource | None = None,
        admin: AdminBackend | None = None,
        log_level_logger: str = DEFAULT_LOG_LEVEL_LOGGER,
        options: Sequence[tuple[str, Any]] = (),
        handlers: Sequence[grpc.GenericRpcHandler] = (),
        services: Sequence[tuple[str, Callable[[grpc.aio.Server], None]]] = (),
        tls: TLSFiles | None = None,
        admin_token: str | None = None,
        on_tick: Callable[[], None] | None = None,
        tick_s: float = 0.25,
    ) -> None:
        self._on_tick, self._tick_s = on_tick, tick_s
        self._kwargs: dict[str, Any] = dict(
            services=services,
            tls=tls,
            admin_token=admin_token,
            host=host,
            port=port,
            book=book,
            admin=admin,
            log_level_logger=log_level_logger,
            options=options,
            handlers=handlers,
        )
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._server: ControlServer | None = None

    @property
    def server(self) -> ControlServer:
        if self._server is None:
            raise RuntimeError("control server thread not started")
        return self._server

    @property
    def address(self) -> str:
        return self.server.address

    def start(self, timeout_s: float = 10.0) -> str:
        if self._thread is not None:
            raise RuntimeError("control server thread already started")
        ready: concurrent.futures.Future[ControlServer] = concurrent.futures.Future()
        self._thread = threading.Thread(
            target=self._run, args=(ready,), name="kvtransfer-control-server", daemon=True
        )
        self._thread.start()
        self._server = ready.result(timeout=timeout_s)
        return self._server.address

    def stop(self, grace: float | None = 1.0, timeout_s: float = 10.0) -> None:
        """Idempotent; a no-op when never started."""
        loop, thread, server = self._loop, self._thread, self._server
        if loop is None or thread is None or server is None or loop.is_closed():
            return
        asyncio.run_coroutine_threadsafe(server.stop(grace), loop).result(timeout=timeout_s)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(timeout=timeout_s)

    def __enter__(self) -> ControlServerThread:
        self.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    async def _tick_forever(self, on_tick: Callable[[], None]) -> None:
        while True:
            on_tick()
            await asyncio.sleep(self._tick_s)

    def _run(self, ready: concurrent.futures.Future[ControlServer]) -> None:
        loop = asyncio.new_event_loop()
        asyncio.set_event_loop(loop)
        self._loop = loop
        try:
            try:
                server = loop.run_until_complete(start_control_server(**self._kwargs))
            except BaseException as exc:
                ready.set_exception(exc)
                return
            ready.set_result(server)
            if self._on_tick is not None:
                ticking = loop.create_task(self._tick_forever(self._on_tick))
            loop.run_forever()
            if self._on_tick is not None:
                ticking.cancel()
        finally:
            loop.run_until_complete(loop.shutdown_default_executor())
            loop.close()
