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

This class is a facade (`RoleSplitConnector`): the scheduler-role instance delegates to
`SharedStorageScheduler`, the worker-role instance to `SharedStorageWorker`; calling a hook of the
other role raises. The scheduler half learns this engine's TP x PP split from its own workers'
handshake metadata (PP supported).
"""

from __future__ import annotations

from typing import Any

from kvtransfer.connector.config import KVTransferConfig
from kvtransfer.connector.metadata import KVCacheLayout, KVConnectorRole
from kvtransfer.connector.split import RoleSplitConnector
from kvtransfer.connectors.shared_storage.metadata import (
    SharedStorageConnectorMetadata,
    SharedStorageHandshakeMetadata,
)
from kvtransfer.connectors.shared_storage.scheduler import SharedStorageScheduler
from kvtransfer.connectors.shared_storage.storage import SharedStorageConfig
from kvtransfer.connectors.shared_storage.worker import SharedStorageWorker


class SharedStorageConnector(RoleSplitConnector[SharedStorageScheduler, SharedStorageWorker]):
    connector_name = "SharedStorageConnector"
    metadata_cls = SharedStorageConnectorMetadata
    handshake_metadata_cls = SharedStorageHandshakeMetadata

    @classmethod
    def supports_sleep_mode(cls, kv_transfer_config: KVTransferConfig) -> bool:
        # Nothing is registered: saves and loads copy through the tensors themselves, and the
        # engine drains them before it sleeps.
        return True

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
        self._build_half(
            lambda: SharedStorageScheduler(config, storage),
            lambda: SharedStorageWorker(
                config,
                storage,
                layout=kv_cache_config if isinstance(kv_cache_config, KVCacheLayout) else None,
            ),
        )
