"""`Wakeup`: how an idle engine sleeps until a KV transfer needs it, instead of polling.

An engine whose requests all wait on transfers has nothing to compute; it must still run a
step as soon as a load or save finishes, because only a step collects completions. Connectors
that say so (`KVConnectorBase_V1.set_completion_callback` returned True) call a
`WakeSignal` from whatever thread finishes a transfer, in whatever worker process; the engine
waits on the `Wakeup`'s reader, plus the readers of anything else that should end its wait
(a new request), with a cap as a safety net.

One one-way pipe serves all workers: each signal is a message far below ``PIPE_BUF`` bytes, so
writers in several processes never interleave.
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import threading
from collections.abc import Sequence
from multiprocessing.connection import Connection, wait


class WakeSignal:
    """The writing end: callable from any thread; a closed reader is ignored (shutting down)."""

    def __init__(self, writer: Connection) -> None:
        self._writer = writer
        self._lock = threading.Lock()

    def __call__(self) -> None:
        with self._lock, contextlib.suppress(OSError, ValueError):
            self._writer.send_bytes(b"")

    # Pickled into spawned worker processes: only the connection travels.
    def __getstate__(self) -> Connection:
        return self._writer

    def __setstate__(self, writer: Connection) -> None:
        self.__init__(writer)


class Wakeup:
    """A reader and the `WakeSignal` that wakes it."""

    def __init__(self) -> None:
        self.reader, writer = mp.Pipe(duplex=False)
        self.signal = WakeSignal(writer)

    def set(self) -> None:
        self.signal()

    def drain(self) -> bool:
        """Consume every pending wake-up; True if there was one."""
        woken = False
        while self.reader.poll():
            self.reader.recv_bytes()
            woken = True
        return woken

    def wait(self, timeout_s: float, others: Sequence[Wakeup] = ()) -> None:
        """Return once this or one of ``others`` was set (or after ``timeout_s``); consumes
        this one's wake-ups, leaves the others' to their owners."""
        if not self.drain() and not any(o.reader.poll() for o in others):
            wait([self.reader, *(o.reader for o in others)], timeout_s)
            self.drain()

    def close(self) -> None:
        self.reader.close()
