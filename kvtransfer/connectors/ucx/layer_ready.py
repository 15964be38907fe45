"""`LayerReadiness`: when a streaming lease's layer may be read, host or device caches alike.

A prefill streams its KV: a consumer may read layer ``l`` of a lease once ``save_kv_layer(l)``
said it is written. On host caches the call comes after the writes, so the layer is ready at
once. On a GPU the call comes when the layer's kernels are *queued*: the layer is ready when a
CUDA event recorded on the compute stream at that moment has completed. A watcher thread waits
on each event in turn (never the whole device, never the compute stream), so the step goes on
while the consumer's reads wait only for the layer they want.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Sequence
from typing import Protocol

from kvtransfer.threads import enter_own_thread
from kvtransfer.transport.access import LeaseGrants


class StreamEvent(Protocol):
    """What `LayerReadiness` needs of a recorded event (``torch.cuda.Event`` has it)."""

    def synchronize(self) -> None: ...


def cuda_event() -> StreamEvent:
    """An event recorded on the current CUDA stream (the one the layer's kernels went to)."""
    import torch

    event = torch.cuda.Event()
    event.record()
    return event


class LayerReadiness:
    """Marks the layers of streaming leases readable in ``grants``.

    ``record``: None for host caches (ready when saved); else makes an event recorded on the
    compute stream (`cuda_event`), waited on by the watcher thread before the layer is marked.
    """

    def __init__(
        self, grants: LeaseGrants, record: Callable[[], StreamEvent] | None = None
    ) -> None:
        self._grants = grants
        self._record = record
        self._pending: queue.SimpleQueue[tuple[StreamEvent, tuple[str, ...], str] | None] = (
            queue.SimpleQueue()
        )
        self._watcher: threading.Thread | None = None
        if record is not None:
            self._watcher = threading.Thread(
                target=self._watch, name="kvtransfer-layer-ready", daemon=True
            )
            self._watcher.start()

    def saved(self, lease_ids: Sequence[str], layer_name: str) -> None:
        """``layer_name``'s writes for these leases are issued (on a GPU: queued)."""
        if not lease_ids:
            return
        if self._record is None:
            self._grants.layer_ready(lease_ids, layer_name)
            return
        self._pending.put((self._record(), tuple(lease_ids), layer_name))

    def step_done(self, lease_ids: Sequence[str]) -> None:
        """The step that computed these leases ended (the runner synchronized to sample): every
        layer is ready, whatever events are still queued."""
        if lease_ids:
            self._grants.layer_ready(lease_ids)

    def close(self, timeout_s: float = 5.0) -> None:
        if self._watcher is not None:
            self._pending.put(None)
            self._watcher.join(timeout_s)
            self._watcher = None

    def _watch(self) -> None:
        enter_own_thread("kvtransfer-layer-ready")
        while (item := self._pending.get()) is not None:
            event, lease_ids, layer_name = item
            event.synchronize()
            self._grants.layer_ready(lease_ids, layer_name)
