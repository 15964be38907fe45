"""Which network interface carries KV traffic: the one holding this host's KV address.

UCX's TCP transport otherwise listens on, advertises and dials every interface of the host
(loopback, docker bridges, unrouted links), and a peer that tries an address it cannot reach
stalls. `kv_net_devices` confines it to one interface, chosen in this order:

1. ``kv_net_device`` from the connector's configuration (UCX device names, comma-separated,
   passed through: e.g. ``eth0``, or ``mlx5_0:1,eth0`` with RDMA; a network interface named
   there must exist);
2. ``UCX_NET_DEVICES`` in the environment (UCX's own variable; deployments set it);
3. the interface that holds ``kv_ip`` (resolved if it is a name), found with the kernel's
   interface table (``SIOCGIFCONF`` for IPv4, ``/proc/net/if_inet6`` for IPv6).

UCX binds the first IPv4 address of the interface: an interface whose first address is not
``kv_ip`` is reported with a warning (`InterfaceAddress.is_primary`).
"""

from __future__ import annotations

import array
import fcntl
import ipaddress
import logging
import os
import socket
import struct
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

logger = logging.getLogger(__name__)

_SIOCGIFCONF = 0x8912
# struct ifreq on Linux: 16-byte name, then a 24-byte union holding the sockaddr.
_IFREQ_SIZE = 40
_IF_INET6 = Path("/proc/net/if_inet6")
ENV_NET_DEVICES = "UCX_NET_DEVICES"


@dataclass(frozen=True)
class InterfaceAddress:
    """An address held by a network interface; ``is_primary``: the interface's first address
    of its family (the one UCX binds and advertises)."""

    device: str
    address: ipaddress.IPv4Address | ipaddress.IPv6Address
    is_primary: bool


@dataclass(frozen=True)
class NetDevices:
    """What UCX is confined to (``None``: left to UCX, ``UCX_NET_DEVICES`` applies) and why."""

    devices: str | None
    source: str


def interface_addresses() -> list[InterfaceAddress]:
    """Every address of every interface in this network namespace, IPv4 first."""
    ipv4 = _ipv4_addresses()
    # UCX prefers IPv4: an interface's IPv6 addresses are used only when it has no IPv4 one.
    with_ipv4 = {entry.device for entry in ipv4}
    ipv6 = [
        InterfaceAddress(e.device, e.address, e.is_primary and e.device not in with_ipv4)
        for e in _ipv6_addresses()
    ]
    return [*ipv4, *ipv6]


def device_holding(host: str) -> InterfaceAddress:
    """The interface that holds ``host`` (an IP address or a name resolving to one).

    `ValueError` when ``host`` does not resolve, is a wildcard, or no interface of this
    network namespace holds it.
    """
    candidates = _resolve(host)
    held = {entry.address: entry for entry in interface_addresses()}
    for address in candidates:
        if address.is_unspecified:
            raise ValueError(f"{host!r} is a wildcard address, not the address of one interface")
        entry = held.get(address)
        if entry is not None:
            return entry
    shown = ", ".join(str(a) for a in candidates)
    local = ", ".join(f"{e.address} ({e.device})" for e in held.values()) or "none"
    raise ValueError(
        f"{host!r} ({shown}) is not an address of any interface here; this network namespace "
        f"holds {local}"
    )


def kv_net_devices(
    kv_ip: str, override: str | None = None, environ: Mapping[str, str] | None = None
) -> NetDevices:
    """The UCX network devices for KV traffic (see the module docstring for the order)."""
    if override is not None:
        _check_interfaces(override)
        return NetDevices(override, "kv_net_device")
    environ = os.environ if environ is None else environ
    if environ.get(ENV_NET_DEVICES):
        return NetDevices(None, f"{ENV_NET_DEVICES}={environ[ENV_NET_DEVICES]}")
    try:
        entry = device_holding(kv_ip)
    except ValueError as exc:
        raise ValueError(
            f"kv_ip: {exc}. Set kv_ip to this host's KV address, or name the interface with "
            f"kv_connector_extra_config.kv_net_device"
        ) from None
    if not entry.is_primary:
        logger.warning(
            "kv_ip %s is not the first address of %s: UCX listens on and advertises that "
            "interface's first (IPv4) address instead",
            kv_ip,
            entry.device,
        )
    return NetDevices(entry.device, f"kv_ip {kv_ip}")


def _check_interfaces(devices: str) -> None:
    # UCX only warns about a device it lacks and then has no network transport at all.
    # RDMA devices ("mlx5_0:1") are not network interfaces: UCX checks those itself.
    present = [name for _, name in socket.if_nameindex()]
    for name in devices.split(","):
        if name != "all" and ":" not in name and name not in present:
            raise ValueError(
                f"kv_net_device: no interface {name!r} here; this network namespace has "
                f"{', '.join(present)}"
            )


def _resolve(host: str) -> list[ipaddress.IPv4Address | ipaddress.IPv6Address]:
    try:
        return [ipaddress.ip_address(host.split("%", 1)[0])]
    except ValueError:
        pass
    try:
        infos = socket.getaddrinfo(host, None, proto=socket.IPPROTO_TCP)
    except (socket.gaierror, UnicodeError) as exc:
        raise ValueError(f"{host!r} does not resolve: {exc}") from None
    resolved = []
    for info in infos:
        address = ipaddress.ip_address(str(info[4][0]).split("%", 1)[0])
        if address not in resolved:
            resolved.append(address)
    return resolved


def _ipv4_addresses() -> list[InterfaceAddress]:
    # SIOCGIFCONF lists every IPv4 address, secondary ones included, labelled "dev" or
    # "dev:alias"; the first of a device is its primary.
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        size = 64 * _IFREQ_SIZE
        while True:
            buffer = array.array("B", bytes(size))
            address, _ = buffer.buffer_info()
            request = struct.pack("iL", size, address)
            used = struct.unpack("iL", fcntl.ioctl(sock.fileno(), _SIOCGIFCONF, request))[0]
            if used < size:
                break
            size *= 2
    raw = buffer.tobytes()
    entries: list[InterfaceAddress] = []
    seen: set[str] = set()
    for offset in range(0, used, _IFREQ_SIZE):
        label = raw[offset : offset + 16].split(b"\0", 1)[0].decode()
        device = label.split(":", 1)[0]
        ipv4 = ipaddress.IPv4Address(raw[offset + 20 : offset + 24])
        entries.append(InterfaceAddress(device, ipv4, device not in seen))
        seen.add(device)
    return entries


def _ipv6_addresses() -> list[InterfaceAddress]:
    try:
        lines = _IF_INET6.read_text().splitlines()
    except OSError:
        return []  # no IPv6 in this kernel or namespace
    entries: list[InterfaceAddress] = []
    seen: set[str] = set()
    for line in lines:
        fields = line.split()
        if len(fields) != 6:
            continue
        ipv6 = ipaddress.IPv6Address(bytes.fromhex(fields[0]))
        device = fields[5]
        entries.append(InterfaceAddress(device, ipv6, device not in seen))
        seen.add(device)
    return entries
