from __future__ import annotations

import inspect

import pytest
from multi_children import multi

from kvtransfer import (
    KVConnectorBase_V1,
    KVConnectorFactory,
    KVConnectorRole,
    KVTransferConfig,
    KVTransferConfigError,
)
from kvtransfer.connectors.multi import (
    MultiConnector,
    MultiKVConnectorHandshakeMetadata,
    MultiKVConnectorMetadata,
)
from kvtransfer.testing import ContractSchedulerOutput, KVConnectorContract, make_request

pytestmark = pytest.mark.unit

PP_REJECTION = "does not support PP-disaggregated KV transfer"


def child(cls: str = "ScriptedConnector", kv_role: str | None = None, **script) -> dict:
    config = {
        "kv_connector": cls,
        "kv_connector_module_path": "multi_children",
        "kv_connector_extra_config": script,
    }
    return config if kv_role is None else {**config, "kv_role": kv_role}


def test_overrides_every_public_base_hook():
    base_hooks = {
        name
        for name, value in vars(KVConnectorBase_V1).items()
        if inspect.isfunction(value) and not name.startswith("_")
    }
    missing = sorted(h for h in base_hooks if h not in vars(MultiConnector))
    assert missing == []


def test_children_inherit_engine_role_and_policy():
    m = multi(child(name="a"), child(name="b", kv_role="kv_consumer"))
    a, b = m.connectors
    assert a.kv_transfer_config.engine_id == b.kv_transfer_config.engine_id == "engine-m"
    assert a.kv_transfer_config.kv_role == "kv_both"
    assert b.kv_transfer_config.kv_role == "kv_consumer"
    assert all(c.role is KVConnectorRole.SCHEDULER for c in m.connectors)


def test_load_comes_from_the_first_child_with_a_hit():
    m = multi(
        child(name="miss"),
        child(name="hit5", hit_tokens=5, load_async=True),
        child(name="hit7", hit_tokens=7),
    )
    request = make_request("r1")
    assert m.get_num_new_matched_tokens(request, 0) == (5, True)
    m.update_state_after_alloc(request, [4, 5, 6], 5)
    miss, hit5, hit7 = m.connectors
    assert ("update_state_after_alloc", ("r1", (4, 5, 6))) in hit5.calls
    assert ("update_state_after_alloc", ("r1", ())) in miss.calls
    assert ("update_state_after_alloc", ("r1", ())) in hit7.calls


def test_a_child_still_looking_means_ask_again():
    m = multi(child(hit_tokens=4), child(hit_tokens=None))
    assert m.get_num_new_matched_tokens(make_request(), 0) == (None, False)


def test_no_hit_gives_every_child_empty_blocks():
    m = multi(child(name="a"), child(name="b"))
    request = make_request("r2")
    assert m.get_num_new_matched_tokens(request, 0) == (0, False)
    m.update_state_after_alloc(request, [1], 0)
    assert all(("update_state_after_alloc", ("r2", ())) in c.calls for c in m.connectors)


def test_saves_go_to_every_child(kv_caches=None):
    from kvtransfer.testing import make_kv_caches

    worker = multi(child(name="a"), child(name="b"), role=KVConnectorRole.WORKER)
    caches = make_kv_caches(num_layers=2)
    worker.register_kv_caches(caches)
    scheduler = multi(child(name="a"), child(name="b"))
    worker.bind_connector_metadata(scheduler.build_connector_meta(ContractSchedulerOutput()))
    worker.start_load_kv(None)
    for name, tensor in caches.items():
        worker.wait_for_layer_load(name)
        worker.save_kv_layer(name, tensor, None)
    worker.wait_for_save()
    worker.get_finished(set())
    worker.clear_connector_metadata()
    for c in worker.connectors:
        assert c.hooks_called() == [
            "register_kv_caches",
            "bind_connector_metadata",
            "start_load_kv",
            "wait_for_layer_load",
            "save_kv_layer",
            "wait_for_layer_load",
            "save_kv_layer",
            "wait_for_save",
            "clear_connector_metadata",
        ]
    assert not worker.has_connector_metadata()


def test_finished_sending_only_after_the_last_saving_child():
    scheduler = multi(child(name="a", saves=True), child(name="b", saves=True), child(name="c"))
    worker = multi(child(name="a"), child(name="b"), child(name="c"), role=KVConnectorRole.WORKER)
    request = make_request("r3")
    assert scheduler.request_finished(request, [1, 2]) == (True, None)
    metadata = scheduler.build_connector_meta(ContractSchedulerOutput(finished_req_ids={"r3"}))
    assert isinstance(metadata, MultiKVConnectorMetadata)
    assert metadata.extra_async_saves == {"r3": 1}
    assert scheduler.build_connector_meta(ContractSchedulerOutput()).extra_async_saves == {}

    worker.bind_connector_metadata(metadata)
    a, b, _ = worker.connectors
    a.sending.add("r3")
    assert worker.get_finished({"r3"}) == (None, None)  # b still saving
    worker.clear_connector_metadata()
    worker.bind_connector_metadata(scheduler.build_connector_meta(ContractSchedulerOutput()))
    b.sending.add("r3")
    assert worker.get_finished(set()) == ({"r3"}, None)
    # A request saved by one child passes at once.
    b.sending.add("solo")
    assert worker.get_finished(set()) == ({"solo"}, None)


def test_single_saving_child_needs_no_extra_count():
    scheduler = multi(child(name="a", saves=True), child(name="b"))
    assert scheduler.request_finished(make_request("r4"), [1]) == (True, None)
    assert scheduler.build_connector_meta(ContractSchedulerOutput()).extra_async_saves == {}


def test_transfer_results_union_failures_and_load_errors():
    worker = multi(child(name="a"), child(name="b"), role=KVConnectorRole.WORKER)
    a, b = worker.connectors
    a.recving.add("ok")
    b.failed.add("bad")
    a.load_errors |= {3}
    b.load_errors |= {9}
    sending, recving, failed = worker.get_transfer_results(set())
    assert sending is None and recving == {"ok", "bad"} and failed == {"bad"}
    assert worker.get_block_ids_with_load_errors() == {3, 9}
    assert worker.get_block_ids_with_load_errors() == set()


def test_params_are_namespaced_so_children_never_clash():
    m = multi(child(name="a", params={"x": 1}), child("PpAwareConnector", params={"x": 2}))
    assert m.request_finished(make_request(), []) == (
        False,
        {"x": 1, "multi_connector": {"1:PpAwareConnector": {"x": 2}}},
    )
    only_later = multi(child(name="a"), child(name="b", params={"y": 2}))
    assert only_later.request_finished(make_request(), [])[1] == {
        "multi_connector": {"1:ScriptedConnector": {"y": 2}}
    }
    assert multi(child(), child()).request_finished(make_request(), []) == (False, None)


def test_the_reserved_key_from_the_first_child_is_an_error():
    m = multi(child(name="a", params={"multi_connector": {}}), child(name="b"))
    with pytest.raises(ValueError, match="reserves for its other children's params"):
        m.request_finished(make_request(), [])


def test_pp_aware_handshake_goes_to_every_child_with_the_full_dict():
    scheduler = multi(child("PpAwareConnector", name="a"), child("PpAwareConnector", name="b"))
    workers = {
        (pp, tp): multi(
            child("PpAwareConnector", name="a"),
            child("PpAwareConnector", name="b"),
            role=KVConnectorRole.WORKER,
        )
        for pp in range(2)
        for tp in range(2)
    }
    published = {rank: w.get_handshake_metadata() for rank, w in workers.items()}
    assert all(isinstance(md, MultiKVConnectorHandshakeMetadata) for md in published.values())
    scheduler.set_xfer_handshake_metadata_pp_aware(published)
    a, b = scheduler.connectors
    assert set(a.received_pp_aware) == set(b.received_pp_aware) == set(published)
    assert {md.child for md in a.received_pp_aware.values()} == {"a"}
    assert {md.child for md in b.received_pp_aware.values()} == {"b"}
    assert type(next(iter(a.received_pp_aware.values()))).__name__ == "ScriptedPayload"


def test_a_child_without_pp_support_rejects_pp_through_multi():
    scheduler = multi(child("PpAwareConnector", name="a"), child("TpOnlyConnector", name="b"))
    worker = multi(
        child("PpAwareConnector", name="a"),
        child("TpOnlyConnector", name="b"),
        role=KVConnectorRole.WORKER,
    )
    md = worker.get_handshake_metadata()
    with pytest.raises(ValueError, match=f"TpOnlyConnector {PP_REJECTION}"):
        scheduler.set_xfer_handshake_metadata_pp_aware({(0, 0): md, (1, 0): md})
    scheduler.set_xfer_handshake_metadata_pp_aware({(0, 0): md, (0, 1): md})
    _, tp_only = scheduler.connectors
    assert set(tp_only.received_tp) == {0, 1} and tp_only.received_tp[1].child == "b"


def test_stats_keep_children_apart_and_finished_count():
    worker = multi(child(name="a", bytes=3), child(name="b", bytes=4), role=KVConnectorRole.WORKER)
    stats = worker.get_kv_connector_stats()
    assert stats.reduce() == {"0:ScriptedConnector.bytes": 3.0, "1:ScriptedConnector.bytes": 4.0}
    assert stats.aggregate(stats).reduce() == {
        "0:ScriptedConnector.bytes": 6.0,
        "1:ScriptedConnector.bytes": 8.0,
    }
    assert multi(child(finished_count=2), child()).get_finished_count() == 2
    assert multi(child(), child()).get_finished_count() is None
    with pytest.raises(ValueError, match=r"disagree on get_finished_count\(\): \[1, 2\]"):
        multi(child(finished_count=1), child(finished_count=2)).get_finished_count()


def test_shutdown_reaches_every_child_even_if_one_fails():
    m = multi(child(name="a", shutdown_raises=True), child(name="b"))
    with pytest.raises(RuntimeError, match="a failed to shut down"):
        m.shutdown()
    assert all(c.hooks_called()[-1] == "shutdown" for c in m.connectors)


@pytest.mark.parametrize(
    ("extra", "error", "message"),
    [
        ({}, ValueError, "needs kv_connector_extra_config.connectors"),
        ({"connectors": []}, ValueError, "non-empty list"),
        ({"connectors": ["x"]}, ValueError, r"connectors\[0\] must be an object"),
        (
            {"connectors": [{"kv_connector": "A", "bogus": 1}]},
            KVTransferConfigError,
            "bogus: unknown key",
        ),
    ],
)
def test_bad_configuration(extra, error, message):
    config = KVTransferConfig(kv_connector="MultiConnector", kv_connector_extra_config=extra)
    with pytest.raises(error, match=message):
        KVConnectorFactory.create_connector(config, KVConnectorRole.WORKER)


def test_bind_rejects_foreign_metadata():
    from kvtransfer import KVConnectorMetadata

    worker = multi(child(), role=KVConnectorRole.WORKER)
    with pytest.raises(TypeError, match="expects MultiKVConnectorMetadata"):
        worker.bind_connector_metadata(KVConnectorMetadata())


class TestMultiConnectorContract(KVConnectorContract):
    @pytest.fixture
    def kv_transfer_config(self):
        return KVTransferConfig(
            kv_connector="MultiConnector",
            kv_role="kv_both",
            kv_connector_extra_config={
                "connectors": [
                    {
                        "kv_connector": "RecordingConnector",
                        "kv_connector_module_path": "kvtransfer.testing.recording",
                    },
                    child("PpAwareConnector", name="b"),
                ]
            },
        )


class TestRecordingConnectorContract(KVConnectorContract):
    @pytest.fixture
    def kv_transfer_config(self):
        return KVTransferConfig(
            kv_connector="RecordingConnector",
            kv_connector_module_path="kvtransfer.testing.recording",
        )
