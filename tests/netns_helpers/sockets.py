"""The TCP sockets a process owns, from ``/proc`` (no root): for bind checks; and what went
through them, from ``ss`` (iproute2)."""

from __future__ import annotations

import ipaddress
import os
import re
import subprocess
from dataclasses import dataclass
from pathlib import Path

LISTEN = "0A"
ESTABLISHED = "01"


@dataclass(frozen=True)
class TcpSocket:
    address: str
    port: int
    state: str


def tcp_sockets(pid: int) -> list[TcpSocket]:
    """Every IPv4/IPv6 TCP socket of ``pid`` (in the caller's network namespace)."""
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue  # closed meanwhile
        if target.startswith("socket:["):
            inodes.add(target[len("socket:[") : -1])
    sockets = []
    for table, length in (("/proc/net/tcp", 4), ("/proc/net/tcp6", 16)):
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            if fields[9] not in inodes:
                continue
            address, port = fields[1].split(":")
            sockets.append(TcpSocket(_address(address, length), int(port, 16), fields[3]))
    return sockets


def listening(pid: int) -> list[TcpSocket]:
    return [s for s in tcp_sockets(pid) if s.state == LISTEN]


def _address(hex_address: str, length: int) -> str:
    # /proc prints each 32-bit word in host (little-endian) order.
    raw = bytes.fromhex(hex_address)
    words = b"".join(raw[i : i + 4][::-1] for i in range(0, length, 4))
    return str(ipaddress.ip_address(words))


def bytes_received(sockets: list[TcpSocket]) -> int:
    """Payload bytes received so far on the established ``sockets`` (``ss``'s TCP_INFO)."""
    ports = {s.port for s in sockets if s.state == ESTABLISHED}
    shown = subprocess.run(
        ["ss", "-tinH", "state", "established"], capture_output=True, text=True, check=True
    ).stdout
    total = 0
    # One socket per entry: an address line, then (indented) its TCP_INFO line.
    for entry in re.split(r"\n(?=\S)", shown):
        local = entry.split()[2] if len(entry.split()) > 2 else ""
        port = local.rsplit(":", 1)[-1]
        received = re.search(r"\bbytes_received:(\d+)", entry)
        if port.isdigit() and int(port) in ports and received:
            total += int(received.group(1))
    return total
