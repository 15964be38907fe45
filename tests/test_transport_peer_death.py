"""A peer that dies while UCX copies a message from it must cost the receiver that message, not
the process.

Without endpoint error handling (which same-host shared memory requires), UCX 1.21 aborts the
receiving process when its ``cma`` transport finds the sender gone mid-copy: a prefill daemon
killed while its decode fetched something large took the decode down with it. The transports
are chosen without ``cma`` (`transport_options`); these tests hold the receiver to surviving,
with real processes on this host, and the choice to what it says.
"""

from __future__ import annotations

import json
import logging
import signal
import subprocess

import pytest
from helper_processes import read_ready_line, spawn

from kvtransfer.transport.ucx import transport_options

pytestmark = pytest.mark.integration

SIZE = 256 << 20  # large enough that the copy is a rendezvous read, and long
TIMEOUT_S = 3.0


def _run_pair(env: dict[str, str] | None = None) -> tuple[subprocess.Popen[str], dict, str]:
    receiver = spawn(
        "transport_helpers.dying_peer", "receive", "--size", str(SIZE),
        "--timeout", str(TIMEOUT_S), env=env,
    )  # fmt: skip
    sender = spawn("transport_helpers.dying_peer", "send", "--size", str(SIZE), env=env)
    try:
        receiver_address = read_ready_line(receiver, 60, "receiver")
        assert sender.stdin is not None and receiver.stdin is not None
        sender.stdin.write(json.dumps(receiver_address) + "\n")
        sender.stdin.flush()
        sender_address = read_ready_line(sender, 60, "sender")
        receiver.stdin.write(json.dumps(sender_address) + "\n")
        receiver.stdin.flush()
        assert read_ready_line(receiver, 60, "receiver") == {"posted": True}
        sender.stdin.write("go\n")
        sender.stdin.flush()
        out, _ = receiver.communicate(timeout=60)
    finally:
        for process in (sender, receiver):
            if process.poll() is None:
                process.kill()
            process.wait()
    # UCX writes its own log lines to stdout too (an ERROR as the sender's memory vanishes).
    said = [line for line in out.splitlines() if line.startswith("{")]
    return receiver, json.loads(said[0]) if said else {}, out


# A rendezvous for every message over 8 KiB, read by the receiver from the sender's memory:
# with cma allowed, that read is cma's ``process_vm_readv``, the path that aborts.
# The control run repeats until the abort shows (it did in most single runs here).
_CONTROL_ATTEMPTS = 6
FORCED_RENDEZVOUS = {"UCX_RNDV_SCHEME": "get_zcopy", "UCX_RNDV_THRESH": "intra:8192,inter:8192"}


@pytest.mark.parametrize("env", [{}, FORCED_RENDEZVOUS], ids=["default", "forced-rendezvous"])
def test_a_sender_killed_mid_message_leaves_the_receiver_serving(monkeypatch, env):
    # The transports the loop chooses itself (an operator's UCX_TLS would be respected).
    monkeypatch.delenv("UCX_TLS", raising=False)
    receiver, said, out = _run_pair(env)
    # Aborted by UCX, the receiver would exit by SIGABRT having printed nothing.
    assert receiver.returncode == 0, (receiver.returncode, out)
    # The sender died before the receiver could have all 256 MiB: the receive never completes
    # and ends at its deadline (UCX reports no dead peer without error handling).
    assert said == {"ended": "timed out"}, out


def test_with_cma_allowed_the_same_death_aborts_the_receiver(monkeypatch):
    """The control run: the forced rendezvous with cma let in (an operator's ``UCX_TLS``)
    kills the receiver, so the test above reaches the path it guards."""
    monkeypatch.delenv("UCX_TLS", raising=False)
    # A race decides each run: a sender that dies before the receiver's copy began costs the
    # receiver only an error line (UCX cannot map the sender's memory any more); one that dies
    # during the copy aborts it. What the control shows is that the abort happens at all.
    outcomes = []
    for _ in range(_CONTROL_ATTEMPTS):
        receiver, said, out = _run_pair({**FORCED_RENDEZVOUS, "UCX_TLS": "all"})
        outcomes.append((receiver.returncode, said))
        if receiver.returncode == -signal.SIGABRT:
            assert said == {}, out  # killed before it could say anything
            return
    raise AssertionError(f"no run aborted with cma allowed: {outcomes}")


def test_cma_is_left_out_unless_the_operator_chose_the_transports():
    eager_here = "intra:inf,inter:auto"
    assert transport_options(None, {}) == {
        "TLS": "^cma",
        "TCP_CONN_NB": "y",
        "RNDV_THRESH": eager_here,
    }
    assert transport_options("eth0", {"PATH": "/bin"}) == {
        "NET_DEVICES": "eth0",
        "TLS": "^cma",
        "TCP_CONN_NB": "y",
        "RNDV_THRESH": eager_here,
    }
    # UCX reads UCX_TLS itself; an option would silently override the operator's choice.
    assert transport_options("lo", {"UCX_TLS": "tcp,sysv"}) == {
        "NET_DEVICES": "lo",
        "TCP_CONN_NB": "y",
        "RNDV_THRESH": eager_here,
    }


def test_tcp_connections_do_not_block_endpoint_creation_unless_the_operator_says():
    # A blocking connect to a partitioned host held the UCX thread for over a minute.
    assert transport_options(None, {})["TCP_CONN_NB"] == "y"
    assert "TCP_CONN_NB" not in transport_options(None, {"UCX_TCP_CONN_NB": "n"})


def test_same_host_messages_are_eager_and_other_hosts_keep_their_threshold():
    # What `import ucxx` writes into the environment applies between hosts.
    assert transport_options(None, {"UCX_RNDV_THRESH": "8192"})["RNDV_THRESH"] == (
        "intra:inf,inter:8192"
    )
    # An operator who split the threshold by locality keeps it as written.
    assert "RNDV_THRESH" not in transport_options(None, {"UCX_RNDV_THRESH": "intra:64k"})


@pytest.mark.parametrize(
    ("tls", "warned"),
    [
        ("all", True),
        ("sm,tcp", True),
        ("shm", True),
        ("tcp, cma", True),
        ("^ib", True),
        ("^cma", False),
        ("^ib, cma", False),
        ("tcp,sysv,posix", False),
        ("cuda_copy,cuda_ipc,tcp", False),
    ],
)
def test_an_operator_tls_that_lets_cma_in_is_warned_about(caplog, tls, warned):
    with caplog.at_level(logging.WARNING, logger="kvtransfer.transport.ucx"):
        assert "TLS" not in transport_options(None, {"UCX_TLS": tls})
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert warnings == ([f"UCX_TLS={tls} lets UCX use cma: a peer that dies while UCX copies "
        "a message from it aborts this process; add ^cma (or list the transports without cma)"]
        if warned else [])  # fmt: skip
