"""Same-host one-sided reads with ``process_vm_readv``: what UCX's cma transport does, with the
failure typed instead of fatal.

UCX reads another process's memory on one host with cma (``process_vm_readv``). An endpoint
without error handling (ours: error handling would take shared memory and cma away) turns a
failed cma read into a process abort, so a producer that dies in the middle of a read would
kill its consumer. Issuing the same system call ourselves keeps the zero-copy path and turns
"no such process" into `PeerUnreachable`. It also batches: one call reads up to ``IOV_MAX``
runs.

It needs what cma needs: the same PID namespace and ptrace permission over the producer
(same user, or ``CAP_SYS_PTRACE``; Yama's ``ptrace_scope`` may forbid it). `DirectReader.probe`
checks both by reading a nonce the producer published; any doubt means the UCX path instead.
"""

from __future__ import annotations

import ctypes
import errno
import functools
import os
from dataclasses import dataclass

import numpy as np

from kvtransfer.transport.errors import PeerUnreachable

# Linux's UIO_MAXIOV: iovecs per call.
IOV_MAX = 1024
# Bytes of one ``struct iovec``.
_IOVEC = 16


class DirectReadUnavailable(Exception):
    """This process may not read the producer's memory directly (use UCX instead)."""


@functools.cache
def _syscall(name: str = "process_vm_readv") -> ctypes._CFuncPtr:  # type: ignore[name-defined]
    libc = ctypes.CDLL(None, use_errno=True)
    function = getattr(libc, name)
    function.argtypes = [
        ctypes.c_int,
        ctypes.c_void_p,
        ctypes.c_ulong,
        ctypes.c_void_p,
        ctypes.c_ulong,
        ctypes.c_ulong,
    ]
    function.restype = ctypes.c_ssize_t
    return function


# Below this many runs (fewer than IOV_MAX) a read is posted as planned: sorting and merging
# would cost more Python than the system calls it saves.
_SORT_MIN = 32


@dataclass(frozen=True)
class DirectPlan:
    """The iovec arrays of a read, built once (a lease row is read twice per pull): per call,
    ``(local iovecs, their count, remote iovecs, their count, bytes)`` with the arrays'
    addresses (``IOV_MAX`` at most on each side); ``arrays`` keeps them alive."""

    calls: tuple[tuple[int, int, int, int, int], ...]
    arrays: tuple[np.ndarray, ...]
    total_bytes: int
    # System calls and iovecs per side: what a read costs the kernel (tests, benchmarks).
    local_iovecs: int
    remote_iovecs: int


def _iovecs(addresses: np.ndarray, lengths: np.ndarray, starts: np.ndarray) -> np.ndarray:
    iov = np.empty((len(starts), 2), dtype=np.uint64)
    iov[:, 0] = addresses[starts]
    iov[:, 1] = np.add.reduceat(lengths, starts) if len(starts) < len(lengths) else lengths
    return iov


def plan_direct(local: np.ndarray, remote: np.ndarray, lengths: np.ndarray) -> DirectPlan:
    """The iovecs copying ``lengths[i]`` bytes at ``remote[i]`` to ``local[i]``.

    ``process_vm_readv`` consumes the remote iovecs as one byte stream and fills the local
    ones as another: the two lists need not pair up. So the runs are put in remote address
    order (the kernel pins the producer's pages per remote iovec, taking its mmap lock each
    time: the dearer side) and each side merges what is adjacent on that side alone. Runs that
    merge on both sides were merged by the planner already.
    """
    count = len(lengths)
    total = int(lengths.sum())
    if count < _SORT_MIN:
        iov_l = np.empty((count, 2), dtype=np.uint64)
        iov_r = np.empty((count, 2), dtype=np.uint64)
        iov_l[:, 0], iov_l[:, 1] = local, lengths
        iov_r[:, 0], iov_r[:, 1] = remote, lengths
        call = (iov_l.ctypes.data, count, iov_r.ctypes.data, count, total)
        return DirectPlan((call,), (iov_l, iov_r), total, count, count)
    order = np.argsort(remote, kind="stable")
    local, remote, lengths = local[order], remote[order], lengths[order]
    # A call holds at most IOV_MAX runs, so at most IOV_MAX iovecs on either side; an iovec
    # never spans two calls.
    chunk = np.zeros(count, dtype=bool)
    chunk[::IOV_MAX] = True
    local_starts = np.flatnonzero(
        chunk | np.concatenate(([True], local[1:] != local[:-1] + lengths[:-1]))
    )
    remote_starts = np.flatnonzero(
        chunk | np.concatenate(([True], remote[1:] != remote[:-1] + lengths[:-1]))
    )
    iov_l = _iovecs(local, lengths, local_starts)
    iov_r = _iovecs(remote, lengths, remote_starts)
    edges = np.arange(0, count + IOV_MAX, IOV_MAX).clip(max=count)
    l_edges = np.searchsorted(local_starts, edges)
    r_edges = np.searchsorted(remote_starts, edges)
    ends = np.concatenate(([0], np.cumsum(lengths)))[edges]
    l_base, r_base = iov_l.ctypes.data, iov_r.ctypes.data
    calls = tuple(
        (
            l_base + int(l_edges[i]) * _IOVEC,
            int(l_edges[i + 1] - l_edges[i]),
            r_base + int(r_edges[i]) * _IOVEC,
            int(r_edges[i + 1] - r_edges[i]),
            int(ends[i + 1] - ends[i]),
        )
        for i in range(len(edges) - 1)
    )
    return DirectPlan(calls, (iov_l, iov_r), total, len(iov_l), len(iov_r))


class DirectReader:
    """Reads runs of process ``pid``'s memory into this process's."""

    _SYSCALL = "process_vm_readv"
    _VERB = "reading"

    def __init__(self, pid: int) -> None:
        self.pid = pid
        # What this reader moved (`counters`): the proof, for tests, of which path did.
        self.reads = 0
        self.bytes_read = 0
        self.system_calls = 0

    def read(self, local: np.ndarray, remote: np.ndarray, lengths: np.ndarray) -> None:
        """Copy ``lengths[i]`` bytes at ``remote[i]`` to ``local[i]``; `PeerUnreachable` if
        the process is gone or the memory is not there any more (nothing is retried)."""
        self.run(plan_direct(local, remote, lengths))

    def run(self, plan: DirectPlan) -> None:
        """Read what `plan_direct` planned (see `read`)."""
        self._copy(plan)
        self.reads += 1
        self.bytes_read += plan.total_bytes
        self.system_calls += len(plan.calls)

    def _copy(self, plan: DirectPlan, syscall: str | None = None) -> None:
        call = _syscall(syscall or self._SYSCALL)
        pid = self.pid
        for local_iov, local_count, remote_iov, remote_count, want in plan.calls:
            done = call(pid, local_iov, local_count, remote_iov, remote_count, 0)
            if done == want:
                continue
            code = ctypes.get_errno() if done < 0 else errno.EFAULT
            if code in (errno.EPERM, errno.EACCES):
                raise DirectReadUnavailable(f"not allowed to access process {self.pid}")
            reason = (
                "the process is gone"
                if code == errno.ESRCH
                else f"{os.strerror(code)} after {max(done, 0)} of {want} bytes"
            )
            raise PeerUnreachable(f"{self._VERB} process {self.pid} failed: {reason}")

    def probe(self, address: int, expected: bytes) -> bool:
        """Whether ``address`` in the process holds ``expected`` (the producer's nonce): the
        same process, reachable. False for anything else (another PID namespace, no right)."""
        buffer = np.zeros(len(expected), dtype=np.uint8)
        try:
            self._copy(
                plan_direct(
                    np.array([buffer.ctypes.data], dtype=np.int64),
                    np.array([address], dtype=np.int64),
                    np.array([len(expected)], dtype=np.int64),
                ),
                "process_vm_readv",  # a writer probes by reading too: the same permission
            )
        except (DirectReadUnavailable, PeerUnreachable):
            return False
        return buffer.tobytes() == expected


class DirectWriter(DirectReader):
    """Writes runs of this process's memory into process ``pid``'s (``process_vm_writev``):
    a plan's local runs are the sources, its remote runs the destinations. Its counters count
    writes. Same permission as reading (`probe` reads the peer's nonce)."""

    _SYSCALL = "process_vm_writev"
    _VERB = "writing"
