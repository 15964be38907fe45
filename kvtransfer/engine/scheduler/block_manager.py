"""`BlockManager`: the paged KV block pool, per-request block tables and the prefix cache.

Every block has a reference count. A block whose count drops to 0 goes to the end of the free
list but keeps its content hash, so a later request with the same prefix can take it back
(a prefix-cache hit); allocation takes blocks from the front of the free list and only then
drops their hash (LRU eviction).

A hybrid model's KV cache is several groups (`kvtransfer.connector.kv_groups`): group 0 holds the
full-attention layers, each further group the sliding-window layers of one window or the
recurrent-state (Mamba) layers. Every group of a request has its own block table drawn from this
one pool, and a block serves one group of one request (the workers give each group's layers their
own slice of every block). A sliding-window table gives back the blocks its window has passed:
their entries become the null block (block 0, reserved, never written) and the blocks return to
the pool. A recurrent-state table is one block, the request's running state, whatever its
length.

Prefix caching with sliding-window groups: each window group publishes its blocks under its own
key of the same chained hashes (KV events tell only group 0's). A hit is the longest run of
group 0's blocks whose end every window group can serve: the blocks its window reaches from
there must all be cached (those before are the null block). A recurrent state is kept for the
latest position only, so prefix caching is off for a model with one.

A block's hash covers its parent's hash and its own token ids (SHA-256, chained), so two
blocks with equal hashes hold the KV of equal prefixes, never merely equal block contents.

What enters and leaves the prefix cache is told to ``event_sink`` (a `KVCacheEventSink`; none
by default), on the thread that calls the block manager: a block is *stored* when it gets its
hash, *removed* when the hash is dropped (eviction, a corrupt block), and every hash goes at once
with `reset_prefix_cache`. The daemons publish these as KV cache events
(`kvtransfer.serve.kv_events`).
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any, Protocol

from kvtransfer.engine.config import NULL_BLOCK_ID
from kvtransfer.engine.scheduler.request import Request

BlockHash = bytes

_ROOT_HASH: BlockHash = b""


class KVCacheEventSink(Protocol):
    """Told what enters and leaves the prefix cache; must return at once (the engine waits)."""

    def blocks_stored(
        self,
        block_hashes: Sequence[BlockHash],
        parent_hash: BlockHash | None,
        token_ids: Sequence[int],
        block_size: int,
    ) -> None:
        """Consecutive full blocks of one request became cacheable; ``parent_hash`` is the
        hash of the block before the first (``None``: the first is a prompt's first block),
        ``token_ids`` their tokens, ``block_size`` per block."""

    def blocks_removed(self, block_hashes: Sequence[BlockHash]) -> None:
        """These hashes left the cache (the blocks may be reused for other content)."""

    def all_blocks_cleared(self) -> None:
        """Every hash left the cache."""


class _NoEvents:
    def blocks_stored(self, block_hashes, parent_hash, token_ids, block_size) -> None:
        pass

    def blocks_removed(self, block_hashes) -> None:
        pass

    def all_blocks_cleared(self) -> None:
        pass


class BlockLeakError(RuntimeError):
    """Blocks are still referenced when the pool should be empty."""


def hash_block_tokens(parent_hash: BlockHash, token_ids: Sequence[int]) -> BlockHash:
    """The chained hash of one full block (``parent_hash`` is ``b""`` for a first block)."""
    digest = hashlib.sha256(parent_hash)
    digest.update(array("q", token_ids).tobytes())
    return digest.digest()


_HASH_BYTES = 32  # sha256


def _window_key(group: int, block_hash: BlockHash) -> BlockHash:
    """Where window group ``group`` caches the block of ``block_hash`` (never a group 0 key:
    those are exactly `_HASH_BYTES` long)."""
    return b"w" + bytes([group]) + block_hash


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


class BlockManager:
    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_prefix_caching: bool = True,
        extra_groups: Sequence[int | None] = (),
    ):
        """``extra_groups``: each KV cache group after group 0, a sliding window in tokens or
        ``None`` for a recurrent-state group (none: a one-group pool)."""
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        if any(w is not None and w < 1 for w in extra_groups):
            raise ValueError(f"sliding windows must be >= 1, got {list(extra_groups)}")
        if extra_groups and num_blocks < 2:
            raise ValueError("a hybrid pool needs >= 2 blocks (block 0 is the null block)")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.extra_groups = tuple(extra_groups)
        self.null_block_id = NULL_BLOCK_ID if extra_groups else None
        self.enable_prefix_caching = enable_prefix_caching and None not in extra_groups
        self._ref_cnt = [0] * num_blocks
        self._block_hash: list[BlockHash | None] = [None] * num_blocks
        # Insertion order is eviction order: front = least recently freed.
        self._free: OrderedDict[int, None] = OrderedDict(
            (b, None) for b in range(num_blocks) if b != self.null_block_id
        )
        # Per request, the tables of groups 1.. (null entries before each window; a state
        # group's is one block).
        self._window_tables: dict[str, list[list[int]]] = {}
        # Per request and group, how many of its table's entries the workers were told of.
        self._told: dict[str, list[int]] = {}
        # Per request, how many leading blocks of each window table were published.
        self._window_published: dict[str, list[int]] = {}
        self._cached: dict[BlockHash, int] = {}
        self._tables: dict[str, list[int]] = {}
        # Leading blocks of each table already published (or taken from) the prefix cache.
        self._num_published: dict[str, int] = {}
        self._hashes: dict[str, list[BlockHash]] = {}
        self.event_sink: KVCacheEventSink = _NoEvents()

    # ------------------------------------------------------------------ queries

    @property
    def num_free_blocks(self) -> int:
        """Blocks with no reference (cached-but-free blocks included)."""
        return len(self._free)

    @property
    def capacity(self) -> int:
        """Blocks requests can hold (the null block of a hybrid pool is not one)."""
        return self.num_blocks - (self.null_block_id is not None)

    @property
    def num_groups(self) -> int:
        return 1 + len(self.extra_groups)

    @property
    def num_used_blocks(self) -> int:
        return self.capacity - len(self._free)

    @property
    def usage(self) -> float:
        return self.num_used_blocks / self.capacity

    @property
    def num_cached_blocks(self) -> int:
        return len(self._cached)

    def ref_count(self, block_id: int) -> int:
        return self._ref_cnt[block_id]

    def get_block_ids(self, request_id: str) -> list[int]:
        """Group 0's table (the full-attention layers)."""
        return list(self._tables.get(request_id, ()))

    def get_group_block_ids(self, request_id: str) -> tuple[list[int], ...]:
        """Every group's table, group 0 first (null entries where a window passed)."""
        others = self._window_tables.get(request_id) or [[] for _ in self.extra_groups]
        return (self.get_block_ids(request_id), *(list(t) for t in others))

    def take_untold_blocks(self, request_id: str) -> tuple[tuple[int, ...], ...]:
        """Each group's entries appended since the last call (what the workers lack)."""
        tables = self.get_group_block_ids(request_id)
        told = self._told.setdefault(request_id, [0] * len(tables))
        new = tuple(tuple(table[told[g] :]) for g, table in enumerate(tables))
        self._told[request_id] = [len(t) for t in tables]
        return new

    def num_blocks_holding(self, request_id: str, start: int, end: int) -> int:
        """How many of the request's blocks, in every group, hold positions ``start`` (a block
        boundary) to ``end`` (null entries a window passed are none of them)."""
        first, stop = start // self.block_size, _cdiv(end, self.block_size)
        tables = self.get_group_block_ids(request_id)
        return sum(
            sum(
                1
                for b in (table if window is None else table[first:stop])
                if b != self.null_block_id
            )
            for window, table in zip((0, *self.extra_groups), tables, strict=True)
        )

    def holds_blocks(self, request_id: str) -> bool:
        return any(self.get_group_block_ids(request_id))

    def can_allocate(self, num_blocks: int) -> bool:
        return num_blocks <= len(self._free)

    def blocks_needed(self, num_tokens: int) -> int:
        """Blocks ``num_tokens`` take at most, in every group together (a window gives its
        blocks back only once they are computed; a state is one block)."""
        per_group = _cdiv(num_tokens, self.block_size)
        return sum(per_group if w is not None else 1 for w in (0, *self.extra_groups))

    # ------------------------------------------------------------------ prefix cache

    def _block_hashes(self, request: Request, num_full_blocks: int) -> list[BlockHash]:
        hashes = self._hashes.setdefault(request.request_id, [])
        tokens = request.all_token_ids
        bs = self.block_size
        while len(hashes) < num_full_blocks:
            i = len(hashes)
            parent = hashes[-1] if hashes else _ROOT_HASH
            hashes.append(hash_block_tokens(parent, tokens[i * bs : (i + 1) * bs]))
        return hashes

    def get_computed_blocks(self, request: Request) -> tuple[Any, int]:
        """Longest run of leading full blocks already in the prefix cache, and their tokens.

        Never covers the whole request: the last token must be computed to get logits.
        Reference counts are untouched until `allocate_slots` takes the blocks. The hits are
        group 0's block ids, or with window groups one list per group (null blocks before each
        window), as `allocate_slots` takes them.
        """
        if not self.enable_prefix_caching:
            return ([] if not self.extra_groups else tuple([] for _ in range(self.num_groups))), 0
        max_blocks = (request.num_tokens - 1) // self.block_size
        hashes = self._block_hashes(request, max_blocks)
        hits: list[int] = []
        for block_hash in hashes:
            block_id = self._cached.get(block_hash)
            if block_id is None:
                break
            hits.append(block_id)
        if not self.extra_groups:
            return hits, len(hits) * self.block_size
        for n in range(len(hits), 0, -1):
            tails = [self._window_hit(g, window, hashes, n) for g, window in self._windows()]
            if all(tail is not None for tail in tails):
                return (hits[:n], *tails), n * self.block_size  # type: ignore[misc]
        return tuple([] for _ in range(self.num_groups)), 0

    def _windows(self) -> list[tuple[int, int]]:
        return [(g, w) for g, w in enumerate(self.extra_groups, start=1) if w is not None]

    def _window_hit(
        self, group: int, window: int, hashes: Sequence[BlockHash], num_blocks: int
    ) -> list[int] | None:
        """Window group ``group``'s table for a hit of ``num_blocks`` blocks: null blocks, then
        the cached blocks its window reaches from there (``None`` if one is missing)."""
        first = max(0, num_blocks * self.block_size - window) // self.block_size
        tail = [self._cached.get(_window_key(group, hashes[i])) for i in range(first, num_blocks)]
        if any(block is None for block in tail):
            return None
        return [NULL_BLOCK_ID] * first + tail  # type: ignore[list-item]

    def cache_full_blocks(self, request: Request, num_computed_tokens: int) -> None:
        """Publish the request's blocks that are full and hold computed (valid) KV."""
        if not self.enable_prefix_caching:
            return
        table = self._tables.get(request.request_id)
        if not table:
            return
        num_full = min(num_computed_tokens, request.num_tokens) // self.block_size
        num_full = min(num_full, len(table))
        start = self._num_published.get(request.request_id, 0)
        if num_full <= start:
            return
        hashes = self._block_hashes(request, num_full)
        run_start = start  # the run of blocks newly cached that ends at i
        for i in range(start, num_full):
            block_id = table[i]
            block_hash = hashes[i]
            # A block already hashed or a prefix another block already serves stays as is; the
            # duplicate simply returns to the pool unhashed when freed.
            if self._block_hash[block_id] is None and block_hash not in self._cached:
                self._block_hash[block_id] = block_hash
                self._cached[block_hash] = block_id
            else:
                self._tell_stored(request, hashes, run_start, i)
                run_start = i + 1
        self._tell_stored(request, hashes, run_start, num_full)
        self._num_published[request.request_id] = num_full
        self._cache_window_blocks(request, hashes, num_full)

    def _cache_window_blocks(
        self, request: Request, hashes: Sequence[BlockHash], num_full: int
    ) -> None:
        """Publish each window group's full blocks (those still held) under its own keys."""
        rid = request.request_id
        tables = self._window_tables.get(rid)
        if not tables:
            return
        published = self._window_published.setdefault(rid, [0] * len(tables))
        for g, _ in self._windows():
            table = tables[g - 1]
            for i in range(published[g - 1], min(num_full, len(table))):
                block_id, key = table[i], _window_key(g, hashes[i])
                fresh = self._block_hash[block_id] is None and key not in self._cached
                if block_id != NULL_BLOCK_ID and fresh:
                    self._block_hash[block_id] = key
                    self._cached[key] = block_id
            published[g - 1] = max(published[g - 1], min(num_full, len(table)))

    def _tell_stored(self, request: Request, hashes: list[BlockHash], start: int, end: int) -> None:
        if start < end:
            bs = self.block_size
            self.event_sink.blocks_stored(
                hashes[start:end],
                hashes[start - 1] if start else None,
                request.all_token_ids[start * bs : end * bs],
                bs,
            )

    def evict_blocks(self, block_ids: Sequence[int]) -> None:
        """Drop these blocks from the prefix cache (their content is not trustworthy)."""
        for block_id in block_ids:
            self._check_block_id(block_id)
            self._drop_hash(block_id)

    def reset_prefix_cache(self) -> None:
        """Forget every hash; tables keep their blocks and may republish them later."""
        self._cached.clear()
        self.event_sink.all_blocks_cleared()
        self._block_hash = [None] * self.num_blocks
        self._num_published = dict.fromkeys(self._num_published, 0)
        self._window_published.clear()

    def _drop_hash(self, block_id: int) -> None:
        block_hash = self._block_hash[block_id]
        if block_hash is None:
            return
        self._block_hash[block_id] = None
        if self._cached.get(block_hash) == block_id:
            del self._cached[block_hash]
            if len(block_hash) == _HASH_BYTES:  # group 0's: the only ones events tell
                self.event_sink.blocks_removed((block_hash,))

    def _check_block_id(self, block_id: int) -> None:
        if not 0 <= block_id < self.num_blocks:
            raise ValueError(f"block id {block_id} out of range [0, {self.num_blocks})")

    # ------------------------------------------------------------------ allocation

    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        new_computed_blocks: Any = (),
        num_lookahead_tokens: int = 0,
    ) -> list[int] | None:
        """Grow the request's tables to cover ``num_computed_tokens`` + prefix hits +
        ``num_new_tokens`` + ``num_lookahead_tokens`` slots.

        ``new_computed_blocks`` (prefix hits from `get_computed_blocks`: group 0's ids, or one
        list per group) may only be given while the request holds no blocks. Returns every
        block id appended to group 0's table (hits first), or ``None`` with nothing changed
        when the free pool cannot supply them.
        """
        new_computed_blocks, window_hits = self._split_hits(new_computed_blocks)
        if num_new_tokens < 0 or num_lookahead_tokens < 0:
            raise ValueError(
                f"request {request.request_id}: num_new_tokens ({num_new_tokens}) and "
                f"num_lookahead_tokens ({num_lookahead_tokens}) must be >= 0"
            )
        table = self._tables.get(request.request_id, [])
        if new_computed_blocks and table:
            raise ValueError(
                f"request {request.request_id}: prefix-cache hits can only be added to an empty "
                f"block table, it already holds {len(table)} blocks"
            )
        num_slots = (
            request.num_computed_tokens
            + len(new_computed_blocks) * self.block_size
            + num_new_tokens
            + num_lookahead_tokens
        )
        num_fresh = max(
            0, _cdiv(num_slots, self.block_size) - len(table) - len(new_computed_blocks)
        )
        window_tables = self._window_tables.get(request.request_id) or [
            list(hits) for hits in window_hits
        ]
        revived_windows = [
            b for hits in window_hits for b in hits if b != NULL_BLOCK_ID and not self._ref_cnt[b]
        ]
        window_fresh = [
            max(0, (1 if window is None else _cdiv(num_slots, self.block_size)) - len(t))
            for window, t in zip(self.extra_groups, window_tables, strict=True)
        ]
        # Hits on free blocks leave the free list too, so they compete with fresh blocks.
        num_revived = sum(1 for b in new_computed_blocks if self._ref_cnt[b] == 0)
        num_revived += len(revived_windows)
        if num_fresh + num_revived + sum(window_fresh) > len(self._free):
            return None
        if request.request_id not in self._window_tables:
            for hits in window_hits:
                for block_id in hits:
                    if block_id != NULL_BLOCK_ID:
                        if self._ref_cnt[block_id] == 0:
                            del self._free[block_id]
                        self._ref_cnt[block_id] += 1
            if any(window_hits):
                self._window_published[request.request_id] = [len(h) for h in window_hits]
        added: list[int] = []
        for block_id in new_computed_blocks:
            if self._ref_cnt[block_id] == 0:
                del self._free[block_id]
            self._ref_cnt[block_id] += 1
            added.append(block_id)
        for _ in range(num_fresh):
            block_id, _ = self._free.popitem(last=False)
            self._drop_hash(block_id)
            self._ref_cnt[block_id] = 1
            added.append(block_id)
        if added:
            if request.request_id not in self._tables:
                self._tables[request.request_id] = table
                self._num_published[request.request_id] = len(new_computed_blocks)
            table.extend(added)
        if self.extra_groups:
            for window_table, count in zip(window_tables, window_fresh, strict=True):
                window_table.extend(self._take_fresh() for _ in range(count))
            self._window_tables[request.request_id] = window_tables
        return added

    def _split_hits(self, hits: Any) -> tuple[list[int], list[list[int]]]:
        """Group 0's hits and each further group's (empty when only group 0's are given)."""
        if hits and isinstance(hits[0], (list, tuple)):
            if len(hits) != self.num_groups:
                raise ValueError(f"{len(hits)} lists of prefix hits for {self.num_groups} groups")
            return list(hits[0]), [list(h) for h in hits[1:]]
        return list(hits), [[] for _ in self.extra_groups]

    def _take_fresh(self) -> int:
        block_id, _ = self._free.popitem(last=False)
        self._drop_hash(block_id)
        self._ref_cnt[block_id] = 1
        return block_id

    def _release(self, block_id: int) -> None:
        self._ref_cnt[block_id] -= 1
        if self._ref_cnt[block_id] == 0:
            self._free[block_id] = None

    def release_out_of_window(
        self, request_id: str, next_position: int, spare_from: int | None = None
    ) -> int:
        """Give back each sliding-window group's blocks that no query from ``next_position``
        on can see (their entries become the null block); returns how many went back.

        ``spare_from``: keep the blocks a recompute from that position would read, when what
        lies between it and ``next_position`` is still to be loaded (a load that fails is
        recomputed from there). Call only once every position before ``next_position`` is
        computed or being loaded, never while a step that reads them is in flight."""
        released = 0
        for window, table in zip(
            self.extra_groups, self._window_tables.get(request_id, ()), strict=False
        ):
            if window is None:
                continue
            # The query at next_position sees positions >= next_position - window + 1; one
            # position more is kept, so that a consumer of these blocks that recomputes the
            # last of them (a prompt's last token) still finds its window.
            first_seen = max(0, next_position - window)
            spared = range(0)
            if spare_from is not None:
                spared = range(
                    max(0, spare_from - window) // self.block_size, spare_from // self.block_size
                )
            for index in range(min(first_seen // self.block_size, len(table))):
                if table[index] != NULL_BLOCK_ID and index not in spared:
                    self._release(table[index])
                    table[index] = NULL_BLOCK_ID
                    released += 1
        return released

    def rewind(self, request_id: str, num_computed_tokens: int) -> int | None:
        """Before positions from ``num_computed_tokens`` on are computed again: the position the
        request must recompute from, with every window entry those queries see a real block.

        That is ``num_computed_tokens`` unless a window gave back a block those queries would
        read but not rewrite (a position before it): then nothing before is usable, and it is
        0; a recurrent state also restarts only from 0 (it cannot be rewound). ``None``
        (nothing changed) when the pool cannot supply the blocks. The workers must then get
        the request's tables anew."""
        tables = self._window_tables.get(request_id, [])
        start = num_computed_tokens
        for window, table in zip(self.extra_groups, tables, strict=False):
            if window is None:
                start = 0
                continue
            first_seen = max(0, start - window) // self.block_size
            last_kept = start // self.block_size  # entries before it are not rewritten
            if NULL_BLOCK_ID in table[first_seen:last_kept]:
                start = 0
        plan: list[tuple[list[int], int]] = []
        for window, table in zip(self.extra_groups, tables, strict=False):
            if window is None:
                continue
            first_seen = max(0, start - window) // self.block_size
            plan.extend(
                (table, i) for i in range(first_seen, len(table)) if table[i] == NULL_BLOCK_ID
            )
        if len(plan) > len(self._free):
            return None
        for table, index in plan:
            table[index] = self._take_fresh()
        self._told.pop(request_id, None)
        return start

    def free(self, request_id: str) -> None:
        """Release the request's blocks, tail first, so its tail is evicted before its head."""
        table = self._tables.pop(request_id, [])
        self._num_published.pop(request_id, None)
        self._hashes.pop(request_id, None)
        self._told.pop(request_id, None)
        self._window_published.pop(request_id, None)
        for window_table in self._window_tables.pop(request_id, ()):
            for block_id in reversed(window_table):
                if block_id != NULL_BLOCK_ID:
                    self._release(block_id)
        for block_id in reversed(table):
            self._release(block_id)

    def check_no_leaks(self) -> None:
        """Raise `BlockLeakError` unless every block is free and no request holds one."""
        problems = [
            f"request {req_id!r} holds blocks {table}"
            for req_id, table in self._tables.items()
            if table
        ]
        problems += [
            f"request {req_id!r} holds sliding-window blocks {tables}"
            for req_id, tables in self._window_tables.items()
            if any(tables)
        ]
        referenced = [
            f"{b} (ref {self._ref_cnt[b]})" for b in range(self.num_blocks) if self._ref_cnt[b]
        ]
        if referenced:
            problems.append("blocks with ref count > 0: " + ", ".join(referenced))
        if len(self._free) != self.capacity and not referenced:
            problems.append(f"free list holds {len(self._free)} of {self.capacity} blocks")
        if problems:
            raise BlockLeakError("KV block leak: " + "; ".join(problems))
