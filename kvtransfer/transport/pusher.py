"""`Pusher`: a producer's side of the push data plane, writing the KV its consumers ask for.

Life cycle of a push ask:

1. a consumer that granted a push lease of its own blocks sends a `PushAskMessage` to the
   producer's server, presenting the request's lease there (the one a pull would present);
2. the server checks that lease (refused typed as a pull would be: unknown yet, ended, wrong
   secret) and queues the ask here; the consumer's ask returns;
3. a pusher thread connects to the consumer, fetches its write keys once and begins a
   `PushSession` (the begin notice: from then on the consumer keeps the blocks out of use);
4. it writes each layer as soon as its KV is complete (a layer computed before the ask came is
   written at once), holding the request's lease as a reader while it reads the blocks, so the
   producer never frees them under a write, and checking the block ids against the lease;
5. it ends the session: "landed" with every layer written and flushed, or "stopped" on any
   failure (the consumer then fails its load typed).

A push is bounded by the agent's transfer timeout; closing the agent stops every push.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING

from kvtransfer.threads import enter_own_thread
from kvtransfer.transport.access import LeaseAccess, LeaseGrants
from kvtransfer.transport.errors import InvalidPeerAddress, TransferTimeoutError
from kvtransfer.transport.messages import PushAskMessage, decode_address, peer_name
from kvtransfer.transport.spec import KVLayout, PullSpec

if TYPE_CHECKING:
    from kvtransfer.transport.agent import KVTransferAgent

logger = logging.getLogger(__name__)

# A push waiting for its layers' KV looks at its deadline and the agent's state this often.
_READY_POLL_S = 0.05
# Asks queued or running at once; beyond this they are refused (no unbounded memory, whatever
# a consumer holding valid leases sends).
MAX_ASKS = 1024


class Pusher:
    """Runs the push asks a producer's server accepted, ``threads`` at a time (each holds its
    thread until its last layer is written: a streamed prefill's pushes last as long as it)."""

    def __init__(
        self,
        agent: KVTransferAgent,
        grants: LeaseGrants,
        timeout_s: float,
        threads: int = 4,
    ) -> None:
        self._agent = agent
        self._grants = grants
        self._timeout_s = timeout_s
        self._queue: queue.SimpleQueue[PushAskMessage | None] = queue.SimpleQueue()
        self._closed = False
        self._pending = 0  # queued or running
        self._lock = threading.Lock()
        self.pushes_done = 0
        self.pushes_failed = 0
        self._threads = [
            threading.Thread(target=self._serve, name=f"kvtransfer-push-{i}", daemon=True)
            for i in range(threads)
        ]
        for thread in self._threads:
            thread.start()

    def submit(self, ask: PushAskMessage) -> bool:
        """Queue an ask whose lease the server checked (any thread; never blocks); False if
        `MAX_ASKS` are queued or running already (refused)."""
        with self._lock:
            if self._closed or self._pending >= MAX_ASKS:
                return False
            self._pending += 1
        self._queue.put(ask)
        return True

    @property
    def pending(self) -> int:
        """Asks queued or running now."""
        with self._lock:
            return self._pending

    def close(self, timeout_s: float = 10.0) -> None:
        """Stop taking asks; pushes running stop at their next check (told "stopped")."""
        if self._closed:
            return
        self._closed = True
        for _ in self._threads:
            self._queue.put(None)
        for thread in self._threads:
            thread.join(timeout_s)

    def _serve(self) -> None:
        enter_own_thread(threading.current_thread().name)
        while True:
            ask = self._queue.get()
            if ask is None:
                return
            error: BaseException | None = None
            try:
                self._push(ask)
            except Exception as exc:  # reported to the consumer as "stopped", logged here
                error = exc
                logger.warning(
                    "push of request %r to %s stopped: %s: %s",
                    ask.request_id,
                    _consumer_name(ask),
                    type(exc).__name__,
                    exc,
                )
            with self._lock:
                self._pending -= 1
                if error is None:
                    self.pushes_done += 1
                else:
                    self.pushes_failed += 1

    def _push(self, ask: PushAskMessage) -> None:
        deadline = time.monotonic() + self._timeout_s
        access = LeaseAccess(*ask.lease)
        push_access = LeaseAccess(*ask.push_lease)
        layouts = {name: KVLayout.from_dict(layout) for name, layout in ask.layouts.items()}
        names = ask.layers
        peer = self._agent.connect(ask.consumer, layouts=layouts)
        session = self._agent.begin_push(
            peer,
            push_access,
            request_id=ask.request_id,
            timeout_s=self._timeout_s,
            should_stop=lambda: self._closed,
        )
        with session:
            left = list(names)
            while left:
                ready = self._wait_ready(access, left, deadline, ask.request_id)
                spec = PullSpec(
                    request_id=ask.request_id,
                    layer_names=tuple(ready),
                    remote_block_ids=ask.dest_block_ids,
                    local_block_ids=ask.block_ids,
                    remote_heads=None if ask.dest_heads is None else range(*ask.dest_heads),
                    local_heads=None if ask.heads is None else range(*ask.heads),
                    lease=push_access,
                )
                # As a reader of the request's lease: its blocks are not freed (nor reused)
                # while they are read, and they must be the lease's own blocks.
                with self._grants.reading(access, ask.block_ids, ready):
                    left_s = max(deadline - time.monotonic(), 1e-3)
                    session.write(spec, timeout_s=left_s).result()
                left = [name for name in left if name not in ready]

    def _wait_ready(
        self, access: LeaseAccess, layers: Sequence[str], deadline: float, request_id: str
    ) -> list[str]:
        """The layers of ``layers`` whose KV is complete, once there is one; `AccessDenied` if
        the request's lease ended meanwhile, `TransferTimeoutError` past ``deadline``."""
        while True:
            if self._closed:
                raise TransferTimeoutError(f"push of {request_id!r}: the agent is closing")
            self._grants.authenticate(access)
            ready = [name for name in layers if self._grants.ready(access.lease_id, (name,))]
            if ready:
                return ready
            left = deadline - time.monotonic()
            if left <= 0:
                raise TransferTimeoutError(
                    f"push of {request_id!r}: {len(layers)} layer(s) not computed within "
                    f"{self._timeout_s:g} s"
                )
            self._grants.wait_for_change(min(_READY_POLL_S, left))


def _consumer_name(ask: PushAskMessage) -> str:
    """The consumer as other log lines name peers, or what is wrong with its address."""
    try:
        return peer_name(decode_address(ask.consumer))
    except InvalidPeerAddress as exc:
        return f"an invalid address ({exc})"
