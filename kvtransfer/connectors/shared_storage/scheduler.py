"""The scheduler half of `SharedStorageConnector`: decides what to save and what to load.

Producer: a finished request with ``do_remote_decode`` keeps its blocks (save borrow); the next
step's metadata tells every worker to write its slice, and the request is freed once all of them
reported it in ``finished_sending``. Consumer: a request with ``do_remote_prefill`` is offered
the saved prompt tokens beyond its local prefix hit (load borrow); the next step's metadata
tells every worker to load them.
"""

from __future__ import annotations

import logging
import shutil
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from kvtransfer.connector.config import KVTransferConfig
from kvtransfer.connector.metadata import KVConnectorHandshakeMetadata, KVRequest, PpTpRank
from kvtransfer.connector.outputs import KVConnectorOutput
from kvtransfer.connector.serving import KVControlEndpoint, KVTransferTotals
from kvtransfer.connectors.shared_storage.metadata import (
    LoadSpec,
    RemotePrefill,
    SaveSpec,
    SharedStorageConnectorMetadata,
    SharedStorageHandshakeMetadata,
    wants_remote_decode,
)
from kvtransfer.connectors.shared_storage.storage import SharedStorageConfig

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class EngineLayout:
    """This engine's TP x PP split and block size, learned from the workers' handshake
    metadata."""

    tp_size: int
    pp_size: int
    block_size: int


def layout_from_handshake(
    engine_id: str, metadata: Mapping[PpTpRank, KVConnectorHandshakeMetadata]
) -> EngineLayout:
    """The split the ``(pp_rank, tp_rank)`` keys describe; raises `ValueError` unless every rank
    of the grid published consistent metadata of this connector."""
    if not metadata:
        raise ValueError("no worker published handshake metadata")
    tp_size = 1 + max(tp for _, tp in metadata)
    pp_size = 1 + max(pp for pp, _ in metadata)
    missing = [(p, t) for p in range(pp_size) for t in range(tp_size) if (p, t) not in metadata]
    if missing:
        raise ValueError(f"no handshake metadata from (pp_rank, tp_rank) {missing}")
    block_sizes = set()
    for (pp, tp), md in sorted(metadata.items()):
        if not isinstance(md, SharedStorageHandshakeMetadata):
            raise ValueError(
                f"worker (pp_rank, tp_rank)=({pp}, {tp}) published {type(md).__name__}, "
                "not SharedStorageHandshakeMetadata"
            )
        expected = pp * tp_size + tp
        if md.global_rank != expected:
            raise ValueError(
                f"worker (pp_rank, tp_rank)=({pp}, {tp}) reports global rank {md.global_rank}, "
                f"expected {expected} for TP size {tp_size}"
            )
        if md.engine_id != engine_id:
            raise ValueError(
                f"worker (pp_rank, tp_rank)=({pp}, {tp}) belongs to engine {md.engine_id!r}, "
                f"not {engine_id!r}"
            )
        block_sizes.add(md.block_size)
    if len(block_sizes) > 1:
        raise ValueError(f"workers disagree on block_size: {sorted(block_sizes)}")
    return EngineLayout(tp_size=tp_size, pp_size=pp_size, block_size=block_sizes.pop())


class SharedStorageScheduler:
    def __init__(self, config: KVTransferConfig, storage: SharedStorageConfig) -> None:
        self._config = config
        self._storage = storage
        self._layout: EngineLayout | None = None
        self._layout_error = "no handshake metadata received from the workers yet"
        # Answer of the latest get_num_new_matched_tokens, until update_state_after_alloc.
        self._matched: dict[str, tuple[RemotePrefill, int]] = {}
        # Requests whose load was scheduled once: a preempted one recomputes instead.
        self._consumed: set[str] = set()
        # Loads not yet reported by every worker: request id -> (producer directory, blocks).
        self._loading: dict[str, tuple[str, int]] = {}
        # Saves not yet reported by every worker: request id -> blocks.
        self._saving: dict[str, int] = {}
        self._totals = KVTransferTotals()
        # Loads of requests that finished (aborted) before their load did.
        self._abandoned: set[str] = set()
        self._saves: list[SaveSpec] = []
        self._loads: list[LoadSpec] = []

    @property
    def layout(self) -> EngineLayout | None:
        return self._layout

    def set_handshake(self, metadata: Mapping[PpTpRank, KVConnectorHandshakeMetadata]) -> None:
        # Not raising keeps an engine without transfers usable; every hook that needs the
        # layout raises this message instead, failing just that request.
        try:
            self._layout = layout_from_handshake(self._config.engine_id, metadata)
        except ValueError as exc:
            self._layout = None
            self._layout_error = f"unusable handshake metadata: {exc}"

    def control_endpoint(self) -> KVControlEndpoint | None:
        return None  # files, not a handshake: nothing for a host to serve

    def transfer_totals(self) -> KVTransferTotals:
        """Blocks of requests whose save or load every worker ended (a failed save counts:
        the workers report it ended, not how); bytes the workers wrote or read."""
        return self._totals

    def _require_layout(self) -> EngineLayout:
        if self._layout is None:
            raise RuntimeError(f"SharedStorageConnector: {self._layout_error}")
        return self._layout

    # ------------------------------------------------------------------ consumer

    def release_kv(self, kv_transfer_params: Mapping[str, Any]) -> bool:
        # Files hold the KV, not blocks: there is nothing held to give back early.
        return False

    def validate_kv_transfer_params(self, params: Mapping[str, Any] | None) -> None:
        if self._config.is_kv_consumer:
            RemotePrefill.parse(params)

    def get_num_new_matched_tokens(
        self, request: KVRequest, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        rid = request.request_id
        self._matched.pop(rid, None)
        if not self._config.is_kv_consumer:
            return 0, False
        remote = RemotePrefill.parse(request.kv_transfer_params)
        if remote is None or rid in self._consumed:
            return 0, False
        self._require_layout()
        available = min(remote.remote_num_tokens, len(request.prompt_token_ids))
        count = available - num_computed_tokens
        if count <= 0:
            return 0, False
        self._matched[rid] = (remote, num_computed_tokens)
        return count, True

    def update_state_after_alloc(
        self, request: KVRequest, block_ids: Sequence[int], num_external_tokens: int
    ) -> None:
        matched = self._matched.pop(request.request_id, None)
        if matched is None or num_external_tokens == 0:
            return
        remote, start = matched
        rid = request.request_id
        directory = str(
            self._storage.request_dir(remote.remote_engine_id, remote.remote_request_id)
        )
        end = start + num_external_tokens
        block_size = self._require_layout().block_size
        self._loads.append(
            LoadSpec(
                req_id=rid,
                directory=directory,
                remote_tp_size=remote.tp_size,
                remote_pp_size=remote.pp_size,
                block_ids=tuple(block_ids),
                start_token=start,
                token_ids=tuple(request.prompt_token_ids[:end]),
            )
        )
        self._consumed.add(rid)
        num_blocks = -(-end // block_size) - start // block_size
        self._loading[rid] = (directory, num_blocks)

    def update_connector_output(self, output: KVConnectorOutput) -> None:
        stats = output.kv_connector_stats.reduce() if output.kv_connector_stats else {}
        self._count(
            bytes_saved=int(stats.get("bytes_saved", 0)),
            bytes_received=int(stats.get("bytes_loaded", 0)),
        )
        for rid in output.finished_sending or ():
            saved = self._saving.pop(rid, None)
            if saved is not None:
                self._count(blocks_saved=saved)
        failed = output.failed_recving or set()
        for rid in output.finished_recving or ():
            entry = self._loading.pop(rid, None)
            abandoned = rid in self._abandoned
            self._abandoned.discard(rid)
            if entry is None:
                continue
            directory, num_blocks = entry
            if rid in failed:
                self._count(loads_failed=1)
                continue
            # Read even if its request was aborted meanwhile.
            self._count(blocks_received=num_blocks)
            if abandoned:
                continue
            if self._storage.delete_after_load:
                # Every worker read its slice; nobody else is known to need the files.
                shutil.rmtree(directory, ignore_errors=True)

    def _count(self, **increments: int) -> None:
        if any(increments.values()):
            self._totals = self._totals + KVTransferTotals(**increments)

    # ------------------------------------------------------------------ producer

    def take_early_kv_transfer_params(self) -> dict[str, dict[str, Any]]:
        return {}  # files are written as the request finishes: nothing to read before

    def set_completion_callback(self, callback: Callable[[], None]) -> bool:
        # Nothing arrives between steps on this side: no reason to be polled.
        return True

    def request_finished(
        self, request: KVRequest, block_ids: Sequence[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        rid = request.request_id
        self._matched.pop(rid, None)
        self._consumed.discard(rid)
        if rid in self._loading:
            self._abandoned.add(rid)
        if not self._config.is_kv_producer or not wants_remote_decode(request.kv_transfer_params):
            return False, None
        layout = self._require_layout()
        num_tokens = _num_saved_tokens(request)
        params = {
            "do_remote_prefill": True,
            "remote_engine_id": self._config.engine_id,
            "remote_request_id": rid,
            "remote_num_tokens": num_tokens,
            "tp_size": layout.tp_size,
            "pp_size": layout.pp_size,
        }
        if num_tokens == 0 or not block_ids:
            return False, params
        directory = self._storage.request_dir(self._config.engine_id, rid)
        self._saving[rid] = -(-num_tokens // layout.block_size)
        self._saves.append(
            SaveSpec(
                req_id=rid,
                directory=str(directory),
                block_ids=tuple(block_ids),
                token_ids=tuple(request.prompt_token_ids[:num_tokens]),
            )
        )
        return True, params

    # ------------------------------------------------------------------ per step

    def build_connector_meta(self, scheduler_output: Any) -> SharedStorageConnectorMetadata:
        layout = self._layout
        metadata = SharedStorageConnectorMetadata(
            tp_size=layout.tp_size if layout else None,
            pp_size=layout.pp_size if layout else None,
            saves=tuple(self._saves),
            loads=tuple(self._loads),
        )
        self._saves = []
        self._loads = []
        return metadata


def _num_saved_tokens(request: KVRequest) -> int:
    """Prompt tokens whose KV is in the request's blocks.

    The engine's request counts computed tokens; a request finished mid-prefill (aborted) has
    only part of its prompt computed. Requests without the counter are taken as prefilled.
    """
    prompt_len = len(request.prompt_token_ids)
    computed = getattr(request, "num_computed_tokens", None)
    if computed is None:
        return prompt_len
    return max(0, min(prompt_len, int(computed)))
