"""`CompletionQueue`: transfers a connector's threads finished, waiting for the next step.

A worker-role connector that transfers in background threads queues each result here and hands
them over in `get_transfer_results`; queueing one also calls the engine's wake-up callback
(`KVConnectorBase_V1.set_completion_callback`), so an idle engine steps at once instead of
polling.
"""

from __future__ import annotations

import queue
from collections.abc import Callable
from typing import Generic, TypeVar

T = TypeVar("T")


class CompletionQueue(Generic[T]):
    """Thread-safe; `put` from any thread, `drain` from the step thread."""

    def __init__(self) -> None:
        self._items: queue.SimpleQueue[T] = queue.SimpleQueue()
        self._wake: Callable[[], None] | None = None

    def set_callback(self, callback: Callable[[], None]) -> bool:
        """Wake the engine with ``callback`` on every `put`; True (it will be called)."""
        self._wake = callback
        return True

    def put(self, item: T) -> None:
        self._items.put(item)
        if self._wake is not None:
            self._wake()

    def drain(self) -> list[T]:
        """Everything queued so far, in order."""
        items: list[T] = []
        while True:
            try:
                items.append(self._items.get_nowait())
            except queue.Empty:
                return items
