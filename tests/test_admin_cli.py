"""`kvtransfer admin ...` against real control servers on 127.0.0.1 (OS-chosen ports)."""

from __future__ import annotations

import json
import logging
import os
import re
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from control_helpers.certs import Certs, make_certs

from kvtransfer.cli import main
from kvtransfer.control import (
    BasicAdminBackend,
    ControlServerThread,
    HandshakeState,
    PeerInfo,
    TLSFiles,
    TransferDirection,
)

pytestmark = pytest.mark.integration

TOKEN = "s3cret-token"
TEST_LOGGER = "kvtransfer.tests.admin_cli"
REPO_ROOT = Path(__file__).resolve().parents[1]


def make_backend() -> BasicAdminBackend:
    admin = BasicAdminBackend(
        role="kv_consumer", engine_id="decode-0", model="builtin", tp_size=2, num_blocks=64
    )
    admin.set_num_used_blocks(5)
    admin.count("kv_blocks_received", 12)
    admin.count("kv_bytes_received", 49152)
    admin.count("kv_tokens_recomputed", 0)
    admin.record_peer(PeerInfo("prefill-0", "10.0.0.1:50052", HandshakeState.READY, 7, 1.25))
    admin.record_peer(PeerInfo("prefill-1", "10.0.0.2:50052", HandshakeState.FAILED, 0, 0.0))
    admin.start_transfer("req-1", "prefill-0", TransferDirection.RECV, 3, 3072)
    return admin


@pytest.fixture(autouse=True)
def _no_token_in_env(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.delenv("KVTRANSFER_ADMIN_TOKEN", raising=False)
    yield
    logging.getLogger(TEST_LOGGER).setLevel(logging.NOTSET)


@pytest.fixture
def backend() -> BasicAdminBackend:
    return make_backend()


@pytest.fixture
def target(backend: BasicAdminBackend) -> Iterator[str]:
    """A token-guarded server; its log-level default is a logger of this test only."""
    with ControlServerThread(
        admin=backend, admin_token=TOKEN, log_level_logger=TEST_LOGGER
    ) as server:
        yield server.address


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> Certs:
    return make_certs(tmp_path_factory.mktemp("certs"))


def admin(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(["admin", *argv])
    out, err = capsys.readouterr()
    return code, out, err


def ok(capsys: pytest.CaptureFixture[str], *argv: str) -> str:
    code, out, err = admin(capsys, *argv)
    assert (code, err) == (0, ""), err
    return out


def failed(capsys: pytest.CaptureFixture[str], code: int, *argv: str) -> str:
    """Runs a command that must fail with ``code``: nothing on stdout, one error line."""
    got, out, err = admin(capsys, *argv)
    assert (got, out) == (code, "")
    assert err.startswith("error: ") and err.count("\n") == 1, err
    assert "Traceback" not in err
    return err


def usage_error(capsys: pytest.CaptureFixture[str], *argv: str) -> str:
    """argparse's own usage errors: exit 2, usage, then the ``error: ...`` line."""
    with pytest.raises(SystemExit) as raised:
        main(["admin", *argv])
    out, err = capsys.readouterr()
    assert (raised.value.code, out) == (2, "")
    assert err.startswith("usage: kvtransfer admin")
    return err.splitlines()[-1]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


# -- each action: table and JSON --------------------------------------------------------------


def test_status_table(capsys, target):
    lines = ok(capsys, "status", "--target", target, "--token", TOKEN).splitlines()
    uptime = lines.pop(6)
    assert re.fullmatch(r"uptime +\d+\.\ds", uptime), uptime
    assert uptime.index(uptime.split()[-1]) == lines[0].index("kv_consumer")
    assert lines == [
        "role                           kv_consumer",
        "engine id                      decode-0",
        "model                          builtin",
        "TP x PP                        2 x 1",
        "blocks free                    59",
        "blocks used                    5",
        "requests running               0",
        "requests waiting               0",
        "counters.kv_blocks_received    12",
        "counters.kv_bytes_received     49152",
        "counters.kv_tokens_recomputed  0",
    ]


def test_status_json(capsys, target):
    data = json.loads(ok(capsys, "status", "--target", target, "--token", TOKEN, "--json"))
    uptime = data.pop("uptime_s")
    assert isinstance(uptime, float) and uptime >= 0
    assert data == {
        "role": "kv_consumer",
        "engine_id": "decode-0",
        "model": "builtin",
        "tp_size": 2,
        "pp_size": 1,
        "num_free_blocks": 59,
        "num_used_blocks": 5,
        "num_running_requests": 0,
        "num_waiting_requests": 0,
        # This fake daemon reports no placement.
        "host_id": "",
        "cpus": [],
        "counters": {
            "kv_blocks_received": 12,
            "kv_bytes_received": 49152,
            "kv_tokens_recomputed": 0,
        },
    }
    assert data["counters"]["kv_bytes_received"] == 49152


def test_peers_table_and_json(capsys, target):
    assert ok(capsys, "peers", "--target", target, "--token", TOKEN).splitlines() == [
        "ENGINE ID  ADDRESS         STATE   GENERATION  LAST HANDSHAKE MS",
        "prefill-0  10.0.0.1:50052  ready   7           1.2",
        "prefill-1  10.0.0.2:50052  failed  0           0.0",
    ]
    assert json.loads(ok(capsys, "peers", "--target", target, "--token", TOKEN, "--json")) == {
        "peers": [
            {
                "engine_id": "prefill-0",
                "address": "10.0.0.1:50052",
                "state": "ready",
                "generation": 7,
                "last_handshake_latency_ms": 1.25,
            },
            {
                "engine_id": "prefill-1",
                "address": "10.0.0.2:50052",
                "state": "failed",
                "generation": 0,
                "last_handshake_latency_ms": 0.0,
            },
        ]
    }


def test_transfers_table_and_json(capsys, target):
    header, row = ok(capsys, "transfers", "--target", target, "--token", TOKEN).splitlines()
    assert header == "REQUEST ID  PEER       DIRECTION  BLOCKS  BYTES  AGE"
    assert re.fullmatch(r"req-1       prefill-0  recv       3       3072   \d+\.\ds", row), row
    data = json.loads(ok(capsys, "transfers", "--target", target, "--token", TOKEN, "--json"))
    (transfer,) = data["transfers"]
    age = transfer.pop("age_s")
    assert isinstance(age, float) and age >= 0
    assert transfer == {
        "request_id": "req-1",
        "peer_engine_id": "prefill-0",
        "direction": "recv",
        "num_blocks": 3,
        "num_bytes": 3072,
    }


def test_empty_tables_say_none(capsys):
    empty = BasicAdminBackend(role="kv_producer", engine_id="p", model="m")
    with ControlServerThread(admin=empty) as server:
        assert ok(capsys, "peers", "--target", server.address).splitlines() == [
            "ENGINE ID  ADDRESS  STATE  GENERATION  LAST HANDSHAKE MS",
            "(none)",
        ]
        assert json.loads(ok(capsys, "transfers", "--target", server.address, "--json")) == {
            "transfers": []
        }


def test_abort(capsys, target):
    common = ("--target", target, "--token", TOKEN)
    assert ok(capsys, "abort", "req-1", *common) == "aborted request 'req-1'\n"
    assert ok(capsys, "abort", "req-1", *common) == "request 'req-1' not found: nothing aborted\n"
    assert json.loads(ok(capsys, "abort", "req-2", *common, "--json")) == {
        "request_id": "req-2",
        "found": False,
    }
    assert json.loads(ok(capsys, "transfers", *common, "--json")) == {"transfers": []}


def test_drain(capsys, target, backend):
    common = ("--target", target, "--token", TOKEN)
    assert ok(capsys, "drain", *common) == "draining: 1 transfer(s) still in flight\n"
    assert backend.draining
    assert json.loads(ok(capsys, "drain", *common, "--json")) == {
        "draining": True,
        "num_in_flight_transfers": 1,
    }


def test_log_level(capsys, target):
    common = ("--target", target, "--token", TOKEN)
    out = ok(capsys, "log-level", "debug", *common)
    assert out == "log level of the server's default logger set to DEBUG (was NOTSET)\n"
    assert logging.getLogger(TEST_LOGGER).level == logging.DEBUG
    other = f"{TEST_LOGGER}.other"
    try:
        data = json.loads(ok(capsys, "log-level", "WARNING", "--logger", other, *common, "--json"))
        assert data == {"logger": other, "level": "WARNING", "previous_level": "NOTSET"}
        assert logging.getLogger(other).level == logging.WARNING
        out = ok(capsys, "log-level", "info", "--logger", other, *common)
        assert out == f"log level of {other!r} set to INFO (was WARNING)\n"
    finally:
        logging.getLogger(other).setLevel(logging.NOTSET)


# -- token ----------------------------------------------------------------------------------


def test_token_from_flag_and_env(capsys, target, monkeypatch):
    monkeypatch.setenv("KVTRANSFER_ADMIN_TOKEN", TOKEN)
    assert json.loads(ok(capsys, "status", "--target", target, "--json"))["engine_id"] == "decode-0"
    # The flag wins over the environment.
    err = failed(capsys, 1, "status", "--target", target, "--token", "nope")
    assert "wrong admin token" in err
    monkeypatch.setenv("KVTRANSFER_ADMIN_TOKEN", "nope")
    assert ok(capsys, "peers", "--target", target, "--token", TOKEN).startswith("ENGINE ID")


def test_wrong_and_missing_token(capsys, target, monkeypatch):
    err = failed(capsys, 1, "status", "--target", target, "--token", "guess")
    assert err == f"error: GetStatus to {target}: UNAUTHENTICATED: wrong admin token\n"
    err = failed(capsys, 1, "drain", "--target", target)
    assert err.startswith(f"error: Drain to {target}: UNAUTHENTICATED: missing admin token")
    # An empty variable is no token at all.
    monkeypatch.setenv("KVTRANSFER_ADMIN_TOKEN", "")
    assert "missing admin token" in failed(capsys, 1, "peers", "--target", target)


def test_token_that_cannot_be_sent_is_a_usage_error(capsys, target):
    err = failed(capsys, 2, "status", "--target", target, "--token", "two words")
    assert err.startswith("error: --token/$KVTRANSFER_ADMIN_TOKEN: ")


# -- TLS ------------------------------------------------------------------------------------


def test_tls_and_mtls(capsys, certs):
    server_tls = TLSFiles(certs.server_cert, certs.server_key, certs.ca)
    with ControlServerThread(admin=make_backend(), tls=server_tls, admin_token=TOKEN) as server:
        common = ("--target", server.address, "--token", TOKEN, "--tls-ca", certs.ca)
        mtls = ("--tls-cert", certs.client_cert, "--tls-key", certs.client_key)
        assert json.loads(ok(capsys, "status", *common, *mtls, "--json"))["tp_size"] == 2
        renamed = ("--tls-server-name", "localhost")
        assert ok(capsys, "peers", *common, *mtls, *renamed).startswith("ENGINE ID")
        err = failed(capsys, 1, "status", *common)
        assert "present a client certificate" in err
        err = failed(capsys, 1, "status", "--target", server.address, "--token", TOKEN)
        assert "connect with TLS too" in err


def test_tls_flag_errors_name_the_flag(capsys, target, certs, tmp_path):
    err = failed(capsys, 2, "status", "--target", target, "--tls-ca", str(tmp_path / "no.pem"))
    assert err.startswith("error: --tls-ca: ") and "does not exist" in err
    err = failed(capsys, 2, "status", "--target", target, "--tls-cert", certs.client_cert)
    assert err == "error: --tls-key is required when --tls-cert is set\n"
    err = failed(capsys, 2, "status", "--target", target, "--tls-key", certs.client_key)
    assert err == "error: --tls-cert is required when --tls-key is set\n"


# -- failures: unreachable, silent, bad arguments --------------------------------------------


def test_unreachable_target(capsys):
    address = f"127.0.0.1:{free_port()}"
    err = failed(capsys, 1, "status", "--target", address, "--timeout-s", "2")
    assert err.startswith(f"error: GetStatus to {address} failed after 1 attempt(s): UNAVAILABLE")


def test_silent_target_hits_the_deadline(capsys):
    # Accepts TCP connections (the kernel backlog does) but never speaks HTTP/2.
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        address = f"127.0.0.1:{listener.getsockname()[1]}"
        err = failed(capsys, 1, "peers", "--target", address, "--timeout-s", "0.5")
    assert err.startswith(f"error: ListPeers to {address} failed") and "DEADLINE_EXCEEDED" in err


def test_bad_arguments(capsys, target):
    assert usage_error(capsys, "status") == (
        "error: the following arguments are required: --target"
    )
    assert usage_error(capsys, "status", "--target", target, "--timeout-s", "0") == (
        "error: argument --timeout-s: must be > 0, got '0'"
    )
    assert usage_error(capsys, "abort", "--target", target) == (
        "error: the following arguments are required: REQ_ID"
    )
    # An unknown action is refused by argparse one level up, in its own words.
    assert "invalid choice: 'reboot'" in usage_error(capsys, "reboot", "--target", target)
    err = failed(capsys, 2, "status", "--target", "localhost")
    assert err == "error: --target must be HOST:PORT with a port in [1, 65535], got 'localhost'\n"
    err = failed(capsys, 2, "log-level", "loud", "--target", target)
    assert err.startswith("error: unknown log level 'loud'")
    assert failed(capsys, 2, "abort", " ", "--target", target) == (
        "error: REQ_ID must not be empty\n"
    )
    code, out, err = admin(capsys)
    assert (code, out) == (2, "")
    assert err.startswith("error: kvtransfer admin needs an action: one of status, peers")


# -- the installed entry point ---------------------------------------------------------------


def run_module(*argv: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "kvtransfer", "admin", *argv],
        cwd=REPO_ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_python_dash_m_kvtransfer_admin(target):
    env = {**os.environ, "KVTRANSFER_ADMIN_TOKEN": TOKEN}
    result = run_module("status", "--target", target, "--json", env=env)
    assert (result.returncode, result.stderr) == (0, "")
    assert json.loads(result.stdout)["counters"]["kv_blocks_received"] == 12
    env["KVTRANSFER_ADMIN_TOKEN"] = "wrong"
    result = run_module("status", "--target", target, env=env)
    assert (result.returncode, result.stdout) == (1, "")
    # One line: no traceback, and no gRPC C-core log lines either.
    assert result.stderr == f"error: GetStatus to {target}: UNAUTHENTICATED: wrong admin token\n"
