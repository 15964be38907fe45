"""`UcxConnector`: prefill/decode disaggregation over UCX, with gRPC handshakes.

Configuration::

    KVTransferConfig(
        kv_connector="UcxConnector",
        kv_role="kv_producer",  # or kv_consumer / kv_both
        engine_id="prefill-0",
        kv_ip="127.0.0.1",  # where a producer serves its handshake (default 127.0.0.1)
        kv_port=0,  # 0: an ephemeral port (default)
        kv_load_failure_policy="fail",  # or "recompute"
        kv_connector_extra_config={
            "kv_lease_s": 30.0,  # a producer frees blocks nobody pulled after this long
            "transfer_timeout_s": 30.0,  # bound of one request's pulls
            "handshake_timeout_s": 5.0,  # bound of one handshake attempt and UCX connect
            "max_concurrent_loads": 4,  # loader threads per consumer worker
        },
    )

A producer request sent with ``kv_transfer_params={"do_remote_decode": True}`` keeps its blocks
when it finishes and comes back with the params a consumer needs (``do_remote_prefill``,
``remote_engine_id``, ``remote_request_id``, ``remote_block_ids``, ``remote_host``,
``remote_port``, ``remote_generation``, ``tp_size``, ``pp_size``, ``remote_num_tokens``). A
consumer request sent with them pulls the prompt KV beyond its local prefix hit straight into
its paged cache: each consumer worker exactly its layers (from the producer PP ranks holding
them; drafter layers from the last stage), exactly its KV heads (from the producer TP ranks
holding them, replicated heads read once), exactly the missing blocks, whatever TP x PP either
side runs. The producer frees the blocks when the consumer says it is done, or when the lease
runs out.

This class is a facade: the scheduler-role instance delegates to `UcxScheduler`, the
worker-role instance to `UcxWorker`; calling a hook of the other role raises.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from connectors.ucx.config import UcxConfig
from connectors.ucx.metadata import UcxConnectorMetadata, UcxHandshakeMetadata
from connectors.ucx.scheduler import UcxScheduler
from connectors.ucx.worker import UcxWorker
from kvtransfer.config import KVTransferConfig
from kvtransfer.connector.base import FinishedIds, KVConnectorBase_V1, TransferResults
from kvtransfer.connector.metadata import (
    KVCacheLayout,
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

_EMPTY = UcxConnectorMetadata()


class UcxConnector(KVConnectorBase_V1):
    handshake_metadata_cls = UcxHandshakeMetadata

    def __init__(
        self,
        config: KVTransferConfig,
        role: KVConnectorRole,
        kv_cache_config: Any | None = None,
    ) -> None:
        super().__init__(config, role, kv_cache_config)
        if config.kv_role is None:
            raise ValueError("UcxConnector needs kv_role: kv_producer, kv_consumer or kv_both")
        if kv_cache_config is not None and not isinstance(kv_cache_config, KVCacheLayout):
            raise ValueError(
                "UcxConnector expects a KVCacheLayout as kv_cache_config, got "
                f"{type(kv_cache_config).__name__}"
            )
        ucx = UcxConfig.from_transfer_config(config)
        self._scheduler: UcxScheduler | None = None
        self._worker: UcxWorker | None = None
        if self.role is KVConnectorRole.SCHEDULER:
            self._scheduler = UcxScheduler(config, ucx, kv_cache_config)
        else:
            self._worker = UcxWorker(config, ucx, kv_cache_config)

    @property
    def scheduler_half(self) -> UcxScheduler:
        return self._scheduler_half("scheduler_half")

    @property
    def worker_half(self) -> UcxWorker:
        return self._worker_half("worker_half")

    def _worker_half(self, hook: str) -> UcxWorker:
        if self._worker is None:
            raise RuntimeError(
                f"UcxConnector.{hook} is a worker hook; this instance is the {self.role.name} half"
            )
        return self._worker

    def _scheduler_half(self, hook: str) -> UcxScheduler:
        if self._scheduler is None:
            raise RuntimeError(
                f"UcxConnector.{hook} is a scheduler hook; this instance is the "
                f"{self.role.name} half"
            )
        return self._scheduler

    # ------------------------------------------------------------------ worker side

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self._worker_half("register_kv_caches").register_kv_caches(kv_caches)

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        # The engine binds a plain KVConnectorMetadata when the scheduler built none.
        if type(connector_metadata) is not KVConnectorMetadata and not isinstance(
            connector_metadata, UcxConnectorMetadata
        ):
            raise TypeError(
                "UcxConnector expects UcxConnectorMetadata, got "
                f"{type(connector_metadata).__name__}"
            )
        super().bind_connector_metadata(connector_metadata)

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        metadata = self._get_connector_metadata()
        if not isinstance(metadata, UcxConnectorMetadata):
            metadata = _EMPTY
        self._worker_half("start_load_kv").start_load_kv(metadata)

    # Whole requests are loaded before they are scheduled and served from the cache after they
    # finished, so nothing happens per layer: wait_for_layer_load, save_kv_layer and
    # wait_for_save keep the base class's no-ops.

    def get_finished(self, finished_req_ids: set[str]) -> FinishedIds:
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
        if self._scheduler is not None:
            self._scheduler.shutdown()

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
        """Serve every ``(pp_rank, tp_rank)`` worker's payload (PP supported)."""
        self._scheduler_half("set_xfer_handshake_metadata_pp_aware").set_handshake(metadata)
