"""`PrefixIndex`: which instance holds which prompt prefix in its KV cache.

Keys are the router's own chained hash of token-id blocks: block ``i`` of a prompt is keyed by
``hash((key of block i - 1, its block_size token ids))`` (block 0 chains from 0), so a key names
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

`match` uses the precise set of an instance whose events are live, and the approximate one
otherwise. Events are live when a subscriber is attached and in sync (`events_synced`) and
they do not lag: no request expected to store blocks there was routed more than
``max_event_lag_s`` ago without a message since, and, for a publisher seen sending heartbeats
(empty batches, as our daemons do), no silence longer than ``max_event_lag_s``.

Not thread-safe: the router calls it from its event loop only.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
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
_REUSE_MATCH_S = 0.01


def block_keys(token_ids: Sequence[int], block_size: int) -> list[int]:
    """The router's keys of every full block of ``token_ids``."""
    tokens = token_ids if isinstance(token_ids, tuple) else tuple(token_ids)
    keys: list[int] = []
    key = ROOT_KEY
    for start in range(0, len(tokens) - block_size + 1, block_size):
        key = hash((key, tokens[start : start + block_size]))
        keys.append(key)
    return keys


@dataclass
class _Group:
    """The instances of one block size and their keys: key -> bit mask of instance slots."""

    block_size: int
    precise: dict[int, int] = field(default_factory=dict)
    approx: dict[int, int] = field(default_factory=dict)
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


@dataclass(frozen=True)
class InstanceIndexStats:
    address: str
    mode: Mode
    block_size: int
    precise_blocks: int
    approx_blocks: int
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
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if default_block_size < 1 or approx_capacity_blocks < 1 or max_event_lag_s <= 0:
            raise ValueError(
                "default_block_size and approx_capacity_blocks must be >= 1, max_event_lag_s > 0"
            )
        self.default_block_size = default_block_size
        self.approx_capacity_blocks = approx_capacity_blocks
        self.max_event_lag_s = max_event_lag_s
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
        """The instance's cache is empty (it restarted, or said so): drop both sets."""
        self._version += 1
        inst = self._instances.get(address)
        if inst is not None:
            self._clear_precise(inst)
            self._clear_approx(inst)

    # ------------------------------------------------------------------ look-up

    def match(self, token_ids: Sequence[int]) -> dict[str, int]:
        """Address -> how many leading full blocks of ``token_ids`` it holds (as far as the
        index knows); an instance holding none is left out."""
        tokens = token_ids if isinstance(token_ids, tuple) else tuple(token_ids)
        now = self._clock()
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
            limit = len(tokens) - bs + 1
            if limit < 1:
                continue
            precise_mask = 0
            for address in _members(group, by_slot):
                inst = self._instances[address]
                if self._mode(inst, now) == "precise":
                    precise_mask |= inst.bit
            approx_mask = group.members & ~precise_mask
            if not approx_mask or not precise_mask:
                # Every instance answers from the same set: one look-up per block.
                masks = group.precise if precise_mask else group.approx
                _walk_one(result, tokens, bs, masks.get, group.members, by_slot)
            else:
                _walk_mixed(result, tokens, bs, group, precise_mask, approx_mask, by_slot)
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

    def observe(self, address: str, token_ids: Sequence[int]) -> None:
        """A request with ``token_ids`` was routed to ``address``: its full blocks are likely
        cached there now (approximate set); with events attached, events are expected."""
        self._version += 1
        if address not in self._instances:
            self.add_instance(address)
        inst = self._instances[address]
        group = inst.group
        keys = block_keys(token_ids, group.block_size)
        if not keys:
            return
        if inst.events_attached and inst.expecting_since is None:
            refs = inst.precise_refs
            if not all(key in refs for key in keys):
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
        """Start the precise set again from nothing (a run of events broke)."""
        self._version += 1
        inst = self._instances.get(address)
        if inst is not None:
            self._clear_precise(inst)

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
                if _indexed_tier(event.medium, event.group_idx):
                    self._removed(inst, event.block_hashes)
            elif isinstance(event, AllBlocksCleared):
                self._clear_precise(inst)
                self._clear_approx(inst)

    def _stored(self, inst: _Instance, event: BlockStored) -> None:
        bs = inst.group.block_size
        hashes = event.block_hashes
        tokens = event.token_ids
        if not _indexed_tier(event.medium, event.group_idx):
            return
        if event.block_size != bs:
            if inst.unusable is None:
                inst.unusable = f"events have block_size {event.block_size}, the index {bs}"
                logger.warning(
                    "KV events of %s: %s; its approximate index is used",
                    inst.address,
                    inst.unusable,
                )
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
        if not isinstance(tokens, tuple):
            tokens = tuple(tokens)
        for i, engine_hash in enumerate(hashes):
            if extra is not None and i < len(extra) and extra[i] is not None:
                inst.skipped_events += 1
                return
            key = hash((key, tokens[i * bs : (i + 1) * bs]))
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
        return [
            InstanceIndexStats(
                address=inst.address,
                mode=self._mode(inst, now),
                block_size=inst.group.block_size,
                precise_blocks=len(inst.precise_refs),
                approx_blocks=len(inst.approx),
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


def _walk_one(
    result: dict[str, int],
    tokens: tuple[int, ...],
    bs: int,
    get: Callable[[int, int], int],
    alive: int,
    by_slot: dict[int, str],
) -> None:
    """Record in ``result`` how many leading blocks of ``tokens`` each instance of ``alive``
    holds per ``get`` (key -> mask); stops at the first block none holds."""
    key = ROOT_KEY
    for start in range(0, len(tokens) - bs + 1, bs):
        key = hash((key, tokens[start : start + bs]))
        held = get(key, 0)
        lost = alive & ~held
        if lost:
            if start:
                _record(result, lost, start // bs, by_slot)
            alive &= held
            if not alive:
                return
    _record(result, alive, len(tokens) // bs, by_slot)


def _walk_mixed(
    result: dict[str, int],
    tokens: tuple[int, ...],
    bs: int,
    group: _Group,
    precise_mask: int,
    approx_mask: int,
    by_slot: dict[int, str],
) -> None:
    """`_walk_one` with the instances of ``precise_mask`` answering from their precise sets
    and the others from their approximate ones."""
    precise_get = group.precise.get
    approx_get = group.approx.get
    alive = group.members
    key = ROOT_KEY
    for start in range(0, len(tokens) - bs + 1, bs):
        key = hash((key, tokens[start : start + bs]))
        held = (precise_get(key, 0) & precise_mask) | (approx_get(key, 0) & approx_mask)
        lost = alive & ~held
        if lost:
            if start:
                _record(result, lost, start // bs, by_slot)
            alive &= held
            if not alive:
                return
    _record(result, alive, len(tokens) // bs, by_slot)


def _indexed_tier(medium: str | None, group_idx: int | None) -> bool:
    """Only the engine's own cache (not an offload tier) of its first KV cache group."""
    return medium in (None, MEDIUM_GPU) and group_idx in (None, 0)


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


def _clear_bit(masks: dict[int, int], key: int, bit: int) -> None:
    mask = masks.get(key, 0) & ~bit
    if mask:
        masks[key] = mask
    else:
        masks.pop(key, None)
