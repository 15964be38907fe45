"""Sets of keys as bit masks: per block size, key -> the mask of the instance slots holding it
(`Group`), and the walks that look a prompt's keys up in them, in C where it can (`walk`)."""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from itertools import compress, repeat
from operator import and_, not_, or_

from kvtransfer.router.routing.prefix_index.keys import Chain

# A look-up goes in rounds of 1, 16, then 64 blocks (`walk`): a prompt nobody holds costs one
# hash; a round costs about 1 us more than its blocks, and a walk that stops inside one has
# hashed the rest of it for nothing (the request's `observe` uses those keys, though). Measured
# against 1, 4, 16, 64 and 1, 64 with benchmarks/routing_index.py: as fast on long prompts,
# faster on short ones.
_FIRST_ROUND_BLOCKS = 1
_ROUND_GROWTH = 16
_MAX_ROUND_BLOCKS = 64
ZEROS = repeat(0)
ONES = repeat(1)
NONES = repeat(None)


@dataclass
class Group:
    """The instances of one block size and their keys: key -> bit mask of instance slots.
    ``pending`` is apart from ``precise`` (its keys come and go with each pick: a small dict
    stays in the CPU's cache, a large one would miss it twice per block and pick), and
    disjoint from it per instance: a block stored is no longer pending there."""

    block_size: int
    precise: dict[int, int] = field(default_factory=dict)
    approx: dict[int, int] = field(default_factory=dict)
    pending: dict[int, int] = field(default_factory=dict)
    members: int = 0


def walk(
    result: dict[str, int],
    prompt: Chain,
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
                            record(result, lost, depth, by_slot)
                        alive &= mask
                        if not alive:
                            return
                depth += 1
        done = end
        size = min(_ROUND_GROWTH * size, _MAX_ROUND_BLOCKS)
    record(result, alive, total, by_slot)


def single(masks: dict[int, int]) -> Callable[[list[int]], list[int]]:
    """Per key, the instances holding it per ``masks``."""
    get = masks.get

    def held(keys: list[int]) -> list[int]:
        return list(map(get, keys, ZEROS))

    return held


def union(masks: dict[int, int], more: dict[int, int]) -> Callable[[list[int]], list[int]]:
    """Per key, the instances holding it per ``masks`` or ``more``."""
    get = masks.get
    more_get = more.get

    def held(keys: list[int]) -> list[int]:
        return list(map(or_, map(get, keys, ZEROS), map(more_get, keys, ZEROS)))

    return held


def mixed(group: Group, precise_mask: int, approx_mask: int) -> Callable[[list[int]], list[int]]:
    """Per key, the instances of ``precise_mask`` answering from their precise and pending
    sets, the others from their approximate ones."""
    precise = union(group.precise, group.pending) if group.pending else single(group.precise)
    approx_get = group.approx.get
    precise_masks = repeat(precise_mask)
    approx_masks = repeat(approx_mask)

    def held(keys: list[int]) -> list[int]:
        return list(
            map(
                or_,
                map(and_, precise(keys), precise_masks),
                map(and_, map(approx_get, keys, ZEROS), approx_masks),
            )
        )

    return held


def members(group: Group, by_slot: dict[int, str]) -> Iterable[str]:
    mask = group.members
    while mask:
        low = mask & -mask
        yield by_slot[low.bit_length() - 1]
        mask ^= low


def record(result: dict[str, int], mask: int, depth: int, by_slot: dict[int, str]) -> None:
    while mask:
        low = mask & -mask
        result[by_slot[low.bit_length() - 1]] = depth
        mask ^= low


def set_bits(masks: dict[int, int], keys: list[int], bit: int) -> None:
    """``bit`` set in the masks of ``keys`` (C loops)."""
    masks.update(zip(keys, map(or_, map(masks.get, keys, ZEROS), repeat(bit)), strict=True))


def clear_bits(masks: dict[int, int], keys: list[int], bit: int) -> None:
    """``bit`` cleared in the masks of ``keys``, a key whose mask is left empty removed (C
    loops)."""
    held = list(map(masks.__getitem__, keys))
    if held.count(bit) == len(held):  # the usual: held by this instance alone
        consume(map(masks.pop, keys, NONES))
        return
    left = list(map(and_, held, repeat(~bit)))
    masks.update(zip(keys, left, strict=True))
    consume(map(masks.pop, compress(keys, map(not_, left)), NONES))


def consume(calls: Iterator[object]) -> None:
    """Run ``calls`` (a map of side effects) in C. Deletions are pops with a default: a
    prompt whose chain repeats a key (a collision of the non-cryptographic hash, which a
    crafted prompt could cause) must not raise."""
    deque(calls, maxlen=0)


def clear_bit(masks: dict[int, int], key: int, bit: int) -> None:
    mask = masks.get(key, 0) & ~bit
    if mask:
        masks[key] = mask
    else:
        masks.pop(key, None)
