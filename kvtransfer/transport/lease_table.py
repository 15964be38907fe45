"""The lease table: which leases a producer holds, readable one-sided by its consumers.

In RMA mode the producer never sees a read, so it cannot refuse one of a released block. It
publishes instead, in a small registered array next to its KV, one row per lease it holds:
``(token, layers_ready, prompt tag, blocks tag)``. The token is derived from the lease id and
the digest of its secret (`lease_token`), so a consumer that knows the secret computes it, and
reading the table reveals no secret; the prompt tag (`prompt_tag`, 0 when the producer checks
no prompt) lets a consumer refuse KV computed for another prompt than its own, and the blocks
tag (`blocks_tag`) blocks in another order or of another lease, as a tagged pull would. A
consumer brackets its data reads with two reads of the lease's row (a seqlock without the
counter):

1. before: the token is there and ``layers_ready`` covers the layers it reads (else it waits
   for the grant, or for the layers still being computed);
2. the data reads, all completed;
3. after: the token is still there.

The producer writes the token when it grants the lease and clears it when the lease ends,
*before* the blocks go back to the engine; a token is written once per lease, never again
after it is cleared. So a token seen at 1 and at 3 means the lease, and with it every block it
holds, was held for the whole of 2: the bytes read are the request's KV. A lease released while
a slow reader reads fails that read at 3 (`LeaseEndedDuringRead`), never silently.

Rows are found by hashing the lease id to a slot and probing a small window (one read of
``WINDOW`` rows). ``layers_ready`` counts the leading layers, in the published order, whose KV
is complete (a layer finished out of order waits for those before it: late, never early).
"""

from __future__ import annotations

import hashlib
import threading
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

SLOTS = 16384
WINDOW = 8
# Four int64 words per row: token, layers ready, prompt tag, blocks tag.
ROW_WORDS = 4
ROW_BYTES = ROW_WORDS * 8


def _tag(*parts: bytes) -> int:
    """A non-zero 63-bit value (int64, never negative) of ``parts``."""
    digest = hashlib.sha256(b"\0".join(parts)).digest()
    return (int.from_bytes(digest[:8], "little") >> 1) | 1


def lease_token(lease_id: str, secret_digest: bytes) -> int:
    """The token a lease's row holds."""
    return _tag(b"kvtransfer-lease-v1", lease_id.encode(), secret_digest)


def prompt_tag(prompt_digest: str) -> int:
    """What a row holds for the prompt its KV was computed for (0: not checked)."""
    return _tag(b"kvtransfer-prompt-v1", prompt_digest.encode()) if prompt_digest else 0


def lease_slot(lease_id: str, slots: int = SLOTS) -> int:
    """The first row of the window where ``lease_id``'s row may be."""
    return int.from_bytes(hashlib.sha256(lease_id.encode()).digest()[:8], "little") % slots


def blocks_tag(block_ids: Sequence[int]) -> int:
    """What a row holds for the lease's block list, in order."""
    packed = np.asarray(block_ids, dtype="<i8").tobytes()
    return _tag(b"kvtransfer-blocks-v1", packed)


def find_row(window: np.ndarray, token: int) -> tuple[int, int, int] | None:
    """``(layers_ready, prompt tag, blocks tag)`` of the row holding ``token`` in a window
    read, or None."""
    rows = window.reshape(-1, ROW_WORDS)
    hits = np.flatnonzero(rows[:, 0] == token)
    if len(hits) == 0:
        return None
    row = rows[hits[0]]
    return int(row[1]), int(row[2]), int(row[3])


class LeaseTable:
    """The producer's table (host memory, registered by the caller). Thread-safe."""

    def __init__(self, layer_names: Sequence[str], slots: int = SLOTS) -> None:
        self.layer_names = tuple(layer_names)
        self.slots = slots
        self.words = torch.zeros((slots + WINDOW) * ROW_WORDS, dtype=torch.int64)
        self._rows = self.words.numpy().reshape(-1, ROW_WORDS)
        self._lock = threading.Lock()
        self._where: dict[str, int] = {}
        self.full = 0  # leases that found no free row (their consumers cannot read one-sided)

    @property
    def nbytes(self) -> int:
        return self.words.numel() * 8

    def publish(
        self,
        lease_id: str,
        secret_digest: bytes,
        prompt_digest: str,
        pending: set[str],
        block_ids: Sequence[int],
    ) -> bool:
        """Write the lease's row; False (and counted in ``full``) when its window is full."""
        token = lease_token(lease_id, secret_digest)
        with self._lock:
            # Granted again (a new secret): its row is rewritten in place.
            held = self._where.get(lease_id)
            first = lease_slot(lease_id, self.slots)
            for row in range(first, first + WINDOW):
                if row == held or (held is None and self._rows[row, 0] == 0):
                    # The rest before the token: whoever sees the token sees a valid row.
                    self._rows[row, 1] = self._ready(pending)
                    self._rows[row, 2] = prompt_tag(prompt_digest)
                    self._rows[row, 3] = blocks_tag(block_ids)
                    self._rows[row, 0] = token
                    self._where[lease_id] = row
                    return True
            self.full += 1
            return False

    def update(self, lease_id: str, pending: set[str]) -> None:
        with self._lock:
            row = self._where.get(lease_id)
            if row is not None:
                self._rows[row, 1] = self._ready(pending)

    def withdraw(self, lease_id: str) -> None:
        """Clear the lease's row: from now on a read that checks it fails."""
        with self._lock:
            row = self._where.pop(lease_id, None)
            if row is not None:
                self._rows[row] = 0

    def __len__(self) -> int:
        with self._lock:
            return len(self._where)

    def _ready(self, pending: set[str]) -> int:
        for index, name in enumerate(self.layer_names):
            if name in pending:
                return index
        return len(self.layer_names)

    def describe(self) -> dict[str, Any]:
        return {"slots": self.slots, "window": WINDOW, "layers": list(self.layer_names)}
