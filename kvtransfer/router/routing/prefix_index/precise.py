"""The precise set of an instance: its KV cache events rebuilt into the router's keys.

A ``BlockStored`` becomes keys from its ``token_ids`` and the key of its ``parent_block_hash``
(engine hash -> key map, kept for removals); ``BlockRemoved`` drops keys. Events the index cannot
key (another tier, LoRA, extra keys, a parent stored before the router listened) are skipped, so
the set stays a subset of what the engine holds; events keyed differently altogether (another
block size, lookahead hashing) make the instance's events unusable: its approximate set answers.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable

from kvtransfer.router.routing.prefix_index.instance import IndexedInstance
from kvtransfer.router.routing.prefix_index.keys import ROOT_KEY, keys_after
from kvtransfer.router.routing.prefix_index.masks import clear_bit
from kvtransfer.serve.kv_events import MEDIUM_GPU, BlockStored, EngineHash

logger = logging.getLogger("kvtransfer.router.prefix_index")


def indexed_tier(medium: str | None, group_idx: int | None, locality: str | None) -> bool:
    """Only the engine's own cache (not an offload tier, not remote storage; vLLM 0.33 says
    ``locality``) of its first KV cache group."""
    return medium in (None, MEDIUM_GPU) and group_idx in (None, 0) and locality in (None, "LOCAL")


def store(inst: IndexedInstance, event: BlockStored) -> None:
    bs = inst.group.block_size
    hashes = event.block_hashes
    tokens = event.token_ids
    if not indexed_tier(event.medium, event.group_idx, event.locality):
        return
    if event.lookahead_token_ids is not None:
        # vLLM 0.33's lookahead hashing: a block's hash covers tokens past it, so the engine
        # hits it only for prompts that continue the same way; keys of block tokens alone
        # would claim hits it does not give. Refused: the approximate index answers.
        mark_unusable(inst, "events hash blocks with lookahead tokens (past the block)")
        inst.skipped_events += 1
        return
    if event.block_size != bs:
        mark_unusable(inst, f"events have block_size {event.block_size}, the index {bs}")
        inst.skipped_events += 1
        return
    if event.lora_id is not None or event.lora_name is not None or len(tokens) != len(hashes) * bs:
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
    keys = keys_after(key, tokens, bs)
    for i, engine_hash in enumerate(hashes):
        if extra is not None and i < len(extra) and extra[i] is not None:
            inst.skipped_events += 1
            return
        key = keys[i]
        old = inst.engine_keys.get(engine_hash)
        if old == key:
            continue
        if old is not None:
            unref(inst, old)
        inst.engine_keys[engine_hash] = key
        refs = inst.precise_refs
        count = refs.get(key, 0)
        refs[key] = count + 1
        if not count:
            masks = inst.group.precise
            masks[key] = masks.get(key, 0) | inst.bit
            # A pending block now stored: confirmed, the precise set holds it from here on.
            if inst.pending and inst.pending.pop(key, None) is not None:
                clear_bit(inst.group.pending, key, inst.bit)


def mark_unusable(inst: IndexedInstance, why: str) -> None:
    """The instance's events cannot be keyed: its approximate index answers for it."""
    if inst.unusable is None:
        inst.unusable = why
        logger.warning("KV events of %s: %s; its approximate index is used", inst.address, why)


def remove(inst: IndexedInstance, hashes: Iterable[EngineHash]) -> None:
    for engine_hash in hashes:
        key = inst.engine_keys.pop(engine_hash, None)
        if key is not None:
            unref(inst, key)


def unref(inst: IndexedInstance, key: int) -> None:
    refs = inst.precise_refs
    count = refs.pop(key, 0) - 1
    if count > 0:
        refs[key] = count
    else:
        clear_bit(inst.group.precise, key, inst.bit)


def clear_precise(inst: IndexedInstance) -> None:
    masks = inst.group.precise
    for key in inst.precise_refs:
        clear_bit(masks, key, inst.bit)
    inst.precise_refs.clear()
    inst.engine_keys.clear()
