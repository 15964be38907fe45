"""`LoadJob`: one request's KV load on one consumer worker, run on a loader thread.

1. get the producer from `RemoteEngines` (handshake and connect on the first request);
2. start one `PullSpec` per planned pull (its layers, its head slice, the request's blocks);
3. wait for all of them, each bounded by the transfer timeout;
4. confirm the producer still holds the request: had its lease run out before or during the
   read, the blocks may have been reused, and the load fails instead of decoding garbage.

`cancel` (from the step thread, for an aborted request) stops it: before the pulls start
nothing is started, after that every pull is cancelled, and `PullHandle.cancel` guarantees
nothing is written once it returns, so the request's blocks can be given back at once.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from connectors.ucx.metadata import LoadSpec, RemotePrefill
from connectors.ucx.remote import RemoteEngine, RemoteEngines
from kvtransfer.transport import KVTransferAgent, PullHandle, PullSpec

# Extra wait beyond a pull's own timeout: the pull raises TransferTimeoutError itself first.
_RESULT_GRACE_S = 5.0


class LoadCancelled(Exception):
    """The request was aborted; its pulls were stopped."""


class LeaseLostError(RuntimeError):
    """The producer no longer held the request after the read: the blocks read may have
    belonged to another request by then."""


# Asks the producer whether it still holds a request (see `Notifier.confirm_held`).
ConfirmHeld = Callable[[RemotePrefill], bool]


@dataclass(frozen=True)
class LoadOutcome:
    num_blocks: int
    num_bytes: int
    elapsed_s: float


class LoadJob:
    def __init__(
        self,
        spec: LoadSpec,
        engines: RemoteEngines,
        agent: KVTransferAgent,
        transfer_timeout_s: float,
        confirm_held: ConfirmHeld,
    ) -> None:
        self.spec = spec
        self._engines = engines
        self._agent = agent
        self._confirm_held = confirm_held
        self._timeout_s = transfer_timeout_s
        self._lock = threading.Lock()
        self._cancelled = False
        self._handles: list[PullHandle] = []

    @property
    def req_id(self) -> str:
        return self.spec.req_id

    @property
    def num_pulls_started(self) -> int:
        with self._lock:
            return len(self._handles)

    def cancel(self) -> None:
        """Stop the load; once this returns, the load writes nothing more."""
        with self._lock:
            self._cancelled = True
            handles = list(self._handles)
        for handle in handles:
            handle.cancel()

    def run(self) -> LoadOutcome:
        started = time.perf_counter()
        spec = self.spec
        if not spec.local_block_ids:
            return LoadOutcome(0, 0, 0.0)
        self._check_cancelled()
        engine = self._engines.get(spec.remote)
        try:
            handles = self._start(engine)
            total = sum(self._wait(handle) for handle in handles)
        except LoadCancelled:
            raise
        except BaseException:
            # A pull stopped by cancel() fails too; that is the cancellation, not an error.
            self._check_cancelled()
            self.cancel()
            # The producer may be gone or restarted: handshake again next time.
            self._engines.invalidate(engine)
            raise
        if not self._confirm_held(spec.remote):
            raise LeaseLostError(
                f"engine {spec.remote.engine_id!r} no longer holds request "
                f"{spec.remote.request_id!r} (its lease ran out, or the engine restarted): the "
                "blocks read may be stale"
            )
        return LoadOutcome(len(spec.local_block_ids), total, time.perf_counter() - started)

    def _start(self, engine: RemoteEngine) -> list[PullHandle]:
        spec = self.spec
        with self._lock:
            if self._cancelled:
                raise LoadCancelled(f"load of request {spec.req_id!r} was cancelled")
            for pull in engine.plan:
                self._handles.append(
                    self._agent.pull(
                        engine.peers[pull.remote_rank],
                        PullSpec(
                            request_id=spec.req_id,
                            layer_names=pull.layer_names,
                            remote_block_ids=spec.remote_block_ids,
                            local_block_ids=spec.local_block_ids,
                            remote_heads=pull.remote_heads,
                            local_heads=pull.local_heads,
                        ),
                        timeout_s=self._timeout_s,
                    )
                )
            return list(self._handles)

    def _wait(self, handle: PullHandle) -> int:
        result = handle.result(self._timeout_s + _RESULT_GRACE_S)
        return result.payload_bytes

    def _check_cancelled(self) -> None:
        with self._lock:
            if self._cancelled:
                raise LoadCancelled(f"load of request {self.spec.req_id!r} was cancelled")
