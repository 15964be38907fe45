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

This class is a facade (`RoleSplitConnector`): the scheduler-role instance delegates to
`UcxScheduler`, the worker-role instance to `UcxWorker`; calling a hook of the other role raises.
The scheduler half serves every ``(pp_rank, tp_rank)`` worker's handshake payload (PP supported).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from kvtransfer.connector.base import SupportsHMA
from kvtransfer.connector.config import KVTransferConfig
from kvtransfer.connector.kv_groups import BlockIds, as_block_ids
from kvtransfer.connector.metadata import KVCacheLayout, KVConnectorRole, KVRequest
from kvtransfer.connector.split import RoleSplitConnector
from kvtransfer.connectors.ucx.config import UcxConfig
from kvtransfer.connectors.ucx.metadata import UcxConnectorMetadata, UcxHandshakeMetadata
from kvtransfer.connectors.ucx.scheduler import UcxScheduler
from kvtransfer.connectors.ucx.worker import UcxWorker

if TYPE_CHECKING:
    import torch


class UcxConnector(RoleSplitConnector[UcxScheduler, UcxWorker], SupportsHMA):
    connector_name = "UcxConnector"
    metadata_cls = UcxConnectorMetadata
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
        self._num_groups = 1 if kv_cache_config is None else kv_cache_config.num_groups
        ucx = UcxConfig.from_transfer_config(config)
        self._build_half(
            lambda: UcxScheduler(config, ucx, kv_cache_config),
            lambda: UcxWorker(config, ucx, kv_cache_config),
        )

    # Scheduler hooks: one block list per KV cache group inside (a flat list is one group).

    def update_state_after_alloc(
        self, request: KVRequest, block_ids: Sequence[Any], num_external_tokens: int
    ) -> None:
        half = self._scheduler_half("update_state_after_alloc")
        groups = as_block_ids(block_ids, self._num_groups)
        half.update_state_after_alloc(request, groups, num_external_tokens)

    def request_finished(
        self, request: KVRequest, block_ids: Sequence[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        return self.request_finished_all_groups(request, as_block_ids(block_ids, 1))

    def request_finished_all_groups(
        self, request: KVRequest, block_ids: BlockIds
    ) -> tuple[bool, dict[str, Any] | None]:
        half = self._scheduler_half("request_finished")
        return half.request_finished(request, as_block_ids(block_ids, self._num_groups))

    @classmethod
    def supports_sleep_mode(cls, kv_transfer_config: KVTransferConfig) -> bool:
        # The agent is closed on unregister and a new one registers the caches on restore.
        return True

    def unregister_kv_caches(self) -> None:
        self._worker_half("unregister_kv_caches").unregister_kv_caches()

    def restore_kv_caches(self) -> None:
        self._worker_half("restore_kv_caches").restore_kv_caches()

    def save_kv_layer(
        self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any
    ) -> None:
        # Pull-based: nothing is sent; a layer computed for a streaming lease becomes servable.
        self._worker_half("save_kv_layer").save_kv_layer(layer_name)

    def shutdown(self) -> None:
        super().shutdown()
        if self._scheduler is not None:
            self._scheduler.shutdown()
