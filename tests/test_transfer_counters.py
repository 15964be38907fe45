"""Transfer counters reconcile: what prefill says it sent and decode says it received.

A TP2 prefill daemon (each worker serves half the KV heads) and a TP1 decode daemon (which reads
both halves). Definitions (docs/operations.md#kv-counters, admin status): ``kv_blocks_sent``
counts the blocks a consumer reported it read, once per request; ``kv_blocks_received`` the
blocks of successful loads, once per request; ``kv_bytes_*`` the payload bytes read (in RMA mode
the prefill counts the bytes of the blocks consumers reported read), all workers and layers. So
blocks sent equal blocks received, and bytes sent are at least bytes received, equal when no
pull was cancelled on the decode side.
"""

from __future__ import annotations

import pytest
from serve_helpers.daemons import (
    BLOCK_SIZE,
    PROMPTS,
    admin,
    daemon_pair,
)
from serve_helpers.probes import cancel_after
from waiting import wait_until

from kvtransfer.clients.generation import GenerationClient, generate_request

pytestmark = pytest.mark.integration

REMOTE_DECODE = {"do_remote_decode": True}
# float32 KV of the built-in tiny model: 4 layers x K/V x 2 heads x block x head_dim 16 x 4 B.
BYTES_PER_BLOCK = 4 * 2 * 2 * BLOCK_SIZE * 16 * 4


LEASE_S = 10


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    logs = tmp_path_factory.mktemp("counters")
    # A call cancelled before the decode saw it leaves the prefill's KV to its lease (the router
    # would release it); a short one keeps _settled's wait short.
    kv = {"kv_connector_extra_config": {"kv_stream_min_tokens": 0, "kv_lease_s": LEASE_S}}
    with daemon_pair(
        logs, ["--engine-id", "p-tp2", "--tp", "2"], ["--engine-id", "d-tp1"], kv=kv
    ) as pair:
        yield pair


def _counters(address: str) -> dict[str, int]:
    return admin(address, "status").counters


def _settled(prefill, decode) -> tuple[dict[str, int], dict[str, int]]:
    """Counters once both daemons hold no blocks (every release reached the prefill)."""
    wait_until(
        lambda: (
            admin(prefill.address, "status").num_used_blocks
            == admin(decode.address, "status").num_used_blocks
            == 0
        ),
        "both daemons hold no blocks",
    )
    return _counters(prefill.address), _counters(decode.address)


def _prefill(client: GenerationClient, request_id: str, prompt: str) -> dict:
    first = client.generate(
        generate_request(request_id, prompt, 1, kv_transfer_params=REMOTE_DECODE)
    )
    assert first.finish_reason == "length", first.error
    return first.kv_transfer_params


def _blocks(prompt: str) -> int:
    return -(-len(prompt.encode()) // BLOCK_SIZE)


def test_sent_equals_received_across_a_head_split(pair):
    prefill, decode = pair
    sent0, received0 = _settled(prefill, decode)
    with GenerationClient(prefill.address) as p, GenerationClient(decode.address) as d:
        for index, prompt in enumerate(PROMPTS):
            params = _prefill(p, f"ok-{index}", prompt)
            result = d.generate(
                generate_request(f"ok-{index}", prompt, 4, kv_transfer_params=params)
            )
            assert result.finish_reason == "length", result.error
    sent, received = _settled(prefill, decode)
    blocks = sum(_blocks(prompt) for prompt in PROMPTS)
    assert sent["kv_blocks_sent"] - sent0["kv_blocks_sent"] == blocks
    assert received["kv_blocks_received"] - received0["kv_blocks_received"] == blocks
    assert sent["kv_bytes_sent"] - sent0["kv_bytes_sent"] == blocks * BYTES_PER_BLOCK
    assert received["kv_bytes_received"] - received0["kv_bytes_received"] == (
        blocks * BYTES_PER_BLOCK
    )
    # The default data plane read every byte one-sided (the prefill served none itself).
    one_sided = received["kv_bytes_received_one_sided"] - received0["kv_bytes_received_one_sided"]
    assert one_sided == blocks * BYTES_PER_BLOCK


def test_aborts_keep_the_counters_reconciled(pair):
    prefill, decode = pair
    sent0, received0 = _settled(prefill, decode)
    prompt = PROMPTS[2]
    with GenerationClient(prefill.address) as p, GenerationClient(decode.address) as d:
        for index in range(6):
            params = _prefill(p, f"abort-{index}", prompt)
            call = d.stream(
                generate_request(f"abort-{index}", prompt, 64, kv_transfer_params=params)
            )
            # Cancel at various points: before, during and after the load.
            cancel_after(call, 0.002 * index)
        params = _prefill(p, "after", prompt)
        result = d.generate(generate_request("after", prompt, 4, kv_transfer_params=params))
        assert result.finish_reason == "length", result.error
    sent, received = _settled(prefill, decode)
    blocks_sent = sent["kv_blocks_sent"] - sent0["kv_blocks_sent"]
    blocks_received = received["kv_blocks_received"] - received0["kv_blocks_received"]
    bytes_sent = sent["kv_bytes_sent"] - sent0["kv_bytes_sent"]
    bytes_received = received["kv_bytes_received"] - received0["kv_bytes_received"]
    assert blocks_sent == blocks_received
    # At least the last, uncancelled request's blocks beyond decode's prefix-cache hit.
    assert blocks_received > 0
    assert bytes_received == blocks_received * BYTES_PER_BLOCK
    assert bytes_sent >= bytes_received
    assert bytes_sent % (BYTES_PER_BLOCK // 2) == 0  # whole half-head blocks, nothing partial
