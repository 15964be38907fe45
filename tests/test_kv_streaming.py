"""Layer-wise KV streaming through the router, with real daemons on ``builtin:small`` (a prefill
long enough to act on while it computes): the decode daemon is called as soon as the prefill
announces its params, loads the KV layer by layer while the prefill computes, gets the first
token through Continue and equals a colocated run; on the push data plane the prefill writes
each layer into the decode's blocks as it computes it, with the same result; a prefill killed
mid-stream gives the decode its ``kv_load_failure_policy``; a client leaving mid-stream leaves
no block held anywhere.

"Layer by layer while the prefill computes" is seen, not inferred from reported phases: both
daemons run `serve_helpers.layer_times.TimedUcxConnector`, which writes down when the prefill
wrote each layer's KV and when each of the decode's pulls (or the prefill's pushes) landed (one
clock), and holds the prefill's forward before its last layer until a layer has landed on the
decode."""

from __future__ import annotations

import contextlib
import json
import random
import socket
import threading
import time
import urllib.parse
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from serve_helpers.daemons import admin, colocated, running, start_daemon, start_router
from serve_helpers.layer_times import arm_hold, read_events, timed_env, timed_kv_config
from serve_helpers.probes import post, started, used_blocks
from waiting import wait_until

from kvtransfer.serve.launcher import ServiceProcess

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


@dataclass
class PD:
    url: str
    prefill: ServiceProcess
    decode: ServiceProcess
    # When each daemon's connector saw what (`serve_helpers.layer_times`).
    prefill_times: Path
    decode_times: Path
    # Armed: the prefill's next forward waits at its last layer for a pull to land on decode.
    hold: Path


@contextlib.contextmanager
def _timed_pair(logs: Path, data_plane: str) -> Iterator[PD]:
    """A prefill and a decode daemon on ``data_plane`` behind a router, every prompt streamed
    (as start_daemon's default), through the timed UcxConnector."""
    times = {role: logs / f"{role}-times.jsonl" for role in ("prefill", "decode")}
    hold = logs / "hold"
    extra = {"kv_stream_min_tokens": 0, "data_plane": data_plane}
    kv = {"kv_connector_extra_config": extra, **timed_kv_config()}
    prefill = start_daemon(
        "prefill", logs, *MODEL, "--engine-id", "p", kv=kv, env=timed_env(times["prefill"], hold)
    )
    decode = start_daemon(
        "decode", logs, *MODEL, "--engine-id", "d", kv=kv, env=timed_env(times["decode"])
    )
    router = start_router(logs, [prefill], [decode])
    with running(router, decode, prefill):
        yield PD(router.address, prefill, decode, times["prefill"], times["decode"], hold)


@pytest.fixture(scope="module")
def pd(tmp_path_factory):
    with _timed_pair(tmp_path_factory.mktemp("stream"), "rma") as pair:
        yield pair


def test_the_decode_loads_while_the_prefill_computes_and_equals_colocated(pd, expected):
    since = time.monotonic()
    # The prefill's forward stops before its last layer until a layer landed on the decode:
    # only a decode loading layer by layer while the prefill computes can release it.
    arm_hold(pd.hold, pd.decode_times, since)
    try:
        status, body = _complete(pd.url)
    finally:
        pd.hold.unlink(missing_ok=True)  # taken by the prefill's forward, unless it never ran
    held = [e["released_by"] for e in read_events(pd.prefill_times, since) if e["event"] == "held"]
    # Released by a layer landing on the decode, not by the hold's bound (a decode that loads
    # only once the whole prompt is computed cannot release it).
    assert held == ["transfer"], (held, status, body)
    assert status == 200, body
    info = body["kvtransfer"]
    assert info["token_ids"] == expected
    assert info["num_recomputed_tokens"] == 0
    phases = info["phases"]
    # The load started before the first token existed: part of it hid behind the prefill.
    assert 0 < phases["kv_overlapped_s"] <= phases["kv_transfer_s"], phases
    wait_until(
        lambda: used_blocks(pd.prefill) == used_blocks(pd.decode) == 0,
        "both sides free",
        RELEASED_WITHIN_S,
    )
    # What each side's connector saw: the prefill's one forward over the prompt (each layer's
    # KV written, in order), the decode's pulls completing.
    produced = read_events(pd.prefill_times, since)
    forward = produced[: next(i for i, e in enumerate(produced) if e["event"] == "forward_done")]
    saved = {e["layer"]: e["t"] for e in forward if e["event"] == "saved"}
    layers = list(saved)
    pulls = [e for e in read_events(pd.decode_times, since) if e["event"] == "pulled"]
    landed = {e["layers"][0]: e["t"] for e in pulls}
    timeline = sorted(
        [(e["t"] - since, f"prefill {e['event']}", e.get("layer")) for e in forward]
        + [(t - since, "decode pulled", layer) for layer, t in landed.items()]
    )
    assert len(layers) > 1, timeline
    # Loaded layer by layer: one pull per layer, each layer once.
    assert [e["layers"] for e in pulls if len(e["layers"]) != 1] == [], timeline
    assert sorted(landed) == sorted(layers) and len(pulls) == len(layers), timeline
    # No layer was served before the prefill had written it ...
    assert [layer for layer in layers if landed[layer] < saved[layer]] == [], timeline
    # ... and some landed on the decode while the prefill was still computing (before it wrote
    # its last layer), the first layer first.
    early = [layer for layer in layers if landed[layer] < saved[layers[-1]]]
    assert early and early[0] == layers[0], timeline


@pytest.fixture(scope="module")
def pd_push(tmp_path_factory):
    """`pd` on the push data plane: the decode asks, the prefill writes each layer."""
    with _timed_pair(tmp_path_factory.mktemp("stream-push"), "push") as pair:
        yield pair


def test_the_prefill_pushes_each_layer_while_it_computes_and_equals_colocated(pd_push, expected):
    pd = pd_push
    since = time.monotonic()
    # The prefill's forward stops before its last layer until one of its pushes landed on the
    # decode: only a push written layer by layer while the prefill computes can release it.
    arm_hold(pd.hold, pd.prefill_times, since)
    try:
        status, body = _complete(pd.url)
    finally:
        pd.hold.unlink(missing_ok=True)
    produced = read_events(pd.prefill_times, since)
    held = [e["released_by"] for e in produced if e["event"] == "held"]
    assert held == ["transfer"], (held, status, body)
    assert status == 200, body
    info = body["kvtransfer"]
    assert info["token_ids"] == expected
    assert info["num_recomputed_tokens"] == 0
    wait_until(
        lambda: used_blocks(pd.prefill) == used_blocks(pd.decode) == 0,
        "both sides free",
        RELEASED_WITHIN_S,
    )
    forward = produced[: next(i for i, e in enumerate(produced) if e["event"] == "forward_done")]
    saved = {e["layer"]: e["t"] for e in forward if e["event"] == "saved"}
    layers = list(saved)
    pushes = [e for e in produced if e["event"] == "pushed"]
    landed = {layer: e["t"] for e in pushes for layer in e["layers"]}
    # (The prefill's log holds its pushes too: its pusher threads write them.)
    timeline = sorted(
        (
            (e["t"] - since, e["event"], e.get("layer") or e.get("layers"))
            for e in produced
            if e["t"] <= saved[layers[-1]] or e["event"] == "pushed"
        ),
        key=lambda entry: entry[0],
    )
    assert len(layers) > 1 and sorted(landed) == sorted(layers), timeline
    # Each layer written once, never before the prefill computed it ...
    assert sum(len(e["layers"]) for e in pushes) == len(layers), timeline
    assert [layer for layer in layers if landed[layer] < saved[layer]] == [], timeline
    # ... and the first ones in the decode's blocks while the prefill still computed.
    early = [layer for layer in layers if landed[layer] < saved[layers[-1]]]
    assert early and early[0] == layers[0], timeline
    # The decode pulled nothing: every byte it received was written by the prefill.
    counters = admin(pd.decode.address, "status").counters
    assert counters["kv_bytes_received_pushed"] == counters["kv_bytes_received"] > 0, counters
    assert not [e for e in read_events(pd.decode_times, since) if e["event"] == "pulled"]


def test_a_client_leaving_mid_stream_leaves_nothing_held(pd):
    url, prefill, decode = pd.url, pd.prefill, pd.decode
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
