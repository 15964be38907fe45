"""End to end through the router, with real daemons as separate processes: completions equal the
colocated `kvtransfer generate` output (JSON and SSE, 1P1D, 2P1D, TP/PP differing across the
sides, the decode loading every prompt's KV); a short token prompt decoded alone; a wedged
prefill that does not hold back its decode's failure; bad requests
get 400 naming the field, bodies over the shared limit 413; a dead decode daemon is ejected,
nothing is prefilled for it, and KV prefilled for a decode that failed is released at once (not
after its lease); a restarted daemon is re-admitted."""

from __future__ import annotations

import json
import subprocess
import sys
import time
import urllib.request

import pytest
from serve_helpers.daemons import (
    PROMPTS,
    admin,
    colocated,
    exit_used_blocks,
    running,
    start_daemon,
    start_router,
)
from serve_helpers.layer_times import (
    HOLD_BOUND_S,
    arm_hold,
    read_events,
    timed_env,
    timed_kv_config,
)
from serve_helpers.probes import get, post, started, used_blocks
from waiting import seconds_until, wait_until

from kvtransfer.clients.limits import DEFAULT_MAX_REQUEST_BYTES

pytestmark = pytest.mark.integration

MAX_TOKENS = 10
# The prefill's lease in the release test: KV freed well before it was freed by a release.
LEASE_S = 60
RELEASED_WITHIN_S = 15.0


def complete(base_url: str, prompt, **fields) -> dict:
    status, text = post(base_url, {"prompt": prompt, "max_tokens": MAX_TOKENS, **fields})
    assert status == 200, text
    return json.loads(text)


def stream(base_url: str, prompt, **fields) -> tuple[str, list[dict]]:
    body = {"prompt": prompt, "max_tokens": MAX_TOKENS, "stream": True, **fields}
    status, text = post(base_url, body)
    assert status == 200, text
    events = text.split("\n\n")
    assert events[-2:] == ["data: [DONE]", ""]
    chunks = [json.loads(e.removeprefix("data: ")) for e in events[:-2]]
    return "".join(c["choices"][0]["text"] for c in chunks), chunks


def generate_cli(prompt: str) -> list[int]:
    """The colocated reference, through the `kvtransfer generate` command."""
    command = [sys.executable, "-m", "kvtransfer", "generate", "--prompt", prompt, "--json"]
    done = subprocess.run(
        [*command, "--max-tokens", str(MAX_TOKENS)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)["token_ids"]


@pytest.fixture(scope="module")
def expected():
    return colocated(PROMPTS, MAX_TOKENS)


@pytest.fixture(scope="module")
def one_to_one(tmp_path_factory):
    logs = tmp_path_factory.mktemp("1p1d")
    prefill = start_daemon("prefill", logs, "--engine-id", "p")
    decode = start_daemon("decode", logs, "--engine-id", "d")
    router = start_router(logs, [prefill], [decode])
    with running(router, decode, prefill):
        yield router.address, prefill, decode
    assert exit_used_blocks(prefill) == exit_used_blocks(decode) == 0


def test_completions_equal_colocated_json_and_stream(one_to_one, expected):
    url, _, decode = one_to_one
    assert expected[1] == generate_cli(PROMPTS[1])
    for index, prompt in enumerate(PROMPTS):
        body = complete(url, prompt)
        info = body["kvtransfer"]
        assert info["token_ids"] == expected[index]
        assert body["choices"][0]["text"] == bytes(expected[index]).decode("utf-8", "replace")
        assert body["choices"][0]["finish_reason"] == "length"
        assert body["usage"] == {
            "prompt_tokens": len(prompt.encode()),
            "completion_tokens": MAX_TOKENS,
            "total_tokens": len(prompt.encode()) + MAX_TOKENS,
            # The first time this prompt is seen: nothing came from a prefix cache.
            "prompt_tokens_details": {"cached_tokens": 0},
        }
        assert info["kv_blocks_received"] > 0 and info["num_recomputed_tokens"] == 0
        phases = info["phases"]
        assert set(phases) == {
            "prefill_queue_s",
            "prefill_compute_s",
            "decode_queue_s",
            "kv_transfer_s",
            "kv_overlapped_s",
            "decode_first_step_s",
            "second_token_s",
        }
        assert all(seconds >= 0 for seconds in phases.values()), phases
        # Measured, not defaulted: the prefill computed, decode waited for KV then stepped.
        for phase in ("prefill_compute_s", "kv_transfer_s", "decode_first_step_s"):
            assert phases[phase] > 0, phases
        assert phases["kv_transfer_s"] == info["kv_transfer_s"]
        assert body["id"] == info["request_id"] and body["id"].startswith("cmpl-")
        text, chunks = stream(url, prompt)
        assert text == body["choices"][0]["text"]
        assert chunks[-1]["choices"][0]["finish_reason"] == "length"
        assert chunks[-1]["kvtransfer"]["token_ids"] == expected[index]
        assert all(c["id"] == chunks[0]["id"] for c in chunks)
    assert admin(decode.address, "status").counters["kv_tokens_recomputed"] == 0


def test_cached_tokens_are_the_prefills_prefix_hit_json_and_stream(one_to_one):
    """``usage.prompt_tokens_details.cached_tokens``: 0 for a new prompt; the full blocks the
    prefill found in its prefix cache when it comes again, streamed or not (the KV the decode
    pulled was computed, so it does not count)."""
    url, _, _ = one_to_one
    prompt = "Cached tokens are counted where the prompt was not computed again. " * 2
    size = len(prompt.encode())  # the built-in tokenizer is byte-level
    block = 16  # serve_helpers.daemons.COMMON_FLAGS
    first = complete(url, prompt)
    assert first["usage"]["prompt_tokens_details"] == {"cached_tokens": 0}
    again = complete(url, prompt)
    # Every full block but the one holding the last token, which is always computed.
    hit = (size - 1) // block * block
    assert hit > 0
    assert again["usage"]["prompt_tokens_details"] == {"cached_tokens": hit}
    assert again["kvtransfer"]["token_ids"] == first["kvtransfer"]["token_ids"]
    body = {
        "prompt": prompt,
        "max_tokens": MAX_TOKENS,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    status, text = post(url, body)
    assert status == 200, text
    events = [json.loads(e.removeprefix("data: ")) for e in text.split("\n\n")[:-2]]
    assert events[-1]["choices"] == []
    assert events[-1]["usage"]["prompt_tokens_details"] == {"cached_tokens": hit}
    assert events[-1]["usage"]["prompt_tokens"] == size


def test_token_id_prompt_and_stop(one_to_one, expected):
    url, _, _ = one_to_one
    body = complete(url, list(PROMPTS[2].encode()))
    assert body["kvtransfer"]["token_ids"] == expected[2]
    full = bytes(expected[2]).decode("utf-8", "replace")
    stop = full[4:6]
    stopped = complete(url, PROMPTS[2], stop=stop)
    assert stopped["choices"][0] == {
        "index": 0,
        "text": full[: full.index(stop)],
        "finish_reason": "stop",
        "logprobs": None,
    }


def test_seeded_sampling_through_the_router_equals_colocated(one_to_one):
    """The first token is sampled on the prefill, the rest on the decode: with the sampling
    noise keyed by (seed, position), seeded runs still equal a colocated run."""
    url, _, _ = one_to_one
    sampling = {"temperature": 0.9, "top_p": 0.95, "seed": 7}
    reference = colocated(PROMPTS, MAX_TOKENS, sampling=sampling)
    greedy = colocated(PROMPTS[1:2], MAX_TOKENS)[0]
    assert reference[1] != greedy  # the sampling really samples
    for index, prompt in enumerate(PROMPTS):
        assert complete(url, prompt, **sampling)["kvtransfer"]["token_ids"] == reference[index]


def test_the_first_token_comes_from_the_prefill_and_may_end_the_request(one_to_one, expected):
    url, prefill, decode = one_to_one
    decode_calls = started(decode)
    # max_tokens 1: the prefill's token is the whole answer; no KV is held for a decode.
    body = complete(url, PROMPTS[1], max_tokens=1)
    assert body["kvtransfer"]["token_ids"] == expected[1][:1]
    assert body["choices"][0]["finish_reason"] == "length"
    assert body["usage"]["completion_tokens"] == 1
    assert started(decode) == decode_calls  # max_tokens 1 never reaches the decode daemon
    # A stop string the first token completes: "stop", no text, as colocated.
    first_text = bytes(expected[1][:1]).decode()
    body = complete(url, PROMPTS[1], stop=first_text)
    assert body["choices"][0]["text"] == "" and body["choices"][0]["finish_reason"] == "stop"
    assert body["kvtransfer"]["token_ids"] == []
    text, chunks = stream(url, PROMPTS[1], stop=first_text)
    assert text == "" and chunks[-1]["choices"][0]["finish_reason"] == "stop"
    # The stopped ones were called while their prefill computed (KV streaming) and cancelled
    # when its first token ended them: a call cancelled before the decode daemon took it is
    # never counted there (seen once in CI-like runs: 1 of 2), so at most 2. Either way both
    # sides must give everything back.
    assert started(decode) <= decode_calls + 2
    wait_until(
        lambda: used_blocks(prefill) == used_blocks(decode) == 0,
        "the stopped requests' KV given back",
        RELEASED_WITHIN_S,
    )
    # Streamed normally, the first chunk holds exactly the first token's text.
    text, chunks = stream(url, PROMPTS[1])
    assert chunks[0]["choices"][0]["text"] == first_text
    assert text == bytes(expected[1]).decode("utf-8", "replace")


@pytest.mark.parametrize(
    ("body", "param", "message"),
    [
        ({"max_tokens": 3}, "prompt", "prompt: Field required"),
        ({"prompt": "", "max_tokens": 3}, "prompt", "prompt: must not be empty"),
        ({"prompt": [1, -2]}, "prompt", "prompt: token ids must be integers in [0, 2**32)"),
        ({"prompt": "x", "max_tokens": 0}, "max_tokens", "max_tokens: Input should be greater"),
        ({"prompt": "x", "temperature": -1}, "temperature", "temperature: Input should be"),
        ({"prompt": "x", "stop": ["a", "b", "c", "d", "e"]}, "stop", "stop: at most 4"),
        ({"prompt": "x", "presence_penalty": 0.5}, "presence_penalty", "presence_penalty: not"),
        ({"prompt": [1, 99999]}, None, "prompt.token_ids[1] = 99999 is outside the vocabulary"),
        ({"prompt": "x" * 1800}, None, "but the pool has only 96"),
    ],
)
def test_bad_requests_get_400_naming_the_field(one_to_one, expected, body, param, message):
    url, _, _ = one_to_one
    status, text = post(url, body)
    assert status == 400, text
    error = json.loads(text)["error"]
    assert message in error["message"]
    if param is not None:
        assert error["param"] == param
    assert complete(url, PROMPTS[0])["kvtransfer"]["token_ids"] == expected[0]


def test_non_json_body_unknown_model_models_health_metrics(one_to_one):
    url, _, _ = one_to_one
    status, text = post(url, None, raw=b"{not json")
    assert status == 400 and "not valid JSON" in text
    status, text = post(url, {"prompt": "x", "model": "gpt-9"})
    assert status == 404 and "model 'gpt-9' does not exist" in text
    assert json.loads(get(url, "/v1/models")[1])["data"][0]["id"] == "builtin"
    status, text = get(url, "/health")
    assert status == 200 and json.loads(text)["status"] == "ok"
    status, text = get(url, "/metrics")
    assert 'kvtransfer_router_requests_total{status="200"}' in text
    assert 'kvtransfer_router_requests_total{status="400"}' in text


def test_two_prefill_daemons_are_used_in_turn_and_a_dead_decode_is_named(tmp_path, expected):
    prefills = [
        start_daemon("prefill", tmp_path, "--engine-id", f"p{i}", name=f"p{i}") for i in (0, 1)
    ]
    decode = start_daemon("decode", tmp_path, "--engine-id", "d")
    router = start_router(tmp_path, prefills, [decode])
    with running(router, decode, *prefills):
        bodies = [complete(router.address, PROMPTS[i % 3]) for i in range(4)]
        assert [b["kvtransfer"]["token_ids"] for b in bodies] == [expected[i % 3] for i in range(4)]
        used = [b["kvtransfer"]["prefill"] for b in bodies]
        assert used == [prefills[0].address, prefills[1].address] * 2
        for prefill in prefills:
            assert admin(prefill.address, "status").counters["requests_finished"] == 2
        decode.kill()
        status, text = post(router.address, {"prompt": PROMPTS[0], "max_tokens": 4})
        assert status == 503
        assert (
            f"decode daemon {decode.address}: UNAVAILABLE" in json.loads(text)["error"]["message"]
        )
        status, text = get(router.address, "/health")
        assert status == 503
        assert json.loads(text)["decode"][decode.address] == "UNREACHABLE (UNAVAILABLE)"


def test_a_decode_that_died_is_replaced_by_another_with_the_same_kv(tmp_path, expected):
    prefill = start_daemon("prefill", tmp_path, "--engine-id", "p")
    decodes = [
        start_daemon("decode", tmp_path, "--engine-id", f"d{i}", name=f"d{i}") for i in (0, 1)
    ]
    # No health check after the first: only the failed call tells the router d0 is gone, and
    # round robin makes d0 the first pick.
    router = start_router(
        tmp_path, [prefill], decodes, "--policy", "round_robin", "--health-interval-s", "600"
    )
    with running(router, prefill, *decodes):
        decodes[0].kill()
        body = complete(router.address, PROMPTS[0])
        info = body["kvtransfer"]
        assert info["token_ids"] == expected[0]
        assert (info["prefill"], info["decode"]) == (prefill.address, decodes[1].address)
        # The KV the prefill computed once was pulled by the second decode, not recomputed.
        assert info["kv_blocks_received"] > 0 and info["num_recomputed_tokens"] == 0
        assert started(prefill) == 1
        retried = 'kvtransfer_router_retries_total{reason="UNAVAILABLE",role="decode"} 1.0'
        assert metric(router.address, retried)
        wait_until(lambda: used_blocks(prefill) == 0, "pulled KV freed", RELEASED_WITHIN_S)
    for daemon in (prefill, decodes[1]):
        assert exit_used_blocks(daemon) == 0


# PP 2 -> TP 2 through the router; TP 2 -> PP 2 runs daemon to daemon in
# test_pd_daemons.py (the router adds nothing that depends on the direction; 17 s of CI).
@pytest.mark.parametrize(
    ("prefill_flags", "decode_flags"), [(("--pp", "2"), ("--tp", "2"))], ids=["pp2-to-tp2"]
)
def test_parallelism_differs_across_the_sides(tmp_path, expected, prefill_flags, decode_flags):
    prefill = start_daemon("prefill", tmp_path, *prefill_flags)
    decode = start_daemon("decode", tmp_path, *decode_flags)
    router = start_router(tmp_path, [prefill], [decode])
    with running(router, decode, prefill):
        received = []
        for index, prompt in enumerate(PROMPTS):
            info = complete(router.address, prompt)["kvtransfer"]
            assert info["token_ids"] == expected[index]
            received.append(info["kv_blocks_received"])
        status = admin(decode.address, "status")
        assert (status.tp_size, status.pp_size) == (
            int(decode_flags[1]) if decode_flags[0] == "--tp" else 1,
            int(decode_flags[1]) if decode_flags[0] == "--pp" else 1,
        )
        # The KV came over from the other layout (every request loaded blocks, the decode's
        # counter adds them up), and nothing was computed again in its place.
        assert all(blocks > 0 for blocks in received), received
        assert status.counters["kv_blocks_received"] == sum(received)
        assert status.counters["kv_tokens_received"] > 0
        assert status.counters["kv_tokens_recomputed"] == 0
    assert exit_used_blocks(prefill) == exit_used_blocks(decode) == 0


def test_a_short_token_prompt_runs_on_the_decode_daemon_alone(one_to_one, expected, tmp_path):
    """--disagg-min-prompt-tokens: a prompt given as token ids and shorter than the threshold
    skips the prefill; the decode daemon computes it as a colocated engine would. The router's
    /workers shows each daemon's own report of its load."""
    _, prefill, decode = one_to_one
    token_file = tmp_path / "admin-token"
    token_file.write_text("adm1n\n")
    router = start_router(
        tmp_path,
        [prefill],
        [decode],
        "--disagg-min-prompt-tokens",
        "1000",
        "--admin-token-file",
        str(token_file),
        name="router-decode-alone",
    )
    with running(router):
        before = {d: admin(d.address, "status").counters for d in (prefill, decode)}
        body = complete(router.address, list(PROMPTS[1].encode()))
        info = body["kvtransfer"]
        assert info["token_ids"] == expected[1]
        assert info["decode"] == decode.address and "prefill" not in info
        assert (info["kv_blocks_received"], info["num_recomputed_tokens"]) == (0, 0)
        assert body["usage"]["prompt_tokens"] == len(PROMPTS[1].encode())
        after = {d: admin(d.address, "status").counters for d in (prefill, decode)}
        assert after[prefill]["requests_started"] == before[prefill]["requests_started"]
        for counter in ("kv_blocks_received", "kv_tokens_recomputed"):
            assert after[decode][counter] == before[decode][counter], counter
        # A text prompt's length is unknown here (no tokenizer): prefill then decode.
        assert complete(router.address, PROMPTS[1])["kvtransfer"]["prefill"] == prefill.address

        request = urllib.request.Request(
            f"{router.address}/workers", headers={"Authorization": "Bearer adm1n"}
        )

        def loads() -> dict | None:
            with urllib.request.urlopen(request, timeout=30) as response:
                workers = json.loads(response.read())["workers"]
            found = {w["role"]: w["load"] for w in workers}
            return found if all(found.values()) else None

        found = wait_until(loads, "both daemons' load read", RELEASED_WITHIN_S)
        assert found["prefill"]["kv_blocks_total"] == found["decode"]["kv_blocks_total"] == 96


def test_a_wedged_prefill_does_not_hold_back_the_decodes_failure(tmp_path):
    """The prefill announced its KV, then its engine stops before the last layer (held there up
    to `HOLD_BOUND_S`, as a wedged engine): the decode gives up on that layer after its transfer
    timeout and fails (policy "fail"), and the router answers that failure then, while the
    prefill is still stuck, instead of waiting for the prefill; the abandoned prefill request
    is cancelled and both sides end with no block in use."""
    times = {role: tmp_path / f"{role}-times.jsonl" for role in ("prefill", "decode")}
    hold = tmp_path / "hold"
    kv = {
        "kv_connector_extra_config": {"kv_stream_min_tokens": 0, "transfer_timeout_s": 2},
        "kv_load_failure_policy": "fail",
        **timed_kv_config(),
    }
    env = {role: timed_env(times[role]) for role in times}
    prefill = start_daemon(
        "prefill", tmp_path, "--engine-id", "p", kv=kv, env=timed_env(times["prefill"], hold)
    )
    decode = start_daemon("decode", tmp_path, "--engine-id", "d", kv=kv, env=env["decode"])
    router = start_router(tmp_path, [prefill], [decode])
    with running(router, decode, prefill):
        since = time.monotonic()
        # Held until a pull shows in a log nobody writes: only the hold's bound ends it.
        arm_hold(hold, tmp_path / "nobody.jsonl", since)
        status, text = post(router.address, {"prompt": PROMPTS[2], "max_tokens": 4})
        still_held = not any(e["event"] == "held" for e in read_events(times["prefill"], since))
        assert status == 502, text
        message = json.loads(text)["error"]["message"]
        assert message.startswith(f"decode daemon {decode.address}: "), message
        assert "KV load failed" in message, message
        assert still_held, "the answer waited for the prefill"
        # The prefill's engine (and so its KVAdmin status) answers again once the hold ends.
        wait_until(
            lambda: any(e["event"] == "held" for e in read_events(times["prefill"], since)),
            "the prefill's hold over",
            HOLD_BOUND_S + RELEASED_WITHIN_S,
        )
        wait_until(
            lambda: used_blocks(prefill) == used_blocks(decode) == 0,
            "both sides free",
            RELEASED_WITHIN_S,
        )
        assert admin(prefill.address, "status").counters["requests_aborted"] == 1
    assert exit_used_blocks(prefill) == exit_used_blocks(decode) == 0


def test_tls_and_admin_token_end_to_end(tmp_path, expected, capsys):
    from control_helpers.certs import make_certs

    from kvtransfer.cli import main

    certs = make_certs(tmp_path)
    secure = ("--tls-cert", certs.server_cert, "--tls-key", certs.server_key)
    token = {"KVTRANSFER_ADMIN_TOKEN": "t0ken"}
    prefill = start_daemon("prefill", tmp_path, *secure, env=token)
    decode = start_daemon("decode", tmp_path, *secure, env=token)
    router = start_router(tmp_path, [prefill], [decode], "--tls-ca", certs.ca)
    with running(router, decode, prefill):
        assert complete(router.address, PROMPTS[1])["kvtransfer"]["token_ids"] == expected[1]
        target = ["--target", decode.address, "--tls-ca", certs.ca, "--json"]
        assert main(["admin", "status", *target, "--token", "t0ken"]) == 0
        assert json.loads(capsys.readouterr().out)["counters"]["kv_blocks_received"] > 0
        assert main(["admin", "status", *target, "--token", "wrong"]) == 1
        assert "wrong admin token" in capsys.readouterr().err
        # Without the CA the daemon's certificate is not trusted: a clear error, no hang.
        assert main(["admin", "status", "--target", decode.address, "--timeout-s", "1"]) == 1
        capsys.readouterr()


def test_body_limit_is_one_clear_413_and_a_body_under_it_reaches_the_daemon(one_to_one, expected):
    url, prefill, _ = one_to_one
    frame = b'{"prompt": "", "max_tokens": 1}'

    def body(size: int) -> bytes:
        return frame.replace(b'""', b'"' + b"x" * (size - len(frame)) + b'"')

    before = admin(prefill.address, "status").counters["requests_rejected"]
    status, text = post(url, None, raw=body(DEFAULT_MAX_REQUEST_BYTES + 1))
    assert status == 413, text
    assert json.loads(text)["error"]["message"] == (
        f"the request body is larger than {DEFAULT_MAX_REQUEST_BYTES} bytes, this router's "
        "limit (--max-request-bytes)"
    )
    # Just under: the daemon's gRPC limit lets it through, and the prefill engine says why
    # the prompt cannot run (not a transport message about sizes).
    status, text = post(url, None, raw=body(DEFAULT_MAX_REQUEST_BYTES))
    assert status == 400, text
    message = json.loads(text)["error"]["message"]
    assert message.startswith(f"prefill daemon {prefill.address}: INVALID_ARGUMENT: request ")
    tokens = DEFAULT_MAX_REQUEST_BYTES - len(frame)  # one per byte with the built-in tokenizer
    assert message.endswith(
        f"prompt has {tokens} tokens but max_model_len is 2048 (no room to generate)"
    )
    after = admin(prefill.address, "status")
    assert after.counters["requests_rejected"] == before + 1
    assert after.num_used_blocks == 0
    assert complete(url, PROMPTS[0])["kvtransfer"]["token_ids"] == expected[0]


def metric(base_url: str, line: str) -> bool:
    return line in get(base_url, "/metrics")[1].splitlines()


def test_dead_decode_is_ejected_nothing_is_prefilled_for_it_and_held_kv_is_released(
    tmp_path, expected
):
    lease = {"kv_connector_extra_config": {"kv_lease_s": LEASE_S}}
    prefill = start_daemon("prefill", tmp_path, "--engine-id", "p", kv=lease)
    decode = start_daemon("decode", tmp_path, "--engine-id", "d")
    # One router only learns from failed calls (no check in the test's time), one checks often.
    calls_only = start_router(
        tmp_path, [prefill], [decode], "--health-interval-s", "600", name="router-calls"
    )
    checking = start_router(
        tmp_path, [prefill], [decode], "--health-interval-s", "0.2", name="router-checks"
    )
    restarted = None
    try:
        for url in (calls_only.address, checking.address):
            assert complete(url, PROMPTS[1])["kvtransfer"]["token_ids"] == expected[1]
        wait_until(lambda: used_blocks(prefill) == 0, "pulled KV freed", RELEASED_WITHIN_S)

        decode.kill()
        # Not known dead yet: prefilled, the decode call fails, the KV is given back at once.
        status, text = post(calls_only.address, {"prompt": PROMPTS[2], "max_tokens": 4})
        assert status == 503, text
        message = json.loads(text)["error"]["message"]
        assert message.startswith(f"decode daemon {decode.address}: UNAVAILABLE: "), message
        assert started(prefill) == 3
        took = seconds_until(
            lambda: used_blocks(prefill) == 0, "released KV freed", RELEASED_WITHIN_S
        )
        assert took < LEASE_S
        assert admin(prefill.address, "status").counters["kv_releases"] == 1
        released = 'kvtransfer_router_kv_releases_total{outcome="released",trigger="decode_failed"}'
        assert metric(calls_only.address, released + " 1.0")

        # Now ejected, by the failed call on one router and by the health checks on the other:
        # 503 naming the decode daemon, and nothing sent to the prefill.
        no_decode = f"no decode daemon is healthy ({decode.address}: UNREACHABLE (UNAVAILABLE))"
        wait_until(
            lambda: get(checking.address, "/health")[0] == 503,
            "health checks eject the dead decode",
            RELEASED_WITHIN_S,
        )
        for url in (calls_only.address, checking.address):
            status, text = post(url, {"prompt": PROMPTS[2], "max_tokens": 4})
            assert (status, json.loads(text)["error"]["message"]) == (503, no_decode)
            status, text = get(url, "/health")
            assert status == 503
            assert json.loads(text)["decode"] == {decode.address: "UNREACHABLE (UNAVAILABLE)"}
        assert started(prefill) == 3 and used_blocks(prefill) == 0

        # Restarted in place, with a smaller pool: the checking router re-admits it.
        port = decode.address.rsplit(":", 1)[1]
        small = ("--engine-id", "d", "--port", port, "--num-kv-blocks", "8")
        restarted = start_daemon("decode", tmp_path, *small, name="decode-restarted")
        wait_until(
            lambda: get(checking.address, "/health")[0] == 200,
            "re-admission",
            RELEASED_WITHIN_S,
        )
        assert complete(checking.address, PROMPTS[0])["kvtransfer"]["token_ids"] == expected[0]
        # A prompt the prefill takes and the decode cannot: the decode refuses it (400 naming
        # it), and the prefill's KV is given back at once.
        status, text = post(checking.address, {"prompt": PROMPTS[2], "max_tokens": 4})
        assert status == 400, text
        message = json.loads(text)["error"]["message"]
        assert message.startswith(f"decode daemon {decode.address}: RESOURCE_EXHAUSTED: ")
        took = seconds_until(
            lambda: used_blocks(prefill) == 0, "released KV freed", RELEASED_WITHIN_S
        )
        assert took < LEASE_S
        assert admin(prefill.address, "status").counters["kv_releases"] == 2
        assert get(checking.address, "/health")[0] == 200  # a refusal is no ejection
    finally:
        for process in (checking, calls_only, restarted, prefill):
            if process is not None:
                process.terminate()
    assert exit_used_blocks(prefill) == 0
    assert restarted is not None and exit_used_blocks(restarted) == 0
