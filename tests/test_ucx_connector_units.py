"""`UcxConnector` pieces on their own: the connector contract, configuration and
``kv_transfer_params`` checks, the producer's lease book, the workers' payload checks, and the
completion service over real gRPC."""

from __future__ import annotations

import asyncio
import re
from types import SimpleNamespace

import grpc
import pytest
import torch

from kvtransfer.connector.config import KVTransferConfig
from kvtransfer.connector.factory import KVConnectorFactory
from kvtransfer.connector.metadata import (
    KVCacheLayout,
    KVConnectorHandshakeMetadata,
    KVConnectorRole,
)
from kvtransfer.connectors.ucx import RemotePrefill, UcxConfig, UcxConnector, UcxHandshakeMetadata
from kvtransfer.connectors.ucx.identity import WorkerIdentity, parse_layer_name
from kvtransfer.connectors.ucx.leases import STALL_S, LeaseBook, LeaseSecretMismatch
from kvtransfer.connectors.ucx.liveness import ProducerUnreachable
from kvtransfer.connectors.ucx.metadata import Release, UcxLayer, kernel_block_ids
from kvtransfer.connectors.ucx.notify import (
    KEEP_ALIVE,
    RELEASE,
    Done,
    KeepAliveRequest,
    LeaseRef,
    NotifyReply,
    ReleaseRequest,
    notify_handler,
)
from kvtransfer.connectors.ucx.scheduler import engine_split
from kvtransfer.connectors.ucx.worker import load_failure_reason
from kvtransfer.control import CompatibilityInfo, ControlServerThread, HandshakeBook
from kvtransfer.testing import KVConnectorContract, make_kv_caches, make_request
from kvtransfer.transport import PeerUnreachable

pytestmark = pytest.mark.integration


class TestUcxConnectorContract(KVConnectorContract):
    @pytest.fixture
    def kv_transfer_config(self):
        return KVTransferConfig(kv_connector="UcxConnector", kv_role="kv_both", engine_id="c")


def _config(**fields) -> KVTransferConfig:
    return KVTransferConfig(kv_connector="UcxConnector", kv_role="kv_both", **fields)


def test_registered_as_an_entry_point():
    assert KVConnectorFactory.get_connector_class(_config()) is UcxConnector


def test_config_defaults_and_overrides():
    assert UcxConfig.from_transfer_config(_config()) == UcxConfig(
        host="127.0.0.1",
        port=0,
        lease_s=120.0,
        transfer_timeout_s=30.0,
        handshake_timeout_s=5.0,
        max_concurrent_loads=4,
    )
    config = _config(
        kv_ip="0.0.0.0",
        kv_port=5555,
        kv_connector_extra_config={
            "kv_lease_s": 2,
            "max_concurrent_loads": 1,
            "kv_payload_checksum": True,
        },
    )
    assert UcxConfig.from_transfer_config(config) == UcxConfig(
        host="0.0.0.0", port=5555, lease_s=2.0, max_concurrent_loads=1, payload_checksum=True
    )


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        ({"lease": 1}, r"unknown kv_connector_extra_config key\(s\) \['lease'\]"),
        (
            {"kv_lease_s": 0},
            r"kv_connector_extra_config.kv_lease_s must be a number of seconds > 0",
        ),
        ({"transfer_timeout_s": True}, r"transfer_timeout_s must be a number of seconds > 0"),
        ({"max_concurrent_loads": 0}, r"max_concurrent_loads must be an int >= 1, got 0"),
        ({"kv_payload_checksum": "yes"}, r"kv_payload_checksum must be true or false, got 'yes'"),
        ({"kv_stream_min_tokens": -1}, r"kv_stream_min_tokens must be an int >= 0, got -1"),
    ],
)
def test_config_rejects_bad_extra_keys(extra, message):
    with pytest.raises(ValueError, match=message):
        UcxConfig.from_transfer_config(_config(kv_connector_extra_config=extra))


def test_connector_needs_a_role_and_a_layout():
    with pytest.raises(ValueError, match="UcxConnector needs kv_role"):
        UcxConnector(KVTransferConfig(kv_connector="UcxConnector"), KVConnectorRole.WORKER)
    with pytest.raises(ValueError, match="expects a KVCacheLayout as kv_cache_config, got dict"):
        UcxConnector(_config(), KVConnectorRole.WORKER, {})
    scheduler = UcxConnector(_config(), KVConnectorRole.SCHEDULER)
    with pytest.raises(RuntimeError, match="register_kv_caches is a worker hook; this instance"):
        scheduler.register_kv_caches({})
    scheduler.shutdown()


def test_a_consumer_schedulers_notifier_runs_before_any_hook():
    """Its first hook must not start the notifier's thread (starting one waits until it runs:
    seconds on a starved core, inside the engine core's step); a producer needs none."""
    consumer = UcxConnector(
        KVTransferConfig(kv_connector="UcxConnector", kv_role="kv_consumer"),
        KVConnectorRole.SCHEDULER,
    )
    producer = UcxConnector(
        KVTransferConfig(kv_connector="UcxConnector", kv_role="kv_producer"),
        KVConnectorRole.SCHEDULER,
    )
    try:
        thread = consumer.scheduler_half._notifier._thread
        assert thread is not None and thread.is_alive()
        assert producer.scheduler_half._notifier is None
    finally:
        consumer.shutdown()
        producer.shutdown()
    assert not thread.is_alive()


# ------------------------------------------------------------------ kv_transfer_params

PARAMS = {
    "do_remote_prefill": True,
    "remote_engine_id": "p",
    "remote_request_id": "r",
    "remote_block_ids": [3, 4],
    "remote_host": "::1",
    "remote_port": 7000,
    "tp_size": 2,
    "pp_size": 1,
    "remote_num_tokens": 10,
    "remote_kv_secret": "s3cret",
    "remote_prompt_digest": "ab" * 32,
}


def test_params_parse_to_a_remote_prefill():
    assert RemotePrefill.parse(None) is None
    assert RemotePrefill.parse({"do_remote_decode": True}) is None
    remote = RemotePrefill.parse({**PARAMS, "remote_generation": 9})
    assert remote == RemotePrefill(
        "p", "r", ((3, 4),), "::1", 7000, 2, 1, 10, "s3cret", "ab" * 32, 9
    )
    assert remote.address == "[::1]:7000"
    assert "s3cret" not in repr(remote)
    assert RemotePrefill.parse(PARAMS).generation is None


def test_a_load_failure_names_the_producer_unless_its_text_does():
    """A reset connection says nothing of whose it was: the request's error names the
    producer it read from (IPv6 in brackets); a text that names it already is kept as is."""
    remote = RemotePrefill.parse(PARAMS)
    reset = PeerUnreachable("one-sided read failed: Connection reset by remote peer")
    assert load_failure_reason(remote, reset) == (
        "PeerUnreachable: one-sided read failed: Connection reset by remote peer "
        "(producer engine 'p' at [::1]:7000)"
    )
    gone = ProducerUnreachable("engine 'p' at [::1]:7000 is gone: Connection refused")
    assert load_failure_reason(remote, gone) == (
        "ProducerUnreachable: engine 'p' at [::1]:7000 is gone: Connection refused"
    )


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"remote_engine_id": None}, "kv_transfer_params.remote_engine_id is missing"),
        ({"remote_engine_id": ""}, "remote_engine_id must be a non-empty string, got ''"),
        ({"remote_block_ids": "3,4"}, "remote_block_ids must be a list of block ids"),
        ({"remote_block_ids": [3, -1]}, "remote_block_ids must be a list of block ids"),
        ({"remote_block_ids": [3, True]}, "remote_block_ids must be a list of block ids"),
        ({"remote_port": 0}, "remote_port must be a port in [1, 65535], got 0"),
        ({"remote_num_tokens": 1.5}, "remote_num_tokens must be an int >= 0, got 1.5"),
        ({"pp_size": None}, "kv_transfer_params.pp_size is missing"),
        ({"remote_generation": "x"}, "remote_generation must be an int >= 0, got 'x'"),
        ({"do_remote_prefill": 1}, "kv_transfer_params.do_remote_prefill must be a bool, got 1"),
        ({"remote_kv_secret": None}, "kv_transfer_params.remote_kv_secret is missing"),
        ({"remote_kv_secret": ""}, "remote_kv_secret must be a non-empty string, got ''"),
        ({"remote_prompt_digest": "AB" * 32}, "remote_prompt_digest must be 64 lowercase hex"),
        ({"remote_prompt_digest": None}, "kv_transfer_params.remote_prompt_digest is missing"),
    ],
)
def test_malformed_params_name_the_key(change, message):
    params = {k: v for k, v in {**PARAMS, **change}.items() if v is not None}
    with pytest.raises(ValueError, match=re.escape(message)):
        RemotePrefill.parse(params)


def test_consumer_refuses_params_naming_itself():
    scheduler = UcxConnector(_config(engine_id="p"), KVConnectorRole.SCHEDULER)
    request = make_request("x", 10, PARAMS)
    with pytest.raises(ValueError, match="remote_engine_id 'p' is this engine; an engine does"):
        scheduler.get_num_new_matched_tokens(request, 0)
    scheduler.shutdown()


# ------------------------------------------------------------------ leases


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_lease_book_releases_finished_then_expired_requests():
    clock = Clock()
    book = LeaseBook(10.0, clock)
    for rid in ("a", "b", "c"):
        book.hold(rid, f"secret-{rid}")
    clock.now = 105.0
    assert book.extend([("b", "secret-b"), ("zzz", "x")]) == ["b"]
    assert book.finish([("c", 4, "secret-c"), ("zzz", 1, "x")]) == ["c"]
    assert book.take() == [Release("c", 4)]
    assert book.extend([("c", "secret-c")]) == []
    clock.now = 110.0
    assert book.take() == [Release("a", expired=True)]
    clock.now = 114.9
    assert book.take() == []
    clock.now = 115.0
    assert book.take() == [Release("b", expired=True)]
    assert len(book) == 0
    with pytest.raises(ValueError, match="lease_s must be > 0, got 0"):
        LeaseBook(0)


def _tick_until(book: LeaseBook, clock: Clock, end: float, every: float = 0.25) -> None:
    """The keep-alive server runs on time until ``end``."""
    while clock.now + every <= end:
        clock.now += every
        book.heard()
    clock.now = end


def test_a_lease_counts_only_the_time_its_server_could_hear_keep_alives():
    """The server is starved from 101 to 140 (no tick): those 39 s do not count, except the
    first STALL_S; the lease expires once 10 s of serving time passed."""
    clock = Clock()
    book = LeaseBook(10.0, clock, max_stall_s=100.0)
    book.heard()
    book.hold("starved", "s")
    _tick_until(book, clock, 101.0)
    clock.now = 140.0  # 39 s without a tick: nobody could have delivered a keep-alive
    assert book.take() == []
    book.heard()  # it runs again: 1 s before the stall + STALL_S of it have counted
    _tick_until(book, clock, 140.0 + 10.0 - 1.0 - STALL_S - 0.25)
    assert book.take() == []
    _tick_until(book, clock, 140.0 + 10.0 - 1.0 - STALL_S)
    assert book.take() == [Release("starved", expired=True)]


def test_a_lease_of_a_starved_server_still_ends_at_its_hard_limit():
    """A consumer that went away while the server was starved does not pin the blocks past
    lease_s + max_stall_s of wall time; a keep-alive heard moves both limits."""
    clock = Clock()
    book = LeaseBook(10.0, clock, max_stall_s=20.0)
    book.heard()
    book.hold("gone", "g")
    book.hold("kept", "k")
    clock.now = 115.0
    book.heard()
    assert book.extend([("kept", "k")]) == ["kept"]  # hard limit of "kept" now 145
    clock.now = 129.99  # no tick since 115: the heard clock stands at 102
    assert book.take() == []
    clock.now = 130.0
    assert book.take() == [Release("gone", expired=True)]
    clock.now = 145.0
    assert book.take() == [Release("kept", expired=True)]
    with pytest.raises(ValueError, match="max_stall_s must be >= 0, got -1"):
        LeaseBook(1.0, max_stall_s=-1)


def test_a_lease_book_without_a_ticking_server_keeps_wall_clock_time():
    clock = Clock()
    book = LeaseBook(10.0, clock, max_stall_s=0.0)
    book.hold("a", "a")
    clock.now = 109.99
    assert book.take() == []
    clock.now = 110.0
    assert book.take() == [Release("a", expired=True)]


def test_lease_book_refuses_reports_with_another_secret():
    clock = Clock()
    book = LeaseBook(10.0, clock)
    book.hold("victim", "right")
    book.hold("mine", "mine")
    with pytest.raises(
        LeaseSecretMismatch, match=r"wrong kv secret for held request\(s\) \['victim'\]"
    ):
        book.finish([("mine", 1, "mine"), ("victim", 0, "guess")])
    with pytest.raises(LeaseSecretMismatch):
        book.extend([("victim", "guess")])
    # Nothing changed: neither the forged release nor the honest one in the same message.
    assert book.take() == []
    clock.now = 110.0
    assert sorted(r.req_id for r in book.take()) == ["mine", "victim"]


# ------------------------------------------------------------------ worker payloads


def _layout(**fields) -> KVCacheLayout:
    values = {
        "model": "m",
        "dtype": "float32",
        "block_size": 16,
        "num_blocks": 8,
        "num_layers": 2,
        "num_kv_heads": 4,
        "head_dim": 8,
        "tp_size": 2,
        "pp_size": 1,
        "tp_rank": 1,
        "pp_rank": 0,
    }
    values.update(fields)
    return KVCacheLayout(**values)


def test_identity_describes_the_workers_slice():
    caches = make_kv_caches(num_layers=2, num_kv_heads=2)
    caches.update(make_kv_caches(num_layers=1, num_kv_heads=2, prefix="draft.layers"))
    identity = WorkerIdentity.from_caches("e", _layout(), caches)
    payload = identity.handshake("YWRkcg==")
    assert payload.kv_heads == (2, 4)
    assert (payload.draft_kv_heads, payload.draft_total_kv_heads) == ((2, 4), 4)
    assert payload.layers == (
        UcxLayer(name="model.layers.0.self_attn", index=0, is_draft=False, num_kv_heads=2),
        UcxLayer(name="model.layers.1.self_attn", index=1, is_draft=False, num_kv_heads=2),
        UcxLayer(name="draft.layers.0.self_attn", index=0, is_draft=True, num_kv_heads=2),
    )
    assert payload.agent_address_bytes() == b"addr"
    assert identity.bytes_per_block == 3 * 2 * 2 * 16 * 8 * 4
    assert UcxHandshakeMetadata.decode(payload.encode()) == payload
    assert identity.compat() == CompatibilityInfo(
        model="m",
        dtype="float32",
        total_num_kv_heads=4,
        head_size=8,
        num_layers=2,
        kv_layout="HND",
        block_size=16,
        wire_version=1,
    )


@pytest.mark.parametrize(
    ("caches", "message"),
    [
        ({}, "register_kv_caches got no layers"),
        ({"lm_head": torch.zeros(8, 2, 2, 16, 8)}, "KV layer 'lm_head' does not name its position"),
        (make_kv_caches(num_kv_heads=4), r"do not hold 2 KV heads, the share of TP rank 1"),
        (make_kv_caches(block_size=12, num_kv_heads=2), "KV caches are block_size 12, head_dim 8"),
        (
            make_kv_caches(block_size=8, num_blocks=7, num_kv_heads=2),
            "hold 7 blocks of 8 tokens: not whole engine blocks of 16",
        ),
    ],
)
def test_identity_refuses_caches_that_do_not_fit(caches, message):
    with pytest.raises(ValueError, match=message):
        WorkerIdentity.from_caches("e", _layout(), caches)


def test_kernel_blocks_are_engine_blocks_registered_in_pieces():
    # vLLM hands 8-token kernel blocks for an engine whose blocks are 16 tokens: engine block
    # b is kernel blocks 2b and 2b + 1.
    caches = make_kv_caches(num_blocks=8, block_size=8, num_kv_heads=2)
    identity = WorkerIdentity.from_caches("e", _layout(), caches)
    assert (identity.block_size, identity.kernel_blocks, identity.num_blocks) == (16, 2, 4)
    assert identity.bytes_per_block == 2 * (2 * 2 * 2 * 8 * 8 * 4)
    payload = identity.handshake("YWRkcg==")
    assert (payload.block_size, payload.kernel_blocks, payload.num_blocks) == (16, 2, 4)
    layout = payload.layouts()["model.layers.0.self_attn"]
    assert (layout.num_blocks, layout.block_size) == (8, 8)
    assert (
        identity.compat()
        == WorkerIdentity.from_caches(
            "e", _layout(), make_kv_caches(num_blocks=4, num_kv_heads=2)
        ).compat()
    )
    assert kernel_block_ids((3, 0), 2) == (6, 7, 0, 1)
    assert kernel_block_ids((3, 0), 1) == (3, 0)


def test_layer_names_carry_their_position():
    assert parse_layer_name("model.layers.12.self_attn") == (False, 12)
    assert parse_layer_name("draft.layers.0.attn") == (True, 0)


def _payload(pp: int, tp: int, *, engine_id: str = "e", tp_size: int = 2, **fields):
    caches = make_kv_caches(num_layers=1, num_kv_heads=2)
    layout = _layout(tp_size=tp_size, tp_rank=tp, pp_rank=pp, pp_size=fields.pop("pp_size", 1))
    identity = WorkerIdentity.from_caches(engine_id, layout, caches)
    return identity.handshake("YQ==").model_copy(update=fields)


def test_engine_split_needs_a_full_consistent_grid():
    assert engine_split("e", {(0, 0): _payload(0, 0), (0, 1): _payload(0, 1)}).tp_size == 2
    cases = [
        ({}, "no worker published handshake metadata"),
        ({(0, 0): KVConnectorHandshakeMetadata()}, "published KVConnectorHandshakeMetadata"),
        ({(0, 0): _payload(0, 0)}, r"workers \[\(0, 0\)\] published, TP 2 x PP 1 needs"),
        ({(0, 0): _payload(0, 0), (0, 1): _payload(0, 0)}, r"filed under .*=\(0, 1\) is worker"),
        ({(0, 0): _payload(0, 0, engine_id="x")}, "belongs to engine 'x', not 'e'"),
        (
            {(0, 0): _payload(0, 0), (0, 1): _payload(0, 1, block_size=8)},
            "workers disagree on",
        ),
    ]
    for metadata, message in cases:
        with pytest.raises(ValueError, match=message):
            engine_split("e", metadata)


def test_unusable_worker_payloads_fail_only_transfer_requests():
    scheduler = UcxConnector(_config(engine_id="e"), KVConnectorRole.SCHEDULER)
    scheduler.set_xfer_handshake_metadata_pp_aware({(0, 0): _payload(0, 0)})
    assert scheduler.scheduler_half.address is None
    assert scheduler.request_finished(make_request("plain"), [0]) == (False, None)
    with pytest.raises(RuntimeError, match="cannot serve KV: unusable handshake metadata"):
        scheduler.request_finished(make_request("p", 4, {"do_remote_decode": True}), [0])
    scheduler.shutdown()


def test_a_producer_streams_long_prompts_only_announcing_them_before_their_last_step():
    extra = {"kv_stream_min_tokens": 32}
    scheduler = UcxConnector(
        _config(engine_id="e", kv_connector_extra_config=extra), KVConnectorRole.SCHEDULER
    )
    scheduler.set_xfer_handshake_metadata_pp_aware({(0, 0): _payload(0, 0), (0, 1): _payload(0, 1)})
    stream = {"do_remote_decode": True, "kv_stream": True}
    long, short = make_request("long", 40, stream), make_request("short", 20, stream)
    scheduler.update_state_after_alloc(long, [1, 2, 3], 0)
    scheduler.update_state_after_alloc(short, [4, 5], 0)
    # The step that computes both prompts (their last part): only the long one streams.
    step = SimpleNamespace(scheduled_cached_reqs=(), num_scheduled_tokens={"long": 40, "short": 20})
    metadata = scheduler.build_connector_meta(step)
    early = scheduler.take_early_kv_transfer_params()
    assert list(early) == ["long"]
    assert early["long"]["remote_streaming"] is True
    assert early["long"]["remote_block_ids"] == [1, 2, 3]
    assert [(g.req_id, g.block_ids, g.streaming) for g in metadata.grants] == [
        ("long", (1, 2, 3), True)
    ]
    assert scheduler.take_early_kv_transfer_params() == {}  # drained
    # Finished, the streamed one returns the params it announced; the other is handed over
    # as usual, granted by the next step.
    assert scheduler.request_finished(long, [1, 2, 3]) == (True, early["long"])
    held, params = scheduler.request_finished(short, [4, 5])
    assert held and "remote_streaming" not in params
    grants = scheduler.build_connector_meta(SimpleNamespace()).grants
    assert [(g.req_id, g.streaming) for g in grants] == [("short", False)]
    # Preempted after its grant (it went on generating there): its blocks are freed, so the
    # lease ends in the same step's metadata, before anything else is written into them.
    again = make_request("again", 40, stream)
    scheduler.update_state_after_alloc(again, [6, 7, 8], 0)
    scheduler.build_connector_meta(
        SimpleNamespace(scheduled_cached_reqs=(), num_scheduled_tokens={"again": 40})
    )
    assert list(scheduler.take_early_kv_transfer_params()) == ["again"]
    preempted = SimpleNamespace(preempted_req_ids=frozenset({"again"}))
    releases = scheduler.build_connector_meta(preempted).releases
    assert [(r.req_id, r.num_blocks) for r in releases] == [("again", 0)]
    scheduler.shutdown()


# ------------------------------------------------------------------ completion service


@pytest.fixture
def notify_server():
    compat = CompatibilityInfo(
        model="m",
        dtype="float32",
        total_num_kv_heads=2,
        head_size=4,
        num_layers=1,
        block_size=8,
        wire_version=1,
    )
    leases = LeaseBook(7.0)
    server = ControlServerThread(
        book=HandshakeBook("e", compat, generation=5),
        handlers=[notify_handler("e", 5, leases)],
    )
    server.start()
    yield server.address, leases
    server.stop()


def _call(address: str, method: str, body: bytes) -> NotifyReply:
    async def call() -> bytes:
        async with grpc.aio.insecure_channel(address) as channel:
            return await channel.unary_unary(method)(body, timeout=5)

    return NotifyReply.model_validate_json(asyncio.run(call()))


def test_notify_service_extends_and_releases_leases(notify_server):
    address, leases = notify_server
    leases.hold("a", "sa")
    leases.hold("b", "sb")
    keep = KeepAliveRequest(
        engine_id="e",
        generation=5,
        leases=(LeaseRef(request_id="a", secret="sa"), LeaseRef(request_id="x", secret="sx")),
    )
    assert _call(address, KEEP_ALIVE, keep.model_dump_json().encode()) == NotifyReply(
        known=("a",), lease_s=7.0
    )
    stale = ReleaseRequest(
        engine_id="e", generation=4, done=(Done(request_id="a", num_blocks=1, secret="sa"),)
    )
    assert _call(address, RELEASE, stale.model_dump_json().encode()).known == ()
    done = ReleaseRequest(engine_id="e", done=(Done(request_id="b", num_blocks=2, secret="sb"),))
    assert _call(address, RELEASE, done.model_dump_json().encode()).known == ("b",)
    assert leases.take() == [Release("b", 2)]


def test_forged_release_and_keep_alive_are_refused(notify_server):
    address, leases = notify_server
    leases.hold("victim", "the-secret")
    forged = ReleaseRequest(
        engine_id="e", done=(Done(request_id="victim", num_blocks=0, secret="guess"),)
    )
    pin = KeepAliveRequest(engine_id="e", leases=(LeaseRef(request_id="victim", secret="guess"),))
    for method, message in ((RELEASE, forged), (KEEP_ALIVE, pin)):
        with pytest.raises(grpc.aio.AioRpcError) as info:
            _call(address, method, message.model_dump_json().encode())
        assert info.value.code() is grpc.StatusCode.PERMISSION_DENIED
        assert "wrong kv secret for held request(s) ['victim']" in info.value.details()
    assert leases.take() == []
    assert len(leases) == 1


def test_notify_service_rejects_garbage_and_other_engines(notify_server):
    address, _ = notify_server
    with pytest.raises(grpc.aio.AioRpcError) as info:
        _call(address, RELEASE, b"{not json")
    assert info.value.code() is grpc.StatusCode.INVALID_ARGUMENT
    assert info.value.details().startswith("malformed ReleaseRequest: ")
    other = KeepAliveRequest(engine_id="other", leases=())
    with pytest.raises(grpc.aio.AioRpcError) as info:
        _call(address, KEEP_ALIVE, other.model_dump_json().encode())
    assert info.value.code() is grpc.StatusCode.FAILED_PRECONDITION
    assert info.value.details() == "this is engine 'e', not 'other'"
