"""What a host reads from a connector (`get_control_endpoint`, `get_transfer_totals`): the base
defaults, `RoleSplitConnector` forwarding, `MultiConnector` combination; and the Multi's
``kv_transfer_params`` namespacing and load fallback, with scripted children."""

from __future__ import annotations

import pytest
from multi_children import multi

from kvtransfer import KVConnectorBase_V1, KVConnectorRole, KVTransferConfig
from kvtransfer.connector.metadata import KVConnectorStats
from kvtransfer.connector.outputs import KVConnectorOutput
from kvtransfer.connector.serving import KVTransferTotals
from kvtransfer.connectors.multi import (
    CHILD_PARAMS_KEY,
    MultiConnector,
    MultiKVConnectorStats,
)
from kvtransfer.connectors.shared_storage import SharedStorageConnector
from kvtransfer.connectors.ucx import UcxConnector
from kvtransfer.testing import make_request

pytestmark = pytest.mark.unit

SLOT_B = "1:ScriptedConnector"


def child(name: str, **script) -> dict:
    return {
        "kv_connector": "ScriptedConnector",
        "kv_connector_module_path": "multi_children",
        "kv_connector_extra_config": {"name": name, **script},
    }


# ---------------------------------------------------------------- defaults and forwarding


def test_the_base_class_serves_nothing_and_counts_nothing():
    for role in KVConnectorRole:
        base = KVConnectorBase_V1(KVTransferConfig(), role)
        assert base.get_control_endpoint() is None
        assert base.get_transfer_totals() is None


def test_totals_add_field_by_field_and_sum_skips_none():
    a = KVTransferTotals(blocks_sent=1, bytes_sent=10, handshakes=1, handshake_s=0.5)
    b = KVTransferTotals(blocks_sent=2, blocks_saved=3, loads_failed=1, handshake_s=0.25)
    assert a + b == KVTransferTotals(
        blocks_sent=3, bytes_sent=10, blocks_saved=3, loads_failed=1, handshakes=1, handshake_s=0.75
    )
    assert KVTransferTotals.sum([None, a, None, b]) == a + b
    assert KVTransferTotals.sum([None, None]) is None
    assert KVTransferTotals.sum([]) is None


def test_role_split_connectors_answer_from_the_scheduler_half(tmp_path):
    storage = KVTransferConfig(
        kv_connector="SharedStorageConnector",
        kv_role="kv_both",
        kv_connector_extra_config={"shared_storage_path": str(tmp_path)},
    )
    ucx = KVTransferConfig(kv_connector="UcxConnector", kv_role="kv_both")
    for cls, config in ((SharedStorageConnector, storage), (UcxConnector, ucx)):
        scheduler = cls(config, KVConnectorRole.SCHEDULER)
        # Nothing published yet: no endpoint; counting from zero.
        assert scheduler.get_control_endpoint() is None
        assert scheduler.get_transfer_totals() == KVTransferTotals()
        scheduler.shutdown()
        # Observing hooks: a worker-role instance answers None instead of raising.
        worker = cls(config, KVConnectorRole.WORKER)
        assert worker.get_control_endpoint() is None
        assert worker.get_transfer_totals() is None
        worker.shutdown()


def test_multi_serves_the_first_childs_endpoint_and_sums_totals():
    m = multi(
        child("a", totals={"blocks_sent": 2, "handshakes": 1}),
        child("b", endpoint="127.0.0.1:1"),
        child("c", endpoint="127.0.0.1:2", totals={"blocks_sent": 3, "blocks_saved": 5}),
    )
    endpoint = m.get_control_endpoint()
    assert endpoint is not None and endpoint.address == "127.0.0.1:1"
    assert endpoint.book.engine_id == "b"
    assert m.get_transfer_totals() == KVTransferTotals(blocks_sent=5, blocks_saved=5, handshakes=1)
    assert multi(child("a"), child("b")).get_control_endpoint() is None
    assert multi(child("a"), child("b")).get_transfer_totals() is None


def test_each_child_sees_its_own_stats():
    m = multi(child("a"), child("b"))
    stats = MultiKVConnectorStats(data={"0:ScriptedConnector": {"bytes": 3}, SLOT_B: {"n": 1}})
    m.update_connector_output(KVConnectorOutput(kv_connector_stats=stats))
    a, b = m.connectors
    assert a.outputs[-1].kv_connector_stats == KVConnectorStats(data={"bytes": 3})
    assert b.outputs[-1].kv_connector_stats == KVConnectorStats(data={"n": 1})
    only_a = MultiKVConnectorStats(data={"0:ScriptedConnector": {"bytes": 1}})
    m.update_connector_output(KVConnectorOutput(kv_connector_stats=only_a))
    assert b.outputs[-1].kv_connector_stats is None


# ---------------------------------------------------------------- params namespacing


def test_shared_params_reach_every_child_and_namespaced_ones_only_their_owner():
    m = multi(child("a"), child("b", releases=True))
    a, b = m.connectors
    shared = {"do_remote_decode": True}
    m.validate_kv_transfer_params(shared)
    assert a.seen_params[-1][1] == b.seen_params[-1][1] == shared
    namespaced = {"x": 1, CHILD_PARAMS_KEY: {SLOT_B: {"y": 2}}}
    m.validate_kv_transfer_params(namespaced)
    assert a.seen_params[-1][1] == {"x": 1}
    assert b.seen_params[-1][1] == {"y": 2}
    # The request each child gets carries its own params; the rest is the engine's request.
    request = make_request("r", 8, namespaced)
    m.get_num_new_matched_tokens(request, 0)
    assert a.seen_params[-1] == ("get_num_new_matched_tokens", {"x": 1})
    assert b.seen_params[-1] == ("get_num_new_matched_tokens", {"y": 2})
    # release_kv asks only children with params; any release counts.
    assert m.release_kv({CHILD_PARAMS_KEY: {SLOT_B: {"y": 2}}}) is True
    assert a.seen_params[-1][0] != "release_kv"
    # A child whose slot is absent sees None.
    m.validate_kv_transfer_params({"x": 1, CHILD_PARAMS_KEY: {}})
    assert b.seen_params[-1][1] is None


@pytest.mark.parametrize(
    ("params", "message"),
    [
        ({CHILD_PARAMS_KEY: []}, f"kv_transfer_params.{CHILD_PARAMS_KEY} must be an object"),
        (
            {CHILD_PARAMS_KEY: {SLOT_B: 3}},
            f"kv_transfer_params.{CHILD_PARAMS_KEY}.{SLOT_B} must be an object",
        ),
    ],
)
def test_malformed_namespaced_params_are_rejected_naming_the_key(params, message):
    with pytest.raises(ValueError, match=message):
        multi(child("a"), child("b")).validate_kv_transfer_params(params)


def test_early_params_follow_the_first_child():
    m = multi(child("a"), child("b"))
    a, b = m.connectors
    a.take_early_kv_transfer_params = lambda: {"r1": {"x": 1}}
    b.take_early_kv_transfer_params = lambda: {"r1": {"y": 2}, "r2": {"y": 3}}
    assert m.take_early_kv_transfer_params() == {
        "r1": {"x": 1, CHILD_PARAMS_KEY: {SLOT_B: {"y": 2}}}
    }


# ---------------------------------------------------------------- load fallback


def _admit(m: MultiConnector, rid: str, blocks=(4, 5, 6)):
    request = make_request(rid, 40)
    assert m.get_num_new_matched_tokens(request, 0) == (40, True)
    m.update_state_after_alloc(request, list(blocks), 40)
    return request


def _failed(rid: str, blocks=frozenset({5})) -> KVConnectorOutput:
    return KVConnectorOutput(
        finished_recving={rid},
        failed_recving={rid},
        invalid_block_ids=set(blocks),
        load_failure_reasons={rid: "producer gone"},
    )


def test_a_failed_load_is_loaded_again_by_the_next_child_into_the_same_blocks():
    m = multi(
        child("a", hit_tokens=40, load_async=True),
        child("b", hit_tokens=40, load_async=True),
    )
    woken = []
    m.set_completion_callback(lambda: woken.append(1))
    _admit(m, "r")
    a, b = m.connectors
    assert ("update_state_after_alloc", ("r", (4, 5, 6))) in a.calls
    assert ("update_state_after_alloc", ("r", ())) in b.calls

    output = _failed("r")
    m.update_connector_output(output)
    # The child that failed learned it; the engine sees nothing, the blocks stay lent.
    assert a.outputs[-1].failed_recving == {"r"}
    assert output == KVConnectorOutput()
    assert b.calls[-1] == ("update_state_after_alloc", ("r", (4, 5, 6)))
    assert woken

    # The second load's outcome is the one the engine gets.
    done = KVConnectorOutput(finished_recving={"r"})
    m.update_connector_output(done)
    assert done.finished_recving == {"r"} and done.failed_recving is None


def test_the_last_childs_failure_reaches_the_engine_with_its_blocks():
    m = multi(
        child("a", hit_tokens=40, load_async=True),
        child("b", hit_tokens=40, load_async=True),
    )
    _admit(m, "r")
    m.update_connector_output(_failed("r"))
    # The invalid block of the failing fallback is held back until that load ends.
    early_error = KVConnectorOutput(invalid_block_ids={6, 99})
    m.update_connector_output(early_error)
    assert early_error.invalid_block_ids == {99}
    last = _failed("r", blocks={4})
    m.update_connector_output(last)
    assert last.finished_recving == last.failed_recving == {"r"}
    assert last.invalid_block_ids == {4, 6}
    assert last.load_failure_reasons == {"r": "producer gone"}


@pytest.mark.parametrize(
    ("second", "aborted"),
    [
        ({"hit_tokens": 40, "load_async": True}, True),  # the request is gone: no retry
        ({"hit_tokens": 30, "load_async": True}, False),  # fewer tokens than the first
        ({"hit_tokens": 40, "load_async": False}, False),  # not asynchronous
        ({}, False),  # no hit at all
    ],
)
def test_no_fallback_passes_the_failure_through_untouched(second, aborted):
    m = multi(child("a", hit_tokens=40, load_async=True), child("b", **second))
    request = _admit(m, "r")
    if aborted:
        m.request_finished(request, [4, 5, 6])
    output = _failed("r")
    m.update_connector_output(output)
    assert output.finished_recving == output.failed_recving == {"r"}
    assert output.invalid_block_ids == {5}
    assert output.load_failure_reasons == {"r": "producer gone"}
    _, b = m.connectors
    assert b.calls.count(("update_state_after_alloc", ("r", (4, 5, 6)))) == 0


def test_a_request_loaded_once_is_not_loaded_again_after_preemption():
    m = multi(
        child("a", hit_tokens=40, load_async=True),
        child("b", hit_tokens=40, load_async=True),
    )
    request = _admit(m, "r")
    m.update_connector_output(KVConnectorOutput(finished_recving={"r"}))
    # Preempted and admitted again: it recomputes, whichever child still reports a hit.
    assert m.get_num_new_matched_tokens(request, 0) == (0, False)
    m.update_state_after_alloc(request, [7, 8, 9], 0)
    m.request_finished(request, [7, 8, 9])
    assert m.get_num_new_matched_tokens(make_request("r", 40), 0) == (40, True)
