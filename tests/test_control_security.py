"""TLS, mTLS and the admin token on real control servers (127.0.0.1, OS-chosen ports)."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterator
from typing import Any

import grpc
import pytest
from control_helpers.certs import Certs, make_certs
from control_helpers.fake_engine import FakeWorkerMetadata, make_compat, start_engine

from kvtransfer.clients.control import (
    AdminClient,
    ClientCache,
    HandshakeClient,
    RetryPolicy,
    check_health,
    fetch_handshake_sync,
    wait_until_serving,
)
from kvtransfer.control import (
    AdminAuthError,
    BasicAdminBackend,
    ControlServerThread,
    HandshakeBook,
    PeerUnavailableError,
    RemoteCallError,
    TLSFiles,
    start_control_server,
)
from kvtransfer.control.security import (
    ADMIN_TOKEN_METADATA_KEY,
    admin_token_metadata,
    channel_credentials,
    channel_options,
    server_credentials,
)
from kvtransfer.control.server import DEFAULT_LOG_LEVEL_LOGGER

pytestmark = pytest.mark.integration

ENGINE_ID = "prefill-tls"
TOKEN = "s3cret-token"
NO_RETRY = RetryPolicy(max_attempts=1)
# Bounds every failing call; what is asserted is the error type, never the time taken.
DEADLINE_S = 2.0
ECHO_METHOD = "/test.Echo/Ping"


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> Certs:
    return make_certs(tmp_path_factory.mktemp("certs"))


@pytest.fixture(scope="module")
def other_certs(tmp_path_factory: pytest.TempPathFactory) -> Certs:
    """Certificates from a second, unrelated CA."""
    return make_certs(tmp_path_factory.mktemp("other-certs"))


def make_backend() -> BasicAdminBackend:
    admin = BasicAdminBackend(role="kv_producer", engine_id=ENGINE_ID, model="m", num_blocks=8)
    admin.set_num_used_blocks(3)
    return admin


def make_book() -> HandshakeBook:
    book = HandshakeBook(ENGINE_ID, make_compat())
    start_engine(book, pp_size=1, tp_size=2)
    return book


def echo_handler() -> grpc.GenericRpcHandler:
    """Another service on the same port, like a daemon's Generation service."""

    async def ping(body: bytes, context: grpc.aio.ServicerContext) -> bytes:
        return b"pong:" + body

    return grpc.method_handlers_generic_handler(
        "test.Echo", {"Ping": grpc.unary_unary_rpc_method_handler(ping)}
    )


def serve(**kwargs: Any) -> ControlServerThread:
    return ControlServerThread(
        book=make_book(), admin=kwargs.pop("admin", None) or make_backend(), **kwargs
    )


def admin_call(address: str, method: str = "status", *args: Any, **client: Any) -> Any:
    async def call() -> Any:
        admin = AdminClient(address, retry=NO_RETRY, timeout_s=DEADLINE_S, **client)
        try:
            return await getattr(admin, method)(*args)
        finally:
            await admin.close()

    return asyncio.run(call())


def fetch(address: str, **client: Any) -> Any:
    async def call() -> Any:
        handshake = HandshakeClient(address, retry=NO_RETRY, timeout_s=DEADLINE_S, **client)
        try:
            return await handshake.fetch(ENGINE_ID, make_compat(), FakeWorkerMetadata)
        finally:
            await handshake.close()

    return asyncio.run(call())


def health(address: str, tls: TLSFiles | None = None) -> str:
    return asyncio.run(check_health(address, timeout_s=DEADLINE_S, tls=tls))


def echo(address: str, tls: TLSFiles | None = None) -> bytes:
    async def call() -> bytes:
        if tls is None:
            channel = grpc.aio.insecure_channel(address)
        else:
            channel = grpc.aio.secure_channel(
                address, channel_credentials(tls), options=channel_options(tls)
            )
        async with channel:
            return await channel.unary_unary(ECHO_METHOD)(b"hi", timeout=DEADLINE_S)

    return asyncio.run(call())


@pytest.fixture
def tls_server(certs: Certs) -> Iterator[ControlServerThread]:
    with serve(tls=TLSFiles(certs.server_cert, certs.server_key)) as server:
        yield server


@pytest.fixture
def mtls_server(certs: Certs) -> Iterator[ControlServerThread]:
    with serve(tls=TLSFiles(certs.server_cert, certs.server_key, certs.ca)) as server:
        yield server


@pytest.fixture
def token_server() -> Iterator[ControlServerThread]:
    with serve(admin_token=TOKEN, handlers=[echo_handler()]) as server:
        yield server


# -- TLS ------------------------------------------------------------------------------------


def test_tls_client_gets_status_health_and_handshakes(tls_server, certs):
    tls = TLSFiles(ca_file=certs.ca)
    status = admin_call(tls_server.address, tls=tls)
    assert (status.engine_id, status.num_used_blocks) == (ENGINE_ID, 3)
    assert health(tls_server.address, tls) == "SERVING"
    asyncio.run(wait_until_serving(tls_server.address, timeout_s=DEADLINE_S, tls=tls))
    fetched = fetch(tls_server.address, tls=tls)
    assert (fetched.engine_id, sorted(fetched.metadata)) == (ENGINE_ID, [(0, 0), (0, 1)])
    synced = fetch_handshake_sync(
        tls_server.address, ENGINE_ID, make_compat(), FakeWorkerMetadata, tls=tls, retry=NO_RETRY
    )
    assert synced.metadata == fetched.metadata


def test_server_name_overrides_the_dialled_host(tls_server, certs):
    # The certificate names "localhost" and 127.0.0.1; dialling an IP but checking "localhost".
    renamed = TLSFiles(ca_file=certs.ca, server_name="localhost")
    assert admin_call(tls_server.address, tls=renamed).engine_id == ENGINE_ID
    wrong = TLSFiles(ca_file=certs.ca, server_name="not-the-server")
    with pytest.raises(PeerUnavailableError, match="Hostname Verification"):
        admin_call(tls_server.address, tls=wrong)


def test_plaintext_client_to_tls_server_fails_typed(tls_server):
    with pytest.raises(PeerUnavailableError, match="connect with TLS too") as raised:
        admin_call(tls_server.address)
    assert raised.value.address == tls_server.address
    with pytest.raises(PeerUnavailableError, match="connect with TLS too"):
        fetch(tls_server.address)
    with pytest.raises(PeerUnavailableError, match=r"Health\.Check"):
        health(tls_server.address)


def test_tls_client_to_plaintext_server_fails_typed(certs):
    with serve() as server, pytest.raises(PeerUnavailableError, match="may not speak TLS"):
        admin_call(server.address, tls=TLSFiles(ca_file=certs.ca))


def test_tls_client_rejects_a_server_from_another_ca(tls_server, other_certs):
    with pytest.raises(PeerUnavailableError, match="Tls handshake failed"):
        admin_call(tls_server.address, tls=TLSFiles(ca_file=other_certs.ca))


def test_mtls_server_requires_a_client_certificate(mtls_server, certs, other_certs):
    with pytest.raises(PeerUnavailableError, match="present a client certificate"):
        admin_call(mtls_server.address, tls=TLSFiles(ca_file=certs.ca))
    stranger = TLSFiles(other_certs.client_cert, other_certs.client_key, certs.ca)
    with pytest.raises(PeerUnavailableError):
        admin_call(mtls_server.address, tls=stranger)
    with pytest.raises(PeerUnavailableError):
        health(mtls_server.address, TLSFiles(ca_file=certs.ca))
    client = TLSFiles(certs.client_cert, certs.client_key, certs.ca)
    assert admin_call(mtls_server.address, tls=client).num_used_blocks == 3
    assert health(mtls_server.address, client) == "SERVING"
    assert fetch(mtls_server.address, tls=client).engine_id == ENGINE_ID


def test_client_cache_keys_channels_by_address_and_tls(certs):
    async def clients() -> list[HandshakeClient]:
        cache = ClientCache()
        try:
            return [
                cache.get("127.0.0.1:1"),
                cache.get("127.0.0.1:1"),
                cache.get("127.0.0.1:1", tls=TLSFiles(ca_file=certs.ca)),
                cache.get("127.0.0.1:1", tls=TLSFiles(ca_file=certs.ca)),
                cache.get("127.0.0.1:1", tls=TLSFiles(ca_file=certs.ca, server_name="x")),
            ]
        finally:
            await cache.close_all()

    plain, plain_again, tls, tls_again, renamed = asyncio.run(clients())
    assert plain is plain_again and tls is tls_again
    assert len({id(plain), id(tls), id(renamed)}) == 3
    assert (plain.tls, tls.tls) == (None, TLSFiles(ca_file=certs.ca))


# -- admin token ----------------------------------------------------------------------------


def test_right_token_works(token_server):
    assert admin_call(token_server.address, token=TOKEN).engine_id == ENGINE_ID
    assert admin_call(token_server.address, "peers", token=TOKEN) == []


def test_missing_and_wrong_token_are_refused_naming_the_problem(token_server):
    with pytest.raises(AdminAuthError, match="UNAUTHENTICATED: missing admin token") as missing:
        admin_call(token_server.address)
    assert token_server.address in str(missing.value)
    assert missing.value.address == token_server.address
    assert isinstance(missing.value, RemoteCallError)
    with pytest.raises(AdminAuthError, match="UNAUTHENTICATED: wrong admin token"):
        admin_call(token_server.address, token="guess")
    with pytest.raises(AdminAuthError, match="wrong admin token"):
        admin_call(token_server.address, token=TOKEN + "x")


class RecordingBackend(BasicAdminBackend):
    """Writes down every backend method the server runs."""

    def __init__(self) -> None:
        super().__init__(role="kv_producer", engine_id=ENGINE_ID, model="m", num_blocks=8)
        self.calls: list[str] = []

    def status(self):
        self.calls.append("status")
        return super().status()

    def peers(self):
        self.calls.append("peers")
        return super().peers()

    def transfers(self):
        self.calls.append("transfers")
        return super().transfers()

    def abort(self, request_id: str) -> bool:
        self.calls.append("abort")
        return super().abort(request_id)

    def drain(self) -> int:
        self.calls.append("drain")
        return super().drain()


@pytest.mark.parametrize(
    ("method", "args"),
    [
        ("status", ()),
        ("peers", ()),
        ("transfers", ()),
        ("abort", ("req-1",)),
        ("drain", ()),
        ("set_log_level", ("DEBUG",)),
    ],
)
def test_every_admin_method_is_guarded_and_never_runs_unauthenticated(method, args):
    backend = RecordingBackend()
    logger = logging.getLogger(DEFAULT_LOG_LEVEL_LOGGER)
    level = logger.level
    with serve(admin=backend, admin_token=TOKEN) as server:
        for token in (None, "wrong"):
            with pytest.raises(AdminAuthError, match="admin token"):
                admin_call(server.address, method, *args, token=token)
        # Nothing ran: no backend method, and the log level (the server's own) is unchanged.
        assert backend.calls == []
        assert logger.level == level
        # The recorder works: an authenticated call is written down.
        admin_call(server.address, method, *args, token=TOKEN)
        assert backend.calls == ([] if method == "set_log_level" else [method])
    logger.setLevel(level)


def test_token_guards_only_kvadmin(token_server):
    assert health(token_server.address) == "SERVING"
    assert fetch(token_server.address).engine_id == ENGINE_ID
    assert echo(token_server.address) == b"pong:hi"


def test_bearer_scheme_is_case_insensitive_and_other_schemes_are_wrong(token_server):
    async def raw_status(value: str) -> grpc.StatusCode:
        async with grpc.aio.insecure_channel(token_server.address) as channel:
            rpc = channel.unary_unary("/kvtransfer.v1.KVAdmin/GetStatus")
            try:
                await rpc(b"", timeout=DEADLINE_S, metadata=((ADMIN_TOKEN_METADATA_KEY, value),))
            except grpc.aio.AioRpcError as exc:
                return exc.code()
            return grpc.StatusCode.OK

    assert asyncio.run(raw_status(f"bearer {TOKEN}")) == grpc.StatusCode.OK
    assert asyncio.run(raw_status(f"Basic {TOKEN}")) == grpc.StatusCode.UNAUTHENTICATED
    assert asyncio.run(raw_status(TOKEN)) == grpc.StatusCode.UNAUTHENTICATED


def test_token_and_mtls_together(certs):
    server_tls = TLSFiles(certs.server_cert, certs.server_key, certs.ca)
    client_tls = TLSFiles(certs.client_cert, certs.client_key, certs.ca)
    with serve(tls=server_tls, admin_token=TOKEN) as server:
        assert admin_call(server.address, tls=client_tls, token=TOKEN).engine_id == ENGINE_ID
        with pytest.raises(AdminAuthError, match="wrong admin token"):
            admin_call(server.address, tls=client_tls, token="nope")


def test_admin_token_metadata():
    assert admin_token_metadata(None) == ()
    assert admin_token_metadata("t0k") == (("authorization", "Bearer t0k"),)
    with pytest.raises(ValueError, match="non-empty"):
        admin_token_metadata("")
    with pytest.raises(ValueError, match="without spaces"):
        admin_token_metadata("two words")
    with pytest.raises(ValueError, match="non-empty"):
        ControlServerThread(admin=make_backend(), admin_token="").start()
    with pytest.raises(ValueError, match="printable ASCII"):
        AdminClient("127.0.0.1:1", token="caf\u00e9")


# -- TLSFiles validation --------------------------------------------------------------------


def test_tls_files_validation_names_the_field(tmp_path, certs):
    with pytest.raises(ValueError, match=r"TLSFiles\.key_file is required when cert_file"):
        TLSFiles(cert_file=certs.server_cert)
    with pytest.raises(ValueError, match=r"TLSFiles\.cert_file is required when key_file"):
        TLSFiles(key_file=certs.server_key)
    with pytest.raises(ValueError, match=r"TLSFiles\.ca_file: '.*nope\.pem' does not exist"):
        TLSFiles(ca_file=str(tmp_path / "nope.pem"))
    with pytest.raises(ValueError, match=r"TLSFiles\.key_file: .* does not exist"):
        TLSFiles(certs.server_cert, str(tmp_path / "missing.key"))
    with pytest.raises(ValueError, match=r"TLSFiles\.ca_file: .* is not a file"):
        TLSFiles(ca_file=str(tmp_path))
    not_pem = tmp_path / "cert.der"
    not_pem.write_bytes(b"\x30\x82\x01\x0a")
    with pytest.raises(ValueError, match=r"TLSFiles\.cert_file: .* is not PEM"):
        TLSFiles(str(not_pem), certs.server_key)
    with pytest.raises(ValueError, match=r"TLSFiles\.server_name must not be empty"):
        TLSFiles(ca_file=certs.ca, server_name="")
    with pytest.raises(ValueError, match=r"TLSFiles\.ca_file must be a str"):
        TLSFiles(ca_file=tmp_path)  # type: ignore[arg-type]


def test_server_side_tls_checks(certs):
    with pytest.raises(ValueError, match=r"TLSFiles\.cert_file and key_file are required"):
        server_credentials(TLSFiles(ca_file=certs.ca))
    with pytest.raises(ValueError, match=r"TLSFiles\.server_name is for clients"):
        server_credentials(TLSFiles(certs.server_cert, certs.server_key, server_name="x"))

    async def start() -> None:
        await start_control_server(admin=make_backend(), tls=TLSFiles(ca_file=certs.ca))

    with pytest.raises(ValueError, match="required on a server"):
        asyncio.run(start())


def test_channel_options():
    assert channel_options(None) == []
    assert channel_options(TLSFiles()) == []
    assert channel_options(TLSFiles(server_name="localhost")) == [
        ("grpc.ssl_target_name_override", "localhost")
    ]
