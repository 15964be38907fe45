"""Transport selection on one host, no root needed: which interface UCX may use (`netdev`),
which address a peer dials (`locality`), and what that does to real pulls and listeners.

The namespace tier (`test_multihost.py`) checks the same across test hosts."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
from netns_helpers.sockets import bytes_received, listening, tcp_sockets
from transport_helpers.kv import LayerGroup, empty_caches, layer_tensor, make_caches

from kvtransfer.connector.config import KVTransferConfig
from kvtransfer.connectors.ucx.config import UcxConfig
from kvtransfer.transport import (
    InvalidPeerAddress,
    KVTransferAgent,
    PullSpec,
    TransportConfig,
    netdev,
)
from kvtransfer.transport.locality import Locality, WorkerAddresses

pytestmark = pytest.mark.integration

GROUP = LayerGroup("model.layers", 0, 2)


# -- which interface ------------------------------------------------------------------------


def test_loopback_is_found_by_address_and_by_name():
    assert netdev.device_holding("127.0.0.1").device == "lo"
    assert netdev.device_holding("localhost").device == "lo"
    assert any(e.device == "lo" and e.is_primary for e in netdev.interface_addresses())


@pytest.mark.parametrize(
    ("host", "message"),
    [
        ("0.0.0.0", "is a wildcard address"),
        ("203.0.113.77", r"is not an address of any interface here; .*127\.0\.0\.1 \(lo\)"),
        ("no-such-host.invalid", "does not resolve"),
    ],
)
def test_an_address_no_interface_holds_is_refused(host, message):
    with pytest.raises(ValueError, match=message):
        netdev.device_holding(host)


def test_kv_net_devices_order_override_then_environment_then_kv_ip():
    assert netdev.kv_net_devices("127.0.0.1", "lo,mlx5_0:1", {}) == netdev.NetDevices(
        "lo,mlx5_0:1", "kv_net_device"
    )
    with pytest.raises(ValueError, match=r"kv_net_device: no interface 'eth9' here; .*\blo\b"):
        netdev.kv_net_devices("127.0.0.1", "eth9", {})
    chosen = netdev.kv_net_devices("127.0.0.1", None, {"UCX_NET_DEVICES": "eth7"})
    assert chosen.devices is None and "UCX_NET_DEVICES=eth7" in chosen.source
    assert netdev.kv_net_devices("127.0.0.1", None, {}) == netdev.NetDevices(
        "lo", "kv_ip 127.0.0.1"
    )
    with pytest.raises(ValueError, match=r"^kv_ip: '203\.0\.113\.77'.*kv_net_device"):
        netdev.kv_net_devices("203.0.113.77", None, {})


def test_a_secondary_address_is_used_with_a_warning(monkeypatch, caplog):
    entries = [netdev.InterfaceAddress("eth0", netdev.ipaddress.ip_address("10.0.0.2"), False)]
    monkeypatch.setattr(netdev, "interface_addresses", lambda: entries)
    assert netdev.kv_net_devices("10.0.0.2", None, {}).devices == "eth0"
    assert "not the first address of eth0" in caplog.text


def _connector_config(**extra) -> UcxConfig:
    return UcxConfig.from_transfer_config(
        KVTransferConfig(
            kv_connector="UcxConnector",
            kv_role="kv_consumer",
            kv_ip="127.0.0.1",
            kv_connector_extra_config=extra,
        )
    )


def test_connector_key_kv_net_device(monkeypatch):
    monkeypatch.delenv("UCX_NET_DEVICES", raising=False)
    assert _connector_config().ucx_net_devices() == "lo"
    assert _connector_config(kv_net_device="mlx5_0:1,lo").ucx_net_devices() == "mlx5_0:1,lo"
    for bad in ("", "eth0, eth1", 3, "eth0,"):
        with pytest.raises(ValueError, match=r"kv_connector_extra_config\.kv_net_device must"):
            _connector_config(kv_net_device=bad)


# -- which address ---------------------------------------------------------------------------


def test_addresses_round_trip_and_pick_shared_memory_only_from_the_same_locality():
    here = Locality.current()
    addresses = WorkerAddresses(here, b"full-address", b"net")
    assert WorkerAddresses.unpack(addresses.pack()) == addresses
    assert addresses.for_peer_at(here) == b"full-address"
    assert addresses.for_peer_at(Locality.unique()) == b"net"
    other_namespace = Locality(here.boot_id, here.netns_dev, here.netns_ino + 1)
    assert addresses.for_peer_at(other_namespace) == b"net"


def test_locality_is_shared_by_processes_of_one_namespace():
    code = "from kvtransfer.transport.locality import Locality; print(Locality.current())"
    child = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert child.stdout.strip() == str(Locality.current())
    assert Locality.unique() != Locality.unique()


@pytest.mark.parametrize(
    ("data", "message"),
    [
        (b"KVUA", "shorter than"),
        (b"XXXX" + bytes(60), "magic"),
        (WorkerAddresses(Locality.unique(), b"a", b"b").pack()[:-1], "declare 1 \\+ 1 bytes"),
    ],
    # Named: the truncated pack holds a random host id, and every worker of a parallel run
    # must collect the same test names.
    ids=["short", "bad-magic", "truncated"],
)
def test_garbage_addresses_are_refused(data, message):
    with pytest.raises(InvalidPeerAddress, match=message):
        WorkerAddresses.unpack(data)


# -- real pulls -------------------------------------------------------------------------------


# A quarter of the caches: enough that where the bytes went is plain.
PULLED = list(range(32, 48))


def _pull_between(
    server_config: TransportConfig, client_config: TransportConfig
) -> tuple[int, int]:
    """Pull between two agents of this process: (payload bytes, bytes the process's TCP
    sockets received while they were connected)."""
    before = set(tcp_sockets(os.getpid()))
    with KVTransferAgent(server_config) as server, KVTransferAgent(client_config) as client:
        server.register_kv_caches(make_caches(5, [GROUP]))
        server.start_server()
        caches = empty_caches([GROUP])
        client.register_kv_caches(caches)
        peer = client.connect(server.address)
        result = client.pull(peer, PullSpec("r", GROUP.names(), PULLED, PULLED)).result(30)
        for name in GROUP.names():
            assert torch.equal(caches[name][32:48], layer_tensor(5, name)[32:48])
        new = [s for s in tcp_sockets(os.getpid()) if s not in before]
        return result.payload_bytes, bytes_received(new)


def test_same_locality_pulls_through_shared_memory_and_other_localities_over_tcp():
    # The KV moves through the shared-memory segments; UCX still wires a TCP lane between
    # the two (the only RMA-capable transport once cma is left out), which carries its
    # connection set-up only.
    payload, over_tcp = _pull_between(TransportConfig(), TransportConfig())
    assert payload == 2 * 16 * 4096 and over_tcp < payload // 16, (payload, over_tcp)
    # What daemons with kv_ip 127.0.0.1 run: confined to lo, still shared memory between them.
    confined = TransportConfig(net_devices="lo")
    payload, over_tcp = _pull_between(confined, confined)
    assert over_tcp < payload // 16, (payload, over_tcp)
    payload, over_tcp = _pull_between(TransportConfig(), TransportConfig(shared_memory=False))
    assert over_tcp >= payload, (payload, over_tcp)


def test_ucx_listens_only_on_the_configured_device():
    config = TransportConfig(net_devices="lo", shared_memory=False)
    # Agents of earlier tests whose peers died may still hold theirs: only new sockets count.
    before = set(listening(os.getpid()))
    with KVTransferAgent(config), KVTransferAgent(config):
        sockets = set(listening(os.getpid())) - before
    assert len(sockets) >= 2 and {s.address for s in sockets} == {"127.0.0.1"}, sockets


def test_transport_config_checks_the_new_fields():
    with pytest.raises(ValueError, match="net_devices must be a non-empty str"):
        TransportConfig(net_devices=" ")
    with pytest.raises(ValueError, match="shared_memory must be a bool"):
        TransportConfig(shared_memory=1)  # type: ignore[arg-type]
