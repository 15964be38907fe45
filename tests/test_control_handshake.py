"""KVHandshake across two processes: the prefill server runs in a subprocess, clients here."""

from __future__ import annotations

import asyncio
import socket
import threading

import grpc
import pytest
from control_helpers.fake_engine import (
    FakeWorkerMetadata,
    make_compat,
    start_engine,
    worker_metadata,
)
from control_helpers.procs import prefill_server
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import (
    ProtoReflectionDescriptorDatabase,
)

from kvtransfer.clients.control import (
    ClientCache,
    HandshakeClient,
    RetryPolicy,
    check_health,
    close_all,
    fetch_handshake_sync,
    get_handshake_client,
)
from kvtransfer.connector.metadata import KVConnectorHandshakeMetadata
from kvtransfer.control import (
    API_VERSION,
    EngineIdMismatchError,
    HandshakeBook,
    HandshakeCompatibilityError,
    HandshakeNotFoundError,
    HandshakePayloadError,
    PeerUnavailableError,
    start_control_server,
)
from kvtransfer.control.server import ENGINE_ID_METADATA_KEY
from kvtransfer.v1 import handshake_pb2, handshake_pb2_grpc

pytestmark = pytest.mark.integration

ENGINE_ID = "prefill-A"
FAST_RETRY = RetryPolicy(max_attempts=3, initial_backoff_s=0.01, max_backoff_s=0.05)


@pytest.fixture(scope="module")
def prefill():
    with prefill_server("--engine-id", ENGINE_ID, "--pp", "2", "--tp", "2") as server:
        yield server


def fetch(address, *, expected=ENGINE_ID, compat=None, metadata_cls=FakeWorkerMetadata, **kw):
    async def run():
        client = HandshakeClient(address, timeout_s=2.0, retry=FAST_RETRY)
        try:
            return await client.fetch(expected, compat or make_compat(), metadata_cls, **kw)
        finally:
            await client.close()

    return asyncio.run(run())


def test_fetch_all_ranks_returns_what_the_remote_connector_received(prefill):
    fetched = fetch(prefill.address)
    received = {
        tuple(int(r) for r in key.split(",")): FakeWorkerMetadata.decode(value.encode())
        for key, value in prefill.received.items()
    }
    expected = {
        (pp, tp): worker_metadata(ENGINE_ID, pp, tp, 2, 2) for pp in (0, 1) for tp in (0, 1)
    }
    assert received == expected
    assert fetched.metadata == received
    assert all(type(md) is FakeWorkerMetadata for md in fetched.metadata.values())
    assert (fetched.engine_id, fetched.generation) == (ENGINE_ID, prefill.generation)
    assert fetched.compat == make_compat()
    assert fetched.address == prefill.address


def test_fetch_one_rank(prefill):
    fetched = fetch(prefill.address, ranks=[(1, 0)])
    assert fetched.metadata == {(1, 0): worker_metadata(ENGINE_ID, 1, 0, 2, 2)}


def test_no_expected_engine_id_accepts_any_engine(prefill):
    assert fetch(prefill.address, expected=None, ranks=[(0, 1)]).engine_id == ENGINE_ID


@pytest.mark.parametrize(
    "field, local, remote",
    [("block_size", 32, 16), ("model", "other/model", "test/tiny-model")],
)
def test_compat_mismatch_names_the_field_and_both_values(prefill, field, local, remote):
    with pytest.raises(HandshakeCompatibilityError) as info:
        fetch(prefill.address, compat=make_compat(**{field: local}))
    text = str(info.value)
    assert f"{field}: local={local!r} remote={remote!r}" in text
    assert prefill.address in text and ENGINE_ID in text
    assert [d.name for d in info.value.differences] == [field]


def test_several_mismatches_are_all_named(prefill):
    with pytest.raises(HandshakeCompatibilityError) as info:
        fetch(prefill.address, compat=make_compat(dtype="bfloat16", head_size=64))
    assert "dtype: local='bfloat16' remote='float16'" in str(info.value)
    assert "head_size: local=64 remote=32" in str(info.value)


class StricterMetadata(KVConnectorHandshakeMetadata):
    """Cannot decode the fake engine's payloads (a field they lack)."""

    rdma_key: str


def test_compat_is_checked_before_metadata_is_decoded(prefill):
    with pytest.raises(HandshakeCompatibilityError):
        fetch(prefill.address, compat=make_compat(block_size=32), metadata_cls=StricterMetadata)
    with pytest.raises(HandshakePayloadError, match="rdma_key"):
        fetch(prefill.address, metadata_cls=StricterMetadata)


def test_engine_id_mismatch(prefill):
    with pytest.raises(EngineIdMismatchError) as info:
        fetch(prefill.address, expected="prefill-B")
    assert (info.value.expected, info.value.actual) == ("prefill-B", ENGINE_ID)
    assert "'prefill-B'" in str(info.value) and f"'{ENGINE_ID}'" in str(info.value)
    assert prefill.address in str(info.value)
    assert isinstance(info.value, ValueError)


def test_unknown_rank_is_not_found(prefill):
    with pytest.raises(HandshakeNotFoundError, match=r"\(0, 5\)") as info:
        fetch(prefill.address, ranks=[(0, 0), (0, 5)])
    assert prefill.address in str(info.value)


def test_engine_that_has_not_published_is_not_found():
    with (
        prefill_server("--engine-id", "prefill-empty", "--no-publish") as server,
        pytest.raises(HandshakeNotFoundError, match="not published"),
    ):
        fetch(server.address, expected="prefill-empty")


def test_bad_rank_arguments_raise_before_any_call(prefill):
    with pytest.raises(ValueError, match="must not be empty"):
        fetch(prefill.address, ranks=[])
    with pytest.raises(ValueError, match="pairs"):
        fetch(prefill.address, ranks=[(0, -1)])


def _free_port() -> int:
    # Bind to 0 so the OS picks a port nobody uses, then free it: nothing listens there.
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_dead_address_fails_after_bounded_retries():
    address = f"127.0.0.1:{_free_port()}"
    calls = 0

    async def run():
        nonlocal calls
        client = HandshakeClient(address, timeout_s=0.5, retry=FAST_RETRY)
        client._get_channel()
        real = client._stub.GetHandshake

        async def counting(request, timeout):
            nonlocal calls
            calls += 1
            return await real(request, timeout=timeout)

        client._stub.GetHandshake = counting
        try:
            return await client.fetch(ENGINE_ID, make_compat(), FakeWorkerMetadata)
        finally:
            await client.close()

    with pytest.raises(PeerUnavailableError) as info:
        asyncio.run(asyncio.wait_for(run(), timeout=10))
    assert calls == 3 == info.value.attempts
    assert address in str(info.value) and "GetHandshake" in str(info.value)
    assert "UNAVAILABLE" in str(info.value) or "DEADLINE_EXCEEDED" in str(info.value)
    assert isinstance(info.value, ConnectionError)


def test_sync_fetch_from_a_plain_thread(prefill):
    results = []

    def worker():
        results.append(
            fetch_handshake_sync(
                prefill.address, ENGINE_ID, make_compat(), FakeWorkerMetadata, ranks=[(0, 0)]
            )
        )

    thread = threading.Thread(target=worker)
    thread.start()
    thread.join(timeout=10)
    assert results[0].metadata == {(0, 0): worker_metadata(ENGINE_ID, 0, 0, 2, 2)}


def test_client_cache_reuses_one_client_per_loop_and_address(prefill):
    async def in_loop():
        first = get_handshake_client(prefill.address)
        assert get_handshake_client(prefill.address) is first
        assert get_handshake_client("127.0.0.1:1") is not first
        await first.fetch(ENGINE_ID, make_compat(), FakeWorkerMetadata)
        channel = first._channel
        await first.fetch(ENGINE_ID, make_compat(), FakeWorkerMetadata)
        assert first._channel is channel
        await close_all()
        assert first.closed
        replacement = get_handshake_client(prefill.address)
        assert replacement is not first
        await close_all()
        return first

    assert asyncio.run(in_loop()) is not asyncio.run(in_loop())


def test_client_cache_instances_are_independent(prefill):
    async def run():
        one, two = ClientCache(), ClientCache()
        assert one.get(prefill.address) is not two.get(prefill.address)
        await one.close_all()
        await two.close_all()

    asyncio.run(run())


def test_health_is_serving_for_the_server_and_its_services(prefill):
    async def run():
        return [
            await check_health(prefill.address),
            await check_health(prefill.address, "kvtransfer.v1.KVHandshake"),
            await check_health(prefill.address, "kvtransfer.v1.KVAdmin"),
            await check_health(prefill.address, "no.such.Service"),
        ]

    assert asyncio.run(run()) == ["SERVING", "SERVING", "SERVING", "SERVICE_UNKNOWN"]
    with grpc.insecure_channel(prefill.address) as channel:
        response = health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(service=""), timeout=2
        )
    assert response.status == health_pb2.HealthCheckResponse.SERVING


def test_reflection_lists_and_describes_the_services(prefill):
    with grpc.insecure_channel(prefill.address) as channel:
        database = ProtoReflectionDescriptorDatabase(channel)
        services = set(database.get_services())
        file = database.FindFileContainingSymbol("kvtransfer.v1.KVHandshake")
    assert {
        "kvtransfer.v1.KVHandshake",
        "kvtransfer.v1.KVAdmin",
        "grpc.health.v1.Health",
        "grpc.reflection.v1alpha.ServerReflection",
    } <= services
    assert file.name == "kvtransfer/v1/handshake.proto"
    assert file.package == "kvtransfer.v1"


def test_raw_server_statuses(prefill):
    """What any gRPC client sees, independent of HandshakeClient's own checks."""
    with grpc.insecure_channel(prefill.address) as channel:
        stub = handshake_pb2_grpc.KVHandshakeStub(channel)
        with pytest.raises(grpc.RpcError) as wrong_engine:
            stub.GetHandshake(
                handshake_pb2.GetHandshakeRequest(expected_engine_id="prefill-B", all_ranks=True),
                timeout=2,
            )
        for ambiguous in (
            handshake_pb2.GetHandshakeRequest(),
            handshake_pb2.GetHandshakeRequest(all_ranks=True, ranks=[handshake_pb2.WorkerRank()]),
        ):
            with pytest.raises(grpc.RpcError) as invalid:
                stub.GetHandshake(ambiguous, timeout=2)
            assert invalid.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        response = stub.GetHandshake(handshake_pb2.GetHandshakeRequest(all_ranks=True), timeout=2)
    assert wrong_engine.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert (ENGINE_ID_METADATA_KEY, ENGINE_ID) in tuple(wrong_engine.value.trailing_metadata())
    assert response.api_version == API_VERSION
    assert [(p.pp_rank, p.tp_rank) for p in response.payloads] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert all(p.compat_hash == make_compat().compat_hash() for p in response.payloads)


def test_a_client_belongs_to_the_loop_that_first_used_it(prefill):
    client = HandshakeClient(prefill.address, timeout_s=2.0)

    async def use():
        await client.fetch(ENGINE_ID, make_compat(), FakeWorkerMetadata, ranks=[(0, 0)])

    asyncio.run(use())
    with pytest.raises(RuntimeError, match="another event loop"):
        asyncio.run(use())


def test_a_retry_reaches_a_peer_that_came_up_after_the_first_attempt():
    address_port = _free_port()
    book = HandshakeBook("prefill-late", make_compat())
    start_engine(book, pp_size=1, tp_size=1)

    async def run():
        client = HandshakeClient(
            f"127.0.0.1:{address_port}",
            timeout_s=2.0,
            retry=RetryPolicy(max_attempts=3, initial_backoff_s=0.1, max_backoff_s=0.2),
        )
        client._get_channel()
        real = client._stub.GetHandshake
        servers = []

        async def start_server_after_first_failure(request, timeout):
            try:
                return await real(request, timeout=timeout)
            finally:
                if not servers:
                    servers.append(await start_control_server(port=address_port, book=book))

        client._stub.GetHandshake = start_server_after_first_failure
        try:
            return await client.fetch("prefill-late", make_compat(), FakeWorkerMetadata)
        finally:
            await client.close()
            for server in servers:
                await server.stop(grace=0)

    assert asyncio.run(run()).generation == book.generation
