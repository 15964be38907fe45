"""Layer-wise KV streaming through the router, with real daemons on ``builtin:small`` (a prefill
long enough to act on while it computes): the decode daemon is called as soon as the prefill
announces its params, loads the KV layer by layer while the prefill computes, gets the first
token through Continue and equals a colocated run; a prefill killed mid-stream gives the decode
its ``kv_load_failure_policy``; a client leaving mid-stream leaves no block held anywhere."""

from __future__ import annotations

import json
import random
import socket
import threading
import urllib.parse

import pytest
from serve_helpers.daemons import admin, colocated, running, start_daemon, start_router
from serve_helpers.probes import post, started, used_blocks
from waiting import wait_until

pytestmark = pytest.mark.integration

MODEL = ("--model", "builtin:small")
MAX_TOKENS = 6
# Long enough that the prefill computes for a good fraction of a second on 2 vCPUs.
PROMPT = [random.Random(11).randrange(32, 127) for _ in range(448)]
# Seconds to see the decode called once the request is sent (daemons start cold).
CALLED_WITHIN_S = 60.0
RELEASED_WITHIN_S = 15.0


@pytest.fixture(scope="module")
def expected() -> list[int]:
    return colocated([PROMPT], MAX_TOKENS, model="builtin:small")[0]


def _complete(url: str) -> tuple[int, dict]:
    status, text = post(url, {"prompt": PROMPT, "max_tokens": MAX_TOKENS})
    return status, json.loads(text)


@pytest.fixture(scope="module")
def pd(tmp_path_factory):
    logs = tmp_path_factory.mktemp("stream")
    prefill = start_daemon("prefill", logs, *MODEL, "--engine-id", "p")
    decode = start_daemon("decode", logs, *MODEL, "--engine-id", "d")
    router = start_router(logs, [prefill], [decode])
    with running(router, decode, prefill):
        yield router.address, prefill, decode


def test_the_decode_loads_while_the_prefill_computes_and_equals_colocated(pd, expected):
    url, prefill, decode = pd
    status, body = _complete(url)
    assert status == 200, body
    info = body["kvtransfer"]
    assert info["token_ids"] == expected
    assert info["num_recomputed_tokens"] == 0
    phases = info["phases"]
    # The load started before the first token existed: part of it hid behind the prefill.
    assert 0 < phases["kv_overlapped_s"] <= phases["kv_transfer_s"], phases
    wait_until(
        lambda: used_blocks(prefill) == used_blocks(decode) == 0,
        "both sides free",
        RELEASED_WITHIN_S,
    )


def test_a_client_leaving_mid_stream_leaves_nothing_held(pd):
    url, prefill, decode = pd
    calls = started(decode)
    parts = urllib.parse.urlsplit(url)
    body = json.dumps({"prompt": PROMPT, "max_tokens": MAX_TOKENS, "stream": True}).encode()
    with socket.create_connection((parts.hostname, parts.port), timeout=30) as client:
        client.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            + f"Content-Length: {len(body)}\r\n\r\n".encode()
            + body
        )
        # Gone while the prefill computes and the decode loads.
        wait_until(lambda: started(decode) > calls, "the decode called", CALLED_WITHIN_S)
    wait_until(
        lambda: used_blocks(prefill) == used_blocks(decode) == 0,
        "both sides free",
        RELEASED_WITHIN_S,
    )
    assert admin(decode.address, "status").counters["requests_aborted"] >= 1


@pytest.mark.parametrize("policy", ["fail", "recompute"])
def test_a_prefill_killed_mid_stream_gives_the_decode_its_failure_policy(
    tmp_path, expected, policy
):
    prefill = start_daemon("prefill", tmp_path, *MODEL, "--engine-id", "p")
    decode = start_daemon(
        "decode", tmp_path, *MODEL, "--engine-id", "d", kv={"kv_load_failure_policy": policy}
    )
    router = start_router(tmp_path, [prefill], [decode])
    with running(router, decode, prefill):
        answer: list[tuple[int, dict]] = []
        thread = threading.Thread(target=lambda: answer.append(_complete(router.address)))
        thread.start()
        wait_until(lambda: started(decode) == 1, "the decode called", CALLED_WITHIN_S)
        prefill.kill()  # while it computes: its KV never completes
        thread.join(120)
        ((status, body),) = answer
        if policy == "fail":
            assert status == 502, body
            assert "KV load failed for request" in body["error"]["message"]
        else:
            # The decode computed the prompt and the first token itself.
            assert status == 200, body
            assert body["kvtransfer"]["token_ids"] == expected
            assert body["kvtransfer"]["num_recomputed_tokens"] > 0
        wait_until(lambda: used_blocks(decode) == 0, "decode free", RELEASED_WITHIN_S)
        # The router stays up: the next request is a clean 5xx naming the prefill, not a hang.
        status, _ = _complete(router.address)
        assert status in (502, 503)
