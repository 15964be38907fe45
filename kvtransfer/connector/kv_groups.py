"""KV cache groups: which layers share a block table, and which of a request's blocks move.

A hybrid model's KV cache is several groups (vLLM's ``KVCacheGroupSpec`` list): each group is a
set of layers that index one block table per request, with its own rule for which blocks still
matter. A request's block ids are then one list per group (``BlockIds``), drawn from one pool:
a block id belongs to one group of one request at a time, so the union of a request's lists
names exactly the memory its KV lives in, in every layer.

Full attention is the one-group case: one list, every block moves. A sliding-window group keeps
only the blocks its window can still reach: the engine replaces the ones before the window by
its null block (vLLM's block 0, shared by every request and never moved), and a transfer moves
the tail, at most ``cdiv(window, block_size) + 1`` blocks. A recurrent-state group (Mamba,
Mamba2, Gated DeltaNet: vLLM's ``MambaSpec``) holds a request's running state in one block (plus
speculative scratch blocks after it): a transfer moves that block, the state after the last
token the producer computed (which is why it computes all but the last prompt token: the
consumer recomputes that one from the state).

A group may count its own tokens per block (``block_size``; DeepSeek-V4's groups are 64-, 256-,
4- and 8-token blocks in one engine): its block positions are then its own, and a request's
lists differ in length by group. A group of ``whole_pages`` (DeepSeek-V4's compressed,
padded MLA pages and compressor states) is moved as opaque pages, one per block and layer,
identical on every TP rank: which blocks move still follows its kind.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from kvtransfer.connector.state_parts import StatePart

FULL_ATTENTION = "full_attention"
SLIDING_WINDOW = "sliding_window"
RECURRENT_STATE = "recurrent_state"
GROUP_KINDS = (FULL_ATTENTION, SLIDING_WINDOW, RECURRENT_STATE)

BlockIds = tuple[tuple[int, ...], ...]
"""A request's block ids, one tuple per KV cache group, in the engine's group order."""


@dataclass(frozen=True)
class KVCacheGroup:
    """One KV cache group: its kind, its layers (names as `register_kv_caches` gets them) and,
    for a sliding-window group, its window in tokens."""

    kind: str
    layer_names: tuple[str, ...]
    sliding_window: int | None = None
    # A recurrent-state group's scratch blocks after its state block (speculative decoding).
    speculative_blocks: int = 0
    # A recurrent-state group whose pages are laid out per head (``[blocks, 2, heads, 1,
    # unit]``): its heads across TP ranks, so that engines of other TP sizes read the heads
    # they hold. None: a page is opaque and moves whole, between equal TP sizes only.
    state_heads: int | None = None
    # A recurrent-state group whose opaque pages (vLLM's) hold sub-projections split by heads
    # across TP ranks (`state_parts`): each moves as its own heads, so engines of other TP
    # sizes exchange state too. Empty: pages move whole, between equal TP sizes only.
    state_parts: tuple[StatePart, ...] = ()
    # Tokens per block of this group (None: the engine's block size).
    block_size: int | None = None
    # Its layers' blocks are opaque pages replicated on every TP rank (not heads of tokens):
    # each moves whole, from any one producer rank.
    whole_pages: bool = False

    def __post_init__(self) -> None:
        if self.kind not in GROUP_KINDS:
            raise ValueError(
                f"KV cache group kind must be one of {list(GROUP_KINDS)}, got {self.kind!r}"
            )
        window = self.sliding_window
        if (self.kind == SLIDING_WINDOW) != (window is not None):
            raise ValueError(
                f"a {self.kind} group {'needs' if self.kind == SLIDING_WINDOW else 'has no'} "
                f"sliding_window (got {window!r})"
            )
        if window is not None and (isinstance(window, bool) or window <= 0):
            raise ValueError(f"sliding_window must be a positive int, got {window!r}")
        if self.state_heads is not None and (self.kind != RECURRENT_STATE or self.state_heads < 1):
            raise ValueError(
                f"state_heads is for a recurrent_state group (>= 1), got {self.state_heads!r} "
                f"for a {self.kind} group"
            )
        if self.state_parts and (self.kind != RECURRENT_STATE or self.state_heads is not None):
            raise ValueError(
                "state_parts describe a recurrent_state group's opaque pages (not pages laid "
                f"out per head), got them for a {self.kind} group"
            )

    @property
    def label(self) -> str:
        """Kind, window and own block size, as workers publish each layer's group: peers
        compare it."""
        label = self.kind
        if self.kind == SLIDING_WINDOW:
            label = f"{SLIDING_WINDOW}:{self.sliding_window}"
        if self.block_size is not None:
            label += f"/{self.block_size}"
        return label

    @property
    def pages_opaque(self) -> bool:
        """Whether its layers register one opaque page per block (state, or whole pages)."""
        return self.is_state or self.whole_pages

    def tokens_per_block(self, engine_block_size: int) -> int:
        return self.block_size or engine_block_size

    def blocks_for(self, num_tokens: int, engine_block_size: int) -> int:
        """How many of its blocks ``num_tokens`` tokens span (a state group: its one)."""
        if self.is_state:
            return 1
        return -(-num_tokens // self.tokens_per_block(engine_block_size))

    @property
    def is_state(self) -> bool:
        """Whether its blocks hold a running state rather than tokens' KV."""
        return self.kind == RECURRENT_STATE

    def describe(self) -> str:
        layers = f" ({len(self.layer_names)} layers)" if self.layer_names else ""
        if self.is_state:
            return f"the recurrent-state group{layers}"
        if self.kind == SLIDING_WINDOW:
            return f"the sliding-window group (window {self.sliding_window}){layers}"
        return f"the full-attention group{layers}"

    def blocks_kept(self, engine_block_size: int) -> int | None:
        """How many trailing blocks a transfer of this group moves at most (None: all)."""
        if self.sliding_window is None:
            return None
        return -(-self.sliding_window // self.tokens_per_block(engine_block_size)) + 1


def transferable_blocks(
    group: KVCacheGroup,
    block_ids: Sequence[int],
    num_tokens: int,
    block_size: int,
    null_block_id: int | None,
) -> tuple[int, ...]:
    """The blocks of one group a transfer of ``num_tokens`` tokens moves (``block_size``: the
    engine's): the group's first blocks holding them, of which a sliding-window group keeps the
    tail its window reaches, without the null blocks the engine put before the window. The
    result is contiguous and ends at the block of the last token; `ValueError` for a null
    block inside it or a short list."""
    if group.is_state:
        return state_block(group, block_ids, null_block_id)
    num_blocks = group.blocks_for(num_tokens, block_size)
    if len(block_ids) < num_blocks:
        raise ValueError(f"{group.describe()}: {len(block_ids)} blocks listed, {num_blocks} needed")
    blocks = tuple(block_ids[:num_blocks])
    kept = group.blocks_kept(block_size)
    if kept is not None:
        blocks = blocks[-kept:] if kept < len(blocks) else blocks
    if null_block_id is None:
        return blocks
    first_real = next((i for i, b in enumerate(blocks) if b != null_block_id), len(blocks))
    if group.kind == FULL_ATTENTION and first_real:
        raise ValueError(
            f"{group.describe()}: null block at position 0 of a full-attention block list"
        )
    tail = blocks[first_real:]
    if null_block_id in tail:
        raise ValueError(f"{group.describe()}: null block inside the blocks to move {list(blocks)}")
    return tail


def state_block(
    group: KVCacheGroup, block_ids: Sequence[int], null_block_id: int | None
) -> tuple[int, ...]:
    """A recurrent-state group's running-state block (its list without the speculative
    scratch blocks after it ends with it); `ValueError` when there is none."""
    blocks = list(block_ids)
    scratch = min(group.speculative_blocks, max(0, len(blocks) - 1))
    if scratch:
        blocks = blocks[:-scratch]
    if not blocks or blocks[-1] == null_block_id:
        raise ValueError(f"{group.describe()}: no state block in {list(block_ids)}")
    return (blocks[-1],)


def check_groups(groups: Sequence[KVCacheGroup], layer_names: Sequence[str]) -> None:
    """Every layer in exactly one group; `ValueError` naming the first that is not."""
    seen: dict[str, int] = {}
    for index, group in enumerate(groups):
        for name in group.layer_names:
            if name in seen:
                raise ValueError(f"layer {name!r} is in KV cache groups {seen[name]} and {index}")
            seen[name] = index
    missing = [name for name in layer_names if name not in seen]
    if missing:
        raise ValueError(f"layers {missing[:4]} are in no KV cache group")


def for_group(group: KVCacheGroup, num_groups: int) -> str:
    """The words " for <group>" in a message about one of several groups ("" for one)."""
    return f" for {group.describe()}" if num_groups > 1 else ""


def num_listed_blocks(listed: object) -> int:
    """How many blocks ``kv_transfer_params.remote_block_ids`` lists: a flat list, or one list
    per KV cache group (blocks of every group)."""
    if not isinstance(listed, Sequence) or isinstance(listed, str | bytes):
        return 0
    return sum(
        len(item) if isinstance(item, Sequence) and not isinstance(item, str | bytes) else 1
        for item in listed
    )


def as_block_ids(block_ids: object, num_groups: int) -> BlockIds:
    """A request's block ids as one tuple per group: a flat list is the one-group case;
    `ValueError` when the lists do not match the engine's ``num_groups`` groups."""
    if not isinstance(block_ids, Sequence) or isinstance(block_ids, str | bytes):
        raise ValueError(
            f"block ids must be a list (or one list per KV cache group), got {block_ids!r}"
        )
    nested = [isinstance(b, Sequence) and not isinstance(b, str | bytes) for b in block_ids]
    if block_ids and all(nested):
        groups = tuple(tuple(int(b) for b in group) for group in block_ids)
    elif not any(nested):
        groups = (tuple(int(b) for b in block_ids),)
    else:
        raise ValueError("block ids mix lists and ids")
    if len(groups) != num_groups:
        raise ValueError(
            f"{len(groups)} block list(s) for an engine with {num_groups} KV cache group(s)"
        )
    return groups
