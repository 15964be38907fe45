"""`TransferTopology`: which remote ranks, heads and layers a local worker reads KV from.

The model. Both engines split the same model two ways:

* tensor parallel (TP): the ``total_num_kv_heads`` KV heads are split across ``tp_size`` ranks.
  With ``tp_size <= heads`` rank ``r`` holds the contiguous heads
  ``[r * heads/tp_size, (r + 1) * heads/tp_size)``; with ``tp_size > heads`` every rank holds one
  head, ``r * heads // tp_size``, and each head is replicated on ``tp_size / heads`` ranks
  (see `kv_head_range`). MLA has no head split: every rank holds the whole latent cache.
* pipeline parallel (PP): every PP rank owns a contiguous, half-open range of global layer
  indices ``[start_layer, end_layer)``. Prefill and decode may split layers differently.

A decode (local) worker identified by ``(pp_rank, tp_rank)`` therefore needs, for each of its
layers, exactly its own KV heads, no more and no less. Because the cache layout of one layer is
``[num_blocks, 2, num_kv_heads, block_size, head_dim]``, the heads a remote rank holds for one
block are one contiguous run of memory per K/V plane, and any sub-range of them is too. A read is
therefore fully described by a `HeadSource` (which remote TP rank, which of its heads, where they
land locally) times a `LayerSource` (which remote PP rank, which layers). Head slices only line up
when both sides use the same tokens per block, so a block-size mismatch is refused at
registration rather than re-blocked here.

Remote engines are learned at handshake time and stored per ``(engine_id, pp_rank)`` as an
`EngineTransferInfo`, following vLLM's ``TransferTopology`` (PR #43720) so its names and the
sign convention of `TransferTopology.tp_ratio` carry over. Beyond vLLM: a replicated remote head
is read once, not once per replica (`TransferTopology.head_sources`), and the layer ranges of
differently split PP engines are matched up (`TransferTopology.layer_sources`).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from itertools import groupby, pairwise

logger = logging.getLogger(__name__)

EngineId = str


class UnknownRemoteEngineError(KeyError):
    """No remote engine is registered under the requested ``(engine_id, pp_rank)``."""

    def __str__(self) -> str:
        # KeyError.__str__ repr()s its argument, which would wrap the message in quotes.
        return str(self.args[0]) if self.args else ""


class LayerCoverageError(ValueError):
    """The registered remote PP ranks do not cover a layer range exactly once."""


def _check_int(name: str, value: object, minimum: int) -> None:
    # bool is an int subclass; True as a TP size is a bug at the call site, not a size of 1.
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name} must be an int, got {type(value).__name__} {value!r}")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")


def _check_layer_range(start_name: str, start: int, end_name: str, end: int) -> None:
    _check_int(start_name, start, 0)
    _check_int(end_name, end, 0)
    if start > end:
        raise ValueError(f"{start_name} ({start}) must be <= {end_name} ({end})")


def _check_tp_heads(name: str, tp_size: int, total_num_kv_heads: int) -> None:
    if tp_size % total_num_kv_heads and total_num_kv_heads % tp_size:
        raise ValueError(
            f"{name} ({tp_size}) must divide total_num_kv_heads ({total_num_kv_heads}) "
            "or be a multiple of it"
        )


def _fmt_range(r: range) -> str:
    return f"[{r.start},{r.stop})"


def kv_head_range(tp_rank: int, tp_size: int, total_num_kv_heads: int) -> range:
    """Global KV head indices held by ``tp_rank`` of an engine with ``tp_size`` TP ranks.

    ``tp_size <= heads``: ``heads / tp_size`` contiguous heads. ``tp_size > heads``: one head,
    ``tp_rank * heads // tp_size``, which ``tp_size / heads`` consecutive ranks share.
    """
    _check_int("tp_size", tp_size, 1)
    _check_int("total_num_kv_heads", total_num_kv_heads, 1)
    _check_int("tp_rank", tp_rank, 0)
    if tp_rank >= tp_size:
        raise ValueError(f"tp_rank ({tp_rank}) must be < tp_size ({tp_size})")
    _check_tp_heads("tp_size", tp_size, total_num_kv_heads)
    if tp_size <= total_num_kv_heads:
        heads_per_rank = total_num_kv_heads // tp_size
        return range(tp_rank * heads_per_rank, (tp_rank + 1) * heads_per_rank)
    head = tp_rank * total_num_kv_heads // tp_size
    return range(head, head + 1)


@dataclass(frozen=True)
class EngineTransferInfo:
    """What a local worker knows about one remote ``(engine, pp_rank)`` after the handshake."""

    remote_tp_size: int
    remote_block_len: int  # bytes per block per layer on one remote rank
    remote_block_size: int  # tokens per block
    remote_physical_blocks_per_logical: int
    remote_pp_rank: int = 0
    # Half-open global layer range owned by this remote PP rank.
    start_layer: int = 0
    end_layer: int = 0

    def __post_init__(self) -> None:
        _check_int("remote_tp_size", self.remote_tp_size, 1)
        _check_int("remote_block_len", self.remote_block_len, 1)
        _check_int("remote_block_size", self.remote_block_size, 1)
        _check_int("remote_physical_blocks_per_logical", self.remote_physical_blocks_per_logical, 1)
        _check_int("remote_pp_rank", self.remote_pp_rank, 0)
        _check_layer_range("start_layer", self.start_layer, "end_layer", self.end_layer)

    @property
    def layers(self) -> range:
        return range(self.start_layer, self.end_layer)


@dataclass(frozen=True)
class HeadSource:
    """One contiguous run of KV heads to read from one remote TP rank.

    ``remote_offset`` indexes the remote rank's local head dimension and ``local_offset`` the
    reading rank's; both select ``num_heads`` consecutive heads.
    """

    remote_tp_rank: int
    remote_heads: range  # global head indices read
    remote_offset: int
    local_offset: int
    num_heads: int


@dataclass(frozen=True)
class LayerSource:
    """The remote PP rank that provides the global layers ``[start_layer, end_layer)``."""

    remote_pp_rank: int
    start_layer: int
    end_layer: int

    @property
    def layers(self) -> range:
        return range(self.start_layer, self.end_layer)


@dataclass(kw_only=True)
class TransferTopology:
    """The local worker's parallel identity plus every remote engine it has handshaken with.

    One instance per local worker. Remote engines are keyed by ``(engine_id, pp_rank)``; the
    first registration of a key wins so that repeated handshakes are idempotent.
    """

    tp_rank: int
    tp_size: int
    block_size: int
    engine_id: EngineId
    is_mla: bool
    total_num_kv_heads: int
    pp_rank: int = 0
    pp_size: int = 1
    # Half-open global layer range owned by the local PP rank.
    start_layer: int = 0
    end_layer: int = 0
    _engines: dict[tuple[EngineId, int], EngineTransferInfo] = field(
        default_factory=dict, init=False, repr=False
    )

    def __post_init__(self) -> None:
        _check_int("tp_size", self.tp_size, 1)
        _check_int("tp_rank", self.tp_rank, 0)
        if self.tp_rank >= self.tp_size:
            raise ValueError(f"tp_rank ({self.tp_rank}) must be < tp_size ({self.tp_size})")
        _check_int("block_size", self.block_size, 1)
        if not isinstance(self.engine_id, str) or not self.engine_id:
            raise ValueError(f"engine_id must be a non-empty str, got {self.engine_id!r}")
        if not isinstance(self.is_mla, bool):
            raise ValueError(f"is_mla must be a bool, got {self.is_mla!r}")
        _check_int("total_num_kv_heads", self.total_num_kv_heads, 1)
        if not self.is_mla:
            _check_tp_heads("tp_size", self.tp_size, self.total_num_kv_heads)
        _check_int("pp_size", self.pp_size, 1)
        _check_int("pp_rank", self.pp_rank, 0)
        if self.pp_rank >= self.pp_size:
            raise ValueError(f"pp_rank ({self.pp_rank}) must be < pp_size ({self.pp_size})")
        _check_layer_range("start_layer", self.start_layer, "end_layer", self.end_layer)

    # -- registry ---------------------------------------------------------------------------

    def register_remote_engine(
        self, remote_engine_id: EngineId, info: EngineTransferInfo
    ) -> EngineTransferInfo:
        """Store ``info`` under ``(remote_engine_id, info.remote_pp_rank)``; return what is stored.

        A key that is already registered keeps its first info (the later one is not validated),
        because every local worker re-handshakes and must end up with the same view.
        """
        if remote_engine_id == self.engine_id:
            raise ValueError(
                f"remote_engine_id {remote_engine_id!r} is the local engine_id; "
                "an engine cannot pull KV from itself"
            )
        key = (remote_engine_id, info.remote_pp_rank)
        stored = self._engines.get(key)
        if stored is not None:
            if stored != info:
                logger.warning(
                    "remote engine %r pp_rank %d already registered; keeping %s, ignoring %s",
                    remote_engine_id,
                    info.remote_pp_rank,
                    stored,
                    info,
                )
            return stored
        if info.remote_block_size != self.block_size:
            raise ValueError(
                f"remote_block_size ({info.remote_block_size}) of engine {remote_engine_id!r} "
                f"!= local block_size ({self.block_size}); mismatched block layouts are "
                "not supported"
            )
        if not self.is_mla:
            _check_tp_heads("remote_tp_size", info.remote_tp_size, self.total_num_kv_heads)
        # Refuse now rather than on the first transfer: every later query needs the ratio.
        self.tp_ratio(info.remote_tp_size)
        self._engines[key] = info
        return info

    def get_engine_info(
        self, remote_engine_id: EngineId, remote_pp_rank: int = 0
    ) -> EngineTransferInfo:
        info = self._engines.get((remote_engine_id, remote_pp_rank))
        if info is None:
            registered = ", ".join(f"({e!r}, {p})" for e, p in sorted(self._engines)) or "none"
            raise UnknownRemoteEngineError(
                f"no remote engine {remote_engine_id!r} with pp_rank {remote_pp_rank} is "
                f"registered; registered (engine_id, pp_rank): {registered}"
            )
        return info

    def unregister_remote_engine(self, remote_engine_id: EngineId) -> int:
        """Forget every PP rank of ``remote_engine_id``; return how many were removed."""
        keys = [key for key in self._engines if key[0] == remote_engine_id]
        for key in keys:
            del self._engines[key]
        return len(keys)

    def remote_pp_ranks(self, remote_engine_id: EngineId) -> list[int]:
        return sorted(pp for engine, pp in self._engines if engine == remote_engine_id)

    def is_registered(self, remote_engine_id: EngineId, pp_rank: int | None = None) -> bool:
        """Whether ``(remote_engine_id, pp_rank)`` is known; ``pp_rank=None`` means any rank."""
        if pp_rank is None:
            return any(engine == remote_engine_id for engine, _ in self._engines)
        return (remote_engine_id, pp_rank) in self._engines

    # -- tensor parallel ----------------------------------------------------------------------

    @property
    def local_kv_heads(self) -> range:
        """Global KV heads held by this rank (MLA: all of them, the latent is not split)."""
        if self.is_mla:
            return range(self.total_num_kv_heads)
        return kv_head_range(self.tp_rank, self.tp_size, self.total_num_kv_heads)

    def tp_ratio(self, remote_tp_size: int) -> int:
        """vLLM's signed TP ratio.

        Positive ``local // remote``: how many local workers read from the same remote worker.
        Negative ``-(remote // local)``: how many remote workers one local worker reads from.
        """
        _check_int("remote_tp_size", remote_tp_size, 1)
        if self.tp_size >= remote_tp_size:
            if self.tp_size % remote_tp_size:
                raise ValueError(
                    f"local tp_size ({self.tp_size}) is not a multiple of "
                    f"remote_tp_size ({remote_tp_size})"
                )
            return self.tp_size // remote_tp_size
        if remote_tp_size % self.tp_size:
            raise ValueError(
                f"remote_tp_size ({remote_tp_size}) is not a multiple of "
                f"local tp_size ({self.tp_size})"
            )
        return -(remote_tp_size // self.tp_size)

    def tp_ratio_from_engine_id(self, remote_engine_id: EngineId, remote_pp_rank: int = 0) -> int:
        return self.tp_ratio(self.get_engine_info(remote_engine_id, remote_pp_rank).remote_tp_size)

    def is_kv_replicated(self, remote_engine_id: EngineId, remote_pp_rank: int = 0) -> bool:
        """Whether each remote rank holds a head that other remote ranks hold too."""
        info = self.get_engine_info(remote_engine_id, remote_pp_rank)
        return info.remote_tp_size > self.total_num_kv_heads

    def replicates_kv_cache(self, remote_engine_id: EngineId, remote_pp_rank: int = 0) -> bool:
        # MLA's latent cache cannot be split by heads, so every rank holds all of it.
        return self.is_mla or self.is_kv_replicated(remote_engine_id, remote_pp_rank)

    def head_sources(self, remote_engine_id: EngineId, remote_pp_rank: int = 0) -> list[HeadSource]:
        """The head slices to read, one per target remote rank, ordered by local head.

        Together they cover `local_kv_heads` exactly once; a head replicated on several remote
        ranks is read from just one of them.
        """
        info = self.get_engine_info(remote_engine_id, remote_pp_rank)
        remote_tp = info.remote_tp_size
        if self.is_mla:
            heads = self.local_kv_heads
            return [HeadSource(self.tp_rank % remote_tp, heads, 0, 0, len(heads))]
        return head_sources_between(self.tp_rank, self.tp_size, remote_tp, self.total_num_kv_heads)

    def target_remote_ranks(self, remote_engine_id: EngineId, remote_pp_rank: int = 0) -> list[int]:
        """Remote TP ranks this rank reads from, one per `head_sources` entry.

        Equals vLLM's answer except that a remote engine replicating heads is read once per
        distinct head instead of once per replica.
        """
        return [s.remote_tp_rank for s in self.head_sources(remote_engine_id, remote_pp_rank)]

    # -- pipeline parallel --------------------------------------------------------------------

    def layer_sources(
        self,
        remote_engine_id: EngineId,
        start_layer: int | None = None,
        end_layer: int | None = None,
    ) -> list[LayerSource]:
        """Which registered remote PP ranks provide which part of ``[start_layer, end_layer)``.

        Defaults to the local PP rank's own layers. Sorted by layer; raises `LayerCoverageError`
        when the remote ranges overlap or leave a requested layer uncovered.
        """
        start = self.start_layer if start_layer is None else start_layer
        end = self.end_layer if end_layer is None else end_layer
        _check_layer_range("start_layer", start, "end_layer", end)
        if start == end:
            raise ValueError(
                f"layer range [{start},{end}) is empty; construct the topology with its "
                "start_layer/end_layer or pass them"
            )
        remote_pp = self.remote_pp_ranks(remote_engine_id)
        if not remote_pp:
            # Raises the typed error with the registered keys in its message.
            self.get_engine_info(remote_engine_id)
        infos = sorted(
            (self._engines[(remote_engine_id, pp)] for pp in remote_pp),
            key=lambda i: (i.start_layer, i.end_layer),
        )
        registered = ", ".join(
            f"remote_pp={i.remote_pp_rank} layers={_fmt_range(i.layers)}" for i in infos
        )
        nonempty = [i for i in infos if i.start_layer < i.end_layer]
        for prev, cur in pairwise(nonempty):
            if cur.start_layer < prev.end_layer:
                raise LayerCoverageError(
                    f"engine {remote_engine_id!r}: remote_pp={prev.remote_pp_rank} and "
                    f"remote_pp={cur.remote_pp_rank} both hold layers "
                    f"{_fmt_range(range(cur.start_layer, min(prev.end_layer, cur.end_layer)))}; "
                    f"registered: {registered}"
                )

        sources: list[LayerSource] = []
        missing: list[range] = []
        cursor = start
        for info in nonempty:
            lo, hi = max(info.start_layer, cursor), min(info.end_layer, end)
            if lo >= hi:
                continue
            if lo > cursor:
                missing.append(range(cursor, lo))
            sources.append(LayerSource(info.remote_pp_rank, lo, hi))
            cursor = hi
        if cursor < end:
            missing.append(range(cursor, end))
        if missing:
            raise LayerCoverageError(
                f"engine {remote_engine_id!r}: no registered remote PP rank holds layers "
                f"{', '.join(_fmt_range(r) for r in missing)} of the requested "
                f"[{start},{end}); registered: {registered}"
            )
        return sources

    # -- logging ------------------------------------------------------------------------------

    def describe(self) -> str:
        """The local identity, then one line per registered remote ``(engine, pp_rank)``."""
        lines = [
            f"local engine={self.engine_id} tp_rank={self.tp_rank}/{self.tp_size} "
            f"pp_rank={self.pp_rank}/{self.pp_size} "
            f"layers={_fmt_range(range(self.start_layer, self.end_layer))} "
            f"block_size={self.block_size} kv_heads={_fmt_range(self.local_kv_heads)}"
            f"/{self.total_num_kv_heads} mla={self.is_mla}"
        ]
        for engine, pp in sorted(self._engines):
            info = self._engines[(engine, pp)]
            lines.append(
                f"engine={engine} remote_pp={pp} remote_tp={info.remote_tp_size} "
                f"tp_ratio={self.tp_ratio(info.remote_tp_size)} "
                f"layers={_fmt_range(info.layers)} block_size={info.remote_block_size} "
                f"replicated={self.replicates_kv_cache(engine, pp)} "
                f"targets={self.target_remote_ranks(engine, pp)}"
            )
        return "\n".join(lines)


def head_sources_between(
    tp_rank: int, tp_size: int, remote_tp_size: int, total_heads: int
) -> list[HeadSource]:
    """The head slices TP rank ``tp_rank`` of ``tp_size`` reads from an engine of
    ``remote_tp_size`` ranks, both splitting ``total_heads`` heads as `kv_head_range` says;
    ordered by local head, covering the local heads exactly once (a replicated remote head is
    read from one replica)."""
    _check_tp_heads("remote_tp_size", remote_tp_size, total_heads)
    local_heads = kv_head_range(tp_rank, tp_size, total_heads)

    def remote_rank(head: int) -> int:
        if remote_tp_size <= total_heads:
            return head // (total_heads // remote_tp_size)
        replicas = remote_tp_size // total_heads
        # Local ranks that share this head (local tp > heads) spread evenly over its remote
        # replicas, so no remote rank serves the same head twice while another idles. This
        # reproduces vLLM's tp_rank // tp_ratio whenever local tp >= remote tp.
        sharers = max(tp_size // total_heads, 1)
        position = tp_rank % sharers
        return head * replicas + position * replicas // sharers

    sources: list[HeadSource] = []
    # Consecutive local heads served by the same remote rank form one contiguous read.
    for rank, run in groupby(local_heads, key=remote_rank):
        heads = list(run)
        remote_heads = range(heads[0], heads[-1] + 1)
        remote_first = kv_head_range(rank, remote_tp_size, total_heads).start
        sources.append(
            HeadSource(
                remote_tp_rank=rank,
                remote_heads=remote_heads,
                remote_offset=remote_heads.start - remote_first,
                local_offset=remote_heads.start - local_heads.start,
                num_heads=len(remote_heads),
            )
        )
    return sources
