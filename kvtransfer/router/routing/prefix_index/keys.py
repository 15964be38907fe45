"""The router's keys of prompt blocks: block ``i`` of a prompt is keyed by ``hash((key of block
i - 1, *its block_size token ids))`` (block 0 chains from `ROOT_KEY`), so a key names a whole
prefix. Hashed in C, as far as a look-up needs, and once per request: the prompts of the latest
requests keep their keys (per thread). Keys never leave the process, and Python salts the hash
of str and bytes only (``PYTHONHASHSEED``), never of ints or tuples of them: router replicas
key a prompt alike all the same (tests/test_router_tie_break.py)."""

from __future__ import annotations

import threading
from collections.abc import Iterable, Iterator, Sequence
from itertools import chain, islice

ROOT_KEY = 0

# Prompts whose keys are kept (per thread), the latest: enough for the choices of one request
# (decode estimate, decode pick, prefill pick, the observes: within milliseconds) and the
# requests routed around it; a request's tuple is kept alive while it is listed.
_KEYED_PROMPTS = 32


def key_chain(
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


def keys_after(parent: int, tokens: Iterable[int], block_size: int) -> list[int]:
    """The keys of every full block of ``tokens``, chained from ``parent``."""
    keys, pipe = key_chain(parent, tokens, block_size)
    keys.extend(pipe)
    return keys


class Chain:
    """The keys of one prompt's full blocks at one block size, computed as far as asked (a
    look-up stops at the first block no instance holds; `observe` then asks for all)."""

    __slots__ = ("_pipe", "keys", "tokens", "total")

    def __init__(self, tokens: tuple[int, ...], block_size: int) -> None:
        self.tokens = tokens
        self.total = len(tokens) // block_size
        self.keys, self._pipe = key_chain(ROOT_KEY, tokens, block_size)

    def upto(self, count: int) -> list[int]:
        """The keys of (at least) the first ``count`` blocks (fewer: all there are)."""
        keys = self.keys
        missing = count - len(keys)
        if missing > 0:
            keys.extend(islice(self._pipe, missing))
        return keys


_kept = threading.local()


def chain_of(tokens: tuple[int, ...], block_size: int, *, keep: bool) -> Chain:
    """The `Chain` of ``tokens``: the prefill and decode indexes, the estimate and the picks of
    one request all see the request's one tuple, so its blocks are hashed once per request
    (``keep``: the caller's own tuple, worth keeping). Per thread, as the indexes are."""
    if not keep:
        return Chain(tokens, block_size)
    chains: dict[tuple[int, int], Chain] | None = getattr(_kept, "chains", None)
    if chains is None:
        chains = _kept.chains = {}
    name = (id(tokens), block_size)
    prompt = chains.get(name)
    # Listed, the tuple is alive: no other object has its id.
    if prompt is not None and prompt.tokens is tokens:
        return prompt
    prompt = chains[name] = Chain(tokens, block_size)
    if len(chains) > _KEYED_PROMPTS:
        del chains[next(iter(chains))]  # the oldest listed
    return prompt


def block_keys(token_ids: Sequence[int], block_size: int) -> list[int]:
    """The router's keys of every full block of ``token_ids``."""
    tokens = token_ids if isinstance(token_ids, tuple) else tuple(token_ids)
    prompt = Chain(tokens, block_size)
    return list(prompt.upto(prompt.total))
