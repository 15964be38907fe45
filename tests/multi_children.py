"""Scriptable child connectors for the MultiConnector tests (loaded via kv_connector_module_path).

Behaviour comes from ``kv_connector_extra_config``; every hook call is recorded.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from kvtransfer import (
    KVConnectorBase_V1,
    KVConnectorFactory,
    KVConnectorHandshakeMetadata,
    KVConnectorRole,
    KVConnectorStats,
    KVTransferConfig,
)
from kvtransfer.connector.serving import KVControlEndpoint, KVTransferTotals
from kvtransfer.connectors.multi import MultiConnector
from kvtransfer.testing.recording import RecordingConnector


class ScriptedBook:
    """A handshake source that serves nothing (only its identity matters to these tests)."""

    def __init__(self, engine_id: str) -> None:
        self.engine_id = engine_id
        self.compat_hash = "0" * 64

    def payloads(self, ranks=None):
        return []


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
        # The kv_transfer_params each scheduler hook saw, in call order.
        self.seen_params: list[tuple[str, Any]] = []
        self.outputs: list[Any] = []

    @property
    def name(self) -> str:
        return self.script.get("name", "child")

    def get_num_new_matched_tokens(self, request, num_computed_tokens):
        super().get_num_new_matched_tokens(request, num_computed_tokens)
        self.seen_params.append(("get_num_new_matched_tokens", request.kv_transfer_params))
        return self.script.get("hit_tokens", 0), self.script.get("load_async", False)

    def validate_kv_transfer_params(self, params):
        self.seen_params.append(("validate_kv_transfer_params", params))

    def release_kv(self, kv_transfer_params):
        self.seen_params.append(("release_kv", kv_transfer_params))
        return self.script.get("releases", False)

    def update_connector_output(self, connector_output):
        # A copy: what the child saw then (the Multi edits the engine's output afterwards).
        self.outputs.append(replace(connector_output))

    def request_finished(self, request, block_ids):
        super().request_finished(request, block_ids)
        self.seen_params.append(("request_finished", request.kv_transfer_params))
        return self.script.get("saves", False), self.script.get("params")

    def get_control_endpoint(self):
        address = self.script.get("endpoint")
        return None if address is None else KVControlEndpoint(ScriptedBook(self.name), address)

    def get_transfer_totals(self):
        totals = self.script.get("totals")
        return None if totals is None else KVTransferTotals(**totals)

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


def multi(*children: dict, role=KVConnectorRole.SCHEDULER) -> MultiConnector:
    """A MultiConnector over ``children`` (each a child's config dict), built by the factory."""
    config = KVTransferConfig(
        kv_connector="MultiConnector",
        kv_role="kv_both",
        engine_id="engine-m",
        kv_connector_extra_config={"connectors": list(children)},
    )
    connector = KVConnectorFactory.create_connector(config, role)
    assert isinstance(connector, MultiConnector)
    return connector
