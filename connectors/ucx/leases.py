"""`LeaseBook`: the producer's finished requests whose blocks wait for a consumer.

A request enters when it finishes with ``do_remote_decode`` (its blocks are kept) and leaves
when its consumer reports it is done with them, or when its lease runs out because nobody
pulled it: a consumer that died or never came must not hold blocks forever. Consumers extend
the lease while they wait for a handshake or a pull. The control-plane thread records reports;
the step thread takes what may be freed.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable

from connectors.ucx.metadata import Release


class LeaseBook:
    def __init__(self, lease_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        if lease_s <= 0:
            raise ValueError(f"lease_s must be > 0, got {lease_s}")
        self.lease_s = lease_s
        self._clock = clock
        self._lock = threading.Lock()
        self._deadlines: dict[str, float] = {}
        self._done: dict[str, int] = {}  # consumer finished: request id -> blocks it read

    def __len__(self) -> int:
        with self._lock:
            return len(self._deadlines)

    def hold(self, req_id: str) -> None:
        with self._lock:
            self._deadlines[req_id] = self._clock() + self.lease_s
            self._done.pop(req_id, None)

    def extend(self, req_ids: Iterable[str]) -> list[str]:
        """Renew the leases of ``req_ids``; returns those still held."""
        now = self._clock()
        known = []
        with self._lock:
            for req_id in req_ids:
                if req_id in self._deadlines and req_id not in self._done:
                    self._deadlines[req_id] = max(self._deadlines[req_id], now + self.lease_s)
                    known.append(req_id)
        return known

    def finish(self, done: Iterable[tuple[str, int]]) -> list[str]:
        """The consumer is done with these requests (and read that many blocks of each);
        returns those still held."""
        known = []
        with self._lock:
            for req_id, num_blocks in done:
                if req_id in self._deadlines:
                    self._done[req_id] = num_blocks
                    known.append(req_id)
        return known

    def take(self) -> list[Release]:
        """Requests whose blocks may be freed now: finished ones, then expired ones."""
        now = self._clock()
        with self._lock:
            released = [Release(req_id, num_blocks) for req_id, num_blocks in self._done.items()]
            expired = [
                Release(req_id, expired=True)
                for req_id, deadline in self._deadlines.items()
                if deadline <= now and req_id not in self._done
            ]
            for release in (*released, *expired):
                del self._deadlines[release.req_id]
            self._done.clear()
        return released + expired
