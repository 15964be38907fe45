"""`PrefixIndex`: which instance holds which prompt prefix in its KV cache.

Keys are the router's own chained hash of token-id blocks: block ``i`` of a prompt is keyed by
``hash((key of block i - 1, *its block_size token ids))`` (block 0 chains from 0), so a key names
a whole prefix, never merely equal block contents, and engines hashing differently (ours:
SHA-256 of int64 tokens; vLLM: its own) all map to one key space. Key spaces are per block size:
an instance's blocks are keyed with its own ``block_size``.

Per instance the index keeps two sets of keys:

* **precise**, from the instance's KV cache events (`kvtransfer.router.routing.kv_events`
  applies them, `precise` keys them): a ``BlockStored`` is rebuilt into keys from its
  ``token_ids`` and the key of its ``parent_block_hash`` (engine hash -> key map, kept for
  removals); ``BlockRemoved`` drops keys,
  ``AllBlocksCleared`` drops everything. Built from an unbroken run of events, the set is a
  subset of what the engine holds: it may miss blocks (stored before the run began, or in
  events it cannot key), it never claims one the engine dropped.
* **approximate**, learned from the requests routed there (`observe`): every full block of the
  prompt, least recently routed evicted beyond ``approx_capacity_blocks``. It may claim blocks
  the engine evicted since.
* **pending**, for an instance with events: the blocks of the requests routed there that its
  events do not show yet (`observe` with the request's id: a *pick*). An engine announces a
  block only once it has scheduled it, so without them a burst of requests on a new prefix
  would score 0 everywhere and be spread, each instance computing the prefix. A pick's claim
  on a block ends when the instance's events store that block (they hold it from then on),
  when the pick ends or fails (`pick_ended`, `picks_ended`, or the same request picked again
  elsewhere: a retry), after ``pending_ttl_s``, or with the precise set (`forget`,
  ``AllBlocksCleared``, `clear_precise`, `detach_events`): it never outlives what it stands
  for by more than the TTL, and never survives a restart of the engine.

`match` uses the precise set plus the pending blocks of an instance whose events are live, and
the approximate one (which holds every pick too) otherwise. Events are live when a subscriber
is attached and in sync (`events_synced`) and they do not lag: no request expected to store
blocks there was routed more than ``max_event_lag_s`` ago without a message since, and, for a
publisher seen sending heartbeats (empty batches, as our daemons do), no silence longer than
``max_event_lag_s``.

Not thread-safe: the router calls it from its event loop only.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable, Sequence
from itertools import filterfalse

from kvtransfer.router.routing.prefix_index.instance import (
    IndexedInstance,
    InstanceIndexStats,
    Mode,
    Pick,
)
from kvtransfer.router.routing.prefix_index.keys import ROOT_KEY, chain_of
from kvtransfer.router.routing.prefix_index.masks import (
    Group,
    clear_bit,
    members,
    mixed,
    single,
    union,
    walk,
)
from kvtransfer.router.routing.prefix_index.pending import PendingPicks
from kvtransfer.router.routing.prefix_index.precise import (
    clear_precise,
    indexed_tier,
    remove,
    store,
)
from kvtransfer.serve.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVCacheEvent

logger = logging.getLogger("kvtransfer.router.prefix_index")

DEFAULT_BLOCK_SIZE = 16
DEFAULT_APPROX_CAPACITY_BLOCKS = 65_536
DEFAULT_MAX_EVENT_LAG_S = 3.0
# How long a pick's pending blocks count at most. They are needed from the pick until the
# engine announces the blocks, which it does when it schedules them: normally tens to hundreds
# of milliseconds, seconds when its queue is long. Beyond that the claim mostly stands for a
# request that will never store them (aborted in the queue, or blocks its events cannot name:
# LoRA, multimodal), and would keep pulling its prefix to an instance that lacks it. The same
# bound as the event lag: a pick that events have not shown for this long makes the instance's
# events lag, and its approximate set (which holds the pick) answers, so a pick counts
# somewhere all along. Ends, failures and the events themselves end most claims far earlier.
DEFAULT_PENDING_TTL_S = DEFAULT_MAX_EVENT_LAG_S
_REUSE_MATCH_S = 0.01


class PrefixIndex:
    def __init__(
        self,
        *,
        default_block_size: int = DEFAULT_BLOCK_SIZE,
        approx_capacity_blocks: int = DEFAULT_APPROX_CAPACITY_BLOCKS,
        max_event_lag_s: float = DEFAULT_MAX_EVENT_LAG_S,
        pending_ttl_s: float = DEFAULT_PENDING_TTL_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if default_block_size < 1 or approx_capacity_blocks < 1 or max_event_lag_s <= 0:
            raise ValueError(
                "default_block_size and approx_capacity_blocks must be >= 1, max_event_lag_s > 0"
            )
        if not pending_ttl_s >= 0:
            raise ValueError(
                f"pending_ttl_s must be >= 0 (0: no pending picks), got {pending_ttl_s}"
            )
        self.default_block_size = default_block_size
        self.approx_capacity_blocks = approx_capacity_blocks
        self.max_event_lag_s = max_event_lag_s
        self.pending_ttl_s = pending_ttl_s
        self._clock = clock
        self._instances: dict[str, IndexedInstance] = {}
        self._groups: dict[int, Group] = {}
        self._free_slots: list[int] = []
        self._next_slot = 0
        self._by_slot: dict[int, str] = {}
        # Bumped by every change: the last look-up is reused for the same prompt object until
        # then (a router asks twice per decision: conditional disaggregation, then the pick).
        self._version = 0
        self._last_match: tuple[tuple[int, ...], int, float, dict[str, int]] | None = None
        self._pending = PendingPicks(pending_ttl_s)

    # ------------------------------------------------------------------ instances

    def add_instance(
        self,
        address: str,
        *,
        block_size: int | None = None,
        approx_capacity_blocks: int | None = None,
    ) -> None:
        """Register ``address``, or change an instance's settings (``None``: keep them, or
        the index's defaults for a new one); a new block size forgets what it knew."""
        self._version += 1
        if (block_size is not None and block_size < 1) or (
            approx_capacity_blocks is not None and approx_capacity_blocks < 1
        ):
            raise ValueError("block_size and approx_capacity_blocks must be >= 1")
        inst = self._instances.get(address)
        if inst is not None:
            if approx_capacity_blocks is not None:
                inst.approx_capacity = approx_capacity_blocks
                self._trim_approx(inst)
            if block_size is None or block_size == inst.group.block_size:
                return
            attached, synced = inst.events_attached, inst.synced
            self.remove_instance(address)
            self.add_instance(
                address, block_size=block_size, approx_capacity_blocks=inst.approx_capacity
            )
            self._instances[address].events_attached = attached
            self._instances[address].synced = synced
            return
        block_size = block_size or self.default_block_size
        capacity = approx_capacity_blocks or self.approx_capacity_blocks
        slot = self._free_slots.pop() if self._free_slots else self._take_slot()
        group = self._groups.get(block_size)
        if group is None:
            group = self._groups[block_size] = Group(block_size)
        inst = IndexedInstance(address, slot, group, capacity)
        group.members |= inst.bit
        self._instances[address] = inst
        self._by_slot[slot] = address

    def _take_slot(self) -> int:
        self._next_slot += 1
        return self._next_slot - 1

    def remove_instance(self, address: str) -> None:
        self._version += 1
        inst = self._instances.pop(address, None)
        if inst is None:
            return
        clear_precise(inst)
        self._clear_approx(inst)
        self._pending.drop(inst)
        inst.group.members &= ~inst.bit
        if not inst.group.members:
            del self._groups[inst.group.block_size]
        del self._by_slot[inst.slot]
        self._free_slots.append(inst.slot)

    @property
    def addresses(self) -> list[str]:
        return list(self._instances)

    def block_size(self, address: str) -> int:
        inst = self._instances.get(address)
        return inst.group.block_size if inst is not None else self.default_block_size

    def forget(self, address: str) -> None:
        """The instance's cache is empty (it restarted, or said so): drop both sets, and its
        pending picks."""
        self._version += 1
        inst = self._instances.get(address)
        if inst is not None:
            clear_precise(inst)
            self._clear_approx(inst)
            self._pending.drop(inst)

    # ------------------------------------------------------------------ look-up

    def match(self, token_ids: Sequence[int]) -> dict[str, int]:
        """Address -> how many leading full blocks of ``token_ids`` it holds (as far as the
        index knows); an instance holding none is left out."""
        keep = isinstance(token_ids, tuple)
        tokens = token_ids if isinstance(token_ids, tuple) else tuple(token_ids)
        now = self._clock()
        expiry = self._pending.expiry
        if expiry and expiry[0].expires <= now:
            self._expire(now)
        last = self._last_match
        if (
            last is not None
            and last[0] is tokens
            and last[1] == self._version
            and 0 <= now - last[2] < _REUSE_MATCH_S
        ):
            return dict(last[3])
        result: dict[str, int] = {}
        by_slot = self._by_slot
        for group in self._groups.values():
            bs = group.block_size
            if len(tokens) < bs:
                continue
            precise_mask = 0
            for address in members(group, by_slot):
                inst = self._instances[address]
                if self._mode(inst, now) == "precise":
                    precise_mask |= inst.bit
            approx_mask = group.members & ~precise_mask
            if not precise_mask:
                held = single(group.approx)  # every instance answers from the same set
            elif not approx_mask:
                held = (
                    union(group.precise, group.pending) if group.pending else single(group.precise)
                )
            else:
                held = mixed(group, precise_mask, approx_mask)
            # A prompt nobody holds is the most common miss: one hash, nothing built.
            if not held([hash((ROOT_KEY, *tokens[:bs]))])[0]:
                continue
            walk(result, chain_of(tokens, bs, keep=keep), held, group.members, by_slot)
        self._last_match = (tokens, self._version, now, result)
        return dict(result)

    def cached_blocks(self, address: str, token_ids: Sequence[int]) -> int:
        return self.match(token_ids).get(address, 0)

    def mode(self, address: str) -> Mode:
        inst = self._instances.get(address)
        return "approximate" if inst is None else self._mode(inst, self._clock())

    def _mode(self, inst: IndexedInstance, now: float) -> Mode:
        if not inst.events_attached or not inst.synced or inst.unusable is not None:
            return "approximate"
        lag = self.max_event_lag_s
        if inst.expecting_since is not None and now - inst.expecting_since > lag:
            return "approximate"
        silent_since = inst.last_message_at if inst.heartbeats else None
        if silent_since is not None and now - silent_since > lag:
            return "approximate"
        return "precise"

    # ------------------------------------------------------------------ learning from routing

    def observe(self, address: str, token_ids: Sequence[int], *, pick: str | None = None) -> None:
        """A request with ``token_ids`` was routed to ``address``: its full blocks are likely
        cached there now (approximate set); with events attached, events are expected, and the
        blocks they do not show yet are pending for pick ``pick`` (the request's id; ``None``:
        one that only the TTL and the events end) until they do."""
        self._version += 1
        if address not in self._instances:
            self.add_instance(address)
        inst = self._instances[address]
        group = inst.group
        keep = isinstance(token_ids, tuple)
        tokens = token_ids if isinstance(token_ids, tuple) else tuple(token_ids)
        prompt = chain_of(tokens, group.block_size, keep=keep)
        keys = prompt.upto(prompt.total)
        if pick is not None:
            # The request picked again (here or elsewhere): its previous try failed.
            self._pick_ended(self._pending.live.get(pick))
        if not keys:
            return
        if inst.events_attached:
            refs = inst.precise_refs
            if self.pending_ttl_s > 0 and inst.unusable is None:
                unseen = list(filterfalse(refs.__contains__, keys))
                if unseen:
                    now = self._clock()
                    if inst.expecting_since is None:
                        inst.expecting_since = now
                    self._pending.claim(inst, pick, unseen, now)
            elif inst.expecting_since is None and not all(map(refs.__contains__, keys)):
                inst.expecting_since = self._clock()
        approx = inst.approx
        bit = inst.bit
        masks = group.approx
        for key in keys:
            if key in approx:
                approx.move_to_end(key)
            else:
                approx[key] = None
                masks[key] = masks.get(key, 0) | bit
        self._trim_approx(inst)

    def _trim_approx(self, inst: IndexedInstance) -> None:
        approx = inst.approx
        masks = inst.group.approx
        while len(approx) > inst.approx_capacity:
            key, _ = approx.popitem(last=False)
            clear_bit(masks, key, inst.bit)

    # ------------------------------------------------------------------ pending picks

    def pick_ended(self, address: str, pick: str) -> None:
        """Request ``pick`` no longer runs on ``address`` (it finished or failed): what its
        events did not show by now is not counted for it any more."""
        found = self._pending.live.get(pick)
        if found is not None and found.address == address:
            self._pick_ended(found)

    @property
    def has_picks(self) -> bool:
        """Whether some pick's blocks are pending anywhere."""
        return bool(self._pending.live)

    def picks_ended(self, address: str) -> None:
        """No request routed to ``address`` runs there any more (none in flight, or the
        instance was taken out): every pick's pending blocks there go."""
        inst = self._instances.get(address)
        if inst is not None and inst.picks:
            self._version += 1
            self._pending.drop(inst)

    def _pick_ended(self, claim: Pick | None) -> None:
        if claim is None:
            return
        self._version += 1
        self._pending.end(self._instances[claim.address], claim)

    def _expire(self, now: float) -> None:
        for claim in self._pending.expired(now):
            self._pick_ended(claim)

    # ------------------------------------------------------------------ events

    def attach_events(self, address: str) -> None:
        """A subscriber now feeds this instance's events (not yet in sync)."""
        self._version += 1
        if address not in self._instances:
            self.add_instance(address)
        inst = self._instances[address]
        inst.events_attached = True
        inst.synced = False

    def detach_events(self, address: str) -> None:
        self._version += 1
        inst = self._instances.get(address)
        if inst is not None:
            inst.events_attached = False
            inst.synced = False
            inst.heartbeats = False
            inst.last_message_at = inst.expecting_since = None
            clear_precise(inst)
            self._pending.drop(inst)

    def events_synced(self, address: str, synced: bool) -> None:
        """The subscriber applies an unbroken run of events (True), or lost track (False)."""
        self._version += 1
        inst = self._instances.get(address)
        if inst is not None:
            inst.synced = synced

    def message_received(self, address: str, *, heartbeat: bool = False) -> None:
        """Any message (a heartbeat too) from the instance's publisher."""
        self._version += 1
        inst = self._instances.get(address)
        if inst is not None:
            inst.last_message_at = self._clock()
            inst.expecting_since = None
            inst.heartbeats = inst.heartbeats or heartbeat

    def clear_precise(self, address: str) -> None:
        """Start the precise set again from nothing (a run of events broke). Pending picks go
        too: what was missed may be a restart, and they only stand on top of an unbroken run."""
        self._version += 1
        inst = self._instances.get(address)
        if inst is not None:
            clear_precise(inst)
            self._pending.drop(inst)

    def apply(self, address: str, events: Iterable[KVCacheEvent]) -> None:
        """Apply one batch of the instance's events, in order."""
        self._version += 1
        inst = self._instances.get(address)
        if inst is None:
            return
        for event in events:
            if isinstance(event, BlockStored):
                store(inst, event)
            elif isinstance(event, BlockRemoved):
                if indexed_tier(event.medium, event.group_idx, event.locality):
                    remove(inst, event.block_hashes)
            elif isinstance(event, AllBlocksCleared):
                clear_precise(inst)
                self._clear_approx(inst)
                self._pending.drop(inst)

    def _clear_approx(self, inst: IndexedInstance) -> None:
        masks = inst.group.approx
        for key in inst.approx:
            clear_bit(masks, key, inst.bit)
        inst.approx.clear()

    # ------------------------------------------------------------------ what it holds

    def stats(self) -> list[InstanceIndexStats]:
        now = self._clock()
        self._expire(now)
        return [
            InstanceIndexStats(
                address=inst.address,
                mode=self._mode(inst, now),
                block_size=inst.group.block_size,
                precise_blocks=len(inst.precise_refs),
                approx_blocks=len(inst.approx),
                pending_blocks=len(inst.pending),
                pending_picks=len(inst.picks),
                events_attached=inst.events_attached,
                synced=inst.synced,
                unusable=inst.unusable,
                seconds_since_message=(
                    None if inst.last_message_at is None else now - inst.last_message_at
                ),
                skipped_events=inst.skipped_events,
            )
            for inst in self._instances.values()
        ]
