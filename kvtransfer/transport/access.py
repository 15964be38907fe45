"""Who may read which blocks: leases as capabilities on the serving side of the data plane.

A producer that keeps a finished request's blocks for a consumer hands out one unguessable
secret with them (`new_secret`). Its transfer agents learn a *grant* for that lease: the
secret's digest, the lease's blocks in prompt order, and the digest of the prompt tokens whose
KV they hold. A pull names the lease, presents the secret and the prompt digest the consumer
computed from its own prompt, and says at which position of the lease its blocks start; it is
served only if all of that matches, so a consumer cannot have the blocks in another order,
twice, or under a prompt they were not computed for (its prefix cache would then hand that KV
to other requests of that prompt). When
the lease ends (released or expired) the grant is *revoked*: pulls are refused from then on, and
revoking waits for gathers of that lease already running, so once `revoke` returns none of its
blocks is read again and the engine may reuse them.

Grants travel from the producer's scheduler to its workers once per engine step, so a pull can
arrive a moment before its grant: the server parks such a pull until the grant comes (up to
``grant_wait_s``, see `KVServer`) instead of refusing a legitimate consumer. Revoked leases are
remembered (bounded) so that a pull of a released lease is refused at once rather than after that
wait.
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import secrets
import threading
import time
from collections import OrderedDict
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field

from kvtransfer.transport.errors import ErrorCode, TransportError
from kvtransfer.transport.lease_table import LeaseTable

# Revoked lease ids remembered for an immediate refusal; older ones wait out grant_wait_s.
_REVOKED_MEMORY = 65536
# How long `revoke` waits for a gather of the lease that is still running.
_REVOKE_WAIT_S = 30.0
SECRET_BYTES = 32


def new_secret() -> str:
    """A fresh lease secret: 256 random bits, URL-safe text."""
    return secrets.token_urlsafe(SECRET_BYTES)


def secret_digest(secret: str) -> bytes:
    """What a server stores instead of the secret itself."""
    return hashlib.sha256(secret.encode()).digest()


class AccessDenied(TransportError, PermissionError):
    """A pull was refused: unknown or ended lease, wrong secret, or blocks outside the lease."""

    code = ErrorCode.ACCESS_DENIED


class LeaseNotGranted(AccessDenied):
    """The serving worker has no record of the lease: never granted, not granted yet (a busy
    producer's workers record a grant at their next step), or ended so long ago it is
    forgotten. A reader that knows the producer still holds the request may ask again."""

    code = ErrorCode.LEASE_NOT_GRANTED


class WritesStopped(TransportError):
    """A push's producer stopped writing before every layer landed: the blocks hold nothing
    usable (the load fails, or recomputes under its policy)."""


class LeaseEndedDuringRead(AccessDenied):
    """RMA mode: the lease ended while a one-sided read ran, so the bytes read may already be
    another request's KV; the pull fails and what it wrote must not be used."""


@dataclass(frozen=True)
class LeaseAccess:
    """What a pull presents: the lease (the producer's request id), its secret, the digest of
    the prompt the consumer will use the KV for, and the position in the lease's block list of
    the pull's first block. ``lease_blocks``: the lease's whole block list as the consumer was
    told it (its params); a one-sided read checks it against the producer's lease table, and
    its own blocks against it, since no producer checks them (empty: not checked)."""

    lease_id: str
    secret: str
    prompt_digest: str = ""
    block_offset: int = 0
    lease_blocks: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        for name in ("lease_id", "secret"):
            value = getattr(self, name)
            if not isinstance(value, str) or not value:
                raise ValueError(f"LeaseAccess.{name} must be a non-empty str, got {value!r}")
        if not isinstance(self.prompt_digest, str):
            raise ValueError(f"LeaseAccess.prompt_digest must be a str, got {self.prompt_digest!r}")
        offset = self.block_offset
        if isinstance(offset, bool) or not isinstance(offset, int) or offset < 0:
            raise ValueError(f"LeaseAccess.block_offset must be an int >= 0, got {offset!r}")

    def at(self, offset: int) -> LeaseAccess:
        """The same access for a part of the pull starting ``offset`` blocks further."""
        return LeaseAccess(
            self.lease_id,
            self.secret,
            self.prompt_digest,
            self.block_offset + offset,
            self.lease_blocks,
        )

    def __repr__(self) -> str:
        # Never print the secret (logs, tracebacks).
        return f"LeaseAccess({self.lease_id!r}, secret=<redacted>, offset={self.block_offset})"


@dataclass
class _Grant:
    digest: bytes
    block_ids: tuple[int, ...]
    prompt_digest: str
    # Layers whose KV is still being computed (a lease granted while its prefill runs).
    pending: set[str] = field(default_factory=set)
    # Gathers reading its blocks (a push grant: producers writing them, `begin_write`).
    readers: int = 0
    # A push grant: per layer, the landed reports still expected (one per producer worker
    # writing it: several when the producer's TP ranks each write their heads; `end_write`).
    unlanded: dict[str, int] = field(default_factory=dict)
    # A push grant whose producer said its writes stopped before all landed: why (its words).
    stopped: str = ""


class LeaseGrants:
    """The grants one serving agent honours. Thread-safe."""

    def __init__(self, grant_wait_s: float = 5.0) -> None:
        if grant_wait_s < 0:
            raise ValueError(f"grant_wait_s must be >= 0, got {grant_wait_s}")
        self.grant_wait_s = grant_wait_s
        self._cond = threading.Condition()
        self._grants: dict[str, _Grant] = {}
        # Ended leases and why they ended, for the refusal of a late pull.
        self._revoked: OrderedDict[str, str] = OrderedDict()
        # Leases ended by `revoke_nowait` that gathers still read.
        self._draining: dict[str, _Grant] = {}
        self._table: LeaseTable | None = None

    def publish_to(self, table: LeaseTable) -> None:
        """Mirror every grant into ``table`` from now on (RMA mode: consumers read it)."""
        with self._cond:
            self._table = table
            for lease_id, grant in self._grants.items():
                table.publish(
                    lease_id, grant.digest, grant.prompt_digest, grant.pending, grant.block_ids
                )

    def __len__(self) -> int:
        with self._cond:
            return len(self._grants)

    def lease_ids(self) -> list[str]:
        """The leases granted now."""
        with self._cond:
            return list(self._grants)

    def grant(
        self,
        lease_id: str,
        digest: bytes,
        block_ids: Iterable[int],
        prompt_digest: str = "",
        pending_layers: Iterable[str] = (),
    ) -> None:
        """Allow reads of ``block_ids`` (in this order) to whoever presents the secret hashing
        to ``digest`` and ``prompt_digest`` (empty: not checked); reads of ``pending_layers``
        wait until `layer_ready` says their KV is complete."""
        with self._cond:
            self._revoked.pop(lease_id, None)
            grant = _Grant(digest, tuple(block_ids), prompt_digest, set(pending_layers))
            self._grants[lease_id] = grant
            if self._table is not None:
                self._table.publish(lease_id, digest, prompt_digest, grant.pending, grant.block_ids)
            self._cond.notify_all()

    def grant_push(
        self,
        lease_id: str,
        digest: bytes,
        block_ids: Iterable[int],
        layer_names: Iterable[str],
        prompt_digest: str = "",
        writers: int = 1,
    ) -> None:
        """Allow writes of ``layer_names`` into ``block_ids`` (this consumer's blocks, in
        prompt order) to the producer presenting the secret hashing to ``digest`` and
        ``prompt_digest``: the lease of a push (see `begin_write`), which ``writers`` producer
        workers each write a part of (their heads), every layer. Its row says every layer
        ready, so writers go at once; what landed is `landed`'s."""
        if isinstance(writers, bool) or not isinstance(writers, int) or writers < 1:
            raise ValueError(f"writers must be an int >= 1, got {writers!r}")
        with self._cond:
            self._revoked.pop(lease_id, None)
            unlanded = dict.fromkeys(layer_names, writers)
            grant = _Grant(digest, tuple(block_ids), prompt_digest, unlanded=unlanded)
            self._grants[lease_id] = grant
            if self._table is not None:
                self._table.publish(lease_id, digest, prompt_digest, set(), grant.block_ids)
            self._cond.notify_all()

    def begin_write(self, access: LeaseAccess | None) -> None:
        """A producer is about to write a push grant's blocks: counted as a reader until its
        `end_write`, so a revocation does not hand the blocks back while writes may land
        (`revoke_nowait`, `drained`). `AccessDenied` as `authenticate`."""
        with self._check(access) as grant:
            grant.readers += 1

    def end_write(
        self, access: LeaseAccess | None, landed: Iterable[str], *, stopped: str = ""
    ) -> None:
        """The producer's writes (after its `begin_write`) have ended; ``landed``: the layers
        they completed (their flush returned); ``stopped``: they gave up, and why (`landed`
        then raises `WritesStopped` with it until the lease is granted again). Valid also
        after the grant was revoked, for a writer draining it. `AccessDenied` for an unknown
        lease, a wrong secret, or no write begun."""
        if access is None:
            raise AccessDenied("the push notice presents no lease")
        with self._cond:
            grant = self._grants.get(access.lease_id) or self._draining.get(access.lease_id)
            if grant is None or not hmac.compare_digest(grant.digest, secret_digest(access.secret)):
                raise AccessDenied(
                    f"lease {access.lease_id!r} has no write to end (unknown, ended, or another "
                    "secret)"
                )
            if grant.readers <= 0:
                raise AccessDenied(f"lease {access.lease_id!r} has no write begun")
            grant.readers -= 1
            if self._grants.get(access.lease_id) is grant:
                grant.stopped = grant.stopped or stopped
                for name in set(landed):
                    left = grant.unlanded.get(name, 0) - 1
                    if left > 0:
                        grant.unlanded[name] = left
                    else:
                        grant.unlanded.pop(name, None)
            self._cond.notify_all()

    def landed(self, lease_id: str) -> bool:
        """Whether every layer of push grant ``lease_id`` was reported written and flushed by
        each of its writers, and no write of it is running; `AccessDenied` if it ended
        (revoked) or is unknown."""
        with self._cond:
            grant = self._grants.get(lease_id)
            if grant is None:
                raise AccessDenied(
                    f"push lease {lease_id!r} {self._revoked.get(lease_id, 'is unknown')}"
                )
            if grant.stopped and grant.readers == 0:
                raise WritesStopped(
                    f"push lease {lease_id!r}: its producer stopped writing before "
                    f"{len(grant.unlanded)} layer(s) landed: {grant.stopped}"
                )
            return not grant.unlanded and grant.readers == 0

    def wait_landed(self, lease_id: str, timeout_s: float) -> bool:
        """`landed`, waiting up to ``timeout_s`` for it (False: not yet)."""
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while True:
                if self.landed(lease_id):
                    return True
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._cond.wait(left)

    def abandon_writes(self, lease_ids: Iterable[str]) -> None:
        """Forget the writes begun on these leases: their producer is known to be gone (its
        process, or its connection closed), so none of them can land any more."""
        with self._cond:
            for lease_id in lease_ids:
                grant = self._grants.get(lease_id) or self._draining.get(lease_id)
                if grant is not None:
                    grant.readers = 0
            self._cond.notify_all()

    def layer_ready(self, lease_ids: Iterable[str], layer_name: str | None = None) -> None:
        """The KV of ``layer_name`` (every layer when None) is complete in these leases' blocks:
        pulls waiting for it may go."""
        with self._cond:
            for lease_id in lease_ids:
                grant = self._grants.get(lease_id)
                if grant is None or not grant.pending:
                    continue
                if layer_name is None:
                    grant.pending.clear()
                else:
                    grant.pending.discard(layer_name)
                if self._table is not None:
                    self._table.update(lease_id, grant.pending)
            self._cond.notify_all()

    def ready(self, lease_id: str, layer_names: Iterable[str]) -> bool:
        """Whether a pull of these layers can be answered now: the lease ended (refused at
        once), or it is granted and none of the layers is still being computed."""
        with self._cond:
            if lease_id in self._revoked:
                return True
            grant = self._grants.get(lease_id)
            return grant is not None and grant.pending.isdisjoint(layer_names)

    def revoke(
        self, lease_ids: Iterable[str], why: str = "has ended", wait_s: float | None = None
    ) -> None:
        """End these leases (``why`` completes "lease X ..." in a late pull's refusal); returns
        once no gather (or counted writer) of them is running, or ``wait_s`` (default 30 s)
        passed."""
        deadline = time.monotonic() + (_REVOKE_WAIT_S if wait_s is None else wait_s)
        with self._cond:
            ended = [grant for _, grant in self._end(lease_ids, why)]
            self._cond.wait_for(
                lambda: all(g.readers == 0 for g in ended), max(0.0, deadline - time.monotonic())
            )

    def revoke_nowait(self, lease_ids: Iterable[str], why: str = "has ended") -> None:
        """End these leases at once, as `revoke`, without waiting for the gathers of them that
        are running: `drained` tells when those ended (an engine step must never wait)."""
        with self._cond:
            for lease_id, grant in self._end(lease_ids, why):
                if grant.readers:
                    self._draining[lease_id] = grant

    def drained(self, lease_ids: Iterable[str]) -> set[str]:
        """Of these leases ended by `revoke_nowait`, those no gather reads any more."""
        with self._cond:
            done = set()
            for lease_id in lease_ids:
                grant = self._draining.get(lease_id)
                if grant is None or grant.readers == 0:
                    self._draining.pop(lease_id, None)
                    done.add(lease_id)
            return done

    def _end(self, lease_ids: Iterable[str], why: str) -> list[tuple[str, _Grant]]:
        """Revoke these leases (under the lock); the grants that ended."""
        ended = []
        for lease_id in lease_ids:
            self._revoked[lease_id] = why
            self._revoked.move_to_end(lease_id)
            grant = self._grants.pop(lease_id, None)
            if grant is not None:
                ended.append((lease_id, grant))
            if self._table is not None:
                # One-sided readers are not counted: clearing the row fails their reads.
                self._table.withdraw(lease_id)
        while len(self._revoked) > _REVOKED_MEMORY:
            self._revoked.popitem(last=False)
        self._cond.notify_all()
        return ended

    def known(self, lease_id: str) -> bool:
        """Whether the lease was granted or has ended (False: its grant may still come)."""
        with self._cond:
            return lease_id in self._grants or lease_id in self._revoked

    def wake(self) -> None:
        """Wake every `wait_for_change` now (a server stopping)."""
        with self._cond:
            self._cond.notify_all()

    def wait_for_change(self, timeout_s: float) -> None:
        """Sleep until a grant or revocation happens, or ``timeout_s`` passes."""
        with self._cond:
            self._cond.wait(max(0.0, timeout_s))

    def authenticate(self, access: LeaseAccess | None) -> None:
        """`AccessDenied` unless ``access`` names a held lease with its secret and prompt."""
        with self._check(access):
            pass

    @contextlib.contextmanager
    def _check(self, access: LeaseAccess | None) -> Iterator[_Grant]:
        if access is None:
            raise AccessDenied("the pull presents no lease: this server serves leased KV only")
        with self._cond:
            grant = self._grants.get(access.lease_id)
            if grant is None:
                state = self._revoked.get(access.lease_id)
                if state is None:
                    raise LeaseNotGranted(
                        f"lease {access.lease_id!r} is unknown (not granted on this worker, or "
                        "not yet): its KV cannot be read"
                    )
                raise AccessDenied(f"lease {access.lease_id!r} {state}: its KV cannot be read")
            if not hmac.compare_digest(grant.digest, secret_digest(access.secret)):
                raise AccessDenied(f"wrong secret for lease {access.lease_id!r}")
            if grant.prompt_digest and not hmac.compare_digest(
                grant.prompt_digest, access.prompt_digest
            ):
                raise AccessDenied(
                    f"lease {access.lease_id!r} holds the KV of another prompt than the one "
                    "the pull is for (prompt digest mismatch)"
                )
            yield grant

    @contextlib.contextmanager
    def reading(
        self,
        access: LeaseAccess | None,
        block_ids: Iterable[int],
        layer_names: Iterable[str] = (),
    ) -> Iterator[None]:
        """Hold the lease open for one gather, or raise `AccessDenied` naming why not."""
        wanted = list(block_ids)
        with self._check(access) as grant:
            computing = sorted(grant.pending.intersection(layer_names))
            if computing:
                raise AccessDenied(
                    f"lease {access.lease_id!r}: the KV of layer(s) {', '.join(computing[:4])} "
                    "is still being computed"
                )
            start = access.block_offset
            expected = list(grant.block_ids[start : start + len(wanted)])
            if wanted != expected:
                outside = sorted(set(wanted) - set(grant.block_ids))
                if outside:
                    shown = ", ".join(map(str, outside[:8])) + (" ..." if len(outside) > 8 else "")
                    problem = f"block(s) {shown} do not belong to lease {access.lease_id!r}"
                else:
                    problem = (
                        f"blocks are not lease {access.lease_id!r}'s blocks at positions "
                        f"[{start}, {start + len(wanted)}) (reordered, repeated or shifted)"
                    )
                raise AccessDenied(f"{problem} ({len(grant.block_ids)} blocks)")
            grant.readers += 1
        try:
            yield
        finally:
            with self._cond:
                grant.readers -= 1
                self._cond.notify_all()
