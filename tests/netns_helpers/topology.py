"""Test hosts as Linux network namespaces on one private switch.

    with Network("mh") as net:               # namespaces kvt-mh-<pid>-*, subnet 10.231.N.0/24
        prefill = net.add_host("prefill")    # veth to the switch; 10.231.N.2
        ...
        net.partition(prefill)               # its switch port down: unreachable both ways
        net.heal(prefill)
        net.shape(prefill, "2mbit")          # what it sends, at most 2 Mbit/s (tc tbf)
        net.unshape(prefill)

Every network gets its own switch namespace holding a bridge, so nothing is added to the root
namespace (no routes, no interfaces, no sysctls) and subnets of concurrent networks cannot
clash. Each host also gets a second, unrouted interface (``x0``, 10.233.N.i/24, with its peer
``x1`` in the same namespace): like a docker bridge on a real host, an address that peers must
never be told to dial (`listeners`, `connections` and `neighbours` show what a host listens on,
is connected to and has sent to). `close` removes every namespace (their veths go with them);
networks left behind by a killed test run are swept when the next one starts.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from collections.abc import Sequence
from dataclasses import dataclass, field
from types import TracebackType

PREFIX = "kvt-"
_NAME = re.compile(r"^kvt-[a-z0-9]+-(\d+)-[a-z0-9]+$")
_SUBNET_PREFIX = "10.231"
_UNROUTED_PREFIX = "10.233"
_next_network = 0
# A token bucket (`Network.shape`) whose queue holds at most 50 ms of traffic.
_TBF = ("tbf", "burst", "16kb", "latency", "50ms")


class NetnsUnavailable(RuntimeError):
    """This machine cannot host namespace tests (not root, no ``ip``, no veth or bridge)."""


@dataclass(frozen=True)
class Host:
    """A test host: a network namespace with one address on the shared switch."""

    name: str
    namespace: str
    address: str
    unrouted_address: str
    # This host's port on the switch (in the switch namespace): down = partitioned.
    port: str

    def command(self, argv: Sequence[str]) -> list[str]:
        """``argv`` run inside this host's network namespace."""
        return ["ip", "netns", "exec", self.namespace, *argv]


@dataclass(frozen=True)
class Connection:
    """One TCP socket of a test host, from ``ss``."""

    state: str
    local_address: str
    local_port: int
    peer_address: str
    peer_port: int
    process: str
    # Bytes not yet read by the process (Recv-Q) and not yet acknowledged by the peer (Send-Q).
    recv_q: int = 0
    send_q: int = 0


def _endpoint(field: str) -> tuple[str, int]:
    address, port = field.rsplit(":", 1)
    return address.strip("[]").removeprefix("::ffff:"), int(port)


@dataclass
class Network:
    tag: str
    subnet: int = field(init=False)
    switch: str = field(init=False)
    hosts: list[Host] = field(default_factory=list, init=False)

    def __post_init__(self) -> None:
        global _next_network
        if not re.fullmatch(r"[a-z0-9]{1,8}", self.tag):
            raise ValueError(f"tag must be 1-8 lowercase letters or digits, got {self.tag!r}")
        check_available()
        sweep_stale()
        # Private to this switch, so only uniqueness within one process matters for clarity.
        self.subnet = (os.getpid() + _next_network) % 250 + 1
        _next_network += 1
        self.switch = self._namespace("sw")
        _ip("netns", "add", self.switch)
        try:
            _ip("-n", self.switch, "link", "set", "lo", "up")
            _ip("-n", self.switch, "link", "add", "br0", "type", "bridge")
            _ip("-n", self.switch, "link", "set", "br0", "up")
        except BaseException:
            self.close()
            raise

    def add_host(self, name: str) -> Host:
        index = len(self.hosts) + 2
        if not re.fullmatch(r"[a-z0-9]{1,8}", name) or index > 250:
            raise ValueError(f"bad host name {name!r} or too many hosts")
        host = Host(
            name=name,
            namespace=self._namespace(name),
            address=f"{_SUBNET_PREFIX}.{self.subnet}.{index}",
            unrouted_address=f"{_UNROUTED_PREFIX}.{self.subnet}.{index}",
            port=f"p-{name}",
        )
        self.hosts.append(host)
        ns, sw = host.namespace, self.switch
        _ip("netns", "add", ns)
        _ip("-n", ns, "link", "set", "lo", "up")
        _ip("-n", sw, "link", "add", host.port, "type", "veth", "peer", "name", "eth0", "netns", ns)
        _ip("-n", sw, "link", "set", host.port, "master", "br0")
        _ip("-n", sw, "link", "set", host.port, "up")
        _ip("-n", ns, "addr", "add", f"{host.address}/24", "dev", "eth0")
        _ip("-n", ns, "link", "set", "eth0", "up")
        _ip("-n", ns, "link", "add", "x0", "type", "veth", "peer", "name", "x1")
        _ip("-n", ns, "addr", "add", f"{host.unrouted_address}/24", "dev", "x0")
        _ip("-n", ns, "link", "set", "x0", "up")
        _ip("-n", ns, "link", "set", "x1", "up")
        return host

    def partition(self, host: Host) -> None:
        """Cut ``host`` off the switch: packets to and from it are dropped, sockets stay open."""
        _ip("-n", self.switch, "link", "set", host.port, "down")

    def heal(self, host: Host) -> None:
        _ip("-n", self.switch, "link", "set", host.port, "up")

    def shape(self, host: Host, rate: str) -> None:
        """Send what ``host`` sends to the switch at ``rate`` at most (``tc`` notation:
        ``2mbit``), through a token bucket with a short queue: a bulk transfer is slowed while a
        small packet (a SYN-ACK) still leaves within tens of milliseconds."""
        _tc(host.namespace, "qdisc", "replace", "dev", "eth0", "root", *_TBF, "rate", rate)

    def unshape(self, host: Host) -> None:
        _tc(host.namespace, "qdisc", "del", "dev", "eth0", "root")

    def listening(self, host: Host) -> list[tuple[str, str]]:
        """``(local address, process)`` of every TCP/UDP socket listening in ``host``; the
        address without port, brackets or the ``::ffff:`` of IPv4-mapped IPv6 sockets."""
        return [(address, process) for address, _, process in self.listeners(host)]

    def listeners(self, host: Host) -> list[tuple[str, int, str]]:
        """`listening`, with each socket's port: ``(local address, port, process)``."""
        done = subprocess.run(
            ["ip", "netns", "exec", host.namespace, "ss", "-lntupH"],
            capture_output=True,
            text=True,
            check=True,
        )
        sockets = []
        for line in done.stdout.splitlines():
            fields = line.split()
            # Netid State Recv-Q Send-Q Local Peer [Process]
            address, port = _endpoint(fields[4])
            sockets.append((address, port, " ".join(fields[6:])))
        return sockets

    def connections(self, host: Host) -> list[Connection]:
        """Every TCP socket in ``host`` that is not listening, whatever its state (connecting,
        established, closing, TIME-WAIT), addresses as in `listening`."""
        done = subprocess.run(
            ["ip", "netns", "exec", host.namespace, "ss", "-tanpH"],
            capture_output=True,
            text=True,
            check=True,
        )
        connections = []
        for line in done.stdout.splitlines():
            fields = line.split()
            # State Recv-Q Send-Q Local Peer [Process]
            if fields[0] == "LISTEN":
                continue
            local, peer = (_endpoint(field) for field in fields[3:5])
            connections.append(
                Connection(
                    fields[0],
                    *local,
                    *peer,
                    " ".join(fields[5:]),
                    recv_q=int(fields[1]),
                    send_q=int(fields[2]),
                )
            )
        return connections

    def neighbours(self, host: Host) -> list[str]:
        """The IPv4 addresses ``host`` has looked up a link-layer address for (``ip neigh``):
        every address it sent a packet to on a directly attached subnet, answered or not."""
        done = subprocess.run(
            ["ip", "-n", host.namespace, "-4", "neigh", "show"],
            capture_output=True,
            text=True,
            check=True,
        )
        return [line.split()[0] for line in done.stdout.splitlines() if line.strip()]

    def close(self) -> None:
        """Delete every namespace of this network; safe to call twice."""
        for namespace in [h.namespace for h in self.hosts] + [self.switch]:
            subprocess.run(["ip", "netns", "del", namespace], capture_output=True, check=False)
        self.hosts.clear()

    def __enter__(self) -> Network:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def _namespace(self, name: str) -> str:
        return f"{PREFIX}{self.tag}-{os.getpid()}-{name}"


def check_available() -> None:
    """`NetnsUnavailable` naming what is missing."""
    if os.geteuid() != 0:
        raise NetnsUnavailable("network namespace tests need root (ip netns add)")
    for tool in ("ip", "ss"):
        if shutil.which(tool) is None:
            raise NetnsUnavailable(f"network namespace tests need the {tool!r} command")
    probe = f"{PREFIX}probe-{os.getpid()}-x"
    try:
        _ip("netns", "add", probe)
        _ip("-n", probe, "link", "add", "v0", "type", "veth", "peer", "name", "v1")
        _ip("-n", probe, "link", "add", "b0", "type", "bridge")
    except subprocess.CalledProcessError as exc:
        raise NetnsUnavailable(
            f"cannot create network namespaces, veth pairs or bridges here: {exc.stderr.strip()}"
        ) from None
    finally:
        subprocess.run(["ip", "netns", "del", probe], capture_output=True, check=False)


def check_shaping() -> None:
    """`NetnsUnavailable` unless `Network.shape` works here (``tc`` and its token bucket)."""
    check_available()
    if shutil.which("tc") is None:
        raise NetnsUnavailable("shaping a test host's link needs the 'tc' command")
    probe = f"{PREFIX}probe-{os.getpid()}-tc"
    try:
        _ip("netns", "add", probe)
        _ip("-n", probe, "link", "add", "v0", "type", "veth", "peer", "name", "v1")
        _tc(probe, "qdisc", "add", "dev", "v0", "root", *_TBF, "rate", "1mbit")
    except subprocess.CalledProcessError as exc:
        raise NetnsUnavailable(
            f"cannot add a token-bucket qdisc (tc tbf) here: {exc.stderr.strip()}"
        ) from None
    finally:
        subprocess.run(["ip", "netns", "del", probe], capture_output=True, check=False)


def sweep_stale() -> None:
    """Delete namespaces of networks whose test process is gone (a killed earlier run)."""
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=False)
    for line in listed.stdout.splitlines():
        name = line.split(" ", 1)[0]
        match = _NAME.match(name)
        if match and not _alive(int(match.group(1))):
            subprocess.run(["ip", "netns", "del", name], capture_output=True, check=False)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], capture_output=True, text=True, check=True)


def _tc(namespace: str, *args: str) -> None:
    subprocess.run(["tc", "-n", namespace, *args], capture_output=True, text=True, check=True)
