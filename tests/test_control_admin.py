"""KVAdmin and the server helpers, served in-process (ControlServerThread and plain asyncio)."""

from __future__ import annotations

import asyncio
import logging

import grpc
import pytest
from control_helpers.fake_engine import FakeWorkerMetadata, make_compat, start_engine

from kvtransfer.clients.control import AdminClient, HandshakeClient
from kvtransfer.control import (
    BasicAdminBackend,
    ControlServerThread,
    HandshakeBook,
    HandshakeState,
    InvalidArgumentError,
    PeerInfo,
    RemoteCallError,
    TransferDirection,
    start_control_server,
)
from kvtransfer.v1 import admin_pb2, admin_pb2_grpc

pytestmark = pytest.mark.integration


@pytest.fixture
def backend():
    backend = BasicAdminBackend(
        role="kv_consumer", engine_id="decode-1", model="m", tp_size=2, pp_size=1, num_blocks=100
    )
    backend.set_num_used_blocks(30)
    backend.count("handshakes", 3)
    backend.record_peer(PeerInfo("prefill-A", "127.0.0.1:9", HandshakeState.READY, 42, 1.5))
    backend.start_transfer("req-1", "prefill-A", TransferDirection.RECV, 4, 4096)
    return backend


@pytest.fixture
def server(backend):
    with ControlServerThread(admin=backend) as server:
        yield server


@pytest.fixture
def kvtransfer_logger():
    logger = logging.getLogger("kvtransfer")
    level = logger.level
    yield logger
    logger.setLevel(level)


def admin_call(address, method, *args):
    async def run():
        client = AdminClient(address, timeout_s=2.0)
        try:
            return await getattr(client, method)(*args)
        finally:
            await client.close()

    return asyncio.run(run())


def test_status(server):
    status = admin_call(server.address, "status")
    assert (status.role, status.engine_id, status.model) == ("kv_consumer", "decode-1", "m")
    assert (status.tp_size, status.pp_size) == (2, 1)
    assert (status.num_free_blocks, status.num_used_blocks) == (70, 30)
    assert status.uptime_s > 0
    assert dict(status.counters) == {"handshakes": 3}


def test_peers_and_transfers(server):
    [peer] = admin_call(server.address, "peers")
    assert peer == PeerInfo("prefill-A", "127.0.0.1:9", HandshakeState.READY, 42, 1.5)
    [transfer] = admin_call(server.address, "transfers")
    assert (transfer.request_id, transfer.peer_engine_id) == ("req-1", "prefill-A")
    assert transfer.direction is TransferDirection.RECV
    assert (transfer.num_blocks, transfer.num_bytes) == (4, 4096)
    assert transfer.age_s >= 0


def test_abort_known_and_unknown_request(server, backend):
    assert admin_call(server.address, "abort", "no-such-request") is False
    assert admin_call(server.address, "abort", "req-1") is True
    assert backend.transfers() == []
    assert backend.status().counters["aborted_requests"] == 1


def test_abort_with_empty_id_is_invalid(server):
    with pytest.raises(InvalidArgumentError, match="request_id"):
        admin_call(server.address, "abort", "")


def test_drain(server, backend):
    assert admin_call(server.address, "drain") == 1
    assert backend.draining
    with pytest.raises(RuntimeError, match="draining"):
        backend.start_transfer("req-2", "prefill-A", TransferDirection.RECV, 1, 1)


def test_set_log_level_returns_the_previous_level(server, kvtransfer_logger):
    kvtransfer_logger.setLevel(logging.WARNING)
    assert admin_call(server.address, "set_log_level", "debug") == "WARNING"
    assert kvtransfer_logger.level == logging.DEBUG
    assert admin_call(server.address, "set_log_level", "INFO") == "DEBUG"
    assert kvtransfer_logger.level == logging.INFO


def test_set_log_level_of_a_named_logger(server):
    target = logging.getLogger("kvtransfer.test_control_admin")
    try:
        assert admin_call(server.address, "set_log_level", "ERROR", target.name) == "NOTSET"
        assert target.level == logging.ERROR
    finally:
        target.setLevel(logging.NOTSET)


def test_invalid_log_level_is_invalid_argument_naming_the_level(server, kvtransfer_logger):
    kvtransfer_logger.setLevel(logging.WARNING)
    with pytest.raises(InvalidArgumentError, match="'LOUDEST'") as info:
        admin_call(server.address, "set_log_level", "LOUDEST")
    assert info.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert server.address in str(info.value)
    assert isinstance(info.value, ValueError)
    assert kvtransfer_logger.level == logging.WARNING
    # The raw status, as any gRPC client (grpcurl, another language) sees it.
    with grpc.insecure_channel(server.address) as channel, pytest.raises(grpc.RpcError) as raw:
        admin_pb2_grpc.KVAdminStub(channel).SetLogLevel(
            admin_pb2.SetLogLevelRequest(level="LOUDEST"), timeout=2
        )
    assert raw.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "LOUDEST" in raw.value.details()


def test_admin_only_server_does_not_serve_handshakes(server):
    async def run():
        client = HandshakeClient(server.address, timeout_s=2.0)
        try:
            await client.fetch(None, make_compat(), FakeWorkerMetadata)
        finally:
            await client.close()

    with pytest.raises(RemoteCallError) as info:
        asyncio.run(run())
    assert info.value.code == grpc.StatusCode.UNIMPLEMENTED


def test_asyncio_server_serves_handshakes_and_stops():
    book = HandshakeBook("prefill-aio", make_compat())
    start_engine(book, pp_size=1, tp_size=2)

    async def run():
        server = await start_control_server(book=book)
        assert server.port > 0 and server.address == f"127.0.0.1:{server.port}"
        client = HandshakeClient(server.address, timeout_s=2.0)
        try:
            fetched = await client.fetch("prefill-aio", make_compat(), FakeWorkerMetadata)
        finally:
            await client.close()
            await server.stop(grace=0)
        return fetched

    fetched = asyncio.run(run())
    assert sorted(fetched.metadata) == [(0, 0), (0, 1)]
    assert fetched.generation == book.generation


def test_server_needs_something_to_serve():
    with pytest.raises(ValueError, match="HandshakeBook"):
        asyncio.run(start_control_server())


def test_server_thread_stop_is_idempotent_and_bind_errors_surface(backend):
    server = ControlServerThread(admin=backend)
    server.stop()  # never started: no-op
    address = server.start()
    port = int(address.rsplit(":", 1)[1])
    with pytest.raises(OSError, match=str(port)):
        ControlServerThread(port=port, admin=backend).start()
    server.stop()
    server.stop()
