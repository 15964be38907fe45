"""`RecordingConnector`: moves nothing, remembers every hook call in order.

Load it with ``{"kv_connector": "RecordingConnector", "kv_connector_module_path":
"kvtransfer.testing.recording"}``. Tests use it to check *when* the engine calls each hook (for
example that drafter layers are saved before `wait_for_save`). With
``kv_connector_extra_config={"record_dir": DIR}`` every instance writes its calls to
``DIR/<role>-<pid>-<n>.json`` on `shutdown`, so a test can inspect instances that lived in
worker processes.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from kvtransfer.connector.base import FinishedIds, KVConnectorBase_V1
from kvtransfer.connector.metadata import (
    KVConnectorHandshakeMetadata,
    KVConnectorMetadata,
    KVConnectorRole,
    KVRequest,
    PpTpRank,
)


class RecordingHandshakeMetadata(KVConnectorHandshakeMetadata):
    engine_id: str
    layer_names: tuple[str, ...] = ()


class RecordingConnector(KVConnectorBase_V1):
    handshake_metadata_cls = RecordingHandshakeMetadata

    def __init__(
        self, config: Any, role: KVConnectorRole, kv_cache_config: Any | None = None
    ) -> None:
        super().__init__(config, role, kv_cache_config)
        self.calls: list[tuple[str, Any]] = []
        self.layer_names: tuple[str, ...] = ()
        self.handshake_metadata: dict[PpTpRank, KVConnectorHandshakeMetadata] = {}

    def _record(self, hook: str, detail: Any = None) -> None:
        self.calls.append((hook, detail))

    def hooks_called(self) -> list[str]:
        return [hook for hook, _ in self.calls]

    def register_kv_caches(self, kv_caches: dict[str, Any]) -> None:
        self.layer_names = tuple(kv_caches)
        self._record("register_kv_caches", self.layer_names)

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        super().bind_connector_metadata(connector_metadata)
        self._record("bind_connector_metadata")

    def clear_connector_metadata(self) -> None:
        super().clear_connector_metadata()
        self._record("clear_connector_metadata")

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        self._record("start_load_kv")

    def wait_for_layer_load(self, layer_name: str) -> None:
        self._record("wait_for_layer_load", layer_name)

    def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: Any, **kw: Any) -> None:
        self._record("save_kv_layer", layer_name)

    def wait_for_save(self) -> None:
        self._record("wait_for_save")

    def get_finished(self, finished_req_ids: set[str]) -> FinishedIds:
        self._record("get_finished", frozenset(finished_req_ids))
        return None, None

    def get_handshake_metadata(self) -> KVConnectorHandshakeMetadata | None:
        return RecordingHandshakeMetadata(
            engine_id=self.kv_transfer_config.engine_id, layer_names=self.layer_names
        )

    def shutdown(self) -> None:
        self._record("shutdown")
        record_dir = self.kv_transfer_config.get_from_extra_config("record_dir")
        if record_dir is None:
            return
        path = Path(record_dir) / f"{self.role.name.lower()}-{os.getpid()}-{id(self)}.json"
        calls = [[hook, _jsonable(detail)] for hook, detail in self.calls]
        path.write_text(json.dumps({"role": self.role.name, "calls": calls}))

    def get_num_new_matched_tokens(
        self, request: KVRequest, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        self._record("get_num_new_matched_tokens", request.request_id)
        return 0, False

    def update_state_after_alloc(
        self, request: KVRequest, block_ids: Sequence[int], num_external_tokens: int
    ) -> None:
        self._record("update_state_after_alloc", (request.request_id, tuple(block_ids)))

    def build_connector_meta(self, scheduler_output: Any) -> KVConnectorMetadata:
        self._record("build_connector_meta")
        return KVConnectorMetadata()

    def request_finished(
        self, request: KVRequest, block_ids: Sequence[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        self._record("request_finished", request.request_id)
        return False, None

    def set_xfer_handshake_metadata_pp_aware(
        self, metadata: Mapping[PpTpRank, KVConnectorHandshakeMetadata]
    ) -> None:
        self._record("set_xfer_handshake_metadata_pp_aware", tuple(sorted(metadata)))
        self.handshake_metadata = dict(metadata)


def _jsonable(detail: Any) -> Any:
    if isinstance(detail, (frozenset, set, tuple, list)):
        return [
            _jsonable(d)
            for d in (sorted(detail) if isinstance(detail, (set, frozenset)) else detail)
        ]
    if detail is None or isinstance(detail, (str, int, float, bool)):
        return detail
    return repr(detail)
