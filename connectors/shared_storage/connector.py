"""`SharedStorageConnector`: prefill/decode disaggregation through a directory both engines see.

Configuration::

    KVTransferConfig(
        kv_connector="SharedStorageConnector",
        kv_role="kv_producer",  # or kv_consumer / kv_both
        engine_id="prefill-0",
        kv_connector_extra_config={
            "shared_storage_path": "/mnt/kv",  # required
            "load_timeout_s": 10.0,  # a load waits this long for the producer's files
            "delete_after_load": False,  # remove a request's files once it was loaded
        },
    )

A producer request sent with ``kv_transfer_params={"do_remote_decode": True}`` keeps its blocks
when it finishes until every worker wrote its slice, and comes back with the params a consumer
needs (``do_remote_prefill``, ``remote_engine_id``, ``remote_request_id``,
``remote_num_tokens``, ``tp_size``, ``pp_size``). A consumer request sent with those params
loads the saved prompt KV asynchronously, from however the producer was split.

This class is a facade: the scheduler-role instance delegates to `SharedStorageScheduler`, the
worker-role instance to `SharedStorageWorker`; calling a hook of the other role raises.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from connectors.shared_storage.metadata import (
    SharedStorageConnectorMetadata,
    SharedStorageHandshakeMetadata,
)
from connectors.shared_storage.scheduler import SharedStorageScheduler
from connectors.shared_storage.storage import SharedStorageConfig
from connectors.shared_storage.worker import SharedStorageWorker
from kvtransfer.config import KVTransferConfig
from kvtransfer.connector.base import FinishedIds, KVConnectorBase_V1, TransferResults
from kvtransfer.connector.metadata import (
    KVConnectorHandshakeMetadata,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorStats,
    KVRequest,
    PpTpRank,
)

if TYPE_CHECKING:
    import torch

    from kvtransfer.outputs import KVConnectorOutput

_EMPTY = SharedStorageConnectorMetadata()


class SharedStorageConnector(KVConnectorBase_V1):
    handshake_metadata_cls = SharedStorageHandshakeMetadata

    def __init__(
        self,
        config: KVTransferConfig,
        role: KVConnectorRole,
        kv_cache_config: Any | None = None,
    ) -> None:
        super().__init__(config, role, kv_cache_config)
        if config.kv_role is None:
            raise ValueError(
                "SharedStorageConnector needs kv_role: kv_producer, kv_consumer or kv_both"
            )
        storage = SharedStorageConfig.from_transfer_config(config)
        self._scheduler: SharedStorageScheduler | None = None
        self._worker: SharedStorageWorker | None = None
        if self.role is KVConnectorRole.SCHEDULER:
            self._scheduler = SharedStorageScheduler(config, storage)
        else:
            self._worker = SharedStorageWorker(config, storage)

    def _worker_half(self, hook: str) -> SharedStorageWorker:
        if self._worker is None:
            raise RuntimeError(
                f"SharedStorageConnector.{hook} is a worker hook; this instance is the "
                f"{self.role.name} half"
            )
        return self._worker

    def _scheduler_half(self, hook: str) -> SharedStorageScheduler:
        if self._scheduler is None:
            raise RuntimeError(
                f"SharedStorageConnector.{hook} is a scheduler hook; this instance is the "
                f"{self.role.name} half"
            )
        return self._scheduler

    # ------------------------------------------------------------------ worker side

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self._worker_half("register_kv_caches").register_kv_caches(kv_caches)

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        # The engine binds a plain KVConnectorMetadata when the scheduler built none.
        if type(connector_metadata) is not KVConnectorMetadata and not isinstance(
            connector_metadata, SharedStorageConnectorMetadata
        ):
            raise TypeError(
                "SharedStorageConnector expects SharedStorageConnectorMetadata, got "
                f"{type(connector_metadata).__name__}"
            )
        super().bind_connector_metadata(connector_metadata)

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        metadata = self._get_connector_metadata()
        if not isinstance(metadata, SharedStorageConnectorMetadata):
            metadata = _EMPTY
        self._worker_half("start_load_kv").start_load_kv(metadata)

    # Whole requests are loaded before they are scheduled and saved after they finished, so
    # nothing happens per layer: wait_for_layer_load, save_kv_layer and wait_for_save keep
    # the base class's no-ops.

    def get_finished(self, finished_req_ids: set[str]) -> FinishedIds:
        # A failed receive is a finished one; its blocks still go to the load-error list.
        sending, recving, _ = self.get_transfer_results(finished_req_ids)
        return sending, recving

    def get_transfer_results(self, finished_req_ids: set[str]) -> TransferResults:
        return self._worker_half("get_transfer_results").transfer_results(finished_req_ids)

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self._worker_half("get_block_ids_with_load_errors").block_ids_with_load_errors()

    def get_handshake_metadata(self) -> KVConnectorHandshakeMetadata | None:
        return self._worker_half("get_handshake_metadata").handshake_metadata()

    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        return self._worker_half("get_kv_connector_stats").stats()

    def shutdown(self) -> None:
        if self._worker is not None:
            self._worker.shutdown()

    # --------------------------------------------------------------- scheduler side

    def get_num_new_matched_tokens(
        self, request: KVRequest, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        half = self._scheduler_half("get_num_new_matched_tokens")
        return half.get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(
        self, request: KVRequest, block_ids: Sequence[int], num_external_tokens: int
    ) -> None:
        half = self._scheduler_half("update_state_after_alloc")
        half.update_state_after_alloc(request, block_ids, num_external_tokens)

    def build_connector_meta(self, scheduler_output: Any) -> KVConnectorMetadata:
        return self._scheduler_half("build_connector_meta").build_connector_meta(scheduler_output)

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        self._scheduler_half("update_connector_output").update_connector_output(connector_output)

    def request_finished(
        self, request: KVRequest, block_ids: Sequence[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        return self._scheduler_half("request_finished").request_finished(request, block_ids)

    def set_xfer_handshake_metadata(
        self, metadata: dict[int, KVConnectorHandshakeMetadata]
    ) -> None:
        self.set_xfer_handshake_metadata_pp_aware({(0, tp): md for tp, md in metadata.items()})

    def set_xfer_handshake_metadata_pp_aware(
        self, metadata: Mapping[PpTpRank, KVConnectorHandshakeMetadata]
    ) -> None:
        """Learn this engine's TP x PP split from its own workers (PP supported)."""
        self._scheduler_half("set_xfer_handshake_metadata_pp_aware").set_handshake(metadata)
