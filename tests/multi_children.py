"""Scriptable child connectors for the MultiConnector tests (loaded via kv_connector_module_path).

Behaviour comes from ``kv_connector_extra_config``; every hook call is recorded.
"""

from __future__ import annotations

from typing import Any

from kvtransfer import KVConnectorBase_V1, KVConnectorHandshakeMetadata, KVConnectorStats
from kvtransfer.testing.recording import RecordingConnector


class ScriptedPayload(KVConnectorHandshakeMetadata):
    child: str
    tp_rank: int = 0


class ScriptedConnector(RecordingConnector):
    handshake_metadata_cls = ScriptedPayload

    def __init__(self, config, role, kv_cache_config=None):
        super().__init__(config, role, kv_cache_config)
        self.script: dict[str, Any] = dict(config.kv_connector_extra_config)
        self.sending: set[str] = set()
        self.recving: set[str] = set()
        self.failed: set[str] = set()
        self.load_errors: set[int] = set()
        self.received_pp_aware: dict | None = None
        self.received_tp: dict | None = None

    @property
    def name(self) -> str:
        return self.script.get("name", "child")

    def get_num_new_matched_tokens(self, request, num_computed_tokens):
        super().get_num_new_matched_tokens(request, num_computed_tokens)
        return self.script.get("hit_tokens", 0), self.script.get("load_async", False)

    def request_finished(self, request, block_ids):
        super().request_finished(request, block_ids)
        return self.script.get("saves", False), self.script.get("params")

    def get_finished(self, finished_req_ids):
        sending, self.sending = self.sending, set()
        recving, self.recving = self.recving, set()
        return sending or None, recving or None

    def get_transfer_results(self, finished_req_ids):
        sending, recving = self.get_finished(finished_req_ids)
        failed, self.failed = self.failed, set()
        return sending, (recving or set()) | failed or None, failed or None

    def get_block_ids_with_load_errors(self):
        errors, self.load_errors = self.load_errors, set()
        return errors

    def get_handshake_metadata(self):
        return ScriptedPayload(child=self.name)

    def get_kv_connector_stats(self):
        return KVConnectorStats(data={"bytes": self.script.get("bytes", 1)})

    def get_finished_count(self):
        return self.script.get("finished_count")

    def set_xfer_handshake_metadata(self, metadata):
        self.received_tp = dict(metadata)

    def shutdown(self):
        super().shutdown()
        if self.script.get("shutdown_raises"):
            raise RuntimeError(f"{self.name} failed to shut down")


class TpOnlyConnector(ScriptedConnector):
    """Keeps the base class's PP-aware default (rejects pp_rank > 0)."""

    set_xfer_handshake_metadata_pp_aware = KVConnectorBase_V1.set_xfer_handshake_metadata_pp_aware


class PpAwareConnector(ScriptedConnector):
    def set_xfer_handshake_metadata_pp_aware(self, metadata):
        self.received_pp_aware = dict(metadata)
