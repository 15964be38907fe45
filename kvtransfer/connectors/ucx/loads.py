"""`LoadJob`: one request's KV load on one consumer worker, run on a loader thread.

1. get the producer from `RemoteEngines` (handshake and connect on the first request);
2. start one `PullSpec` per planned pull (its layers, its head slice, the request's blocks); a
   one-sided pull (RMA mode) reads right there, probing the producer while it waits;
3. wait for all of them, each bounded by the transfer timeout, probing the producer meanwhile
   (`liveness`): a dead or unreachable producer, or one that no longer holds the request,
   fails the load in about a second instead of at the timeout;
4. a pull that failed only because another read from the producer reset their connection
   (`EndpointReset`) is not the producer's failure: the load's pulls run once more, on the new
   connection;
5. a pull refused because the producer's worker has not recorded the lease yet
   (`LeaseNotGranted`: its scheduler lent the blocks, its workers record grants at their next
   step, which a busy host delays) is asked again while the producer is alive, still holds the
   request and the load's deadline allows: a lease not yet recorded is not a lease refused.

Every pull presents the lease's secret; the producer serves only that lease's blocks and only
while it holds the lease (it stops before it frees them), so a load that succeeded read the
request's own KV, never blocks reused by another request.

`stop_nowait` (from the step thread, for an aborted request) never waits: it flags the load and
answers whether any pull had begun. None had: none ever will, and the blocks can be given back
at once. Some had: the loader thread notices the flag within `_STOP_POLL_S` (or at its next
read chunk), cancels its pulls itself and ends with `LoadCancelled`; only then are the blocks
given back. `cancel` (shutdown, sleep) does the same and waits for it: `PullHandle.cancel`
guarantees nothing is written once it returns.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass

from kvtransfer.connector.kv_groups import FULL_ATTENTION, KVCacheGroup
from kvtransfer.connectors.ucx.liveness import PROBE_INTERVAL_S, AskHeld, ProducerWatch
from kvtransfer.connectors.ucx.metadata import LoadSpec
from kvtransfer.connectors.ucx.plan import RemoteLayoutError, check_request_blocks
from kvtransfer.connectors.ucx.pushes import PushedLoad, producer_pushes
from kvtransfer.connectors.ucx.remote import RemoteEngine, RemoteEngines
from kvtransfer.timeline import BOOK, now_ns
from kvtransfer.transport import (
    AccessDenied,
    EndpointReset,
    ErrorCode,
    KVTransferAgent,
    LeaseGrants,
    LeaseNotGranted,
    PullHandle,
    PullSpec,
    RemoteTransferError,
)

logger = logging.getLogger(__name__)

# Extra wait beyond a pull's own timeout: the pull raises TransferTimeoutError itself first.
_RESULT_GRACE_S = 5.0
# How often a loader waiting for its pulls looks at the stop flag set by `stop_nowait`.
_STOP_POLL_S = 0.02
# Pause before asking again for a lease the producer's worker had not recorded yet.
_NOT_GRANTED_RETRY_S = 0.2


class LoadCancelled(Exception):
    """The request was aborted; its pulls were stopped."""


@dataclass(frozen=True)
class LoadOutcome:
    num_blocks: int
    num_bytes: int
    elapsed_s: float
    # Of num_bytes, those read one-sided (RMA mode).
    one_sided_bytes: int = 0
    # Of num_bytes, those of each KV cache group kind other than full attention.
    bytes_by_kind: tuple[tuple[str, int], ...] = ()
    # The producer wrote the KV (push data plane).
    pushed: bool = False


class LoadJob:
    def __init__(
        self,
        spec: LoadSpec,
        engines: RemoteEngines,
        agent: KVTransferAgent,
        transfer_timeout_s: float,
        ask_held: AskHeld | None = None,
        groups: Sequence[KVCacheGroup] | None = None,
        push_grants: LeaseGrants | None = None,
    ) -> None:
        self.spec = spec
        # Push data plane: this worker's grants of its blocks to producers that offer pushes
        # (None: every load pulls).
        self._push_grants = push_grants
        # The engine's KV cache groups (a model without any: one of full attention).
        self._groups = tuple(groups or (KVCacheGroup(FULL_ATTENTION, ()),))
        self._engines = engines
        self._agent = agent
        self._ask_held = ask_held
        self._timeout_s = transfer_timeout_s
        self._lock = threading.Lock()
        # Held while a pull starts: a one-sided pull reads inside `pull` itself, and `cancel`
        # waits on this lock for it to notice the cancel (it polls `_cancelled`).
        self._starting = threading.Lock()
        self._cancelled = False
        self._begun = 0
        self._handles: list[PullHandle] = []
        # Pulls not yet on the timeline: their start (wall ns) and layer count, by handle.
        self._read_started: dict[int, tuple[int, int]] = {}
        # Each pull's KV cache group kind, by handle.
        self._kinds: dict[int, str] = {}
        self._bytes_by_kind: dict[str, int] = {}
        # The producer wrote this load's KV (push data plane) rather than this worker pulling.
        self.pushed = False

    @property
    def req_id(self) -> str:
        return self.spec.req_id

    @property
    def num_pulls_started(self) -> int:
        """Pulls begun (a one-sided one counts while it reads, before `pull` returns)."""
        with self._lock:
            return self._begun

    def stop_nowait(self) -> bool:
        """Ask the load to stop, without waiting; True if no pull had begun (none will: the
        load writes nothing, ever), False if the loader must stop them (it then ends with
        `LoadCancelled`, or with whatever outcome it reached first)."""
        with self._lock:
            self._cancelled = True
            return self._begun == 0

    def cancel(self) -> None:
        """Stop the load; once this returns, the load writes nothing more."""
        with self._lock:
            self._cancelled = True
            handles = list(self._handles)
        for handle in handles:
            handle.cancel()
        with self._starting:
            pass  # a one-sided read in progress has seen the flag and stopped writing

    def run(self) -> LoadOutcome:
        started = time.perf_counter()
        spec = self.spec
        if not spec.local_block_ids:
            return LoadOutcome(0, 0, 0.0)
        self._check_cancelled()
        engine = self._engines.get(spec.remote, spec.req_id)
        if spec.refused:
            raise RemoteLayoutError(spec.refused)
        check_request_blocks(
            spec.remote, next(iter(engine.metadata.values())).block_size, self._groups
        )
        watch = ProducerWatch(spec.remote, self._ask_held)
        try:
            total, one_sided = self._attempts(engine, watch)
        except LoadCancelled:
            raise
        except BaseException as exc:
            # A pull stopped by cancel() fails too; that is the cancellation, not an error.
            self._check_cancelled()
            self.cancel()
            if not _refused_access(exc):
                # The producer may be gone or restarted: handshake again next time.
                self._engines.invalidate(engine)
                if self._push_grants is not None and producer_pushes(engine):
                    # A pull's failure resets the endpoint it read on; asks use theirs only at
                    # the start, so a producer that reset its side meanwhile (its writes timed
                    # out) would leave them broken for the next load: new ones instead.
                    for peer in engine.peers.values():
                        self._agent.disconnect(peer)
            raise
        return LoadOutcome(
            len(spec.local_block_ids),
            total,
            time.perf_counter() - started,
            one_sided,
            tuple(sorted(self._bytes_by_kind.items())),
            self.pushed,
        )

    def _attempts(self, engine: RemoteEngine, watch: ProducerWatch) -> tuple[int, int]:
        """Start and wait for every pull, again after a reset (once) or while the lease is
        not recorded yet (within the deadline); (bytes, of which one-sided)."""
        deadline = time.monotonic() + self._timeout_s
        reset_seen = False
        while True:
            try:
                if self._push_grants is not None and producer_pushes(engine):
                    return self._pushed(engine, watch)
                handles = self._start(engine, watch)
                return self._wait_all(handles, watch)
            except EndpointReset as reset:
                # Another read from this producer failed and took the connection with it
                # (after a partition healed, a read on the broken connection times out): the
                # producer may be fine. Once more, on the new connection the next pull makes.
                if reset_seen:
                    raise
                reset_seen = True
                self._restart(f"{reset}; reading it again once")
            except (AccessDenied, RemoteTransferError) as refused:
                if not _not_granted(refused) or time.monotonic() + _NOT_GRANTED_RETRY_S >= deadline:
                    raise
                # Gone, or no longer holding the request: typed, at once. Else it holds it and
                # its workers have not recorded the grant yet.
                watch.check()
                self._restart(f"{refused}; asking again while the producer holds the request")
                time.sleep(_NOT_GRANTED_RETRY_S)

    def _pushed(self, engine: RemoteEngine, watch: ProducerWatch) -> tuple[int, int]:
        """The producer writes the blocks (`PushedLoad`); (bytes, all of them one-sided)."""
        if self._push_grants is None:  # never: `_attempts` checked
            raise ValueError("a pushed load needs push grants")
        started = now_ns()
        attempt = PushedLoad(
            self.spec,
            self._agent,
            self._push_grants,
            self._timeout_s,
            lambda: self._cancelled,
            self._begin_push,
        )
        total, by_group = attempt.run(engine, watch)
        self._check_cancelled()
        self.pushed = True
        self._bytes_by_kind = {}
        for group, num_bytes in by_group.items():
            kind = self._groups[group].kind
            if kind != FULL_ATTENTION:
                self._bytes_by_kind[kind] = self._bytes_by_kind.get(kind, 0) + num_bytes
        BOOK.record(self.spec.req_id, "kv.pushed", started, now_ns(), bytes=total)
        return total, total

    def _begin_push(self) -> None:
        """One push ask is about to go: counted as a pull begun (`stop_nowait`)."""
        with self._lock:
            if self._cancelled:
                raise LoadCancelled(f"load of request {self.spec.req_id!r} was cancelled")
            self._begun += 1

    def _restart(self, why: str) -> None:
        """Stop this attempt's pulls (nothing they write lands after this) before another."""
        self._check_cancelled()
        with self._lock:
            handles, self._handles = self._handles, []
        for handle in handles:
            handle.cancel()
        self._read_started.clear()
        logger.info("%s", why, extra={"request_id": self.spec.req_id})

    def _start(self, engine: RemoteEngine, watch: ProducerWatch) -> list[PullHandle]:
        """Start every pull (a one-sided one runs to completion right here)."""
        spec = self.spec
        runs = {run.group: run for run in spec.runs}
        for pull in engine.plan:
            run = runs.get(pull.group)
            if run is None or not run.local_block_ids:
                continue  # nothing of this group's layers to move (e.g. all out of window)
            # KV still being computed is pulled layer by layer, each as soon as it is.
            batches = (
                [(name,) for name in pull.layer_names]
                if spec.remote.streaming
                else [pull.layer_names]
            )
            for layer_names in batches:
                with self._starting:
                    with self._lock:
                        # One section with `stop_nowait`: a stopped load begins no pull.
                        if self._cancelled:
                            raise LoadCancelled(f"load of request {spec.req_id!r} was cancelled")
                        self._begun += 1
                    pull_started = now_ns()
                    handle = self._agent.pull(
                        engine.peers[pull.remote_rank],
                        PullSpec(
                            request_id=spec.req_id,
                            layer_names=layer_names,
                            remote_block_ids=spec.kernel_ids(run.remote_block_ids),
                            local_block_ids=spec.kernel_ids(run.local_block_ids),
                            remote_heads=pull.remote_heads,
                            local_heads=pull.local_heads,
                            lease=spec.lease_at(run),
                        ),
                        timeout_s=self._timeout_s,
                        on_wait=watch.check,
                        should_stop=lambda: self._cancelled,
                    )
                self._read_started[id(handle)] = (pull_started, len(layer_names))
                self._kinds[id(handle)] = self._groups[pull.group].kind
                if handle.done():  # one-sided: read right there
                    self._record_read(handle)
                with self._lock:
                    self._handles.append(handle)
                    started = list(self._handles)
                if handle.done() and handle.exception() is not None:
                    return started  # failed already: the wait raises it
        with self._lock:
            return list(self._handles)

    def _wait_all(self, handles: list[PullHandle], watch: ProducerWatch) -> tuple[int, int]:
        """(bytes, of which one-sided) of every pull, once all finished."""
        self._bytes_by_kind = {}  # this attempt's (a reset load is read again)
        deadline = time.monotonic() + self._timeout_s + _RESULT_GRACE_S
        total = one_sided = 0
        next_probe = time.monotonic() + PROBE_INTERVAL_S
        for handle in handles:
            while True:
                try:
                    result = handle.result(_STOP_POLL_S)
                    self._record_read(handle)
                    total += result.payload_bytes
                    one_sided += result.payload_bytes if result.one_sided else 0
                    kind = self._kinds.get(id(handle), FULL_ATTENTION)
                    if kind != FULL_ATTENTION:
                        self._bytes_by_kind[kind] = (
                            self._bytes_by_kind.get(kind, 0) + result.payload_bytes
                        )
                    break
                except TimeoutError:
                    if handle.done() or time.monotonic() >= deadline:
                        raise
                if self._cancelled:
                    self.cancel()  # this thread's pulls: stopped here, off the step thread
                    self._check_cancelled()
                if time.monotonic() >= next_probe:
                    watch.check()
                    next_probe = time.monotonic() + PROBE_INTERVAL_S
        return total, one_sided

    def _record_read(self, handle: PullHandle) -> None:
        """A ``kv.read`` span for a pull that ended (once per pull)."""
        started = self._read_started.pop(id(handle), None)
        if started is None:
            return
        try:
            result = handle.result(0)
        except BaseException:  # a failed pull's error is raised by the wait, not here
            return
        BOOK.record(
            self.spec.req_id,
            "kv.read",
            started[0],
            now_ns(),
            layers=started[1],
            bytes=result.payload_bytes,
            one_sided=result.one_sided,
        )

    def _check_cancelled(self) -> None:
        with self._lock:
            if self._cancelled:
                raise LoadCancelled(f"load of request {self.spec.req_id!r} was cancelled")


def _not_granted(error: BaseException) -> bool:
    """A pull refused because the serving worker has no record of its lease (yet)."""
    return isinstance(error, LeaseNotGranted) or (
        isinstance(error, RemoteTransferError) and error.code == ErrorCode.LEASE_NOT_GRANTED
    )


def _refused_access(error: BaseException) -> bool:
    """A pull refused for its lease (by the producer, or by a one-sided check of its lease
    table) says nothing about the producer's health."""
    return isinstance(error, AccessDenied) or (
        isinstance(error, RemoteTransferError)
        and error.code in (ErrorCode.ACCESS_DENIED, ErrorCode.LEASE_NOT_GRANTED)
    )
