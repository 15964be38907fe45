"""TLS, mTLS and the admin token on real gRPC servers, and the `kvtransfer admin` command."""

from __future__ import annotations

import asyncio
import json

import pytest
from control_helpers.certs import make_certs

from kvtransfer.cli import main
from kvtransfer.control import (
    AdminClient,
    BasicAdminBackend,
    ControlServerThread,
    HandshakeState,
    PeerInfo,
    PeerUnavailableError,
    RetryPolicy,
    TransferDirection,
    check_health,
)
from kvtransfer.control.errors import AdminAuthError
from kvtransfer.control.security import TLSFiles

TOKEN = "s3cret-token"
NO_RETRY = RetryPolicy(max_attempts=1)


@pytest.fixture(scope="module")
def certs(tmp_path_factory):
    return make_certs(tmp_path_factory.mktemp("certs"))


def backend() -> BasicAdminBackend:
    admin = BasicAdminBackend(
        role="kv_consumer", engine_id="d0", model="builtin", tp_size=2, num_blocks=64
    )
    admin.set_num_used_blocks(5)
    admin.count("kv_blocks_received", 12)
    admin.record_peer(PeerInfo("p0", "10.0.0.1:50052", HandshakeState.READY, 7, 1.5))
    admin.start_transfer("req-1", "p0", TransferDirection.RECV, 3, 3072)
    return admin


def status(address: str, **client) -> object:
    async def call():
        admin = AdminClient(address, retry=NO_RETRY, timeout_s=2.0, **client)
        try:
            return await admin.status()
        finally:
            await admin.close()

    return asyncio.run(call())


def test_tls_server_and_client(certs):
    tls_server = TLSFiles(certs.server_cert, certs.server_key)
    with ControlServerThread(admin=backend(), tls=tls_server) as server:
        client_tls = TLSFiles(ca_file=certs.ca)
        assert status(server.address, tls=client_tls).engine_id == "d0"
        assert asyncio.run(check_health(server.address, tls=client_tls)) == "SERVING"
        # A plaintext client gets a typed, bounded failure, not a hang.
        with pytest.raises(PeerUnavailableError):
            status(server.address)


def test_mtls_requires_a_client_certificate(certs):
    tls_server = TLSFiles(certs.server_cert, certs.server_key, ca_file=certs.ca)
    with ControlServerThread(admin=backend(), tls=tls_server) as server:
        with pytest.raises(PeerUnavailableError):
            status(server.address, tls=TLSFiles(ca_file=certs.ca))
        client_tls = TLSFiles(certs.client_cert, certs.client_key, certs.ca)
        assert status(server.address, tls=client_tls).num_used_blocks == 5


def test_admin_token_guards_admin_calls_only():
    with ControlServerThread(admin=backend(), admin_token=TOKEN) as server:
        assert status(server.address, token=TOKEN).engine_id == "d0"
        with pytest.raises(AdminAuthError, match="UNAUTHENTICATED: missing admin token"):
            status(server.address)
        with pytest.raises(AdminAuthError, match="UNAUTHENTICATED: wrong admin token"):
            status(server.address, token="guess")
        assert asyncio.run(check_health(server.address)) == "SERVING"


def test_tls_files_are_checked(tmp_path, certs):
    with pytest.raises(ValueError, match="cert_file and key_file must be given together"):
        TLSFiles(cert_file=certs.server_cert)
    with pytest.raises(ValueError, match=r"tls ca_file '.*nope.pem' does not exist"):
        TLSFiles(ca_file=str(tmp_path / "nope.pem"))


# -- kvtransfer admin ----------------------------------------------------------------------


@pytest.fixture
def guarded():
    with ControlServerThread(admin=backend(), admin_token=TOKEN) as server:
        yield server.address


def admin_cli(capsys, *argv) -> tuple[int, str, str]:
    code = main(["admin", *argv])
    out, err = capsys.readouterr()
    return code, out, err


def test_status_table_and_json(guarded, capsys):
    code, out, _ = admin_cli(capsys, "status", "--target", guarded, "--token", TOKEN)
    assert code == 0
    lines = out.splitlines()
    assert lines[0].split() == ["role", "kv_consumer"]
    assert ["tp", "x", "pp", "2", "x", "1"] in [line.split() for line in lines]
    assert ["counters.kv_blocks_received", "12"] in [line.split() for line in lines]
    code, out, _ = admin_cli(capsys, "status", "--target", guarded, "--token", TOKEN, "--json")
    data = json.loads(out)
    assert data["counters"]["kv_blocks_received"] == 12
    assert (data["num_free_blocks"], data["num_used_blocks"]) == (59, 5)


def test_peers_transfers_abort_log_level_drain(guarded, capsys, monkeypatch):
    monkeypatch.setenv("KVTRANSFER_ADMIN_TOKEN", TOKEN)
    code, out, _ = admin_cli(capsys, "peers", "--target", guarded)
    assert code == 0
    assert out.splitlines()[1].split() == ["p0", "10.0.0.1:50052", "ready", "7", "1.5"]
    code, out, _ = admin_cli(capsys, "transfers", "--target", guarded, "--json")
    (transfer,) = json.loads(out)["transfers"]
    assert (transfer["request_id"], transfer["direction"], transfer["num_bytes"]) == (
        "req-1",
        "recv",
        3072,
    )
    assert admin_cli(capsys, "abort", "req-1", "--target", guarded)[1] == "found: True\n"
    assert admin_cli(capsys, "abort", "req-1", "--target", guarded)[1] == "found: False\n"
    code, out, _ = admin_cli(capsys, "log-level", "debug", "--target", guarded, "--json")
    assert json.loads(out) == {"previous_level": "NOTSET"}
    admin_cli(capsys, "log-level", "NOTSET", "--target", guarded)
    assert admin_cli(capsys, "drain", "--target", guarded)[1] == "num_in_flight_transfers: 0\n"


def test_errors_exit_non_zero_with_a_message(guarded, capsys):
    code, out, err = admin_cli(capsys, "status", "--target", guarded, "--token", "nope")
    assert (code, out) == (1, "")
    assert err.startswith("error: GetStatus to ") and "wrong admin token" in err
    code, _, err = admin_cli(capsys, "status", "--target", "127.0.0.1:1", "--timeout-s", "0.5")
    assert code == 1 and err.startswith("error: ")
    code, _, err = admin_cli(
        capsys, "status", "--target", guarded, "--tls-cert", "/nonexistent.pem", "--tls-key", "x"
    )
    assert code == 2 and "does not exist" in err
    code, _, err = admin_cli(capsys, "log-level", "loud", "--target", guarded, "--token", TOKEN)
    assert code == 1 and "unknown log level 'loud'" in err
