"""Recurrent-state pages split into parts, so engines of different TP sizes exchange state.

vLLM keeps a Mamba2 or Gated DeltaNet layer's state for one request in one page of bytes: the
conv state (the last ``kernel - 1`` inputs of the causal convolution, one row per position,
each row the TP rank's channels of x|B|C or q|k|v) then the temporal (SSM) state
(``[heads, head_dim, state]``). Tensor parallelism splits every sub-projection by its own heads:
x and the SSM state by Mamba heads, B and C by groups (a group count below the TP size is
replicated, as vLLM's ``extra_groups_for_head_shards`` does), q and k by key heads, v and the
state by value heads. A rank's page is therefore not a slice of another TP size's page, but
each sub-projection is: a `StatePart` describes one as heads (or groups) of ``head_bytes``
contiguous bytes, repeated over ``rows``, at ``offset`` in the page. Moving state across TP
sizes is then moving the heads each part needs from the ranks holding them, like attention KV.

A part is registered with the transport as its own layer (`part_layer_name`), a
``[blocks, 2, heads, rows, head_bytes / 2]`` uint8 view of the page memory (`part_views`;
the "2" halves each head's bytes, where attention has K and V). Bytes outside every part (the
padding vLLM adds so a state page fills an attention page) never move.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from itertools import pairwise
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # torch only where views are made: importing kvtransfer stays light
    import torch

PART_SEPARATOR = "#"


@dataclass(frozen=True)
class StatePart:
    """One sub-projection of a state page on one TP rank.

    ``heads`` is how many this rank holds, ``total_heads`` how many the model has (before any
    replication across ranks): rank ``r`` of ``tp`` holds ``kv_head_range(r, tp,
    total_heads)``. Head ``h`` of row ``i`` is the ``head_bytes`` bytes at ``offset + i *
    row_stride + h * head_bytes`` of the page.
    """

    name: str
    offset: int
    heads: int
    total_heads: int
    head_bytes: int
    rows: int = 1
    row_stride: int = 0

    def __post_init__(self) -> None:
        if not self.name or PART_SEPARATOR in self.name:
            raise ValueError(f"state part name must be non-empty without {PART_SEPARATOR!r}")
        for field_name in ("heads", "total_heads", "head_bytes", "rows"):
            value = getattr(self, field_name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"state part {self.name!r}: {field_name} must be >= 1")
        if self.offset < 0 or self.head_bytes % 2:
            raise ValueError(
                f"state part {self.name!r}: offset {self.offset} must be >= 0 and head_bytes "
                f"{self.head_bytes} even (each head's bytes move as two halves)"
            )
        if self.rows > 1 and self.row_stride < self.heads * self.head_bytes:
            raise ValueError(
                f"state part {self.name!r}: rows {self.row_stride} bytes apart overlap its "
                f"{self.heads} heads of {self.head_bytes} bytes"
            )

    @property
    def end(self) -> int:
        """One past its last byte in the page."""
        return self.offset + (self.rows - 1) * self.row_stride + self.heads * self.head_bytes

    def signature(self) -> tuple[str, int, int, int]:
        """What two engines' parts must share to exchange heads (offsets are each rank's)."""
        return (self.name, self.total_heads, self.head_bytes, self.rows)


def part_layer_name(layer: str, part: str) -> str:
    """The transport layer one part of ``layer``'s state pages is registered as."""
    return f"{layer}{PART_SEPARATOR}{part}"


def check_parts(parts: Sequence[StatePart], page_bytes: int) -> None:
    """Distinct names, inside the page, not overlapping; `ValueError` otherwise."""
    names = [p.name for p in parts]
    if len(set(names)) != len(names):
        raise ValueError(f"state part names repeat: {names}")
    spans = []
    for part in parts:
        if part.end > page_bytes:
            raise ValueError(
                f"state part {part.name!r} ends at byte {part.end} of a {page_bytes}-byte page"
            )
        for row in range(part.rows):
            start = part.offset + row * part.row_stride
            spans.append((start, start + part.heads * part.head_bytes, part.name))
    spans.sort()
    for (_, end, first), (start, _, second) in pairwise(spans):
        if start < end:
            raise ValueError(f"state parts {first!r} and {second!r} overlap")


def part_views(
    name: str, page: torch.Tensor, parts: Sequence[StatePart]
) -> dict[str, torch.Tensor]:
    """The parts of ``name``'s state pages (``page``: ``[blocks, 2, 1, 1, half]`` uint8, the
    page's two byte halves) as ``[blocks, 2, heads, rows, head_bytes / 2]`` uint8 views of the
    same memory, keyed by `part_layer_name`."""
    import torch

    if page.dim() != 5 or page.shape[1:4] != (2, 1, 1) or page.dtype != torch.uint8:
        raise ValueError(
            f"recurrent-state cache {name!r} is not a [blocks, 2, 1, 1, bytes] uint8 page view "
            f"(got {tuple(page.shape)}, {page.dtype})"
        )
    half = int(page.shape[4])
    if page.stride(4) != 1 or page.stride(1) != half:
        raise ValueError(f"recurrent-state cache {name!r}: a page's bytes are not contiguous")
    check_parts(parts, 2 * half)
    views = {}
    for part in parts:
        half_head = part.head_bytes // 2
        views[part_layer_name(name, part.name)] = page.as_strided(
            (page.shape[0], 2, part.heads, part.rows, half_head),
            (page.stride(0), half_head, part.head_bytes, max(part.row_stride, 1), 1),
            page.storage_offset() + part.offset,
        )
    return views


def expand_state_parts(
    caches: Mapping[str, torch.Tensor], parts_of: Mapping[str, Sequence[StatePart]]
) -> dict[str, torch.Tensor]:
    """``caches`` with each state layer that has parts replaced by its part views."""
    expanded: dict[str, torch.Tensor] = {}
    for name, cache in caches.items():
        parts = parts_of.get(name)
        if parts:
            expanded.update(part_views(name, cache, parts))
        else:
            expanded[name] = cache
    return expanded


def mamba2_parts(
    conv_shape: Sequence[int],
    ssm_shape: Sequence[int],
    conv_bytes: int,
    ssm_bytes: int,
    *,
    dim_first: bool,
    tp_size: int,
    total_groups: int | None,
) -> tuple[StatePart, ...]:
    """A Mamba2 page's parts on one TP rank: conv x (by head), B and C (by group), SSM state
    (by head). ``conv_bytes``/``ssm_bytes`` are the element sizes; ``dim_first``: the conv
    state is ``(channels, positions)`` (vLLM's "DS"), else ``(positions, channels)``;
    ``total_groups``: the model's ``n_groups`` (None: this rank's times ``tp_size``)."""
    heads, head_dim, state = (int(v) for v in ssm_shape)
    channels, positions = _conv_axes(conv_shape, dim_first)
    groups = _paired_heads(
        channels,
        heads * head_dim,
        state,
        f"a Mamba2 conv state of {channels} channels does not hold x ({heads} heads of "
        f"{head_dim}) then B and C in groups of {state}",
    )
    total = groups * tp_size if total_groups is None else total_groups
    widths = (("x", heads, heads * tp_size, head_dim), ("B", groups, total, state))
    widths += (("C", groups, total, state),)
    ssm = _ssm_part(conv_shape, conv_bytes, heads, tp_size, head_dim * state * ssm_bytes)
    return (*_conv_parts(widths, positions, conv_bytes, dim_first), ssm)


def gdn_parts(
    conv_shape: Sequence[int],
    ssm_shape: Sequence[int],
    conv_bytes: int,
    ssm_bytes: int,
    *,
    dim_first: bool,
    tp_size: int,
) -> tuple[StatePart, ...]:
    """A Gated DeltaNet page's parts on one TP rank: conv q and k (by key head), v (by value
    head), the recurrent state ``[value heads, v_dim, k_dim]`` (by value head)."""
    v_heads, v_dim, k_dim = (int(v) for v in ssm_shape)
    channels, positions = _conv_axes(conv_shape, dim_first)
    k_heads = _paired_heads(
        channels,
        v_heads * v_dim,
        k_dim,
        f"a Gated DeltaNet conv state of {channels} channels does not hold q and k in heads "
        f"of {k_dim} then v ({v_heads} heads of {v_dim})",
    )
    widths = (
        ("q", k_heads, k_heads * tp_size, k_dim),
        ("k", k_heads, k_heads * tp_size, k_dim),
        ("v", v_heads, v_heads * tp_size, v_dim),
    )
    ssm = _ssm_part(conv_shape, conv_bytes, v_heads, tp_size, v_dim * k_dim * ssm_bytes)
    return (*_conv_parts(widths, positions, conv_bytes, dim_first), ssm)


def _paired_heads(channels: int, known: int, width: int, mismatch: str) -> int:
    """How many heads of ``width`` each of the two sub-projections (Mamba2's B and C, GDN's q
    and k) holds in a conv state of ``channels``, beside ``known`` channels of the other."""
    rest = channels - known
    if rest <= 0 or rest % (2 * width):
        raise ValueError(mismatch)
    return rest // (2 * width)


def _conv_axes(conv_shape: Sequence[int], dim_first: bool) -> tuple[int, int]:
    if len(conv_shape) != 2:
        raise ValueError(f"a conv state is 2-D, got shape {tuple(conv_shape)}")
    first, second = (int(v) for v in conv_shape)
    return (first, second) if dim_first else (second, first)


def _conv_parts(
    widths: Sequence[tuple[str, int, int, int]], positions: int, size: int, dim_first: bool
) -> tuple[StatePart, ...]:
    channels = sum(heads * width for _, heads, _, width in widths)
    parts, channel = [], 0
    for name, heads, total, width in widths:
        if dim_first:
            # (channels, positions): a head's channels hold all their positions contiguously.
            part = StatePart(
                f"conv.{name}", channel * positions * size, heads, total, width * positions * size
            )
        else:
            # (positions, channels): each position is a row of every channel.
            part = StatePart(
                f"conv.{name}",
                channel * size,
                heads,
                total,
                width * size,
                positions,
                channels * size,
            )
        parts.append(part)
        channel += heads * width
    return tuple(parts)


def _ssm_part(
    conv_shape: Sequence[int], conv_size: int, heads: int, tp_size: int, head_bytes: int
) -> StatePart:
    conv_total = int(conv_shape[0]) * int(conv_shape[1]) * conv_size
    return StatePart("ssm", conv_total, heads, heads * tp_size, head_bytes)
