"""Where an agent runs, and the address it publishes so that peers pick transports that work.

UCX judges a peer with the same boot id and IPC namespace to be on this host and then moves
data over shared memory (sysv, posix, cma). Across network namespaces of one host (containers
sharing the host's IPC, test hosts made with ``ip netns``) that fails silently: a receiver
sleeping on the worker's event descriptor (as `UcxLoop` does) is woken by a datagram to an
abstract Unix socket, and those live in the sender's network namespace, so the wake-up never
arrives and with UCX's adaptive progress the message is never even polled. Measured with UCX
1.21: every pull timed out.

So an agent publishes `WorkerAddresses`: its `Locality` (boot id and network namespace), its
full UCX address (shared memory and network devices) and its network-only address. A peer
dials the full address only from the same locality, the network-only one otherwise; equality
is symmetric, so requests and replies take the same kind of path. Within one locality UCX
still checks IPC and PID namespaces itself before using shared memory.
"""

from __future__ import annotations

import os
import secrets
import struct
import uuid
from dataclasses import dataclass
from pathlib import Path

from kvtransfer.transport.errors import InvalidPeerAddress

_BOOT_ID = Path("/proc/sys/kernel/random/boot_id")
_NET_NAMESPACE = "/proc/self/ns/net"
_MAGIC = b"KVUA"
_VERSION = 1
# magic, version, reserved, boot id, net namespace device and inode, address lengths
_HEADER = struct.Struct("<4sBB16sQQHH")


@dataclass(frozen=True)
class Locality:
    """A host (its boot id) and a network namespace on it (``nsfs`` device and inode).

    Namespace inode numbers repeat across hosts (the initial one is the same everywhere), so
    only the pair identifies one.
    """

    boot_id: bytes
    netns_dev: int
    netns_ino: int

    @classmethod
    def current(cls) -> Locality:
        """This process's locality; an unmatchable one where it cannot be read (safe: every
        peer then counts as remote)."""
        try:
            boot_id = uuid.UUID(_BOOT_ID.read_text().strip()).bytes
            namespace = os.stat(_NET_NAMESPACE)
        except (OSError, ValueError):
            return cls.unique()
        return cls(boot_id, namespace.st_dev, namespace.st_ino)

    @classmethod
    def unique(cls) -> Locality:
        """A locality no other agent has: every peer uses the network."""
        return cls(secrets.token_bytes(16), 0, 0)


@dataclass(frozen=True)
class WorkerAddresses:
    """What an agent publishes: its locality, full UCX address and network-only address."""

    locality: Locality
    full: bytes
    net: bytes

    def pack(self) -> bytes:
        header = _HEADER.pack(
            _MAGIC,
            _VERSION,
            0,
            self.locality.boot_id,
            self.locality.netns_dev,
            self.locality.netns_ino,
            len(self.full),
            len(self.net),
        )
        return header + self.full + self.net

    @classmethod
    def unpack(cls, data: bytes) -> WorkerAddresses:
        """`InvalidPeerAddress` for anything that is not a packed `WorkerAddresses`."""
        view = bytes(data)
        if len(view) < _HEADER.size:
            raise InvalidPeerAddress(
                f"UCX addresses are {len(view)} bytes, shorter than the {_HEADER.size}-byte header"
            )
        magic, version, _, boot_id, dev, ino, full_len, net_len = _HEADER.unpack_from(view)
        if magic != _MAGIC:
            raise InvalidPeerAddress(f"UCX addresses have magic {magic!r}, expected {_MAGIC!r}")
        if version != _VERSION:
            raise InvalidPeerAddress(
                f"UCX addresses have version {version}, this agent reads {_VERSION}"
            )
        if full_len == 0 or net_len == 0 or len(view) != _HEADER.size + full_len + net_len:
            raise InvalidPeerAddress(
                f"UCX addresses declare {full_len} + {net_len} bytes but carry "
                f"{len(view) - _HEADER.size}"
            )
        full = view[_HEADER.size : _HEADER.size + full_len]
        net = view[_HEADER.size + full_len :]
        return cls(Locality(boot_id, dev, ino), full, net)

    def for_peer_at(self, locality: Locality) -> bytes:
        """The UCX address a peer at ``locality`` dials: shared memory only from here."""
        return self.full if locality == self.locality else self.net
