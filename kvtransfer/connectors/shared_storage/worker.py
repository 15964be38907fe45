"""The worker half of `SharedStorageConnector`: writes and reads this worker's KV slice.

Saves: the step that receives a `SaveSpec` gathers the request's blocks out of the paged cache
(cheap; the blocks stay borrowed until the save is reported anyway) and a background thread
writes the file. Loads: a background thread runs `loading.load_request`, which waits (bounded
by ``load_timeout_s``) for the producer's files and copies this worker's layers and heads into
the request's blocks. Neither blocks the step; every save and load is reported exactly once
through `transfer_results` (a failed save too, so its blocks are freed).

A worker learns its ``(pp_rank, tp_rank)`` from its torch.distributed rank (0 in a
single-process engine) and the engine's TP size, which the scheduler half sends with every
step's metadata.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

import torch

from kvtransfer.connector.base import TransferResults
from kvtransfer.connector.completions import CompletionQueue
from kvtransfer.connector.config import KVTransferConfig
from kvtransfer.connector.metadata import KVCacheLayout, KVConnectorStats, canonical_kv_caches
from kvtransfer.connectors.shared_storage.loading import LoadCancelled, block_range, load_request
from kvtransfer.connectors.shared_storage.metadata import (
    LoadSpec,
    SaveSpec,
    SharedStorageConnectorMetadata,
    SharedStorageHandshakeMetadata,
)
from kvtransfer.connectors.shared_storage.storage import (
    FileHeader,
    HeadSlice,
    SharedStorageConfig,
    dtype_name,
    worker_file_name,
    write_worker_file,
)

logger = logging.getLogger(__name__)

_SEND = "send"
_RECV = "recv"


@dataclass(frozen=True)
class WorkerRank:
    pp_rank: int
    tp_rank: int
    pp_size: int
    tp_size: int


@dataclass(frozen=True)
class _Result:
    kind: str  # _SEND or _RECV
    req_id: str
    error: str | None = None
    cancelled: bool = False
    num_bytes: int = 0
    # Loads: the blocks the load writes (reported as load errors when it fails).
    blocks: tuple[int, ...] = ()


@dataclass
class _Job:
    thread: threading.Thread
    cancel: threading.Event


def current_global_rank() -> int:
    """This process's rank in the engine's torch.distributed world; 0 when there is none."""
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_rank()
    return 0


class SharedStorageWorker:
    def __init__(
        self,
        config: KVTransferConfig,
        storage: SharedStorageConfig,
        global_rank: int | None = None,
        layout: KVCacheLayout | None = None,
    ) -> None:
        self._engine_id = config.engine_id
        self._layout = layout
        self._storage = storage
        self._global_rank = global_rank
        self._caches: dict[str, torch.Tensor] = {}
        # Queueing a result wakes the engine (`set_completion_callback`).
        self._results: CompletionQueue[_Result] = CompletionQueue()
        self._jobs: dict[tuple[str, str], _Job] = {}
        self._threads: list[threading.Thread] = []
        self._load_errors: set[int] = set()
        self._failure_reasons: dict[str, str] = {}
        self._stats: dict[str, int] = {}
        self._closed = False

    # ------------------------------------------------------------------ set-up

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        if not kv_caches:
            raise ValueError("SharedStorageConnector: register_kv_caches got no layers")
        kv_caches = canonical_kv_caches(kv_caches, self._layout)
        first = next(iter(kv_caches.values()))
        for name, cache in kv_caches.items():
            if cache.dim() != 5 or cache.shape[1] != 2:
                raise ValueError(
                    f"KV cache {name!r} has shape {tuple(cache.shape)}, expected "
                    "[num_blocks, 2, num_kv_heads, block_size, head_dim]"
                )
            if (cache.shape[0], cache.shape[3], cache.dtype, cache.device) != (
                first.shape[0],
                first.shape[3],
                first.dtype,
                first.device,
            ):
                raise ValueError(
                    f"KV cache {name!r} differs from the others in num_blocks, block_size, "
                    "dtype or device"
                )
        self._caches = dict(kv_caches)
        if self._global_rank is None:
            self._global_rank = current_global_rank()

    @property
    def _first_cache(self) -> torch.Tensor:
        if not self._caches:
            raise RuntimeError("SharedStorageConnector: KV caches are not registered yet")
        return next(iter(self._caches.values()))

    @property
    def block_size(self) -> int:
        return int(self._first_cache.shape[3])

    def handshake_metadata(self) -> SharedStorageHandshakeMetadata | None:
        if not self._caches:
            return None
        first = self._first_cache
        return SharedStorageHandshakeMetadata(
            engine_id=self._engine_id,
            global_rank=self._global_rank or 0,
            layer_names=tuple(self._caches),
            num_kv_heads=tuple(int(c.shape[2]) for c in self._caches.values()),
            head_dim=int(first.shape[4]),
            block_size=int(first.shape[3]),
            num_blocks=int(first.shape[0]),
            dtype=dtype_name(first.dtype),
        )

    def _rank(self, metadata: SharedStorageConnectorMetadata) -> WorkerRank:
        if metadata.tp_size is None or metadata.pp_size is None:
            raise RuntimeError("the step's metadata does not carry the engine's TP/PP size")
        pp_rank, tp_rank = divmod(self._global_rank or 0, metadata.tp_size)
        if pp_rank >= metadata.pp_size:
            raise RuntimeError(
                f"global rank {self._global_rank} does not fit TP {metadata.tp_size} x PP "
                f"{metadata.pp_size}"
            )
        return WorkerRank(pp_rank, tp_rank, metadata.pp_size, metadata.tp_size)

    def _head_slices(self, rank: WorkerRank) -> dict[str, HeadSlice]:
        slices = {}
        for name, cache in self._caches.items():
            n = int(cache.shape[2])
            slices[name] = HeadSlice(rank.tp_rank * n, (rank.tp_rank + 1) * n, n * rank.tp_size)
        return slices

    # ------------------------------------------------------------------ per step

    def start_load_kv(self, metadata: SharedStorageConnectorMetadata) -> None:
        if not metadata.saves and not metadata.loads:
            return
        if self._closed:
            raise RuntimeError("SharedStorageConnector worker is shut down")
        try:
            rank: WorkerRank | None = self._rank(metadata)
            rank_error = ""
        except RuntimeError as exc:
            rank, rank_error = None, str(exc)
        for save in metadata.saves:
            if rank is None:
                self._results.put(_Result(_SEND, save.req_id, error=rank_error))
            else:
                self._start_save(save, rank)
        for load in metadata.loads:
            if rank is None:
                blocks = self._load_blocks(load)
                self._results.put(_Result(_RECV, load.req_id, error=rank_error, blocks=blocks))
            else:
                self._start_load(load, rank)

    def transfer_results(self, finished_req_ids: Iterable[str]) -> TransferResults:
        sending: set[str] = set()
        recving: set[str] = set()
        failed: set[str] = set()
        for result in self._results.drain():
            self._jobs.pop((result.kind, result.req_id), None)
            if result.kind == _SEND:
                # Even a failed save ends the borrow: the consumer's load fails on its own.
                sending.add(result.req_id)
                self._count("num_saves_failed" if result.error else "num_saves", result)
                if result.error:
                    logger.error("saving KV of request %s failed: %s", result.req_id, result.error)
                continue
            recving.add(result.req_id)
            if result.cancelled:
                self._count("num_loads_cancelled", result)
            elif result.error:
                failed.add(result.req_id)
                self._failure_reasons[result.req_id] = str(result.error)
                self._load_errors.update(result.blocks)
                self._count("num_loads_failed", result)
                logger.warning("loading KV of request %s failed: %s", result.req_id, result.error)
            else:
                self._count("num_loads", result)
        # Checked after draining, so a cancelled load reports in a later step at the earliest.
        for req_id in finished_req_ids:
            job = self._jobs.get((_RECV, req_id))
            if job is not None:
                job.cancel.set()
        self._threads = [t for t in self._threads if t.is_alive()]
        return sending or None, recving or None, failed or None

    def block_ids_with_load_errors(self) -> set[int]:
        errors, self._load_errors = self._load_errors, set()
        return errors

    def set_completion_callback(self, callback: Callable[[], None]) -> bool:
        return self._results.set_callback(callback)

    def load_failure_reasons(self) -> dict[str, str]:
        reasons, self._failure_reasons = self._failure_reasons, {}
        return reasons

    def stats(self) -> KVConnectorStats | None:
        if not self._stats:
            return None
        stats, self._stats = self._stats, {}
        return KVConnectorStats(data=stats)

    def _count(self, key: str, result: _Result) -> None:
        self._stats[key] = self._stats.get(key, 0) + 1
        if result.num_bytes:
            direction = "bytes_saved" if result.kind == _SEND else "bytes_loaded"
            self._stats[direction] = self._stats.get(direction, 0) + result.num_bytes

    def shutdown(self) -> None:
        self._closed = True
        for job in self._jobs.values():
            job.cancel.set()
        for thread in self._threads:
            thread.join()
        self._threads = []

    # ------------------------------------------------------------------ jobs

    def _spawn(
        self,
        kind: str,
        req_id: str,
        blocks: tuple[int, ...],
        work: Callable[[threading.Event], int],
    ) -> None:
        cancel = threading.Event()

        def run() -> None:
            try:
                result = _Result(kind, req_id, num_bytes=work(cancel), blocks=blocks)
            except LoadCancelled:
                result = _Result(kind, req_id, cancelled=True, blocks=blocks)
            except Exception as exc:
                result = _Result(kind, req_id, error=f"{type(exc).__name__}: {exc}", blocks=blocks)
            self._results.put(result)

        thread = threading.Thread(
            target=run, name=f"kvtransfer-shared-storage-{kind}-{req_id}", daemon=True
        )
        self._jobs[(kind, req_id)] = _Job(thread, cancel)
        self._threads.append(thread)
        thread.start()

    # ------------------------------------------------------------------ saving

    def _start_save(self, spec: SaveSpec, rank: WorkerRank) -> None:
        try:
            path, header, tensors, token_ids = self._gather(spec, rank)
        except (IndexError, RuntimeError, ValueError) as exc:
            # A save that cannot start must not fail the step; it ends the borrow like any save.
            self._results.put(_Result(_SEND, spec.req_id, error=f"{type(exc).__name__}: {exc}"))
            return

        def work(cancel: threading.Event) -> int:
            return write_worker_file(path, header, tensors, token_ids)

        self._spawn(_SEND, spec.req_id, (), work)

    def _gather(
        self, spec: SaveSpec, rank: WorkerRank
    ) -> tuple[Path, FileHeader, dict[str, torch.Tensor], torch.Tensor]:
        """Copy the request's blocks out of the cache, on the step's thread: the background
        write then reads only private tensors."""
        bs = self.block_size
        num_blocks = -(-spec.num_tokens // bs)
        if num_blocks > len(spec.block_ids):
            raise ValueError(
                f"{spec.num_tokens} tokens need {num_blocks} blocks of {bs}, the request holds "
                f"{len(spec.block_ids)}"
            )
        first = self._first_cache
        index = torch.tensor(spec.block_ids[:num_blocks], dtype=torch.long, device=first.device)
        tensors = {name: cache.index_select(0, index).cpu() for name, cache in self._caches.items()}
        header = FileHeader(
            engine_id=self._engine_id,
            request_id=spec.req_id,
            num_tokens=spec.num_tokens,
            block_size=bs,
            dtype=dtype_name(first.dtype),
            pp_rank=rank.pp_rank,
            tp_rank=rank.tp_rank,
            pp_size=rank.pp_size,
            tp_size=rank.tp_size,
            layers=self._head_slices(rank),
        )
        path = Path(spec.directory) / worker_file_name(rank.pp_rank, rank.tp_rank)
        return path, header, tensors, torch.tensor(spec.token_ids, dtype=torch.long)

    # ------------------------------------------------------------------ loading

    def _start_load(self, spec: LoadSpec, rank: WorkerRank) -> None:
        caches, wanted = self._caches, self._head_slices(rank)
        timeout_s = self._storage.load_timeout_s

        def work(cancel: threading.Event) -> int:
            return load_request(spec, caches, wanted, timeout_s, cancel)

        self._spawn(_RECV, spec.req_id, self._load_blocks(spec), work)

    def _load_blocks(self, spec: LoadSpec) -> tuple[int, ...]:
        """The blocks a load writes (flagged as load errors if it fails)."""
        first, end = block_range(spec, self.block_size)
        return spec.block_ids[first:end]
