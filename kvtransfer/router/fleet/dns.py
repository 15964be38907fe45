"""DNS names as sources of instances: ``--prefill dns:NAME:PORT`` (`DnsTarget`) is resolved at
start and every ``dns_interval_s``, and one instance per address it resolves to is added or
removed to match (a headless Kubernetes Service gives one per ready pod). A name that does not
resolve (NXDOMAIN: a Service with no ready pod) empties its instances; any other resolution
failure keeps them."""

from __future__ import annotations

import asyncio
import errno
import logging
import socket
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

from kvtransfer.router.fleet.instance import Instance

logger = logging.getLogger("kvtransfer.router.fleet")

Resolver = Callable[[str, int], Awaitable[Sequence[str]]]

_EMPTY_ANSWERS = {socket.EAI_NONAME, getattr(socket, "EAI_NODATA", errno.ENODATA)}


async def resolve_host(name: str, port: int) -> list[str]:
    """The default `Resolver`: every address ``name`` resolves to, IPv4 and IPv6."""
    infos = await asyncio.get_running_loop().getaddrinfo(name, port, type=socket.SOCK_STREAM)
    return sorted({str(info[4][0]) for info in infos})


def host_port(host: str, port: int) -> str:
    """``HOST:PORT``, an IPv6 literal in brackets."""
    if ":" in host and not host.startswith("["):
        return f"[{host}]:{port}"
    return f"{host}:{port}"


@dataclass(frozen=True)
class DnsTarget:
    """``dns:NAME:PORT``: NAME's addresses, each an instance on PORT."""

    role: str
    name: str
    port: int

    @property
    def source(self) -> str:
        return f"dns:{self.name}:{self.port}"


class Members(Protocol):
    """What resolving changes: the fleet's membership."""

    def instances(self, role: str | None = None) -> list[Instance]: ...

    def get(self, address: str) -> Instance | None: ...

    def add(self, role: str, address: str, source: str = ...) -> Instance: ...

    def remove(self, address: str) -> Instance: ...

    async def check_instances(self, instances: Sequence[Instance]) -> None: ...


class DnsWatcher:
    """Keeps the instances of every `DnsTarget` matching what its name resolves to."""

    def __init__(
        self,
        members: Members,
        targets: Sequence[DnsTarget],
        interval_s: float,
        resolver: Resolver,
    ) -> None:
        self._members = members
        self.targets = tuple(targets)
        self._interval_s = interval_s
        self._resolver = resolver

    async def resolve(self, target: DnsTarget) -> None:
        """Resolve ``target`` once; add and remove its instances to match (then check the new
        ones)."""
        try:
            hosts = await self._resolver(target.name, target.port)
        except socket.gaierror as exc:
            if exc.errno not in _EMPTY_ANSWERS:
                logger.warning("%s did not resolve (%s): instances kept", target.source, exc)
                return
            hosts = []
        except OSError as exc:
            logger.warning("%s did not resolve (%s): instances kept", target.source, exc)
            return
        wanted = {host_port(host, target.port) for host in hosts}
        mine = {
            i.address for i in self._members.instances(target.role) if i.source == target.source
        }
        added = []
        for address in sorted(wanted - mine):
            present = self._members.get(address)
            if present is not None:
                logger.debug("%s: %s is in the fleet already", target.source, address)
                continue
            added.append(self._members.add(target.role, address, target.source))
        for address in sorted(mine - wanted):
            self._members.remove(address)
        if added:
            await self._members.check_instances(added)

    async def run_forever(self) -> None:
        while True:
            await asyncio.sleep(self._interval_s)
            for target in self.targets:
                try:
                    await self.resolve(target)
                except Exception:  # a bug here must not silently end resolving
                    logger.exception("%s: resolution failed", target.source)
