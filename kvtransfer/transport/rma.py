"""RMA mode: the producer registers its KV once; consumers read it one-sided.

Producer (`RmaExporter`): at `KVTransferAgent.start_server` every tensor storage behind the
registered layers is mapped with UCX (``ucp_mem_map``, remote read only; host or CUDA memory)
and its remote key packed, together with the lease table (see `lease_table`). `RmaKeys` is
what a consumer receives, once per producer agent, in answer to a keys request that presents a
valid lease (the same authentication as a tagged pull); after that the producer runs none of
our code per read: UCX serves it (cma on one host, tcp emulated by the producer's UCX worker).

Consumer (`RmaReader`): unpacks the keys on its endpoint to the producer (`RmaPeer`), plans the
contiguous runs of a pull (`rma_layout`), checks the lease row, posts one ``ucp_get_nbx`` per run
straight into its own cache blocks, waits for the flush, and checks the lease row again. All of
it on the calling thread (the UCX worker is thread-safe), so a pull costs no thread hand-off.
"""

from __future__ import annotations

import base64
import itertools
import json
import logging
import os
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace

import numpy as np
import torch

from kvtransfer.transport.access import (
    AccessDenied,
    LeaseEndedDuringRead,
    LeaseNotGranted,
    secret_digest,
)
from kvtransfer.transport.cuda_ipc import (
    CudaIpcHandle,
    CudaIpcUnavailable,
    RowViews,
    Span,
    copy_runs,
    local_bytes,
    open_region,
)
from kvtransfer.transport.direct_read import (
    DirectPlan,
    DirectReader,
    DirectReadUnavailable,
    DirectWriter,
    plan_direct,
)
from kvtransfer.transport.errors import (
    ErrorCode,
    PeerUnreachable,
    RemoteTransferError,
    TransferCancelled,
    TransferTimeoutError,
)
from kvtransfer.transport.lease_table import (
    ROW_BYTES,
    ROW_WORDS,
    WINDOW,
    LeaseTable,
    blocks_tag,
    find_row,
    lease_slot,
    lease_token,
    prompt_tag,
)
from kvtransfer.transport.rma_layout import LayerMemory, RunGrid, Runs, concat_runs, merge_runs
from kvtransfer.transport.spec import LayerPlan, PullSpec
from kvtransfer.transport.ucp_rma import (
    MEMORY_CUDA,
    MEMORY_HOST,
    Gets,
    MappedRegion,
    Puts,
    UcxStatusError,
    destroy_key,
    unpack_key,
)

logger = logging.getLogger(__name__)

# A keys answer larger than this is refused (a layer entry is ~200 bytes, a key ~100).
MAX_KEYS_BYTES = 4 << 20
# A reader waiting for its UCX gets could poll without a pause this long before napping
# between polls from `_NAP_S` doubling to `_MAX_NAP_S` (see `_wait`). Off: where a consumer
# rank and its producer share a core (vLLM pins both), the spin takes the core the producer's
# UCX worker needs to answer the get, and the vLLM TP 1 -> TP 2 pairing, pinned, stalled past
# vLLM's 60 s step timeout again with 0.5 ms (docs/data-plane.md has what the spin bought).
_SPIN_S = 0.0
_NAP_S = 0.00005
_MAX_NAP_S = 0.001
# A waiting reader runs its `on_wait` (the producer liveness probe) this often.
_WAIT_HOOK_S = 0.25
# A reader queued behind another read from the same producer checks its deadline, cancel flag
# and probe this often.
_LOCK_POLL_S = 0.05
# Back-off of a reader waiting for its lease row (the grant reaches the workers once a step).
_ROW_BACKOFF_S = (0.0005, 0.02)


@dataclass(frozen=True)
class RegionKey:
    address: int
    length: int
    memory: str
    key: bytes
    # A CUDA region's IPC handle, for a consumer on the same host (see `cuda_ipc`).
    ipc: CudaIpcHandle | None = None


@dataclass(frozen=True)
class TableRef:
    """Where the producer's lease table is: region, address, and its layer order."""

    region: int
    address: int
    slots: int
    layers: tuple[str, ...]


@dataclass(frozen=True)
class Identity:
    """The producer's process and a nonce at ``address`` in it: a same-host reader checks it
    before reading the process's memory directly (`direct_read`)."""

    pid: int
    address: int
    nonce: bytes


@dataclass(frozen=True)
class RmaKeys:
    """What a consumer needs to read a producer agent's KV one-sided."""

    regions: tuple[RegionKey, ...]
    layers: Mapping[str, LayerMemory]
    table: TableRef | None
    identity: Identity

    def encode(self) -> bytes:
        body = {
            "regions": [
                [r.address, r.length, r.memory, base64.b64encode(r.key).decode()]
                + ([] if r.ipc is None else [r.ipc.as_list()])
                for r in self.regions
            ],
            "layers": [layer.as_dict() for layer in self.layers.values()],
            "table": None
            if self.table is None
            else [self.table.region, self.table.address, self.table.slots, list(self.table.layers)],
            "identity": [
                self.identity.pid,
                self.identity.address,
                base64.b64encode(self.identity.nonce).decode(),
            ],
        }
        return json.dumps(body, separators=(",", ":")).encode()

    @classmethod
    def decode(cls, data: bytes) -> RmaKeys:
        """`ValueError` naming what is wrong with a peer's keys answer."""
        try:
            body = json.loads(data)
            regions = tuple(
                RegionKey(
                    int(a),
                    int(n),
                    str(m),
                    base64.b64decode(k, validate=True),
                    CudaIpcHandle.from_list(ipc[0]) if ipc else None,
                )
                for a, n, m, k, *ipc in body["regions"]
            )
            layers = {}
            for item in body["layers"]:
                layer = LayerMemory.from_dict(item)
                layers[layer.name] = layer
            table = body["table"]
            ref = (
                None
                if table is None
                else TableRef(int(table[0]), int(table[1]), int(table[2]), tuple(table[3]))
            )
            pid, address, nonce = body["identity"]
            identity = Identity(int(pid), int(address), base64.b64decode(nonce, validate=True))
        except (KeyError, TypeError, ValueError, IndexError) as exc:
            raise ValueError(f"unreadable RMA keys: {type(exc).__name__}: {exc}") from exc
        for name, layer in layers.items():
            if not 0 <= layer.region < len(regions):
                raise ValueError(f"layer {name!r} names region {layer.region} of {len(regions)}")
            region = regions[layer.region]
            low, high = layer.extent()
            if low < region.address or high > region.address + region.length:
                raise ValueError(f"layer {name!r} lies outside its region")
        if ref is not None and not 0 <= ref.region < len(regions):
            raise ValueError(f"the lease table names region {ref.region} of {len(regions)}")
        return cls(regions, layers, ref, identity)


def _memory_type(tensor: torch.Tensor) -> int:
    return MEMORY_CUDA if tensor.is_cuda else MEMORY_HOST


class RmaExporter:
    """The producer's registered memory: every cache storage and the lease table. With
    ``writable`` (a consumer taking pushes) the cache storages are mapped for remote writes
    too; the lease table never is. ``cuda_ipc``: CUDA storages also publish their IPC
    handles, for consumers on the same host (`cuda_ipc`)."""

    def __init__(
        self,
        context: int,
        caches: Mapping[str, torch.Tensor],
        table: LeaseTable | None,
        *,
        writable: bool = False,
        cuda_ipc: bool = True,
    ) -> None:
        self._mapped: list[MappedRegion] = []
        # Random bytes only this process holds at this address (see `Identity`).
        self._nonce = torch.frombuffer(bytearray(os.urandom(16)), dtype=torch.uint8)
        by_storage: dict[tuple[int, int], int] = {}
        handles: list[CudaIpcHandle | None] = []
        layers: dict[str, LayerMemory] = {}
        try:
            for name, tensor in caches.items():
                storage = tensor.untyped_storage()
                key = (storage.data_ptr(), storage.nbytes())
                if key not in by_storage:
                    by_storage[key] = len(self._mapped)
                    self._mapped.append(
                        MappedRegion.map(context, *key, _memory_type(tensor), remote_write=writable)
                    )
                    share = cuda_ipc and tensor.is_cuda
                    handles.append(CudaIpcHandle.export(tensor) if share else None)
                layers[name] = LayerMemory.of(name, tensor, by_storage[key])
            ref = None
            if table is not None:
                self._mapped.append(
                    MappedRegion.map(context, table.words.data_ptr(), table.nbytes, MEMORY_HOST)
                )
                ref = TableRef(
                    len(self._mapped) - 1, table.words.data_ptr(), table.slots, table.layer_names
                )
        except BaseException:
            self.close()
            raise
        self.keys = RmaKeys(
            tuple(
                RegionKey(
                    m.address,
                    m.length,
                    "cuda" if m.memory_type == MEMORY_CUDA else "host",
                    m.packed_key,
                    handles[i] if i < len(handles) else None,
                )
                for i, m in enumerate(self._mapped)
            ),
            layers,
            ref,
            Identity(os.getpid(), self._nonce.data_ptr(), bytes(self._nonce.numpy())),
        )
        self.encoded = self.keys.encode()
        if len(self.encoded) > MAX_KEYS_BYTES:
            self.close()
            raise ValueError(f"RMA keys take {len(self.encoded)} bytes, over {MAX_KEYS_BYTES}")

    @property
    def registered_bytes(self) -> int:
        return sum(m.length for m in self._mapped)

    def close(self) -> None:
        for region in self._mapped:
            try:
                region.unmap()
            except Exception:
                logger.exception("unmapping a KV region failed")
        self._mapped = []


class RmaPeer:
    """A producer's keys on the consumer, and how this consumer reads it: directly (same host,
    host memory, `direct_read`) or through UCX gets on its endpoint to the producer.

    ``lock`` is held by a reader for a whole read and by `release`, which destroys the keys
    unpacked on an endpoint before that endpoint closes (UCX's order), so no read uses a
    destroyed key.
    """

    def __init__(self, keys: RmaKeys, same_host: bool) -> None:
        self.keys = keys
        self.lock = threading.Lock()
        self._endpoint: int | None = None
        self._rkeys: list[int] = []
        self._direct: DirectReader | None = None
        self._direct_writer: DirectWriter | None = None
        # CUDA memory on this host: the data is copied through the regions' IPC handles,
        # opened at the first read (`cuda_spans`); the lease rows are read directly where
        # the probe allows, else through UCX.
        self._ipc = same_host and any(region.ipc is not None for region in keys.regions)
        self._cuda_spans: list[Span] | None = None
        self._row_reader: DirectReader | None = None
        # Pull shapes planned against these keys (see `plan_runs`).
        self.shapes: dict[tuple, PullShape] = {}
        if not same_host:
            return
        host = all(region.memory == "host" for region in keys.regions)
        if host or self._ipc:
            candidate = DirectReader(keys.identity.pid)
            if candidate.probe(keys.identity.address, keys.identity.nonce):
                if host:
                    self._direct = candidate
                    self._direct_writer = DirectWriter(keys.identity.pid)
                else:
                    self._row_reader = candidate

    @property
    def direct(self) -> DirectReader | None:
        return self._direct

    @property
    def direct_writer(self) -> DirectWriter | None:
        """Same-host writes into the peer (a push), where `direct` reads it."""
        return self._direct_writer if self._direct is not None else None

    def ucx_keys(self, endpoint: int) -> list[int]:
        """The region keys unpacked on ``endpoint`` (call under ``lock``)."""
        if self._endpoint == endpoint:
            return self._rkeys
        self._unbind()
        rkeys: list[int] = []
        try:
            for region in self.keys.regions:
                rkeys.append(unpack_key(endpoint, region.key))
        except UcxStatusError:
            for rkey in rkeys:
                destroy_key(rkey)
            raise
        self._endpoint, self._rkeys = endpoint, rkeys
        return rkeys

    def release(self) -> None:
        """The endpoint is closing: destroy the keys unpacked on it first (any thread)."""
        with self.lock:
            self._unbind()

    @property
    def row_reader(self) -> DirectReader | None:
        """Direct reads of the lease table where the data is GPU memory copied over IPC."""
        return self._row_reader

    def cuda_spans(self) -> list[Span] | None:
        """The producer's regions mapped into this process through their IPC handles (a
        region without one, the lease table's, maps to nothing), opened once; None: UCX."""
        if not self._ipc:
            return None
        if self._cuda_spans is None:
            try:
                self._cuda_spans = [
                    Span(
                        region.address,
                        torch.empty(0, dtype=torch.uint8)
                        if region.ipc is None
                        else open_region(region.ipc, self.keys.identity.pid),
                    )
                    for region in self.keys.regions
                ]
            except CudaIpcUnavailable as exc:
                pid = self.keys.identity.pid
                logger.warning("GPU reads and writes with pid %d go through UCX: %s", pid, exc)
                self._ipc = False
                return None
        return self._cuda_spans

    def no_direct(self) -> None:
        """Direct reads (or writes) were refused (permissions changed): UCX from now on."""
        self._direct = None
        self._direct_writer = None
        self._row_reader = None

    def _unbind(self) -> None:
        rkeys, self._rkeys = self._rkeys, []
        self._endpoint = None
        for rkey in rkeys:
            destroy_key(rkey)


@dataclass
class ReadControl:
    """What a read checks while it waits: a cancel flag, a deadline and a liveness hook."""

    cancelled: Callable[[], bool]
    deadline: float
    timeout_s: float
    on_wait: Callable[[], None] | None = None
    grant_wait_s: float = 5.0
    _probe_at: float = 0.0
    # Set by a read that failed while it only waited for its turn (behind another read from
    # the producer, or for a reconnect): it posted nothing, so there is nothing in flight to
    # end by resetting the endpoint, and a reset would wait for the read it queued behind.
    queued_only: bool = False

    def check(self, what: str) -> None:
        """Raise if ``what`` was cancelled or ran past its deadline; else run the probe."""
        if self.cancelled():
            raise TransferCancelled(f"{what} was cancelled")
        if time.monotonic() >= self.deadline:
            raise TransferTimeoutError(f"{what} timed out after {self.timeout_s} s")
        self.probe()

    def probe(self) -> None:
        """Run ``on_wait`` if it has not run for `_WAIT_HOOK_S` (it may raise)."""
        now = time.monotonic()
        if self.on_wait is None:
            return
        if not self._probe_at:
            self._probe_at = now + _WAIT_HOOK_S
        elif now >= self._probe_at:
            self._probe_at = now + _WAIT_HOOK_S
            self.on_wait()


@dataclass(frozen=True)
class _Group:
    """Layers of one geometry on both sides: one `RunGrid`, shifted by each layer's bases."""

    grid: RunGrid
    local_bases: np.ndarray
    remote_bases: np.ndarray
    regions: np.ndarray


@dataclass(frozen=True)
class PullShape:
    """What planning a pull needs besides its block ids, checked once per (layers, heads)."""

    groups: tuple[_Group, ...]
    # The fewest blocks any remote layer of the pull has, and that layer.
    blocks: int
    smallest: str
    # Whether a layer's memory touches the next one's on both sides (layers in one buffer):
    # only then can runs merge across layers.
    touching: bool
    local_memory: Mapping[str, LayerMemory]


# Shapes kept per producer: one per (layers, heads) a consumer pulls, a handful in practice.
_MAX_SHAPES = 64


def _shape(
    keys: RmaKeys,
    spec: PullSpec,
    plans: list[LayerPlan],
    local_memory: Mapping[str, LayerMemory],
) -> PullShape:
    groups: dict[tuple, list[tuple[LayerMemory, LayerMemory]]] = {}
    grids: dict[tuple, RunGrid] = {}
    smallest: LayerMemory | None = None
    for plan in plans:
        remote = keys.layers.get(plan.name)
        if remote is None:
            raise RemoteTransferError(
                f"pull {spec.request_id!r}: the producer has no layer {plan.name!r}",
                code=ErrorCode.UNKNOWN_LAYER,
            )
        heads = spec.remote_heads or range(remote.shape[2])
        if heads.stop > remote.shape[2] or len(heads) != len(plan.local_heads):
            raise RemoteTransferError(
                f"pull {spec.request_id!r}: head range [{heads.start},{heads.stop}) does not fit "
                f"layer {plan.name!r} with {remote.shape[2]} heads on the producer",
                code=ErrorCode.HEAD_RANGE,
            )
        if smallest is None or remote.shape[0] < smallest.shape[0]:
            smallest = remote
        local = local_memory[plan.name]
        signature = (
            local.shape,
            local.strides,
            local.dtype,
            remote.shape,
            remote.strides,
            remote.dtype,
            plan.local_heads,
            heads,
        )
        if signature not in grids:
            try:
                grids[signature] = RunGrid.of(
                    replace(local, address=0), replace(remote, address=0), plan.local_heads, heads
                )
            except ValueError as exc:
                raise RemoteTransferError(
                    f"pull {spec.request_id!r}: {exc}", code=ErrorCode.LAYOUT_MISMATCH
                ) from exc
        groups.setdefault(signature, []).append((local, remote))
    touching = False
    for layers in groups.values():
        for (local_a, remote_a), (local_b, remote_b) in itertools.pairwise(layers):
            if _touch(local_a, local_b) and _touch(remote_a, remote_b):
                touching = True
    assert smallest is not None
    return PullShape(
        tuple(
            _Group(
                grids[signature],
                np.array([pair[0].address for pair in layers], dtype=np.int64),
                np.array([pair[1].address for pair in layers], dtype=np.int64),
                np.array([pair[1].region for pair in layers], dtype=np.int64),
            )
            for signature, layers in groups.items()
        ),
        smallest.shape[0],
        smallest.name,
        touching or len(groups) > 1,
        local_memory,
    )


def _touch(a: LayerMemory, b: LayerMemory) -> bool:
    """Whether ``b``'s memory begins where ``a``'s ends, or the two overlap (a shared buffer)."""
    a_low, a_high = a.extent()
    b_low, b_high = b.extent()
    return a_low <= b_high and b_low <= a_high


def plan_runs(
    keys: RmaKeys,
    spec: PullSpec,
    plans: list[LayerPlan],
    local_memory: Mapping[str, LayerMemory],
    shapes: dict[tuple, PullShape] | None = None,
) -> Runs:
    """The merged runs of ``spec``; `RemoteTransferError` with the tagged mode's codes for
    what the producer's layout cannot serve (checked here: no producer sees the read).

    Layers with the same geometry on both sides (the usual case) share one set of runs computed
    at address 0, shifted by each layer's base addresses: numpy work per pull, not per layer.
    ``shapes`` caches what does not depend on the block ids (checks, grids, bases) per layers
    and heads, so a small pull costs a few numpy operations.
    """
    key = (tuple(plan.name for plan in plans), spec.local_heads, spec.remote_heads)
    shape = None if shapes is None else shapes.get(key)
    if shape is None or shape.local_memory is not local_memory:
        shape = _shape(keys, spec, plans, local_memory)
        if shapes is not None:
            if len(shapes) >= _MAX_SHAPES:
                shapes.clear()
            shapes[key] = shape
    remote_ids = np.asarray(spec.remote_block_ids, dtype=np.int64)
    local_ids = np.asarray(spec.local_block_ids, dtype=np.int64)
    if len(remote_ids) and int(remote_ids.max()) >= shape.blocks:
        raise RemoteTransferError(
            f"pull {spec.request_id!r}: block id {int(remote_ids.max())} out of range for "
            f"layer {shape.smallest!r} with {shape.blocks} blocks on the producer",
            code=ErrorCode.BLOCK_OUT_OF_RANGE,
        )
    parts = []
    for group in shape.groups:
        template = group.grid.runs(local_ids, remote_ids)
        if len(group.local_bases) == 1:
            parts.append(
                Runs(
                    template.local + int(group.local_bases[0]),
                    template.remote + int(group.remote_bases[0]),
                    template.lengths,
                    np.full(len(template), int(group.regions[0]), dtype=np.int64),
                )
            )
            continue
        # Filled by broadcasting: np.tile and np.repeat cost more than the arithmetic here.
        shape2d = (len(group.local_bases), len(template))
        lengths = np.empty(shape2d, dtype=np.int64)
        lengths[:] = template.lengths
        regions = np.empty(shape2d, dtype=np.int64)
        regions[:] = group.regions[:, None]
        parts.append(
            Runs(
                (group.local_bases[:, None] + template.local).reshape(-1),
                (group.remote_bases[:, None] + template.remote).reshape(-1),
                lengths.reshape(-1),
                regions.reshape(-1),
            )
        )
    if not shape.touching:
        return parts[0]
    return concat_runs(parts) if len(parts) > 1 else merge_runs(parts[0])


@dataclass
class ReadCounters:
    """What one-sided reads moved on this consumer, by path: the proof of which path ran.
    Data runs only; the lease-row reads around them are counted apart."""

    direct_reads: int = 0
    direct_bytes: int = 0
    # process_vm_readv calls of the data reads (IOV_MAX iovecs each at most).
    direct_calls: int = 0
    ucx_reads: int = 0
    ucx_bytes: int = 0
    # ucp_get_nbx calls of the data reads (one per run).
    ucx_gets: int = 0
    row_reads: int = 0
    # Pushes: the same, for writes into a consumer's blocks.
    direct_writes: int = 0
    direct_write_bytes: int = 0
    ucx_writes: int = 0
    ucx_write_bytes: int = 0
    ucx_puts: int = 0


class _Channel:
    """Copies runs from the producer and returns once they all landed (or raises)."""

    def __init__(self, counters: ReadCounters) -> None:
        self.counters = counters

    def copy(self, runs: Runs, control: ReadControl, what: str) -> None:
        raise NotImplementedError

    def copy_row(self, row: _LeaseRow, control: ReadControl) -> None:
        """Read the lease row's window (counted apart from the data)."""
        self._copy_row(row, control)
        self.counters.row_reads += 1

    def _copy_row(self, row: _LeaseRow, control: ReadControl) -> None:
        raise NotImplementedError


class _DirectChannel(_Channel):
    """``writer``: the data runs are written into the peer (a push), rows still read."""

    def __init__(
        self, reader: DirectReader, counters: ReadCounters, writer: DirectWriter | None = None
    ) -> None:
        super().__init__(counters)
        self._reader = reader
        self._writer = writer

    def copy(self, runs: Runs, control: ReadControl, what: str) -> None:
        plan = plan_direct(runs.local, runs.remote, runs.lengths)
        if self._writer is not None:
            self._writer.run(plan)
            self.counters.direct_writes += 1
            self.counters.direct_write_bytes += plan.total_bytes
            return
        self._reader.run(plan)
        self.counters.direct_reads += 1
        self.counters.direct_bytes += plan.total_bytes
        self.counters.direct_calls += len(plan.calls)

    def _copy_row(self, row: _LeaseRow, control: ReadControl) -> None:
        self._reader.run(row.direct_plan)


class _CudaIpcChannel(_Channel):
    """GPU memory on one host: the data runs copied through the producer's mapped regions by
    `copy_runs` on a stream of the reader's, synchronised before returning; the lease rows
    (host memory) read by ``rows``, directly or through UCX."""

    def __init__(
        self,
        rows: _Channel,
        remote: list[Span],
        local: list[Span],
        stream: torch.cuda.Stream,
        views: RowViews,
        write: bool = False,
    ) -> None:
        super().__init__(rows.counters)
        self._rows, self._remote, self._local, self._stream = rows, remote, local, stream
        self._views, self._write = views, write

    def copy(self, runs: Runs, control: ReadControl, what: str) -> None:
        # The copy waits for what this thread queued on the device (a push's source blocks).
        self._stream.wait_stream(torch.cuda.current_stream(self._stream.device))
        with torch.cuda.stream(self._stream):
            launched = copy_runs(
                runs.local,
                runs.remote,
                runs.lengths,
                runs.keys,
                self._local,
                self._remote,
                write=self._write,
                views=self._views,
            )
        self._stream.synchronize()
        if self._write:
            self.counters.direct_writes += 1
            self.counters.direct_write_bytes += runs.total_bytes
            return
        self.counters.direct_reads += 1
        self.counters.direct_bytes += runs.total_bytes
        self.counters.direct_calls += launched

    def _copy_row(self, row: _LeaseRow, control: ReadControl) -> None:
        self._rows._copy_row(row, control)


class _UcxChannel(_Channel):
    """``write``: the data runs are put into the peer (a push), rows still read."""

    def __init__(
        self,
        worker: int,
        endpoint: int,
        rkeys: list[int],
        memory: int,
        counters: ReadCounters,
        write: bool = False,
    ) -> None:
        super().__init__(counters)
        self._worker, self._endpoint, self._rkeys, self._memory = worker, endpoint, rkeys, memory
        self._write = write

    def copy(self, runs: Runs, control: ReadControl, what: str) -> None:
        rkeys = self._rkeys
        self._get(
            runs,
            [rkeys[0]] * len(runs) if len(rkeys) == 1 else [rkeys[k] for k in runs.keys.tolist()],
            self._memory,
            control,
            what,
            write=self._write,
        )
        if self._write:
            self.counters.ucx_writes += 1
            self.counters.ucx_write_bytes += runs.total_bytes
            self.counters.ucx_puts += len(runs)
            return
        self.counters.ucx_reads += 1
        self.counters.ucx_bytes += runs.total_bytes
        self.counters.ucx_gets += len(runs)

    def _copy_row(self, row: _LeaseRow, control: ReadControl) -> None:
        runs = row.runs
        rkeys = [self._rkeys[k] for k in runs.keys.tolist()]
        self._get(runs, rkeys, MEMORY_HOST, control, f"lease check of {row.lease_id!r}")

    def _get(
        self,
        runs: Runs,
        rkeys: list[int],
        memory: int,
        control: ReadControl,
        what: str,
        *,
        write: bool = False,
    ) -> None:
        gets = (Puts if write else Gets)(self._worker, self._endpoint, memory)
        try:
            try:
                gets.post_many(
                    runs.local.tolist(), runs.lengths.tolist(), runs.remote.tolist(), rkeys
                )
                gets.flush()
            except UcxStatusError as exc:
                # Posting fails at once where UCX already knows the peer is gone (its TCP
                # lane reset): the same failure as one met while waiting.
                verb = "write" if write else "read"
                raise PeerUnreachable(f"{what}: one-sided {verb} failed: {exc}") from exc
            _wait(gets, control, what)
        except BaseException:
            gets.abandon()
            raise


def _wait(gets: Gets, control: ReadControl, what: str) -> None:
    """Progress until ``gets`` completed, or raise: cancelled, timed out, peer failed, or
    whatever ``control.on_wait`` raises (a dead producer).

    Polls without a pause for `_SPIN_S` (a small read completes within it: no sleep's wake-up
    latency), then sleeps between polls, doubling the nap from `_NAP_S` to `_MAX_NAP_S`: a
    read in flight costs at most `_SPIN_S` of a core, and nothing spins while none is."""
    spin_until = time.perf_counter() + _SPIN_S
    nap = _NAP_S
    while True:
        try:
            if gets.poll():
                return
        except UcxStatusError as exc:
            raise PeerUnreachable(f"{what}: one-sided read failed: {exc}") from exc
        if time.perf_counter() < spin_until:
            continue
        control.check(f"{what} (one-sided read)")
        time.sleep(nap)
        nap = min(nap * 2, _MAX_NAP_S)


class RmaReader:
    """Runs one-sided pulls for one agent (see the module docstring)."""

    def __init__(self, worker: int, nudge: Callable[[], None]) -> None:
        self._worker = worker
        # Wakes the loop thread after this thread progressed the worker (it may have taken
        # the events the loop sleeps on).
        self._nudge = nudge
        self.counters = ReadCounters()
        # The local caches as spans (`_local_spans`), per registration, and the CUDA stream
        # GPU copies run on.
        self._spans: tuple[Mapping[str, LayerMemory], list[Span]] | None = None
        self._stream: torch.cuda.Stream | None = None
        self._views = RowViews()

    def _local_spans(self, local_memory: Mapping[str, LayerMemory]) -> list[Span]:
        """The local layers' memory as byte spans, layers that touch or overlap (one buffer)
        merged into one."""
        if self._spans is not None and self._spans[0] is local_memory:
            return self._spans[1]
        extents = sorted(layer.extent() for layer in local_memory.values())
        merged: list[list[int]] = []
        for low, high in extents:
            if merged and low <= merged[-1][1]:
                merged[-1][1] = max(merged[-1][1], high)
            else:
                merged.append([low, high])
        cuda = any(layer.memory == MEMORY_CUDA for layer in local_memory.values())
        spans = [Span(low, local_bytes(low, high - low, cuda)) for low, high in merged]
        self._spans = (local_memory, spans)
        return spans

    def _ipc_channel(
        self,
        spans: list[Span],
        rows: _Channel,
        local_memory: Mapping[str, LayerMemory],
        write: bool,
    ) -> _CudaIpcChannel:
        local = self._local_spans(local_memory)
        if self._stream is None:
            self._stream = torch.cuda.Stream(local[0].tensor.device)
        return _CudaIpcChannel(rows, spans, local, self._stream, self._views, write)

    def read(
        self,
        rma: RmaPeer,
        endpoint: Callable[[], int | None],
        connect: Callable[[], None],
        spec: PullSpec,
        plans: list[LayerPlan],
        local_memory: Mapping[str, LayerMemory],
        control: ReadControl,
        *,
        write: bool = False,
    ) -> tuple[int, int]:
        """Read ``spec`` into the local layers ``local_memory`` describes; returns (bytes,
        runs). ``endpoint`` gives the live endpoint's handle (None: none yet), ``connect``
        makes one (never called holding ``rma.lock``: the loop thread takes it to close
        endpoints). Any error raised while
        UCX reads were in flight (cancel, timeout, ``on_wait``, a failed read) leaves them to
        the caller, who must reset the endpoint; one raised while the read only waited for its
        turn or a reconnect sets ``control.queued_only`` (nothing of it in flight: no reset)."""
        # ``write`` (a push): the other way round, the local layers' blocks are written into
        # the peer's (``spec``'s remote blocks are the peer's, of the push lease its keys were
        # fetched with), bracketed by the same two checks of the peer's lease row.
        runs = plan_runs(rma.keys, spec, plans, local_memory, rma.shapes)
        row = _LeaseRow.of(rma.keys, spec, plans)
        what = f"{'push' if write else 'pull'} {spec.request_id!r}"
        memory = local_memory[plans[0].name].memory
        direct = rma.direct if memory == MEMORY_HOST else None
        spans = rma.cuda_spans() if memory == MEMORY_CUDA else None
        if spans is not None and rma.row_reader is not None:
            try:
                rows = _DirectChannel(rma.row_reader, self.counters)
                ipc = self._ipc_channel(spans, rows, local_memory, write)
                self._read(ipc, runs, row, control, what, write)
                return runs.total_bytes, len(runs)
            except DirectReadUnavailable:
                rma.no_direct()
            except CudaIpcUnavailable as exc:
                logger.debug("%s goes through UCX: %s", what, exc)
                spans = None
        if direct is not None:
            try:
                channel = _DirectChannel(
                    direct, self.counters, rma.direct_writer if write else None
                )
                self._read(channel, runs, row, control, what, write)
                return runs.total_bytes, len(runs)
            except DirectReadUnavailable:
                rma.no_direct()
        while True:
            # A read waiting here for another read from the producer waits within its own
            # deadline, cancel flag and liveness probe: behind a read held by a partitioned
            # producer, unprobed waiters each failed only after the one before them did.
            while not rma.lock.acquire(timeout=_LOCK_POLL_S):
                try:
                    control.check(f"{what} (queued behind another read from the producer)")
                except BaseException:
                    control.queued_only = True
                    raise
            try:
                ep = endpoint()
                if ep is not None:
                    channel = _UcxChannel(
                        self._worker, ep, rma.ucx_keys(ep), memory, self.counters, write
                    )
                    try:
                        if spans is not None:
                            try:
                                ipc = self._ipc_channel(spans, channel, local_memory, write)
                                self._read(ipc, runs, row, control, what, write)
                                return runs.total_bytes, len(runs)
                            except CudaIpcUnavailable as exc:
                                logger.debug("%s goes through UCX: %s", what, exc)
                        self._read(channel, runs, row, control, what, write)
                    finally:
                        self._nudge()
                    return runs.total_bytes, len(runs)
            finally:
                rma.lock.release()
            try:
                connect()
            except BaseException:
                control.queued_only = True
                raise

    def _read(
        self,
        channel: _Channel,
        runs: Runs,
        row: _LeaseRow | None,
        control: ReadControl,
        what: str,
        write: bool = False,
    ) -> None:
        if row is not None:
            row.wait_held(channel, control)
        channel.copy(runs, control, what)
        if row is not None and not row.held(channel, control):
            if write:
                raise LeaseEndedDuringRead(
                    f"push lease {row.lease_id!r} ended while {what} wrote its blocks: the "
                    "consumer gave them up, and keeps them out of use until this producer "
                    "says its writes stopped"
                )
            raise LeaseEndedDuringRead(
                f"lease {row.lease_id!r} ended while {what} read its blocks one-sided: what "
                "was read may be another request's KV and is not used"
            )


class _LeaseRow:
    """The lease-table window a read checks before and after its data reads."""

    def __init__(
        self,
        token: int,
        prompt: int,
        blocks: int,
        address: int,
        table_key: int,
        needed: int,
        lease_id: str,
    ):
        self.token = token
        self.prompt = prompt
        self.blocks = blocks
        self.needed = needed
        self.lease_id = lease_id
        self.window = np.zeros(WINDOW * ROW_WORDS, dtype=np.int64)
        self.runs = Runs(
            np.array([self.window.ctypes.data], dtype=np.int64),
            np.array([address], dtype=np.int64),
            np.array([self.window.nbytes], dtype=np.int64),
            np.array([table_key], dtype=np.int64),
        )
        self._direct_plan: DirectPlan | None = None

    @property
    def direct_plan(self) -> DirectPlan:
        """The window's read as iovecs, built once for the reads before and after."""
        if self._direct_plan is None:
            self._direct_plan = plan_direct(self.runs.local, self.runs.remote, self.runs.lengths)
        return self._direct_plan

    @classmethod
    def of(cls, keys: RmaKeys, spec: PullSpec, plans: list[LayerPlan]) -> _LeaseRow | None:
        table, lease = keys.table, spec.lease
        if table is None or lease is None:
            return None
        order = {name: i for i, name in enumerate(table.layers)}
        missing = [p.name for p in plans if p.name not in order]
        if missing:
            raise RemoteTransferError(
                f"pull {spec.request_id!r}: the producer's lease table lists no layer "
                f"{missing[0]!r}",
                code=ErrorCode.UNKNOWN_LAYER,
            )
        token = lease_token(lease.lease_id, secret_digest(lease.secret))
        address = table.address + lease_slot(lease.lease_id, table.slots) * ROW_BYTES
        needed = max(order[p.name] for p in plans) + 1
        blocks = 0
        if lease.lease_blocks:
            start = lease.block_offset
            if tuple(spec.remote_block_ids) != lease.lease_blocks[start : start + spec.num_blocks]:
                raise AccessDenied(
                    f"pull {spec.request_id!r}: blocks are not lease {lease.lease_id!r}'s blocks "
                    f"at positions [{start}, {start + spec.num_blocks}) (reordered, repeated, "
                    "shifted or outside it)"
                )
            blocks = blocks_tag(lease.lease_blocks)
        return cls(
            token,
            prompt_tag(lease.prompt_digest),
            blocks,
            address,
            table.region,
            needed,
            lease.lease_id,
        )

    def _read(self, channel: _Channel, control: ReadControl) -> tuple[int, int, int] | None:
        channel.copy_row(self, control)
        return find_row(self.window, self.token)

    def wait_held(self, channel: _Channel, control: ReadControl) -> None:
        """Until the lease row is there with the layers read ready (the grant may lag). A
        read whose liveness hook watches the producer (it raises once the producer is gone
        or no longer holds the request) waits up to its own deadline; others `grant_wait_s`."""
        if control.on_wait is not None:
            give_up = control.deadline
        else:
            give_up = min(control.deadline, time.monotonic() + control.grant_wait_s)
        delay = _ROW_BACKOFF_S[0]
        while True:
            row = self._read(channel, control)
            if row is not None and row[1] and self.prompt and row[1] != self.prompt:
                raise AccessDenied(
                    f"lease {self.lease_id!r} holds the KV of another prompt than the one the "
                    "pull is for (prompt digest mismatch, one-sided check)"
                )
            if row is not None and self.blocks and row[2] != self.blocks:
                raise AccessDenied(
                    f"lease {self.lease_id!r} holds other blocks, or these in another order, "
                    "than the pull was told (block list mismatch, one-sided check)"
                )
            ready = None if row is None else row[0]
            if ready is not None and ready >= self.needed:
                return
            if control.cancelled():
                raise TransferCancelled(f"read of lease {self.lease_id!r} was cancelled")
            if time.monotonic() >= give_up:
                waited = control.timeout_s if control.on_wait is not None else control.grant_wait_s
                if ready is None:
                    raise LeaseNotGranted(
                        f"lease {self.lease_id!r} is not held on the producer (one-sided check "
                        f"of its lease table after {waited} s)"
                    )
                raise AccessDenied(
                    f"lease {self.lease_id!r} has layers still being computed on the producer "
                    f"(one-sided check of its lease table after {waited} s)"
                )
            control.probe()
            time.sleep(delay)
            delay = min(delay * 2, _ROW_BACKOFF_S[1])

    def held(self, channel: _Channel, control: ReadControl) -> bool:
        return self._read(channel, control) is not None
