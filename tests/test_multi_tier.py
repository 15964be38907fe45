"""`MultiConnector(UcxConnector, SharedStorageConnector)` between real daemons: UCX moves the KV,
the shared directory is a tier the decode falls back to.

Both daemons run the same Multi configuration. Through the real router, completions equal a
colocated run; the prefill daemon serves KVHandshake on its own port (the UCX child's book) and
both daemons count the KV in their admin status. Then the fallback, with real UCX failing for
real: the producer killed after the prefill (before the decode pulls), or its lease expired,
and the decode still completes, from the files, with the colocated tokens and no block left.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import grpc
import pytest
from serve_helpers.daemons import (
    BLOCK_SIZE,
    PROMPTS,
    admin,
    colocated,
    exit_used_blocks,
    running,
    start_daemon,
    start_router,
)
from serve_helpers.probes import post
from waiting import wait_until

from kvtransfer.clients.generation import GenerationClient, generate_request
from kvtransfer.connectors.multi import CHILD_PARAMS_KEY
from kvtransfer.serve.launcher import ServiceProcess
from kvtransfer.v1 import handshake_pb2, handshake_pb2_grpc

pytestmark = pytest.mark.integration

MAX_TOKENS = 8
CALL_TIMEOUT_S = 120.0
STORAGE_SLOT = "1:SharedStorageConnector"
# float32 KV of the built-in tiny model: 4 layers x K/V x 2 heads x block x head_dim 16 x 4 B.
BYTES_PER_BLOCK = 4 * 2 * 2 * BLOCK_SIZE * 16 * 4


def multi_config(storage: Path, **ucx_extra: Any) -> dict[str, Any]:
    """What a user writes in --kv-transfer-config for UCX plus a storage tier."""
    return {
        "kv_connector": "MultiConnector",
        "kv_connector_extra_config": {
            "connectors": [
                {
                    "kv_connector": "UcxConnector",
                    "kv_port": 0,
                    "kv_connector_extra_config": dict(ucx_extra),
                },
                {
                    "kv_connector": "SharedStorageConnector",
                    "kv_connector_extra_config": {"shared_storage_path": str(storage)},
                },
            ]
        },
    }


def start_pair(
    logs: Path, storage: Path, name: str, **ucx_extra: Any
) -> tuple[ServiceProcess, ServiceProcess]:
    kv = multi_config(storage, **ucx_extra)
    prefill = start_daemon("prefill", logs, "--engine-id", f"{name}-p", kv=kv, name=f"{name}-p")
    try:
        decode = start_daemon("decode", logs, "--engine-id", f"{name}-d", kv=kv, name=f"{name}-d")
    except BaseException:
        prefill.terminate()
        raise
    return prefill, decode


def counters(daemon: ServiceProcess) -> dict[str, int]:
    return admin(daemon.address, "status").counters


def used_blocks(daemon: ServiceProcess) -> int:
    return admin(daemon.address, "status").num_used_blocks


def num_blocks(prompt: str) -> int:
    return -(-len(prompt.encode()) // BLOCK_SIZE)


def handshake(address: str) -> handshake_pb2.GetHandshakeResponse:
    with grpc.insecure_channel(address) as channel:
        return handshake_pb2_grpc.KVHandshakeStub(channel).GetHandshake(
            handshake_pb2.GetHandshakeRequest(all_ranks=True), timeout=10
        )


def prefill_params(daemon: ServiceProcess, request_id: str, prompt: str) -> dict[str, Any]:
    with GenerationClient(daemon.address) as client:
        first = client.generate(
            generate_request(request_id, prompt, 1, kv_transfer_params={"do_remote_decode": True}),
            CALL_TIMEOUT_S,
        )
    assert first.finish_reason == "length", first.error
    assert first.kv_transfer_params is not None
    return first.kv_transfer_params


def decode(daemon: ServiceProcess, request_id: str, prompt: str, params: dict[str, Any]):
    with GenerationClient(daemon.address) as client:
        return client.generate(
            generate_request(request_id, prompt, MAX_TOKENS, kv_transfer_params=params),
            CALL_TIMEOUT_S,
        )


@pytest.fixture(scope="module")
def expected():
    return colocated(PROMPTS, MAX_TOKENS)


def test_router_pd_over_multi_equals_colocated_with_handshake_and_counters(tmp_path, expected):
    storage = tmp_path / "kv"
    # Every prompt streams its KV (announced early through the Multi's first child).
    prefill, decode_daemon = start_pair(tmp_path, storage, "m", kv_stream_min_tokens=0)
    router = start_router(tmp_path, [prefill], [decode_daemon])
    with running(router, decode_daemon, prefill):
        # The daemon port serves the UCX child's book: the same engine and generation as the
        # connector's own kv_port.
        own = handshake(prefill.ready["kv_handshake"])
        served = handshake(prefill.address)
        assert [p.engine_id for p in served.payloads] == ["m-p"]
        assert served.payloads == own.payloads
        assert decode_daemon.ready["kv_handshake"] is None  # a consumer serves none

        for index, prompt in enumerate(PROMPTS):
            status, text = post(router.address, {"prompt": prompt, "max_tokens": MAX_TOKENS})
            assert status == 200, text
            body = json.loads(text)
            assert body["kvtransfer"]["token_ids"] == expected[index]
            assert body["kvtransfer"]["num_recomputed_tokens"] == 0

        wait_until(
            lambda: used_blocks(decode_daemon) == used_blocks(prefill) == 0,
            "both daemons hold no KV block",
        )
        blocks = sum(num_blocks(prompt) for prompt in PROMPTS)
        sent, received = counters(prefill), counters(decode_daemon)
        assert sent["kv_blocks_sent"] == received["kv_blocks_received"] == blocks
        assert sent["kv_bytes_sent"] == received["kv_bytes_received"] == blocks * BYTES_PER_BLOCK
        # The tier kept everything the prefill computed; the decode never needed it.
        assert sent["kv_blocks_saved"] == blocks
        assert sent["kv_bytes_saved"] == blocks * BYTES_PER_BLOCK
        assert received["kv_loads_failed"] == 0 and received["handshakes"] >= 1
        assert len(list((storage / "m-p").iterdir())) == len(PROMPTS)
    assert exit_used_blocks(prefill) == exit_used_blocks(decode_daemon) == 0


def test_params_of_each_child_travel_apart(tmp_path):
    prefill, decode_daemon = start_pair(tmp_path, tmp_path / "kv", "ns")
    with running(decode_daemon, prefill):
        params = prefill_params(prefill, "ns-0", PROMPTS[1])
        # UCX owns the top level, the storage child's params are its own.
        assert params["remote_host"] and params["remote_kv_secret"]
        storage = params[CHILD_PARAMS_KEY][STORAGE_SLOT]
        assert storage["do_remote_prefill"] is True
        assert storage["remote_request_id"] == "ns-0"
        assert "remote_kv_secret" not in storage
        # A malformed slot fails that request alone, naming the key; the daemon keeps serving.
        bad = {**params, CHILD_PARAMS_KEY: {STORAGE_SLOT: "nope"}}
        with (
            GenerationClient(decode_daemon.address) as client,
            pytest.raises(grpc.RpcError) as info,
        ):
            client.generate(
                generate_request("ns-bad", PROMPTS[1], 4, kv_transfer_params=bad), CALL_TIMEOUT_S
            )
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert f"kv_transfer_params.{CHILD_PARAMS_KEY}.{STORAGE_SLOT}" in info.value.details()
        result = decode(decode_daemon, "ns-0", PROMPTS[1], params)
        assert result.finish_reason == "length", result.error
        wait_until(
            lambda: used_blocks(decode_daemon) == used_blocks(prefill) == 0,
            "both daemons hold no KV block",
        )
    assert exit_used_blocks(prefill) == exit_used_blocks(decode_daemon) == 0


def test_decode_falls_back_to_the_tier_when_the_producer_was_killed(tmp_path, expected):
    prompt = PROMPTS[2]
    prefill, decode_daemon = start_pair(tmp_path, tmp_path / "kv", "kill")
    with running(decode_daemon, prefill):
        params = prefill_params(prefill, "kill-0", prompt)
        saved = num_blocks(prompt) * BYTES_PER_BLOCK
        wait_until(
            lambda: counters(prefill)["kv_bytes_saved"] >= saved, "the tier holds the prompt's KV"
        )
        prefill.kill()
        wait_until(lambda: not prefill.is_alive(), "the producer is dead")

        result = decode(decode_daemon, "kill-0", prompt, params)
        assert result.finish_reason == "length", result.error
        assert result.token_ids == expected[2]
        got = counters(decode_daemon)
        assert got["kv_loads_failed"] == 1  # the UCX pull
        assert got["kv_blocks_received"] == num_blocks(prompt)  # from the files
        assert got["kv_tokens_recomputed"] == 0
        wait_until(lambda: used_blocks(decode_daemon) == 0, "decode holds no KV block")
    assert exit_used_blocks(decode_daemon) == 0


def test_decode_falls_back_to_the_tier_when_the_lease_expired(tmp_path, expected):
    prompt = PROMPTS[1]
    prefill, decode_daemon = start_pair(tmp_path, tmp_path / "kv", "lease", kv_lease_s=0.5)
    with running(decode_daemon, prefill):
        params = prefill_params(prefill, "lease-0", prompt)
        wait_until(lambda: counters(prefill)["kv_leases_expired"] == 1, "the lease expired")
        wait_until(lambda: used_blocks(prefill) == 0, "the producer freed the blocks")

        result = decode(decode_daemon, "lease-0", prompt, params)
        assert result.finish_reason == "length", result.error
        assert result.token_ids == expected[1]
        got = counters(decode_daemon)
        assert got["kv_loads_failed"] == 1
        assert got["kv_blocks_received"] == num_blocks(prompt)
        assert got["kv_tokens_recomputed"] == 0
        wait_until(lambda: used_blocks(decode_daemon) == 0, "decode holds no KV block")
    assert exit_used_blocks(prefill) == exit_used_blocks(decode_daemon) == 0
