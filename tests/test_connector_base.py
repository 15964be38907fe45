from __future__ import annotations

import inspect

import pytest

from kvtransfer import (
    KVConnectorBase_V1,
    KVConnectorHandshakeMetadata,
    KVConnectorMetadata,
    KVConnectorRole,
    KVTransferConfig,
    merge_handshake_metadata,
)

pytestmark = pytest.mark.unit

PP_REJECTION = "does not support PP-disaggregated KV transfer"


class _Payload(KVConnectorHandshakeMetadata):
    address: str


class _TpOnlyConnector(KVConnectorBase_V1):
    """Records what the non-PP hook receives; keeps the base PP-aware default."""

    def __init__(self, config, role, kv_cache_config=None):
        super().__init__(config, role, kv_cache_config)
        self.received: dict[int, KVConnectorHandshakeMetadata] | None = None

    def set_xfer_handshake_metadata(self, metadata):
        self.received = metadata


class _NoSuperInit(KVConnectorBase_V1):
    """A subclass that never calls super().__init__: the default must still work."""

    def __init__(self):
        self.received = None

    def set_xfer_handshake_metadata(self, metadata):
        self.received = metadata


def _md(name: str) -> _Payload:
    return _Payload(address=name)


def test_role_values_match_vllm():
    assert KVConnectorRole.SCHEDULER == 0 and KVConnectorRole.WORKER == 1


def test_role_and_config_are_kept():
    config = KVTransferConfig(kv_role="kv_both")
    connector = KVConnectorBase_V1(config, KVConnectorRole.WORKER)
    assert connector.role is KVConnectorRole.WORKER
    assert connector.kv_transfer_config is config


def test_pp_aware_default_forwards_tp_keyed_dict():
    connector = _TpOnlyConnector(KVTransferConfig(), KVConnectorRole.SCHEDULER)
    connector.set_xfer_handshake_metadata_pp_aware({(0, 0): _md("a"), (0, 1): _md("b")})
    assert connector.received == {0: _md("a"), 1: _md("b")}


def test_pp_aware_default_rejects_pp_ranks_and_forwards_nothing():
    connector = _TpOnlyConnector(KVTransferConfig(), KVConnectorRole.SCHEDULER)
    with pytest.raises(ValueError, match=PP_REJECTION) as info:
        connector.set_xfer_handshake_metadata_pp_aware(
            {(0, 0): _md("a"), (1, 0): _md("b"), (2, 1): _md("c")}
        )
    assert "_TpOnlyConnector" in str(info.value) and "[1, 2]" in str(info.value)
    assert connector.received is None


def test_pp_aware_default_needs_no_instance_state():
    connector = _NoSuperInit()
    connector.set_xfer_handshake_metadata_pp_aware({(0, 3): _md("x")})
    assert connector.received == {3: _md("x")}
    with pytest.raises(ValueError, match=PP_REJECTION):
        _NoSuperInit().set_xfer_handshake_metadata_pp_aware({(1, 0): _md("x")})


def test_base_set_xfer_handshake_metadata_is_a_noop():
    connector = KVConnectorBase_V1(KVTransferConfig(), KVConnectorRole.SCHEDULER)
    connector.set_xfer_handshake_metadata_pp_aware({(0, 0): _md("a")})  # no error


def test_merge_skips_none_and_keeps_pp_tp_keys():
    merged = merge_handshake_metadata(
        [
            {(0, 0): _md("p0t0")},
            None,
            {(0, 1): _md("p0t1")},
            {(1, 0): _md("p1t0"), (1, 1): _md("p1t1")},
        ]
    )
    assert merged == {
        (0, 0): _md("p0t0"),
        (0, 1): _md("p0t1"),
        (1, 0): _md("p1t0"),
        (1, 1): _md("p1t1"),
    }
    assert merge_handshake_metadata([None, None]) == {}


def test_merged_metadata_reaches_pp_aware_hook():
    # The engine's path (seed 003): workers -> merge -> scheduler connector.
    connector = _TpOnlyConnector(KVTransferConfig(), KVConnectorRole.SCHEDULER)
    merged = merge_handshake_metadata([{(0, 0): _md("a")}, None, {(0, 1): _md("b")}])
    connector.set_xfer_handshake_metadata_pp_aware(merged)
    assert connector.received == {0: _md("a"), 1: _md("b")}


def test_merge_rejects_duplicate_ranks():
    with pytest.raises(ValueError, match=r"\(pp_rank, tp_rank\)=\(0, 1\).*worker #1"):
        merge_handshake_metadata([{(0, 1): _md("a")}, {(0, 1): _md("b")}])


@pytest.mark.parametrize("bad_key", [0, (0,), (0, -1), ("0", 0), (True, 0), (0, 0, 0)])
def test_merge_rejects_non_pp_tp_keys(bad_key):
    with pytest.raises(
        ValueError, match=r"must be \(pp_rank, tp_rank\) pairs of non-negative ints"
    ):
        merge_handshake_metadata([{bad_key: _md("a")}])


def test_handshake_metadata_round_trip_and_bad_payload():
    md = _md("10.0.0.1:5555")
    assert _Payload.decode(md.encode()) == md
    with pytest.raises(ValueError, match="malformed _Payload handshake payload"):
        _Payload.decode(b'{"address": 3}')
    with pytest.raises(ValueError, match="malformed"):
        _Payload.decode(b'{"address": "x", "extra": 1}')
    with pytest.raises(ValueError, match="frozen"):
        md.address = "y"


def test_metadata_binding_cycle():
    connector = KVConnectorBase_V1(KVTransferConfig(), KVConnectorRole.WORKER)
    assert not connector.has_connector_metadata()
    with pytest.raises(RuntimeError, match="no connector metadata bound"):
        connector._get_connector_metadata()
    metadata = KVConnectorMetadata()
    connector.bind_connector_metadata(metadata)
    assert connector.has_connector_metadata()
    assert connector._get_connector_metadata() is metadata
    connector.clear_connector_metadata()
    connector.clear_connector_metadata()
    assert not connector.has_connector_metadata()


def test_base_defaults():
    connector = KVConnectorBase_V1(KVTransferConfig(), KVConnectorRole.WORKER)
    assert connector.get_finished(set()) == (None, None)
    assert connector.get_transfer_results({"r"}) == (None, None, None)
    assert connector.get_block_ids_with_load_errors() == set()
    assert connector.get_handshake_metadata() is None
    assert connector.get_kv_connector_stats() is None
    assert connector.get_finished_count() is None
    assert list(connector.take_events()) == []
    # It will not wake the engine: an idle engine polls it instead.
    assert connector.set_completion_callback(lambda: None) is False
    assert connector.take_early_kv_transfer_params() == {}  # streams nothing
    assert connector.request_finished(object(), [1]) == (False, None)  # type: ignore[arg-type]
    assert connector.get_num_new_matched_tokens(object(), 0) == (0, False)  # type: ignore[arg-type]
    connector.shutdown()
    connector.shutdown()


def test_transfer_results_default_wraps_get_finished():
    class Finishing(KVConnectorBase_V1):
        def get_finished(self, finished_req_ids):
            return {"s"}, {"r"}

    connector = Finishing(KVTransferConfig(), KVConnectorRole.WORKER)
    assert connector.get_transfer_results(set()) == ({"s"}, {"r"}, None)


HOOKS = {
    # worker side
    "register_kv_caches",
    "unregister_kv_caches",
    "restore_kv_caches",
    "bind_connector_metadata",
    "clear_connector_metadata",
    "has_connector_metadata",
    "start_load_kv",
    "wait_for_layer_load",
    "save_kv_layer",
    "wait_for_save",
    "get_finished",
    "get_transfer_results",
    "get_block_ids_with_load_errors",
    "get_handshake_metadata",
    "get_kv_connector_stats",
    "shutdown",
    # scheduler side
    "get_num_new_matched_tokens",
    "update_state_after_alloc",
    "validate_kv_transfer_params",
    "get_load_failure_reasons",
    "set_completion_callback",
    "take_early_kv_transfer_params",
    "release_kv",
    "build_connector_meta",
    "update_connector_output",
    "request_finished",
    "take_events",
    "get_finished_count",
    "set_xfer_handshake_metadata",
    "set_xfer_handshake_metadata_pp_aware",
    # what a host reads
    "get_control_endpoint",
    "get_transfer_totals",
}


def test_every_hook_has_a_contract_docstring():
    hooks = [
        name
        for name, value in vars(KVConnectorBase_V1).items()
        if inspect.isfunction(value) and not name.startswith("_")
    ]
    assert set(hooks) == HOOKS
    undocumented = [h for h in hooks if not (getattr(KVConnectorBase_V1, h).__doc__ or "").strip()]
    assert undocumented == []
