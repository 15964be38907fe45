"""`SharedStorageConnector` without an engine: the contract, its configuration, the
``kv_transfer_params`` it accepts and returns, and the scheduler half's bookkeeping."""

from __future__ import annotations

import pickle

import pytest

from kvtransfer.connector.config import KVTransferConfig
from kvtransfer.connector.factory import KVConnectorFactory
from kvtransfer.connector.metadata import KVConnectorMetadata, KVConnectorRole
from kvtransfer.connector.outputs import KVConnectorOutput
from kvtransfer.connectors.shared_storage import (
    LoadSpec,
    SaveSpec,
    SharedStorageConnector,
    SharedStorageConnectorMetadata,
    SharedStorageHandshakeMetadata,
)
from kvtransfer.connectors.shared_storage.storage import path_component
from kvtransfer.testing import KVConnectorContract, make_kv_caches, make_request

pytestmark = pytest.mark.unit

VALID_PARAMS = {
    "do_remote_prefill": True,
    "remote_engine_id": "prefill",
    "remote_request_id": "req-7",
    "remote_num_tokens": 12,
    "tp_size": 1,
    "pp_size": 1,
}


def config(root, role="kv_both", engine_id="engine-a", **extra) -> KVTransferConfig:
    return KVTransferConfig(
        kv_connector="SharedStorageConnector",
        kv_role=role,
        engine_id=engine_id,
        kv_connector_extra_config={"shared_storage_path": str(root), **extra},
    )


def handshake(global_rank: int, engine_id: str = "engine-a", block_size: int = 16):
    return SharedStorageHandshakeMetadata(
        engine_id=engine_id,
        global_rank=global_rank,
        layer_names=("model.layers.0.self_attn",),
        num_kv_heads=(2,),
        head_dim=8,
        block_size=block_size,
        num_blocks=8,
        dtype="float32",
    )


def scheduler(root, role="kv_both", tp=1, pp=1, **extra) -> SharedStorageConnector:
    connector = SharedStorageConnector(config(root, role, **extra), KVConnectorRole.SCHEDULER)
    connector.set_xfer_handshake_metadata_pp_aware(
        {(p, t): handshake(p * tp + t) for p in range(pp) for t in range(tp)}
    )
    return connector


class TestSharedStorageContract(KVConnectorContract):
    @pytest.fixture
    def kv_transfer_config(self, tmp_path):
        return config(tmp_path)


# ---------------------------------------------------------------------------- configuration


def test_registered_under_its_entry_point_name():
    assert KVConnectorFactory.get_connector_class_by_name("SharedStorageConnector") is (
        SharedStorageConnector
    )


def test_missing_path_names_the_key():
    bare = KVTransferConfig(kv_connector="SharedStorageConnector", kv_role="kv_both")
    with pytest.raises(ValueError, match=r"kv_connector_extra_config\.shared_storage_path"):
        SharedStorageConnector(bare, KVConnectorRole.WORKER)


def test_relative_path_that_does_not_exist_is_refused(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(
        ValueError,
        match=r"shared_storage_path 'no/such/dir' is relative and no such directory exists",
    ):
        SharedStorageConnector(config("no/such/dir"), KVConnectorRole.SCHEDULER)


def test_relative_existing_path_is_made_absolute(tmp_path, monkeypatch):
    (tmp_path / "kv").mkdir()
    monkeypatch.chdir(tmp_path)
    connector = scheduler("kv")
    _, params = connector.request_finished(make_request("r", 4, {"do_remote_decode": True}), [0])
    saves = connector.build_connector_meta(None).saves
    assert saves[0].directory == str(tmp_path / "kv" / "engine-a" / "r")
    assert params["remote_num_tokens"] == 4


def test_absolute_path_is_created(tmp_path):
    root = tmp_path / "a" / "b"
    SharedStorageConnector(config(root), KVConnectorRole.WORKER).shutdown()
    assert root.is_dir()


def test_path_that_is_a_file_is_refused(tmp_path):
    (tmp_path / "file").write_text("x")
    with pytest.raises(ValueError, match="exists but is not a directory"):
        SharedStorageConnector(config(tmp_path / "file"), KVConnectorRole.WORKER)


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        ({"load_timeout_s": 0}, r"load_timeout_s must be a positive number of seconds, got 0"),
        ({"load_timeout_s": "5"}, r"load_timeout_s must be a positive number of seconds"),
        ({"delete_after_load": "yes"}, r"delete_after_load must be a bool, got 'yes'"),
        ({"delete_after_lod": True}, r"unknown kv_connector_extra_config key\(s\) \['delete_"),
    ],
)
def test_bad_extra_config_is_refused(tmp_path, extra, message):
    with pytest.raises(ValueError, match=message):
        SharedStorageConnector(config(tmp_path, **extra), KVConnectorRole.WORKER)


def test_role_is_required(tmp_path):
    no_role = KVTransferConfig(
        kv_connector="SharedStorageConnector",
        kv_connector_extra_config={"shared_storage_path": str(tmp_path)},
    )
    with pytest.raises(ValueError, match="SharedStorageConnector needs kv_role"):
        SharedStorageConnector(no_role, KVConnectorRole.SCHEDULER)


def test_hooks_of_the_other_role_raise(tmp_path):
    sched = scheduler(tmp_path)
    with pytest.raises(RuntimeError, match=r"register_kv_caches is a worker hook.*SCHEDULER"):
        sched.register_kv_caches(make_kv_caches())
    worker = SharedStorageConnector(config(tmp_path), KVConnectorRole.WORKER)
    with pytest.raises(RuntimeError, match=r"request_finished is a scheduler hook.*WORKER"):
        worker.request_finished(make_request(), [0])
    # Observing hooks answer on either role: vLLM asks the scheduler for stats every step.
    assert sched.get_kv_connector_stats() is None


def test_foreign_metadata_is_refused(tmp_path):
    class Other(KVConnectorMetadata):
        pass

    worker = SharedStorageConnector(config(tmp_path), KVConnectorRole.WORKER)
    with pytest.raises(TypeError, match="expects SharedStorageConnectorMetadata, got Other"):
        worker.bind_connector_metadata(Other())


@pytest.mark.parametrize(
    ("name", "component"),
    [
        ("gen-0", "gen-0"),
        ("..", "%2E%2E"),
        ("a/../../etc", "a%2F%2E%2E%2F%2E%2E%2Fetc"),
        ("", "%he3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855"),
    ],
)
def test_ids_become_safe_path_components(name, component):
    assert path_component(name) == component


def test_long_ids_are_hashed():
    assert path_component("x" * 500) == path_component("x" * 500)
    assert path_component("x" * 500).startswith("%h")
    assert len(path_component("x" * 500)) == 66


# ----------------------------------------------------------------------- handshake / layout


def test_handshake_metadata_describes_the_worker(tmp_path):
    worker = SharedStorageConnector(config(tmp_path), KVConnectorRole.WORKER)
    assert worker.get_handshake_metadata() is None  # nothing registered yet
    worker.register_kv_caches(make_kv_caches(num_layers=2, num_kv_heads=2, head_dim=8))
    assert worker.get_handshake_metadata() == SharedStorageHandshakeMetadata(
        engine_id="engine-a",
        global_rank=0,
        layer_names=("model.layers.0.self_attn", "model.layers.1.self_attn"),
        num_kv_heads=(2, 2),
        head_dim=8,
        block_size=16,
        num_blocks=8,
        dtype="float32",
    )


def test_layout_comes_from_the_handshake_keys(tmp_path):
    connector = scheduler(tmp_path, tp=2, pp=2)
    metadata = connector.build_connector_meta(None)
    assert (metadata.tp_size, metadata.pp_size) == (2, 2)


@pytest.mark.parametrize(
    ("published", "message"),
    [
        (
            {(0, 0): handshake(0), (0, 1): handshake(0)},
            r"\(0, 1\) reports global rank 0, expected 1",
        ),
        ({(0, 0): handshake(0), (1, 1): handshake(3)}, r"no handshake metadata from .*\[\(0, 1\)"),
        ({(0, 0): handshake(0, engine_id="other")}, r"belongs to engine 'other'"),
        (
            {(0, 0): handshake(0), (0, 1): handshake(1, block_size=8)},
            r"workers disagree on block_size: \[8, 16\]",
        ),
    ],
)
def test_inconsistent_handshake_fails_transfers_not_the_engine(tmp_path, published, message):
    connector = SharedStorageConnector(config(tmp_path), KVConnectorRole.SCHEDULER)
    connector.set_xfer_handshake_metadata_pp_aware(published)
    assert connector.build_connector_meta(None).tp_size is None
    with pytest.raises(RuntimeError, match="unusable handshake metadata: .*" + message):
        connector.request_finished(make_request("r", 4, {"do_remote_decode": True}), [0])
    with pytest.raises(RuntimeError, match="unusable handshake metadata"):
        connector.get_num_new_matched_tokens(make_request("r", 20, VALID_PARAMS), 0)


def test_transfers_before_any_handshake_raise(tmp_path):
    connector = SharedStorageConnector(config(tmp_path), KVConnectorRole.SCHEDULER)
    with pytest.raises(RuntimeError, match="no handshake metadata received from the workers"):
        connector.request_finished(make_request("r", 4, {"do_remote_decode": True}), [0])


def test_non_pipelined_handshake_is_accepted(tmp_path):
    connector = SharedStorageConnector(config(tmp_path), KVConnectorRole.SCHEDULER)
    connector.set_xfer_handshake_metadata({0: handshake(0), 1: handshake(1)})
    assert connector.build_connector_meta(None).tp_size == 2


# ------------------------------------------------------------------------------- producer


def test_producer_keeps_blocks_and_returns_consumer_params(tmp_path):
    connector = scheduler(tmp_path, role="kv_producer", tp=2, pp=2)
    request = make_request("req-1", 20, {"do_remote_decode": True})
    delay_free, params = connector.request_finished(request, [4, 9])
    assert delay_free is True
    assert params == {
        "do_remote_prefill": True,
        "remote_engine_id": "engine-a",
        "remote_request_id": "req-1",
        "remote_num_tokens": 20,
        "tp_size": 2,
        "pp_size": 2,
    }
    metadata = pickle.loads(pickle.dumps(connector.build_connector_meta(None)))
    assert metadata.saves == (
        SaveSpec("req-1", str(tmp_path / "engine-a" / "req-1"), (4, 9), tuple(range(1, 21))),
    )
    assert connector.build_connector_meta(None).saves == ()  # consumed by the step


def test_producer_saves_only_computed_prompt_tokens(tmp_path):
    connector = scheduler(tmp_path, role="kv_producer")
    aborted = make_request("half", 20, {"do_remote_decode": True})
    aborted.num_computed_tokens = 8  # aborted in the middle of a chunked prefill
    assert connector.request_finished(aborted, [3])[1]["remote_num_tokens"] == 8
    untouched = make_request("none", 20, {"do_remote_decode": True})
    untouched.num_computed_tokens = 0
    delay_free, params = connector.request_finished(untouched, [])
    assert (delay_free, params["remote_num_tokens"]) == (False, 0)
    assert [s.token_ids for s in connector.build_connector_meta(None).saves] == [tuple(range(1, 9))]


@pytest.mark.parametrize(
    ("role", "params"),
    [
        ("kv_producer", None),
        ("kv_producer", {"do_remote_decode": False}),
        ("kv_consumer", {"do_remote_decode": True}),
    ],
)
def test_requests_not_asking_to_be_saved_free_their_blocks(tmp_path, role, params):
    connector = scheduler(tmp_path, role=role)
    assert connector.request_finished(make_request("r", 4, params), [0]) == (False, None)
    assert connector.build_connector_meta(None).saves == ()


def test_malformed_do_remote_decode_names_the_key(tmp_path):
    connector = scheduler(tmp_path, role="kv_producer")
    with pytest.raises(ValueError, match=r"kv_transfer_params\.do_remote_decode must be a bool"):
        connector.request_finished(make_request("r", 4, {"do_remote_decode": "yes"}), [0])


# ------------------------------------------------------------------------------- consumer


def test_consumer_offers_saved_prompt_tokens_beyond_local_hits(tmp_path):
    connector = scheduler(tmp_path, role="kv_consumer")
    request = make_request("dec-1", 20, VALID_PARAMS)  # producer saved 12 of them
    assert connector.get_num_new_matched_tokens(request, 0) == (12, True)
    assert connector.get_num_new_matched_tokens(request, 8) == (4, True)
    connector.update_state_after_alloc(request, [5, 6, 7], 4)
    (load,) = connector.build_connector_meta(None).loads
    assert load == LoadSpec(
        req_id="dec-1",
        directory=str(tmp_path / "prefill" / "req-7"),
        remote_tp_size=1,
        remote_pp_size=1,
        block_ids=(5, 6, 7),
        start_token=8,
        token_ids=tuple(range(1, 13)),
    )
    # A request loads once: preempted and re-admitted, it recomputes.
    assert connector.get_num_new_matched_tokens(request, 0) == (0, False)


def test_consumer_caps_by_the_prompt_and_ignores_covered_requests(tmp_path):
    connector = scheduler(tmp_path, role="kv_consumer")
    short = make_request("short", 5, VALID_PARAMS)
    assert connector.get_num_new_matched_tokens(short, 0) == (5, True)
    assert connector.get_num_new_matched_tokens(short, 5) == (0, False)
    plain = make_request("plain", 5)
    assert connector.get_num_new_matched_tokens(plain, 0) == (0, False)
    producer = scheduler(tmp_path, role="kv_producer")
    assert producer.get_num_new_matched_tokens(make_request("p", 20, VALID_PARAMS), 0) == (
        0,
        False,
    )


def test_alloc_without_a_matched_load_schedules_nothing(tmp_path):
    connector = scheduler(tmp_path, role="kv_consumer")
    request = make_request("r", 20, VALID_PARAMS)
    connector.update_state_after_alloc(request, [1, 2], 0)
    assert connector.build_connector_meta(None).loads == ()


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"do_remote_prefill": 1}, r"kv_transfer_params\.do_remote_prefill must be a bool, got 1"),
        ({"remote_engine_id": None}, r"kv_transfer_params\.remote_engine_id is missing"),
        ({"remote_engine_id": 3}, r"remote_engine_id must be a non-empty string, got 3"),
        ({"remote_request_id": None}, r"kv_transfer_params\.remote_request_id is missing"),
        ({"remote_request_id": ""}, r"remote_request_id must be a non-empty string, got ''"),
        ({"remote_num_tokens": None}, r"kv_transfer_params\.remote_num_tokens is missing"),
        ({"remote_num_tokens": "12"}, r"remote_num_tokens must be an int >= 0, got '12'"),
        ({"remote_num_tokens": True}, r"remote_num_tokens must be an int >= 0, got True"),
        ({"tp_size": 0}, r"kv_transfer_params\.tp_size must be an int >= 1, got 0"),
        ({"pp_size": None}, r"kv_transfer_params\.pp_size is missing"),
    ],
)
def test_malformed_remote_prefill_params_name_the_key(tmp_path, change, message):
    params = {**VALID_PARAMS, **change}
    params = {k: v for k, v in params.items() if v is not None}
    connector = scheduler(tmp_path, role="kv_consumer")
    with pytest.raises(ValueError, match=message):
        connector.get_num_new_matched_tokens(make_request("r", 20, params), 0)


def _load_one(connector, rid="dec-1") -> str:
    request = make_request(rid, 20, VALID_PARAMS)
    count, _ = connector.get_num_new_matched_tokens(request, 0)
    connector.update_state_after_alloc(request, [1, 2], count)
    (load,) = connector.build_connector_meta(None).loads
    return load.directory


def test_delete_after_load_removes_the_files_once_every_worker_loaded(tmp_path):
    connector = scheduler(tmp_path, role="kv_consumer", delete_after_load=True)
    directory = _load_one(connector)
    (tmp_path / "prefill" / "req-7").mkdir(parents=True)
    connector.update_connector_output(KVConnectorOutput())
    assert (tmp_path / "prefill" / "req-7").is_dir()
    connector.update_connector_output(KVConnectorOutput(finished_recving={"dec-1"}))
    assert not (tmp_path / "prefill" / "req-7").exists()
    assert directory == str(tmp_path / "prefill" / "req-7")


@pytest.mark.parametrize("how", ["failed", "aborted", "not_asked"])
def test_files_stay_after_failed_aborted_or_by_default(tmp_path, how):
    connector = scheduler(tmp_path, role="kv_consumer", delete_after_load=how != "not_asked")
    _load_one(connector)
    (tmp_path / "prefill" / "req-7").mkdir(parents=True)
    if how == "aborted":
        connector.request_finished(make_request("dec-1", 20, VALID_PARAMS), [1, 2])
    failed = {"dec-1"} if how == "failed" else None
    connector.update_connector_output(
        KVConnectorOutput(finished_recving={"dec-1"}, failed_recving=failed)
    )
    assert (tmp_path / "prefill" / "req-7").is_dir()


def test_metadata_starts_empty_and_pickles(tmp_path):
    metadata = SharedStorageConnector(
        config(tmp_path), KVConnectorRole.SCHEDULER
    ).build_connector_meta(None)
    assert pickle.loads(pickle.dumps(metadata)) == SharedStorageConnectorMetadata()
