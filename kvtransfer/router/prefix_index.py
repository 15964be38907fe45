"""`PrefixIndex`: which instance holds which prompt prefix in its KV cache.

Keys are the router's own chained hash of token-id blocks: block ``i`` of a prompt is keyed by
``hash((key of block i - 1, *its block_size token ids))`` (block 0 chains from 0), so a key names
a whole prefix, never merely equal block contents, and engines hashing differently (ours:
SHA-256 of int64 tokens; vLLM: its own) all map to one key space. Key spaces are per block size:
an instance's blocks are keyed with its own ``block_size``.

Per instance the index keeps two sets of keys:

* **precise**, from the instance's KV cache events (`kvtransfer.router.kv_events` applies them):
  a ``BlockStored`` is rebuilt into keys from its ``token_ids`` and the key of its
  ``parent_block_hash`` (engine hash -> key map, kept for removals); ``BlockRemoved`` drops keys,
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
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from itertools import chain, compress, filterfalse, islice, repeat
from operator import add, and_, not_, or_, rshift
from typing import Literal

from kvtransfer.serve.kv_events import (
    MEDIUM_GPU,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EngineHash,
    KVCacheEvent,
)

logger = logging.getLogger("kvtransfer.router.prefix_index")

Mode = Literal["precise", "approximate"]
ROOT_KEY = 0
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
# A look-up goes in rounds of 1, 16, then 64 blocks (`_walk`): a prompt nobody holds costs one
# hash; a round costs about 1 us more than its blocks, and a walk that stops inside one has
# hashed the rest of it for nothing (the request's `observe` uses those keys, though). Measured
# against 1, 4, 16, 64 and 1, 64 with benchmarks/routing_index.py: as fast on long prompts,
# faster on short ones.
_FIRST_ROUND_BLOCKS = 1
_ROUND_GROWTH = 16
_MAX_ROUND_BLOCKS = 64
# Prompts whose keys are kept (per thread), the latest: enough for the choices of one request
# (decode estimate, decode pick, prefill pick, the observes: within milliseconds) and the
# requests routed around it; a request's tuple is kept alive while it is listed.
_KEYED_PROMPTS = 32
_COUNT_BITS = 32
_COUNT_MASK = (1 << _COUNT_BITS) - 1
_ZEROS = repeat(0)
_ONES = repeat(1)
_NONES = repeat(None)


def _key_chain(
    parent: int, tokens: Iterable[int], block_size: int
) -> tuple[list[int], Iterator[int]]:
    """An empty list and the iterator that yields the keys of the blocks of ``tokens`` after
    the block keyed ``parent``, each to be appended to that list before the next is drawn
    (``list.extend`` does): a block's key needs the one before, and the iterator reads it back
    from the list. All in C: zip cuts the blocks and puts the previous key in front (reusing
    its tuple, which hash does not keep), a list iterator sees what is appended while it runs;
    no Python code runs per block."""
    keys: list[int] = []
    previous = chain((parent,), iter(keys))
    return keys, map(hash, zip(previous, *[iter(tokens)] * block_size, strict=False))


def _keys_after(parent: int, tokens: Iterable[int], block_size: int) -> list[int]:
    """The keys of every full block of ``tokens``, chained from ``parent``."""
    keys, pipe = _key_chain(parent, tokens, block_size)
    keys.extend(pipe)
    return keys


class _Chain:
    """The keys of one prompt's full blocks at one block size, computed as far as asked (a
    look-up stops at the first block no instance holds; `observe` then asks for all)."""

    __slots__ = ("_pipe", "keys", "tokens", "total")

    def __init__(self, tokens: tuple[int, ...], block_size: int) -> None:
        self.tokens = tokens
        self.total = len(tokens) // block_size
        self.keys, self._pipe = _key_chain(ROOT_KEY, tokens, block_size)

    def upto(self, count: int) -> list[int]:
        """The keys of (at least) the first ``count`` blocks (fewer: all there are)."""
        keys = self.keys
        missing = count - len(keys)
        if missing > 0:
            keys.extend(islice(self._pipe, missing))
        return keys


_kept = threading.local()


def _chain_of(tokens: tuple[int, ...], block_size: int, *, keep: bool) -> _Chain:
    """The `_Chain` of ``tokens``: the prefill and decode indexes, the estimate and the picks of
    one request all see the request's one tuple, so its blocks are hashed once per request
    (``keep``: the caller's own tuple, worth keeping). Per thread, as the indexes are."""
    if not keep:
        return _Chain(tokens, block_size)
    chains: dict[tuple[int, int], _Chain] | None = getattr(_kept, "chains", None)
    if chains is None:
        chains = _kept.chains = {}
    name = (id(tokens), block_size)
    prompt = chains.get(name)
    # Listed, the tuple is alive: no other object has its id.
    if prompt is not None and prompt.tokens is tokens:
        return prompt
    prompt = chains[name] = _Chain(tokens, block_size)
    if len(chains) > _KEYED_PROMPTS:
        del chains[next(iter(chains))]  # the oldest listed
    return prompt


def block_keys(token_ids: Sequence[int], block_size: int) -> list[int]:
    """The router's keys of every full block of ``token_ids``."""
    tokens = token_ids if isinstance(token_ids, tuple) else tuple(token_ids)
    prompt = _Chain(tokens, block_size)
    return list(prompt.upto(prompt.total))


@dataclass
class _Group:
    """The instances of one block size and their keys: key -> bit mask of instance slots.
    ``pending`` is apart from ``precise`` (its keys come and go with each pick: a small dict
    stays in the CPU's cache, a large one would miss it twice per block and pick), and
    disjoint from it per instance: a block stored is no longer pending there."""

    block_size: int
    precise: dict[int, int] = field(default_factory=dict)
    approx: dict[int, int] = field(default_factory=dict)
    pending: dict[int, int] = field(default_factory=dict)
    members: int = 0


@dataclass
class _Instance:
    address: str
    slot: int
    group: _Group
    approx_capacity: int
    # precise: engine hash -> key; key -> how many engine hashes map to it
    engine_keys: dict[EngineHash, int] = field(default_factory=dict)
    precise_refs: dict[int, int] = field(default_factory=dict)
    approx: OrderedDict[int, None] = field(default_factory=OrderedDict)
    # pending: key -> (serial << _COUNT_BITS) | live picks claiming it, the serial that of the
    # pick that made the key pending: a pick releases its claim only on the entry it counted
    # in, not on one made after its own was confirmed (stored) and the block dropped again.
    pending: dict[int, int] = field(default_factory=dict)
    picks: dict[str, _Pick] = field(default_factory=dict)
    # event health
    events_attached: bool = False
    synced: bool = False
    unusable: str | None = None
    heartbeats: bool = False
    last_message_at: float | None = None
    expecting_since: float | None = None
    skipped_events: int = 0

    @property
    def bit(self) -> int:
        return 1 << self.slot


@dataclass(eq=False)
class _Pick:
    """A request routed to ``address`` whose blocks its events have not all shown yet."""

    pick: str
    address: str
    expires: float
    serial: int
    fresh: list[int]  # the blocks it made pending (their entries have its serial)
    shared: list[int]  # the blocks another live pick had made pending, and those serials
    shared_serials: list[int]


@dataclass(frozen=True)
class InstanceIndexStats:
    address: str
    mode: Mode
    block_size: int
    precise_blocks: int
    approx_blocks: int
    pending_blocks: int
    pending_picks: int
    events_attached: bool
    synced: bool
    unusable: str | None
    seconds_since_message: float | None
    skipped_events: int


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
        self._instances: dict[str, _Instance] = {}
        self._groups: dict[int, _Group] = {}
        self._free_slots: list[int] = []
        self._next_slot = 0
        self._by_slot: dict[int, str] = {}
        # Bumped by every change: the last look-up is reused for the same prompt object until
        # then (a router asks twice per decision: conditional disaggregation, then the pick).
        self._version = 0
        self._last_match: tuple[tuple[int, ...], int, float, dict[str, int]] | None = None
        # Live picks by request id (a retry of one elsewhere ends it), and every pick in the
        # order it expires (one TTL for all: the order they were made).
        self._picks: dict[str, _Pick] = {}
        self._expiry: deque[_Pick] = deque()
        self._serial = 0
        self._anonymous = 0

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
            group = self._groups[block_size] = _Group(block_size)
        inst = _Instance(address, slot, group, capacity)
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
        self._clear_precise(inst)
        self._clear_approx(inst)
        self._drop_picks(inst)
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
            self._clear_precise(inst)
            self._clear_approx(inst)
            self._drop_picks(inst)

    # ------------------------------------------------------------------ look-up

    def match(self, token_ids: Sequence[int]) -> dict[str, int]:
        """Address -> how many leading full blocks of ``token_ids`` it holds (as far as the
        index knows); an instance holding none is left out."""
        keep = isinstance(token_ids, tuple)
        tokens = token_ids if isinstance(token_ids, tuple) else tuple(token_ids)
        now = self._clock()
        expiry = self._expiry
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
            for address in _members(group, by_slot):
                inst = self._instances[address]
                if self._mode(inst, now) == "precise":
                    precise_mask |= inst.bit
            approx_mask = group.members & ~precise_mask
            if not precise_mask:
                held = _single(group.approx)  # every instance answers from the same set
            elif not approx_mask:
                held = (
                    _union(group.precise, group.pending)
                    if group.pending
                    else _single(group.precise)
                )
            else:
                held = _mixed(group, precise_mask, approx_mask)
            # A prompt nobody holds is the most common miss: one hash, nothing built.
            if not held([hash((ROOT_KEY, *tokens[:bs]))])[0]:
                continue
            _walk(result, _chain_of(tokens, bs, keep=keep), held, group.members, by_slot)
        self._last_match = (tokens, self._version, now, result)
        return dict(result)

    def cached_blocks(self, address: str, token_ids: Sequence[int]) -> int:
        return self.match(token_ids).get(address, 0)

    def mode(self, address: str) -> Mode:
        inst = self._instances.get(address)
        return "approximate" if inst is None else self._mode(inst, self._clock())

    def _mode(self, inst: _Instance, now: float) -> Mode:
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
        prompt = _chain_of(tokens, group.block_size, keep=keep)
        keys = prompt.upto(prompt.total)
        if pick is not None:
            # The request picked again (here or elsewhere): its previous try failed.
            self._pick_ended(self._picks.get(pick))
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
                    self._claim(inst, pick, unseen, now)
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

    def _trim_approx(self, inst: _Instance) -> None:
        approx = inst.approx
        masks = inst.group.approx
        while len(approx) > inst.approx_capacity:
            key, _ = approx.popitem(last=False)
            _clear_bit(masks, key, inst.bit)

    # ------------------------------------------------------------------ pending picks

    def pick_ended(self, address: str, pick: str) -> None:
        """Request ``pick`` no longer runs on ``address`` (it finished or failed): what its
        events did not show by now is not counted for it any more."""
        found = self._picks.get(pick)
        if found is not None and found.address == address:
            self._pick_ended(found)

    @property
    def has_picks(self) -> bool:
        """Whether some pick's blocks are pending anywhere."""
        return bool(self._picks)

    def picks_ended(self, address: str) -> None:
        """No request routed to ``address`` runs there any more (none in flight, or the
        instance was taken out): every pick's pending blocks there go."""
        inst = self._instances.get(address)
        if inst is not None and inst.picks:
            self._version += 1
            self._drop_picks(inst)

    def _claim(self, inst: _Instance, pick: str | None, keys: list[int], now: float) -> None:
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
            pending.update(zip(shared, map(add, entries, _ONES), strict=True))
            shared_serials = list(map(rshift, entries, repeat(_COUNT_BITS)))
        else:
            fresh, shared, shared_serials = keys, [], []
        pending.update(zip(fresh, repeat((serial << _COUNT_BITS) | 1), strict=False))
        _set_bits(inst.group.pending, fresh, inst.bit)
        claim = _Pick(
            pick, inst.address, now + self.pending_ttl_s, serial, fresh, shared, shared_serials
        )
        inst.picks[pick] = self._picks[pick] = claim
        self._expiry.append(claim)

    def _pick_ended(self, claim: _Pick | None) -> None:
        if claim is None:
            return
        self._version += 1
        inst = self._instances[claim.address]
        del inst.picks[claim.pick]
        del self._picks[claim.pick]
        pending = inst.pending
        fresh = claim.fresh
        alone = (claim.serial << _COUNT_BITS) | 1
        if list(map(pending.get, fresh)).count(alone) == len(fresh):
            # The usual end: its blocks were pending for it alone, none stored since.
            _consume(map(pending.pop, fresh, _NONES))
            _clear_bits(inst.group.pending, fresh, inst.bit)
            fresh = []
        masks = inst.group.pending
        bit = inst.bit
        for keys, serials in (
            (fresh, repeat(claim.serial)),
            (claim.shared, claim.shared_serials),
        ):
            for key, serial in zip(keys, serials, strict=False):
                entry = pending.get(key)
                if entry is None or entry >> _COUNT_BITS != serial:
                    continue  # stored since: the events answer for it now
                if entry & _COUNT_MASK > 1:
                    pending[key] = entry - 1
                else:
                    del pending[key]
                    _clear_bit(masks, key, bit)

    def _drop_picks(self, inst: _Instance) -> None:
        masks = inst.group.pending
        for key in inst.pending:
            _clear_bit(masks, key, inst.bit)
        inst.pending.clear()
        for pick in inst.picks:
            del self._picks[pick]
        inst.picks.clear()

    def _expire(self, now: float) -> None:
        expiry = self._expiry
        while expiry and expiry[0].expires <= now:
            claim = expiry.popleft()
            if self._picks.get(claim.pick) is claim:
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
            self._clear_precise(inst)
            self._drop_picks(inst)

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
            self._clear_precise(inst)
            self._drop_picks(inst)

    def apply(self, address: str, events: Iterable[KVCacheEvent]) -> None:
        """Apply one batch of the instance's events, in order."""
        self._version += 1
        inst = self._instances.get(address)
        if inst is None:
            return
        for event in events:
            if isinstance(event, BlockStored):
                self._stored(inst, event)
            elif isinstance(event, BlockRemoved):
                if _indexed_tier(event.medium, event.group_idx, event.locality):
                    self._removed(inst, event.block_hashes)
            elif isinstance(event, AllBlocksCleared):
                self._clear_precise(inst)
                self._clear_approx(inst)
                self._drop_picks(inst)

    def _stored(self, inst: _Instance, event: BlockStored) -> None:
        bs = inst.group.block_size
        hashes = event.block_hashes
        tokens = event.token_ids
        if not _indexed_tier(event.medium, event.group_idx, event.locality):
            return
        if event.lookahead_token_ids is not None:
            # vLLM 0.33's lookahead hashing: a block's hash covers tokens past it, so the engine
            # hits it only for prompts that continue the same way; keys of block tokens alone
            # would claim hits it does not give. Refused: the approximate index answers.
            self._unusable(inst, "events hash blocks with lookahead tokens (past the block)")
            inst.skipped_events += 1
            return
        if event.block_size != bs:
            self._unusable(inst, f"events have block_size {event.block_size}, the index {bs}")
            inst.skipped_events += 1
            return
        if (
            event.lora_id is not None
            or event.lora_name is not None
            or len(tokens) != len(hashes) * bs
        ):
            # Blocks keyed by more than their tokens, or not one block per hash (hybrid groups):
            # left out, so the set stays a subset of what the engine holds.
            inst.skipped_events += 1
            return
        parent = event.parent_block_hash
        key = ROOT_KEY if parent is None else inst.engine_keys.get(parent)
        if key is None:
            inst.skipped_events += 1  # its parent was stored before we listened, or is gone
            return
        extra = event.extra_keys
        keys = _keys_after(key, tokens, bs)
        for i, engine_hash in enumerate(hashes):
            if extra is not None and i < len(extra) and extra[i] is not None:
                inst.skipped_events += 1
                return
            key = keys[i]
            old = inst.engine_keys.get(engine_hash)
            if old == key:
                continue
            if old is not None:
                self._unref(inst, old)
            inst.engine_keys[engine_hash] = key
            refs = inst.precise_refs
            count = refs.get(key, 0)
            refs[key] = count + 1
            if not count:
                masks = inst.group.precise
                masks[key] = masks.get(key, 0) | inst.bit
                # A pending block now stored: confirmed, the precise set holds it from here on.
                if inst.pending and inst.pending.pop(key, None) is not None:
                    _clear_bit(inst.group.pending, key, inst.bit)

    def _unusable(self, inst: _Instance, why: str) -> None:
        """The instance's events cannot be keyed: its approximate index answers for it."""
        if inst.unusable is None:
            inst.unusable = why
            logger.warning("KV events of %s: %s; its approximate index is used", inst.address, why)

    def _removed(self, inst: _Instance, hashes: Iterable[EngineHash]) -> None:
        for engine_hash in hashes:
            key = inst.engine_keys.pop(engine_hash, None)
            if key is not None:
                self._unref(inst, key)

    def _unref(self, inst: _Instance, key: int) -> None:
        refs = inst.precise_refs
        count = refs.pop(key, 0) - 1
        if count > 0:
            refs[key] = count
        else:
            _clear_bit(inst.group.precise, key, inst.bit)

    def _clear_precise(self, inst: _Instance) -> None:
        masks = inst.group.precise
        for key in inst.precise_refs:
            _clear_bit(masks, key, inst.bit)
        inst.precise_refs.clear()
        inst.engine_keys.clear()

    def _clear_approx(self, inst: _Instance) -> None:
        masks = inst.group.approx
        for key in inst.approx:
            _clear_bit(masks, key, inst.bit)
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


def _walk(
    result: dict[str, int],
    prompt: _Chain,
    held: Callable[[list[int]], list[int]],
    alive: int,
    by_slot: dict[int, str],
) -> None:
    """Record in ``result`` how many leading blocks of ``prompt`` each instance of ``alive``
    holds, ``held`` giving the mask of instances holding each of a list of keys; stops at the
    first block none holds.

    In rounds: a round hashes its blocks (the keys stay in ``prompt`` for the request's other
    choices) and looks them all up in C; only a round where who holds the prefix changes is
    gone through in Python, block by block. A miss costs one hash; a walk that stops
    mid-prompt hashes at most a round's worth of blocks past its end."""
    total = prompt.total
    done = 0
    size = _FIRST_ROUND_BLOCKS
    while done < total:
        end = min(total, done + size)
        masks = held(prompt.upto(end)[done:end])
        if masks.count(alive) != len(masks):
            depth = done
            for mask in masks:
                if mask != alive:
                    lost = alive & ~mask
                    if lost:
                        if depth:
                            _record(result, lost, depth, by_slot)
                        alive &= mask
                        if not alive:
                            return
                depth += 1
        done = end
        size = min(_ROUND_GROWTH * size, _MAX_ROUND_BLOCKS)
    _record(result, alive, total, by_slot)


def _single(masks: dict[int, int]) -> Callable[[list[int]], list[int]]:
    """Per key, the instances holding it per ``masks``."""
    get = masks.get

    def held(keys: list[int]) -> list[int]:
        return list(map(get, keys, _ZEROS))

    return held


def _union(masks: dict[int, int], more: dict[int, int]) -> Callable[[list[int]], list[int]]:
    """Per key, the instances holding it per ``masks`` or ``more``."""
    get = masks.get
    more_get = more.get

    def held(keys: list[int]) -> list[int]:
        return list(map(or_, map(get, keys, _ZEROS), map(more_get, keys, _ZEROS)))

    return held


def _mixed(group: _Group, precise_mask: int, approx_mask: int) -> Callable[[list[int]], list[int]]:
    """Per key, the instances of ``precise_mask`` answering from their precise and pending
    sets, the others from their approximate ones."""
    precise = _union(group.precise, group.pending) if group.pending else _single(group.precise)
    approx_get = group.approx.get
    precise_masks = repeat(precise_mask)
    approx_masks = repeat(approx_mask)

    def held(keys: list[int]) -> list[int]:
        return list(
            map(
                or_,
                map(and_, precise(keys), precise_masks),
                map(and_, map(approx_get, keys, _ZEROS), approx_masks),
            )
        )

    return held


def _indexed_tier(medium: str | None, group_idx: int | None, locality: str | None) -> bool:
    """Only the engine's own cache (not an offload tier, not remote storage; vLLM 0.33 says
    ``locality``) of its first KV cache group."""
    return medium in (None, MEDIUM_GPU) and group_idx in (None, 0) and locality in (None, "LOCAL")


def _members(group: _Group, by_slot: dict[int, str]) -> Iterable[str]:
    mask = group.members
    while mask:
        low = mask & -mask
        yield by_slot[low.bit_length() - 1]
        mask ^= low


def _record(result: dict[str, int], mask: int, depth: int, by_slot: dict[int, str]) -> None:
    while mask:
        low = mask & -mask
        result[by_slot[low.bit_length() - 1]] = depth
        mask ^= low


def _set_bits(masks: dict[int, int], keys: list[int], bit: int) -> None:
    """``bit`` set in the masks of ``keys`` (C loops)."""
    masks.update(zip(keys, map(or_, map(masks.get, keys, _ZEROS), repeat(bit)), strict=True))


def _clear_bits(masks: dict[int, int], keys: list[int], bit: int) -> None:
    """``bit`` cleared in the masks of ``keys``, a key whose mask is left empty removed (C
    loops)."""
    held = list(map(masks.__getitem__, keys))
    if held.count(bit) == len(held):  # the usual: held by this instance alone
        _consume(map(masks.pop, keys, _NONES))
        return
    left = list(map(and_, held, repeat(~bit)))
    masks.update(zip(keys, left, strict=True))
    _consume(map(masks.pop, compress(keys, map(not_, left)), _NONES))


def _consume(calls: Iterator[object]) -> None:
    """Run ``calls`` (a map of side effects) in C. Deletions are pops with a default: a
    prompt whose chain repeats a key (a collision of the non-cryptographic hash, which a
    crafted prompt could cause) must not raise."""
    deque(calls, maxlen=0)


def _clear_bit(masks: dict[int, int], key: int, bit: int) -> None:
    mask = masks.get(key, 0) & ~bit
    if mask:
        masks[key] = mask
    else:
        masks.pop(key, None)
