"""Pending picks: the blocks of requests routed to an instance that its KV events do not show
yet (an engine announces a block only once it has scheduled it).

A pick's claim on a block ends when the instance's events store that block, when the pick ends
or fails, after the TTL, or with the instance's precise set. A block pending for several picks
is counted per pick, each entry tagged with the serial of the pick that made it pending: a pick
releases its claim only on the entry it counted in (`IndexedInstance.pending`).
"""

from __future__ import annotations

from collections import deque
from itertools import filterfalse, repeat
from operator import add, rshift

from kvtransfer.router.routing.prefix_index.instance import (
    COUNT_BITS,
    COUNT_MASK,
    IndexedInstance,
    Pick,
)
from kvtransfer.router.routing.prefix_index.masks import (
    NONES,
    ONES,
    clear_bit,
    clear_bits,
    consume,
    set_bits,
)


class PendingPicks:
    """The live picks of one index, by request id (a retry of one elsewhere ends it), and every
    pick in the order it expires (one TTL for all: the order they were made)."""

    def __init__(self, ttl_s: float) -> None:
        self.ttl_s = ttl_s
        self.live: dict[str, Pick] = {}
        self.expiry: deque[Pick] = deque()
        self._serial = 0
        self._anonymous = 0

    def claim(self, inst: IndexedInstance, pick: str | None, keys: list[int], now: float) -> None:
        """``keys`` (not stored on ``inst`` yet) pending there for ``pick`` (``None``: a pick
        that only the TTL and the events end) until ``now`` plus the TTL."""
        if pick is None:
            self._anonymous += 1
            pick = f"\0anonymous {self._anonymous}"  # never a request id
        self._serial += 1
        serial = self._serial
        pending = inst.pending
        # Bulk dictionary updates (C loops): a long prompt's hundreds of blocks cost little.
        if pending and not pending.keys().isdisjoint(keys):
            shared = list(filter(pending.__contains__, keys))
            fresh = list(filterfalse(pending.__contains__, keys))
            entries = list(map(pending.__getitem__, shared))
            pending.update(zip(shared, map(add, entries, ONES), strict=True))
            shared_serials = list(map(rshift, entries, repeat(COUNT_BITS)))
        else:
            fresh, shared, shared_serials = keys, [], []
        pending.update(zip(fresh, repeat((serial << COUNT_BITS) | 1), strict=False))
        set_bits(inst.group.pending, fresh, inst.bit)
        claim = Pick(pick, inst.address, now + self.ttl_s, serial, fresh, shared, shared_serials)
        inst.picks[pick] = self.live[pick] = claim
        self.expiry.append(claim)

    def end(self, inst: IndexedInstance, claim: Pick) -> None:
        """``claim`` (live, on ``inst``) ends: the blocks pending for it alone stop counting."""
        del inst.picks[claim.pick]
        del self.live[claim.pick]
        pending = inst.pending
        fresh = claim.fresh
        alone = (claim.serial << COUNT_BITS) | 1
        if list(map(pending.get, fresh)).count(alone) == len(fresh):
            # The usual end: its blocks were pending for it alone, none stored since.
            consume(map(pending.pop, fresh, NONES))
            clear_bits(inst.group.pending, fresh, inst.bit)
            fresh = []
        masks = inst.group.pending
        bit = inst.bit
        for keys, serials in (
            (fresh, repeat(claim.serial)),
            (claim.shared, claim.shared_serials),
        ):
            for key, serial in zip(keys, serials, strict=False):
                entry = pending.get(key)
                if entry is None or entry >> COUNT_BITS != serial:
                    continue  # stored since: the events answer for it now
                if entry & COUNT_MASK > 1:
                    pending[key] = entry - 1
                else:
                    del pending[key]
                    clear_bit(masks, key, bit)

    def drop(self, inst: IndexedInstance) -> None:
        """Every pick on ``inst`` ends: nothing is pending there any more."""
        masks = inst.group.pending
        for key in inst.pending:
            clear_bit(masks, key, inst.bit)
        inst.pending.clear()
        for pick in inst.picks:
            del self.live[pick]
        inst.picks.clear()

    def expired(self, now: float) -> list[Pick]:
        """The live picks whose TTL ran out by ``now`` (taken off the expiry queue; the caller
        ends them)."""
        expiry = self.expiry
        ended = []
        while expiry and expiry[0].expires <= now:
            claim = expiry.popleft()
            if self.live.get(claim.pick) is claim:
                ended.append(claim)
        return ended
