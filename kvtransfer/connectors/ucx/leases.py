"""`LeaseBook`: the producer's finished requests whose blocks wait for a consumer.

A request enters when it finishes with ``do_remote_decode`` (its blocks are kept, and a secret
is handed out with its params) and leaves when its consumer reports it is done with them, or
when its lease runs out because nobody pulled it: a consumer that died or never came must not
hold blocks forever. Consumers extend the lease while they wait for a handshake or a pull.
Every report names the request and presents its secret: a report with another secret is refused
and changes nothing, so nobody can free or pin another request's KV. The control-plane thread
records reports; the step thread takes what may be freed.
"""

from __future__ import annotations

import hmac
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from kvtransfer.connectors.ucx.metadata import Release
from kvtransfer.transport import secret_digest


class LeaseSecretMismatch(PermissionError):
    """A report presented the wrong secret for a held request; nothing was changed."""

    def __init__(self, req_ids: list[str]) -> None:
        super().__init__(f"wrong kv secret for held request(s) {req_ids}: not released or extended")
        self.req_ids = req_ids


@dataclass
class _Lease:
    deadline: float
    digest: bytes = field(repr=False)
    done: int | None = None  # blocks the consumer read, once it reported done


class LeaseBook:
    def __init__(self, lease_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        if lease_s <= 0:
            raise ValueError(f"lease_s must be > 0, got {lease_s}")
        self.lease_s = lease_s
        self._clock = clock
        self._lock = threading.Lock()
        self._leases: dict[str, _Lease] = {}
        # Called after a consumer reported done, so the engine frees the blocks without a poll.
        self.on_finish: Callable[[], None] | None = None

    def __len__(self) -> int:
        with self._lock:
            return len(self._leases)

    def hold(self, req_id: str, secret: str) -> None:
        with self._lock:
            self._leases[req_id] = _Lease(self._clock() + self.lease_s, secret_digest(secret))

    def _check(self, claims: Iterable[tuple[str, str]]) -> list[tuple[str, _Lease]]:
        """The held leases among ``claims`` (id, secret); raises if any secret is wrong."""
        held, wrong = [], []
        for req_id, secret in claims:
            lease = self._leases.get(req_id)
            if lease is None:
                continue
            if not hmac.compare_digest(lease.digest, secret_digest(secret)):
                wrong.append(req_id)
            else:
                held.append((req_id, lease))
        if wrong:
            raise LeaseSecretMismatch(wrong)
        return held

    def extend(self, claims: Iterable[tuple[str, str]]) -> list[str]:
        """Renew the leases of ``claims`` (request id, secret); returns those still held."""
        now = self._clock()
        known = []
        with self._lock:
            for req_id, lease in self._check(claims):
                if lease.done is None:
                    lease.deadline = max(lease.deadline, now + self.lease_s)
                    known.append(req_id)
        return known

    def finish(self, done: Iterable[tuple[str, int, str]]) -> list[str]:
        """The consumer is done with these requests (id, blocks it read, secret); returns
        those still held. Nothing changes if any secret is wrong."""
        done = list(done)
        read = {req_id: num_blocks for req_id, num_blocks, _ in done}
        known = []
        with self._lock:
            for req_id, lease in self._check((r, s) for r, _, s in done):
                lease.done = read[req_id]
                known.append(req_id)
        if known and self.on_finish is not None:
            self.on_finish()
        return known

    def take(self) -> list[Release]:
        """Requests whose blocks may be freed now: finished ones, then expired ones."""
        now = self._clock()
        with self._lock:
            released = [
                Release(req_id, lease.done)
                for req_id, lease in self._leases.items()
                if lease.done is not None
            ]
            expired = [
                Release(req_id, expired=True)
                for req_id, lease in self._leases.items()
                if lease.done is None and lease.deadline <= now
            ]
            for release in (*released, *expired):
                del self._leases[release.req_id]
        return released + expired
