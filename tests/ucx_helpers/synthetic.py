"""Synthetic engines: the halves of `UcxConnector` without a model, over seeded caches.

One `SyntheticEngine` is a scheduler half plus one worker half per ``(pp, tp)`` rank, all in
this process, each worker with its own transfer agent and the slice of a seeded "global" KV
cache (every layer, every head) its rank would hold. A producer serves its handshake over real
gRPC; a consumer's workers load through real UCX. Checking a consumer's caches against the
global tensors then covers every layer and head slice of any TP x PP pairing in milliseconds.
"""

from __future__ import annotations

import zlib
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
from waiting import wait_until

from kvtransfer.connector.config import KVTransferConfig
from kvtransfer.connector.kv_groups import KVCacheGroup
from kvtransfer.connector.metadata import KVCacheLayout, KVConnectorRole, merge_handshake_metadata
from kvtransfer.connector.topology import kv_head_range
from kvtransfer.connectors.ucx import LoadSpec, RemotePrefill, UcxConnector, UcxConnectorMetadata
from kvtransfer.connectors.ucx.metadata import Grant
from kvtransfer.engine.parallel import pp_layer_range
from kvtransfer.transport import new_secret, secret_digest

MODEL = "synthetic"
NUM_LAYERS = 4
NUM_DRAFT_LAYERS = 2
NUM_KV_HEADS = 2
HEAD_DIM = 4
BLOCK_SIZE = 8
NUM_BLOCKS = 24
SENTINEL = -7.0
WAIT_S = 30.0


def layer_names(draft: bool = True) -> list[str]:
    names = [f"model.layers.{i}.self_attn" for i in range(NUM_LAYERS)]
    if draft:
        names += [f"draft.layers.{i}.self_attn" for i in range(NUM_DRAFT_LAYERS)]
    return names


def global_layer(
    seed: int, name: str, num_blocks: int = NUM_BLOCKS, cache_dtype: str = "auto"
) -> torch.Tensor:
    """The whole (all heads) cache of one layer of a producer seeded with ``seed``: float32,
    or any byte for a quantised (fp8, as vLLM stores it: uint8) cache."""
    generator = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))
    shape = (num_blocks, 2, NUM_KV_HEADS, BLOCK_SIZE, HEAD_DIM)
    if cache_dtype != "auto":
        return torch.randint(0, 256, shape, generator=generator, dtype=torch.uint8)
    return torch.randn(*shape, generator=generator, dtype=torch.float32)


# Bytes per half of a recurrent-state layer's page: pages of 16, as the wire aligns segments
# to 16 (a tagged pull's payload_bytes counts that padding).
STATE_WIDTH = 8


def state_pages(seed: int, name: str) -> torch.Tensor:
    """A recurrent-state layer's pages (`[blocks, 2, 1, 1, width]` uint8, as the vLLM adapter
    views them): the same on every TP rank of a producer seeded with ``seed``."""
    generator = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))
    shape = (NUM_BLOCKS, 2, 1, 1, STATE_WIDTH)
    return torch.randint(0, 256, shape, generator=generator, dtype=torch.uint8)


StateMaker = Callable[[str, int, int, "int | None"], torch.Tensor]
"""``(layer, tp_size, tp_rank, seed)`` -> that rank's state pages of the layer (a consumer's
when ``seed`` is None)."""


def sentinel_cache(shape: Sequence[int], cache_dtype: str = "auto") -> torch.Tensor:
    """A consumer's cache before any load: every element `SENTINEL` (its byte for fp8)."""
    if cache_dtype != "auto":
        return torch.full(tuple(shape), int(-SENTINEL), dtype=torch.uint8)
    return torch.full(tuple(shape), SENTINEL)


@dataclass
class SyntheticEngine:
    engine_id: str
    tp_size: int
    pp_size: int
    scheduler: UcxConnector
    workers: dict[tuple[int, int], UcxConnector]
    caches: dict[tuple[int, int], dict[str, torch.Tensor]] = field(repr=False)

    @property
    def address(self) -> str:
        address = self.scheduler.scheduler_half.address
        if address is None:
            raise RuntimeError(f"engine {self.engine_id} serves no handshake")
        return address

    @property
    def generation(self) -> int:
        book = self.scheduler.scheduler_half.book
        if book is None:
            raise RuntimeError(f"engine {self.engine_id} serves no handshake")
        return book.generation

    def remote(
        self,
        request_id: str = "r",
        block_ids: Sequence[int] = (),
        *,
        grant: bool = True,
        **changes,
    ) -> RemotePrefill:
        """The params a consumer would receive for ``block_ids`` of this producer, which now
        holds ``request_id`` for it and has granted its workers that lease (as
        `request_finished` and the next step would; ``grant=False``: not yet, see `grant`)."""
        secret = new_secret()
        self.scheduler.scheduler_half.leases.hold(request_id, secret)
        if grant:
            self.grant(request_id, secret, block_ids)
        host, port = self.address.rsplit(":", 1)
        fields = {
            "engine_id": self.engine_id,
            "request_id": request_id,
            "block_ids": (tuple(block_ids),),
            "host": host,
            "port": int(port),
            "tp_size": self.tp_size,
            "pp_size": self.pp_size,
            "num_tokens": len(block_ids) * BLOCK_SIZE,
            "secret": secret,
            "prompt_digest": "0" * 64,
            "generation": self.generation,
        }
        fields.update(changes)
        return RemotePrefill(**fields)

    def grant(self, request_id: str, secret: str, block_ids: Sequence[int]) -> None:
        """The step that records a held lease on every worker."""
        self.step(grants=(Grant(request_id, secret_digest(secret), tuple(block_ids)),))

    def step(self, **metadata) -> None:
        """Hand every worker one step's metadata, as the engine would."""
        bound = UcxConnectorMetadata(**metadata)
        for worker in self.workers.values():
            worker.bind_connector_metadata(bound)
            worker.start_load_kv(None)
            worker.clear_connector_metadata()

    def shutdown(self) -> None:
        for worker in self.workers.values():
            worker.shutdown()
        self.scheduler.shutdown()


def _config(engine_id: str, role: str, **extra) -> KVTransferConfig:
    return KVTransferConfig(
        kv_connector="UcxConnector",
        kv_role=role,
        engine_id=engine_id,
        kv_connector_extra_config=extra,
    )


def _layout(
    tp: int,
    pp: int,
    rank: tuple[int, int] | None,
    block_size: int,
    cache_dtype: str = "auto",
    groups: tuple[KVCacheGroup, ...] = (),
) -> KVCacheLayout:
    return KVCacheLayout(
        model=MODEL,
        dtype="float32" if cache_dtype == "auto" else "uint8",
        cache_dtype=cache_dtype,
        block_size=block_size,
        num_blocks=NUM_BLOCKS,
        num_layers=NUM_LAYERS,
        num_kv_heads=NUM_KV_HEADS,
        head_dim=HEAD_DIM,
        tp_size=tp,
        pp_size=pp,
        pp_rank=None if rank is None else rank[0],
        tp_rank=None if rank is None else rank[1],
        groups=groups,
        # A hybrid engine's skipped positions point at block 0, as vLLM's do.
        null_block_id=0 if groups else None,
    )


def rank_caches(
    tp: int,
    pp: int,
    rank: tuple[int, int],
    seed: int | None,
    draft: bool,
    block_size: int,
    cache_dtype: str = "auto",
    state: frozenset[str] = frozenset(),
    state_maker: StateMaker | None = None,
) -> dict[str, torch.Tensor]:
    """What worker ``rank`` holds: its PP stage's layers (drafter on the last), its heads; the
    seeded producer values, or the sentinel on a consumer (``seed=None``). State pages are
    ``state_maker``'s for the rank when given, else the same opaque pages on every rank."""
    pp_rank, tp_rank = rank
    start, end = pp_layer_range(NUM_LAYERS, pp, pp_rank)
    names = [f"model.layers.{i}.self_attn" for i in range(start, end)]
    if draft and pp_rank == pp - 1:
        names += [f"draft.layers.{i}.self_attn" for i in range(NUM_DRAFT_LAYERS)]
    heads = kv_head_range(tp_rank, tp, NUM_KV_HEADS)
    caches = {}
    for name in names:
        if name in state and state_maker is not None:
            caches[name] = state_maker(name, tp, tp_rank, seed)
            continue
        if name in state:
            pages = state_pages(seed or 0, name)
            caches[name] = pages if seed is not None else sentinel_cache(pages.shape, "fp8")
            continue
        if seed is None:
            shape = (NUM_BLOCKS, 2, len(heads), block_size, HEAD_DIM)
            caches[name] = sentinel_cache(shape, cache_dtype)
        else:
            layer = global_layer(seed, name, cache_dtype=cache_dtype)
            caches[name] = layer[:, :, heads.start : heads.stop].contiguous()
    return caches


def start_engine(
    engine_id: str,
    tp: int,
    pp: int,
    role: str,
    *,
    seed: int | None = None,
    draft: bool = True,
    block_size: int = BLOCK_SIZE,
    cache_dtype: str = "auto",
    groups: tuple[KVCacheGroup, ...] = (),
    state_maker: StateMaker | None = None,
    **extra,
) -> SyntheticEngine:
    """``cache_dtype``: "auto" (float32 caches) or a quantised format (uint8 caches, the
    format in the layout, as vLLM's fp8 caches)."""
    config = _config(engine_id, role, **extra)
    workers: dict[tuple[int, int], UcxConnector] = {}
    caches: dict[tuple[int, int], dict[str, torch.Tensor]] = {}
    scheduler = UcxConnector(
        config, KVConnectorRole.SCHEDULER, _layout(tp, pp, None, block_size, cache_dtype, groups)
    )
    engine = SyntheticEngine(engine_id, tp, pp, scheduler, workers, caches)
    try:
        for p in range(pp):
            for t in range(tp):
                layout = _layout(tp, pp, (p, t), block_size, cache_dtype, groups)
                worker = UcxConnector(config, KVConnectorRole.WORKER, layout)
                workers[(p, t)] = worker
                state = frozenset(n for g in groups if g.pages_opaque for n in g.layer_names)
                caches[(p, t)] = rank_caches(
                    tp, pp, (p, t), seed, draft, block_size, cache_dtype, state, state_maker
                )
                worker.register_kv_caches(caches[(p, t)])
        merged = merge_handshake_metadata(
            [{rank: w.get_handshake_metadata()} for rank, w in workers.items()]
        )
        scheduler.set_xfer_handshake_metadata_pp_aware(merged)
    except BaseException:
        engine.shutdown()
        raise
    return engine


@contextmanager
def engines(*specs: dict) -> Iterator[list[SyntheticEngine]]:
    started: list[SyntheticEngine] = []
    try:
        for spec in specs:
            started.append(start_engine(**spec))
        yield started
    finally:
        for engine in started:
            engine.shutdown()


def run_load(
    consumer: SyntheticEngine, spec: LoadSpec, *, abort_after_start: bool = False
) -> dict[tuple[int, int], tuple[set[str], set[str], set[int]]]:
    """Run one load on every consumer worker the way the engine does, step by step, until each
    reported it; returns per rank (finished_recving, failed_recving, load-error blocks)."""
    metadata = UcxConnectorMetadata(loads=(spec,))
    results: dict[tuple[int, int], tuple[set[str], set[str], set[int]]] = {}
    for rank, worker in consumer.workers.items():
        worker.bind_connector_metadata(metadata)
        worker.start_load_kv(None)
        finished = {spec.req_id} if abort_after_start else set()
        recving, failed, errors = _collect(worker, finished)
        worker.clear_connector_metadata()

        def reported(worker=worker, recving=recving, failed=failed, errors=errors) -> bool:
            if spec.req_id in recving:
                return True
            more = _collect(worker, set())
            recving |= more[0]
            failed |= more[1]
            errors |= more[2]
            return False

        wait_until(reported, f"worker {rank} reports {spec.req_id}", WAIT_S, interval=0.005)
        results[rank] = (recving, failed, errors)
    return results


def _collect(worker: UcxConnector, finished: set[str]) -> tuple[set[str], set[str], set[int]]:
    _, recving, failed = worker.get_transfer_results(finished)
    return set(recving or ()), set(failed or ()), worker.get_block_ids_with_load_errors()


def expected_rank_cache(
    seed: int,
    name: str,
    rank: tuple[int, int],
    tp: int,
    remote_ids: Sequence[int],
    local_ids: Sequence[int],
    block_size: int = BLOCK_SIZE,
    cache_dtype: str = "auto",
) -> torch.Tensor:
    """A consumer worker's cache of ``name`` after loading ``remote_ids`` into ``local_ids``."""
    heads = kv_head_range(rank[1], tp, NUM_KV_HEADS)
    expected = sentinel_cache((NUM_BLOCKS, 2, len(heads), block_size, HEAD_DIM), cache_dtype)
    source = global_layer(seed, name, cache_dtype=cache_dtype)[:, :, heads.start : heads.stop]
    expected[list(local_ids)] = source[list(remote_ids)]
    return expected
