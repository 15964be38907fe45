"""KV pulls over real UCX between real processes on this host (shared memory / loopback).

Two server processes (spawned once for the module) serve seeded caches: server A holds
``model.layers.0-2`` (float32) and ``draft.layers.0`` (bfloat16), server B ``model.layers.3-5``
(a PP split). The test process recomputes the same seeded tensors to check byte equality.
"""

from __future__ import annotations

import threading

import pytest
import torch
from transport_helpers.kv import NUM_BLOCKS, LayerGroup, empty_caches, layer_tensor
from transport_helpers.procs import KVServerProcess, ServerSpec, kv_server, kv_servers
from waiting import wait_until

from kvtransfer.transport import (
    EndpointReset,
    ErrorCode,
    InvalidPeerAddress,
    KVLayout,
    KVTransferAgent,
    PeerHandle,
    PeerUnreachable,
    PullSpec,
    RemoteTransferError,
    TransferCancelled,
    TransferTimeoutError,
    TransportClosed,
    TransportConfig,
)

pytestmark = pytest.mark.integration

SEED_A, SEED_B = 11, 22
MODEL_A = LayerGroup("model.layers", 0, 3)
DRAFT_A = LayerGroup("draft.layers", 0, 1, "bfloat16")
MODEL_B = LayerGroup("model.layers", 3, 3)
# Generous: a pull that should succeed must never flake on a loaded machine.
WAIT_S = 30.0
# Small pulls run on the UCX threads (the default), or with inline_bytes=0 through the pull
# and handler threads, the path every pull larger than inline_bytes takes.
PATHS = [pytest.param({}, id="inline"), pytest.param({"inline_bytes": 0}, id="threaded")]


@pytest.fixture(scope="module")
def servers() -> list[KVServerProcess]:
    with kv_servers(
        [ServerSpec(SEED_A, (MODEL_A, DRAFT_A)), ServerSpec(SEED_B, (MODEL_B,))]
    ) as running:
        yield running


@pytest.fixture(scope="module", params=PATHS)
def agent(request) -> KVTransferAgent:
    with KVTransferAgent(TransportConfig(timeout_s=WAIT_S, **request.param)) as client:
        yield client


@pytest.fixture(scope="module")
def peer_a(agent, servers) -> PeerHandle:
    return agent.connect(servers[0].address)


@pytest.fixture(scope="module")
def peer_b(agent, servers) -> PeerHandle:
    return agent.connect(servers[1].address)


def _fresh(agent: KVTransferAgent, *groups: LayerGroup, num_heads: int = 4):
    caches = empty_caches(list(groups), num_heads=num_heads)
    agent.register_kv_caches(caches)
    return caches


def _expect(
    caches: dict[str, torch.Tensor],
    seed: int,
    names: list[str],
    remote_ids: list[int],
    local_ids: list[int],
    remote_heads: range | None = None,
    local_heads: range | None = None,
) -> None:
    """Pulled blocks equal the remote's bytes; every other block and head is untouched."""
    for name in names:
        local = caches[name]
        remote = layer_tensor(seed, name, str(local.dtype).removeprefix("torch."))
        rh = remote_heads or range(remote.shape[2])
        lh = local_heads or range(local.shape[2])
        expected = torch.full_like(local, -7.0)
        expected[local_ids, :, lh.start : lh.stop] = remote[remote_ids][:, :, rh.start : rh.stop]
        assert torch.equal(local.view(torch.uint8), expected.view(torch.uint8)), name


BLOCK_PATTERNS = {
    "contiguous": (list(range(8, 24)), list(range(30, 46))),
    "scattered": ([63, 0, 17, 5, 40, 41, 2], [1, 60, 33, 7, 8, 20, 0]),
    "single": ([31], [12]),
    "all": (list(range(NUM_BLOCKS)), list(reversed(range(NUM_BLOCKS)))),
}


@pytest.mark.parametrize("pattern", sorted(BLOCK_PATTERNS))
def test_pull_block_patterns_float32(agent, peer_a, pattern):
    remote_ids, local_ids = BLOCK_PATTERNS[pattern]
    caches = _fresh(agent, MODEL_A)
    names = MODEL_A.names()
    result = agent.pull(peer_a, PullSpec(pattern, names, remote_ids, local_ids)).result(WAIT_S)
    assert result.num_blocks == len(local_ids)
    assert result.num_layers == 3
    assert result.payload_bytes == len(local_ids) * 3 * 2 * 4 * 16 * 8 * 4
    _expect(caches, SEED_A, names, remote_ids, local_ids)


@pytest.mark.parametrize("pattern", ["scattered", "all"])
def test_pull_bfloat16_draft_layer(agent, peer_a, pattern):
    remote_ids, local_ids = BLOCK_PATTERNS[pattern]
    caches = _fresh(agent, DRAFT_A)
    names = DRAFT_A.names()
    agent.pull(peer_a, PullSpec("draft", names, remote_ids, local_ids)).result(WAIT_S)
    _expect(caches, SEED_A, names, remote_ids, local_ids)


def test_tp_head_slice_into_a_two_head_cache(agent, peer_a):
    # Decode TP=2 rank 1 reading prefill TP=1: remote heads 2:4 land in local heads 0:2.
    caches = _fresh(agent, MODEL_A, DRAFT_A, num_heads=2)
    names = MODEL_A.names() + DRAFT_A.names()
    remote_ids, local_ids = BLOCK_PATTERNS["scattered"]
    spec = PullSpec("tp", names, remote_ids, local_ids, remote_heads=(2, 4), local_heads=(0, 2))
    result = agent.pull(peer_a, spec).result(WAIT_S)
    # 7 blocks x K/V x 2 heads x 16 x 8: three float32 layers and one bfloat16 layer.
    assert result.payload_bytes == 7 * 2 * 2 * 16 * 8 * (3 * 4 + 2)
    _expect(caches, SEED_A, names, remote_ids, local_ids, range(2, 4), range(0, 2))


def test_head_slice_into_the_middle_of_a_wider_cache(agent, peer_a):
    caches = _fresh(agent, MODEL_A)
    names = MODEL_A.names()
    spec = PullSpec("mid", names, [3, 9], [4, 5], remote_heads=(0, 2), local_heads=(1, 3))
    agent.pull(peer_a, spec).result(WAIT_S)
    _expect(caches, SEED_A, names, [3, 9], [4, 5], range(0, 2), range(1, 3))


def test_layer_subset_leaves_other_layers_untouched(agent, peer_a):
    caches = _fresh(agent, MODEL_A)
    agent.pull(peer_a, PullSpec("subset", ["model.layers.1.self_attn"], [6, 7], [0, 1])).result(
        WAIT_S
    )
    _expect(caches, SEED_A, ["model.layers.1.self_attn"], [6, 7], [0, 1])
    _expect(caches, SEED_A, ["model.layers.0.self_attn", "model.layers.2.self_attn"], [], [])


def test_concurrent_pulls_from_two_threads(agent, peer_a):
    caches = _fresh(agent, MODEL_A)
    names = MODEL_A.names()
    errors: list[BaseException] = []

    def puller(offset: int) -> None:
        try:
            for i in range(8):
                local = [offset + 2 * i, offset + 2 * i + 1]
                spec = PullSpec(f"t{offset}-{i}", names, [i, 63 - i], local)
                agent.pull(peer_a, spec).result(WAIT_S)
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=puller, args=(offset,)) for offset in (0, 32)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(WAIT_S * 2)
    assert errors == []
    remote = [b for i in range(8) for b in (i, 63 - i)]
    local = list(range(16)) + list(range(32, 48))
    _expect(caches, SEED_A, names, remote + remote, local)


def test_pipeline_split_pulls_layers_from_two_servers(agent, peer_a, peer_b):
    caches = _fresh(agent, MODEL_A, MODEL_B)
    remote_ids, local_ids = BLOCK_PATTERNS["scattered"]
    handles = [
        agent.pull(peer, PullSpec(f"pp{i}", group.names(), remote_ids, local_ids))
        for i, (peer, group) in enumerate([(peer_a, MODEL_A), (peer_b, MODEL_B)])
    ]
    for handle in handles:
        handle.result(WAIT_S)
    _expect(caches, SEED_A, MODEL_A.names(), remote_ids, local_ids)
    _expect(caches, SEED_B, MODEL_B.names(), remote_ids, local_ids)


def test_large_pull_is_split_into_bounded_messages(servers):
    # 12 KiB per block over 3 layers: 20 KiB messages carry one block each.
    config = TransportConfig(timeout_s=WAIT_S, chunk_bytes=20 << 10, max_inflight_chunks=3)
    with KVTransferAgent(config) as small:
        caches = _fresh(small, MODEL_A)
        peer = small.connect(servers[0].address)
        remote_ids, local_ids = BLOCK_PATTERNS["all"]
        spec = PullSpec("chunks", MODEL_A.names(), remote_ids, local_ids)
        result = small.pull(peer, spec).result(WAIT_S)
        assert result.num_messages == NUM_BLOCKS
        _expect(caches, SEED_A, MODEL_A.names(), remote_ids, local_ids)


def test_empty_pull_completes_without_traffic(agent, peer_a):
    _fresh(agent, MODEL_A)
    result = agent.pull(peer_a, PullSpec("empty", MODEL_A.names(), [], [])).result(WAIT_S)
    assert (result.num_blocks, result.num_messages, result.payload_bytes) == (0, 0, 0)


# -- errors -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("spec_kwargs", "code", "match"),
    [
        (
            {"layer_names": ["model.layers.0.self_attn", "model.layers.99.self_attn"]},
            ErrorCode.UNKNOWN_LAYER,
            r"\(UNKNOWN_LAYER\): unknown layer\(s\) 'model.layers.99.self_attn'; this server "
            r"holds 4 layers",
        ),
        (
            {"remote_block_ids": [0, 64]},
            ErrorCode.BLOCK_OUT_OF_RANGE,
            r"block id 64 out of range for layer 'model.layers.0.self_attn' with 64 blocks",
        ),
        (
            {"remote_heads": (3, 5), "local_heads": (0, 2)},
            ErrorCode.HEAD_RANGE,
            r"head range \[3,5\) out of bounds for layer 'model.layers.0.self_attn' with 4 heads",
        ),
        (
            {"layer_names": ["draft.layers.0.self_attn"]},
            ErrorCode.LAYOUT_MISMATCH,
            r"layer 'draft.layers.0.self_attn' dtype mismatch: request expects float32, server "
            r"has bfloat16",
        ),
    ],
)
def test_server_rejects_bad_pulls_and_keeps_serving(agent, peer_a, spec_kwargs, code, match):
    # The local float32 draft layer disagrees with the server's bfloat16 one on purpose.
    caches = _fresh(
        agent, MODEL_A, LayerGroup("model.layers", 99, 1), LayerGroup("draft.layers", 0, 1)
    )
    before = {name: tensor.clone() for name, tensor in caches.items()}
    fields = {
        "request_id": "bad",
        "layer_names": ["model.layers.0.self_attn"],
        "remote_block_ids": [0, 1],
        "local_block_ids": [0, 1],
    }
    fields.update(spec_kwargs)
    with pytest.raises(RemoteTransferError, match=match) as info:
        agent.pull(peer_a, PullSpec(**fields)).result(WAIT_S)
    assert info.value.code is code
    assert str(info.value).startswith("pull 'bad' refused by peer-")
    assert all(torch.equal(caches[name], before[name]) for name in caches)
    # The server is still serving.
    agent.pull(peer_a, PullSpec("after", MODEL_A.names(), [5], [5])).result(WAIT_S)
    _expect(caches, SEED_A, MODEL_A.names(), [5], [5])


def test_server_refuses_a_head_count_the_client_cannot_write(agent, peer_a):
    # Without remote_heads the server sends all 4 of its heads; the local cache has 2.
    _fresh(agent, MODEL_A, num_heads=2)
    with pytest.raises(
        RemoteTransferError, match=r"serves 4 heads \[0,4\) but the client writes 2"
    ):
        agent.pull(peer_a, PullSpec("count", MODEL_A.names(), [1], [1])).result(WAIT_S)


def test_local_validation_happens_before_any_traffic(agent, peer_a, servers):
    _fresh(agent, MODEL_A)
    with pytest.raises(ValueError, match=r"layers \['other.0'\] are not registered locally"):
        agent.pull(peer_a, PullSpec("v", ["other.0"], [0], [0]))
    with pytest.raises(ValueError, match=r"local block id 64 out of range"):
        agent.pull(peer_a, PullSpec("v", MODEL_A.names(), [0], [64]))
    with pytest.raises(ValueError, match=r"timeout_s must be > 0, got 0"):
        agent.pull(peer_a, PullSpec("v", MODEL_A.names(), [0], [0]), timeout_s=0)
    with pytest.raises(ValueError, match=r"peer must be a PeerHandle from connect\(\)"):
        agent.pull(servers[0].address, PullSpec("v", MODEL_A.names(), [0], [0]))
    # With the peer's published layouts, remote mismatches are caught locally too.
    informed = agent.connect(servers[0].address, layouts=servers[0].layouts)
    assert informed.layouts == servers[0].layouts
    with pytest.raises(ValueError, match=r"remote block id 64 out of range for layer"):
        agent.pull(informed, PullSpec("v", MODEL_A.names(), [64], [0]))
    _fresh(agent, LayerGroup("draft.layers", 0, 1))
    with pytest.raises(ValueError, match=r"dtype mismatch: local float32, remote bfloat16"):
        agent.pull(informed, PullSpec("v", ["draft.layers.0.self_attn"], [0], [0]))


def test_connect_is_cached_and_refuses_garbage(agent, servers):
    assert agent.connect(servers[1].address) is agent.connect(servers[1].address)
    with pytest.raises(InvalidPeerAddress, match=r"peer address has magic b'garb'"):
        agent.connect(b"garbage" * 40)
    truncated = servers[0].address[:-3]
    with pytest.raises(InvalidPeerAddress, match=r"declares \d+ UCX address bytes but carries"):
        agent.connect(truncated)


def test_pull_from_killed_server_fails_typed_and_leaves_the_cache_untouched():
    """Reported dead (UCX's TCP lane to it reset) or timed out: either way a typed error."""
    group = LayerGroup("model.layers", 0, 1)
    with (
        kv_server(44, [group]) as server,
        KVTransferAgent(TransportConfig(timeout_s=2.0)) as client,
    ):
        caches = _fresh(client, group)
        peer = client.connect(server.address)
        client.pull(peer, PullSpec("warm", group.names(), [1], [1])).result(WAIT_S)
        server.kill()
        before = caches[group.names()[0]].clone()
        handle = client.pull(
            peer, PullSpec("dead", group.names(), list(range(64)), list(range(64)))
        )
        with pytest.raises(
            (PeerUnreachable, TransferTimeoutError),
            match=r"pull 'dead'(: transfer with| from) peer-\w+ (failed: .*reset|timed out after)",
        ):
            handle.result(WAIT_S)
        assert handle.done()
        assert torch.equal(caches[group.names()[0]], before)


# -- in-process peers: a server that answers late, or never ----------------------------------


@pytest.fixture(params=PATHS)
def silent_pair(request):
    """A client and a peer agent that holds caches but is not serving (yet)."""
    group = LayerGroup("model.layers", 0, 2)
    with (
        KVTransferAgent(TransportConfig(send_timeout_s=1.0, **request.param)) as quiet,
        KVTransferAgent(TransportConfig(timeout_s=WAIT_S, **request.param)) as client,
    ):
        from transport_helpers.kv import make_caches

        quiet.register_kv_caches(make_caches(55, [group]))
        caches = _fresh(client, group)
        yield quiet, client, client.connect(quiet.address), caches, group


def test_cancelled_pull_never_writes_even_when_the_answer_arrives(silent_pair):
    quiet, client, peer, caches, group = silent_pair
    handle = client.pull(peer, PullSpec("late", group.names(), [1, 2], [3, 4]))
    wait_until(lambda: handle.messages_sent == 1, "the request sent", WAIT_S)
    assert not handle.done()
    assert handle.cancel() is True
    with pytest.raises(TransferCancelled, match=r"pull 'late' was cancelled"):
        handle.result(WAIT_S)
    assert handle.cancel() is False
    quiet.start_server()
    wait_until(lambda: quiet.server.requests_served == 1, "the late answer sent", WAIT_S)
    # The answer lands in the pull's private buffer. Answers from one peer arrive in order, so
    # once the next pull is done the late one was handled: only the next pull's block changed.
    client.pull(peer, PullSpec("next", group.names(), [5], [6])).result(WAIT_S)
    _expect(caches, 55, group.names(), [5], [6])


def test_timed_out_pull_resets_the_peer_and_the_next_pull_reconnects(silent_pair):
    quiet, client, peer, caches, group = silent_pair
    handle = client.pull(peer, PullSpec("slow", group.names(), [1, 2], [3, 4]), timeout_s=0.5)
    with pytest.raises(TransferTimeoutError, match=r"timed out after 0.5 s \(0/1 messages"):
        handle.result(WAIT_S)
    assert (handle.messages_sent, handle.messages_received) == (1, 0)
    quiet.start_server()
    wait_until(lambda: quiet.server.requests_served == 1, "the late answer sent", WAIT_S)
    # Its receives were cancelled: the answer matches nothing, and only "again" writes.
    client.pull(peer, PullSpec("again", group.names(), [7, 8], [9, 10])).result(WAIT_S)
    _expect(caches, 55, group.names(), [7, 8], [9, 10])


def test_a_timeout_resets_the_peer_for_other_pulls_in_flight(silent_pair):
    _, client, peer, _, group = silent_pair
    patient = client.pull(peer, PullSpec("patient", group.names(), [1], [1]))
    hasty = client.pull(peer, PullSpec("hasty", group.names(), [2], [2]), timeout_s=0.5)
    wait_until(lambda: patient.messages_sent == 1, "the patient request sent", WAIT_S)
    with pytest.raises(TransferTimeoutError, match=r"pull 'hasty'"):
        hasty.result(WAIT_S)
    with pytest.raises(EndpointReset, match=r"pull 'patient': connection to peer-\w+ was reset"):
        patient.result(WAIT_S)


def test_close_aborts_in_flight_pulls_and_stops_every_thread(silent_pair):
    quiet, client, peer, _, group = silent_pair
    handle = client.pull(peer, PullSpec("stuck", group.names(), [1], [1]))
    client.close()
    with pytest.raises(TransportClosed, match=r"pull 'stuck' aborted: the transfer agent was"):
        handle.result(WAIT_S)
    client.close()
    with pytest.raises(TransportClosed, match=r"the transfer agent is closed"):
        client.pull(peer, PullSpec("x", group.names(), [1], [1]))
    quiet.close()
    threads = [client._loop._thread, quiet._loop._thread, *client._client._workers]
    # An inline pull starts no pull thread.
    assert len(threads) == (3 if client.config.inline_bytes == 0 else 2)
    assert [t.name for t in threads if t.is_alive()] == []


def test_agent_without_peers_shuts_down_cleanly():
    before = {t.ident for t in threading.enumerate()}
    agent = KVTransferAgent()
    agent.register_kv_caches(empty_caches([LayerGroup("model.layers", 0, 1)]))
    agent.start_server()
    agent.close()
    assert {t.ident for t in threading.enumerate()} - before == set()


def test_registration_is_validated():
    with KVTransferAgent() as agent:
        with pytest.raises(ValueError, match=r"kv_caches must be a non-empty mapping"):
            agent.register_kv_caches({})
        with pytest.raises(ValueError, match=r"KV cache 'x' has elements that share memory"):
            agent.register_kv_caches({"x": torch.zeros(4, 1, 2, 16, 8).expand(4, 2, 2, 16, 8)})
        agent.register_kv_caches({"x": torch.zeros(4, 2, 2, 16, 8)})
        meta = torch.zeros(4, 2, 2, 16, 8, device="meta")
        with pytest.raises(ValueError, match=r"KV caches must share one device, got \['cpu', 'me"):
            agent.register_kv_caches({"y": meta})
        assert list(agent.kv_caches) == ["x"]
        assert agent.kv_layouts() == {"x": KVLayout(4, 2, 16, 8, "float32")}
    assert agent.closed
    with pytest.raises(TransportClosed, match=r"the transfer agent is closed"):
        agent.register_kv_caches({"x": torch.zeros(4, 2, 2, 16, 8)})


def test_disconnect_forgets_the_peer_and_a_new_connect_works(servers):
    with KVTransferAgent(TransportConfig(timeout_s=WAIT_S)) as fresh:
        caches = _fresh(fresh, MODEL_B)
        peer = fresh.connect(servers[1].address)
        fresh.disconnect(peer)
        again = fresh.connect(servers[1].address)
        assert again is not peer
        fresh.pull(again, PullSpec("re", MODEL_B.names(), [2], [3])).result(WAIT_S)
        _expect(caches, SEED_B, MODEL_B.names(), [2], [3])


def test_a_starved_local_connect_is_not_an_unreachable_peer(monkeypatch):
    """Creating an endpoint is local work of this process's UCX thread: when that thread does
    not run in time, the error says so (a timeout of ours), not that the peer is unreachable."""
    from concurrent.futures import Future

    from kvtransfer.transport import TransferTimeoutError

    config = TransportConfig(timeout_s=0.3, connect_timeout_s=0.05)
    with KVTransferAgent(config) as agent, KVTransferAgent() as peer:
        monkeypatch.setattr(agent._loop, "call", lambda fn: Future())  # never runs
        with pytest.raises(TransferTimeoutError, match=r"did not create the endpoint .* 0.3 s"):
            agent.connect(peer.address)


def test_agents_work_with_descriptors_beyond_1024():
    """vLLM raises the open-files limit and holds many: the progress thread's wait must take
    descriptors past select()'s 1024."""
    import os
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard < 1200:
        raise AssertionError(f"this test needs an open-files hard limit >= 1200, have {hard}")
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, 1200), hard))
    filler = [os.open(os.devnull, os.O_RDONLY) for _ in range(1100)]
    try:
        cache = torch.arange(2 * 2 * 2 * 4 * 8, dtype=torch.float32).view(2, 2, 2, 4, 8)
        target = torch.zeros_like(cache)
        with KVTransferAgent() as server, KVTransferAgent() as client:
            server.register_kv_caches({"l": cache})
            server.start_server()
            client.register_kv_caches({"l": target})
            for one_sided in (False, True):
                peer = client.connect(server.address, one_sided=one_sided)
                client.pull(peer, PullSpec(f"fd-{one_sided}", ["l"], [0, 1], [0, 1])).result(30)
        assert torch.equal(target, cache)
    finally:
        for fd in filler:
            os.close(fd)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
