"""`LeaseBook`: the producer's finished requests whose blocks wait for a consumer.

A request enters when it finishes with ``do_remote_decode`` (its blocks are kept, and a secret
is handed out with its params) and leaves when its consumer reports it is done with them, or
when its lease runs out because nobody pulled it: a consumer that died or never came must not
hold blocks forever. Consumers extend the lease while they wait for a handshake or a pull.
Every report names the request and presents its secret: a report with another secret is refused
and changes nothing, so nobody can free or pin another request's KV. The control-plane thread
records reports; the step thread takes what may be freed.

Lease time is the time the producer could hear keep-alives. The server that hears them ticks
(`heard`); while its ticks stall (its process starved of CPU or of the GIL: a TP 2 vLLM engine
steps continuously while it holds KV for a consumer, on the same cores as everything else) the
lease clock stops, so a consumer that kept sending keep-alives nobody could receive never sees
its lease expire. A hard limit (``lease_s + max_stall_s`` without a keep-alive, wall clock) still
frees the blocks of a consumer that really went away while the server was starved.
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


# Ticks further apart than this mean the server could not run: the lease clock stops.
STALL_S = 1.0


@dataclass
class _Lease:
    deadline: float  # on the heard clock
    hard_deadline: float  # on the wall clock
    digest: bytes = field(repr=False)
    done: int | None = None  # blocks the consumer read, once it reported done


class LeaseBook:
    def __init__(
        self,
        lease_s: float,
        clock: Callable[[], float] = time.monotonic,
        *,
        max_stall_s: float | None = None,
    ) -> None:
        if lease_s <= 0:
            raise ValueError(f"lease_s must be > 0, got {lease_s}")
        self.lease_s = lease_s
        self.max_stall_s = 3 * lease_s if max_stall_s is None else max_stall_s
        if self.max_stall_s < 0:
            raise ValueError(f"max_stall_s must be >= 0, got {self.max_stall_s}")
        self._clock = clock
        self._lock = threading.Lock()
        self._leases: dict[str, _Lease] = {}
        # The heard clock: its value and the wall time at the server's last tick (None: no
        # server ticks, the heard clock is the wall clock).
        self._heard = 0.0
        self._heard_at: float | None = None
        # Called after a consumer reported done, so the engine frees the blocks without a poll.
        self.on_finish: Callable[[], None] | None = None

    def __len__(self) -> int:
        with self._lock:
            return len(self._leases)

    def heard(self) -> None:
        """The server that hears keep-alives ran just now (called from its loop, often)."""
        now = self._clock()
        with self._lock:
            self._heard = self._heard_now(now)
            self._heard_at = now

    def _heard_now(self, now: float) -> float:
        if self._heard_at is None:
            return now
        # Between timely ticks the heard clock keeps pace with the wall clock; past STALL_S
        # without a tick it stops until the server runs again.
        return self._heard + min(now - self._heard_at, STALL_S)

    def hold(self, req_id: str, secret: str) -> None:
        now = self._clock()
        with self._lock:
            self._leases[req_id] = _Lease(
                self._heard_now(now) + self.lease_s,
                now + self.lease_s + self.max_stall_s,
                secret_digest(secret),
            )

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
            heard = self._heard_now(now)
            for req_id, lease in self._check(claims):
                if lease.done is None:
                    lease.deadline = max(lease.deadline, heard + self.lease_s)
                    lease.hard_deadline = max(
                        lease.hard_deadline, now + self.lease_s + self.max_stall_s
                    )
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
            heard = self._heard_now(now)
            released = [
                Release(req_id, lease.done)
                for req_id, lease in self._leases.items()
                if lease.done is not None
            ]
            expired = [
                Release(req_id, expired=True)
                for req_id, lease in self._leases.items()
                if lease.done is None and (lease.deadline <= heard or lease.hard_deadline <= now)
            ]
            for release in (*released, *expired):
                del self._leases[release.req_id]
        return released + expired
