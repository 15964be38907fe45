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

import numpy as np

from kvtransfer.transport.errors import PeerUnreachable

# Linux's UIO_MAXIOV: iovecs per call.
IOV_MAX = 1024


class DirectReadUnavailable(Exception):
    """This process may not read the producer's memory directly (use UCX instead)."""


@functools.cache
def _syscall() -> ctypes._CFuncPtr:  # type: ignore[name-defined]
    libc = ctypes.CDLL(None, use_errno=True)
    function = libc.process_vm_readv
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


class DirectReader:
    """Reads runs of process ``pid``'s memory into this process's."""

    def __init__(self, pid: int) -> None:
        self.pid = pid

    def read(self, local: np.ndarray, remote: np.ndarray, lengths: np.ndarray) -> None:
        """Copy ``lengths[i]`` bytes at ``remote[i]`` to ``local[i]``; `PeerUnreachable` if
        the process is gone or the memory is not there any more (nothing is retried)."""
        call = _syscall()
        count = len(lengths)
        local_iov = np.empty((count, 2), dtype=np.uint64)
        remote_iov = np.empty((count, 2), dtype=np.uint64)
        local_iov[:, 0], local_iov[:, 1] = local, lengths
        remote_iov[:, 0], remote_iov[:, 1] = remote, lengths
        for start in range(0, count, IOV_MAX):
            stop = min(start + IOV_MAX, count)
            want = int(lengths[start:stop].sum())
            done = call(
                self.pid,
                local_iov[start:].ctypes.data,
                stop - start,
                remote_iov[start:].ctypes.data,
                stop - start,
                0,
            )
            if done == want:
                continue
            code = ctypes.get_errno() if done < 0 else errno.EFAULT
            if code in (errno.EPERM, errno.EACCES):
                raise DirectReadUnavailable(f"not allowed to read process {self.pid}")
            reason = (
                "the process is gone"
                if code == errno.ESRCH
                else f"{os.strerror(code)} after {max(done, 0)} of {want} bytes"
            )
            raise PeerUnreachable(f"reading producer process {self.pid} failed: {reason}")

    def probe(self, address: int, expected: bytes) -> bool:
        """Whether ``address`` in the process holds ``expected`` (the producer's nonce): the
        same process, reachable. False for anything else (another PID namespace, no right)."""
        buffer = np.zeros(len(expected), dtype=np.uint8)
        try:
            self.read(
                np.array([buffer.ctypes.data], dtype=np.uint64),
                np.array([address], dtype=np.uint64),
                np.array([len(expected)], dtype=np.uint64),
            )
        except (DirectReadUnavailable, PeerUnreachable):
            return False
        return buffer.tobytes() == expected
