"""`Placement`: where a daemon computes (its host and the CPUs it may run on), as it reports it in
``GetStatus``, and whether two daemons would compete for the same cores."""

from __future__ import annotations

import os
import socket
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

_BOOT_ID = Path("/proc/sys/kernel/random/boot_id")


@dataclass(frozen=True)
class Placement:
    """``host_id``: the kernel's boot id (one per running kernel: processes in different network
    namespaces or containers of one machine share it), else the host name. ``cpus``: the CPUs
    the process may run on (its affinity)."""

    host_id: str
    cpus: frozenset[int]

    @classmethod
    def of_this_process(cls) -> Placement:
        return cls(_host_id(), frozenset(os.sched_getaffinity(0)))

    @classmethod
    def reported(cls, host_id: str, cpus: Iterable[int]) -> Placement | None:
        """A peer's placement from its status; None when it reported none (an older daemon)."""
        return cls(host_id, frozenset(cpus)) if host_id else None

    def shares_cores(self, other: Placement) -> bool:
        return self.host_id == other.host_id and bool(self.cpus & other.cpus)


def _host_id() -> str:
    try:
        return _BOOT_ID.read_text().strip() or socket.gethostname()
    except OSError:
        return socket.gethostname()
