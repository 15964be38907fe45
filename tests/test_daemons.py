"""The prefill and decode daemons as real processes: Generation over gRPC equals a colocated run,
admin counters show the KV really moved, bad input is rejected with the field named while the
daemons keep serving, cancellation frees blocks, ReleaseKV frees held KV at once (and only with
the request's secret), messages up to the shared size limit get through, drain and SIGTERM lose
nothing."""

from __future__ import annotations

import asyncio
import threading
import time
import urllib.request

import grpc
import pytest
from serve_helpers.daemons import (
    BLOCK_SIZE,
    PROMPTS,
    admin,
    colocated,
    daemon_pair,
    exit_used_blocks,
    running,
    start_daemon,
)
from waiting import wait_until

from kvtransfer.clients.control import check_health
from kvtransfer.clients.generation import GenerateResult, GenerationClient, generate_request
from kvtransfer.clients.limits import DEFAULT_MAX_REQUEST_BYTES, grpc_message_limit

pytestmark = pytest.mark.integration

MAX_TOKENS = 12
REMOTE_DECODE = {"do_remote_decode": True}


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    logs = tmp_path_factory.mktemp("daemons")
    with daemon_pair(logs, ["--engine-id", "p0"], ["--engine-id", "d0"]) as pair:
        yield pair


@pytest.fixture(scope="module")
def expected():
    return colocated(PROMPTS, MAX_TOKENS)


def pd(prefill, decode, request_id, prompt, max_tokens=MAX_TOKENS, **options):
    with GenerationClient(prefill.address) as p, GenerationClient(decode.address) as d:
        first = p.generate(
            generate_request(request_id, prompt, 1, kv_transfer_params=REMOTE_DECODE)
        )
        assert first.finish_reason == "length", first.error
        params = first.kv_transfer_params
        return first, d.generate(
            generate_request(request_id, prompt, max_tokens, kv_transfer_params=params, **options)
        )


def wait_for_free_blocks(address: str) -> None:
    wait_until(lambda: admin(address, "status").num_used_blocks == 0, f"{address} frees its blocks")


def test_disaggregated_equals_colocated_and_counters_show_the_transfer(pair, expected):
    prefill, decode = pair
    before = admin(decode.address, "status").counters
    for index, prompt in enumerate(PROMPTS):
        first, result = pd(prefill, decode, f"eq-{index}", prompt)
        assert result.token_ids == expected[index]
        assert result.finish_reason == "length"
        assert first.kv_transfer_params["remote_engine_id"] == "p0"
        num_tokens = len(prompt.encode())
        blocks = -(-num_tokens // BLOCK_SIZE)
        assert result.metrics.kv_blocks_received == blocks
        assert result.metrics.num_cached_tokens == num_tokens
        assert result.metrics.num_recomputed_tokens == 0
        assert result.num_messages > 1  # streamed, not one message at the end
    wait_for_free_blocks(prefill.address)
    after = admin(decode.address, "status")
    received = after.counters["kv_blocks_received"] - before["kv_blocks_received"]
    assert received == sum(-(-len(p.encode()) // BLOCK_SIZE) for p in PROMPTS)
    assert after.counters["kv_bytes_received"] > before["kv_bytes_received"]
    assert after.counters["kv_tokens_recomputed"] == before["kv_tokens_recomputed"]
    assert after.role == "kv_consumer" and after.engine_id == "d0"
    sent = admin(prefill.address, "status").counters
    assert sent["kv_blocks_sent"] >= received
    peers = admin(decode.address, "peers")
    assert [(p.engine_id, p.state.name) for p in peers] == [("p0", "READY")]


def test_token_id_prompts_and_stop_strings(pair, expected):
    prefill, decode = pair
    prompt_ids = list(PROMPTS[1].encode())
    _, by_ids = pd(prefill, decode, "ids", prompt_ids)
    assert by_ids.token_ids == expected[1]
    full = bytes(expected[1]).decode("latin-1")
    stop = full[3:5]
    _, stopped = pd(prefill, decode, "stop", PROMPTS[1], stop=[stop])
    assert stopped.finish_reason == "stop"
    assert stopped.text == full[: full.index(stop)]
    wait_for_free_blocks(decode.address)


@pytest.mark.parametrize(
    ("change", "code", "message"),
    [
        ({"request_id": ""}, "INVALID_ARGUMENT", "request_id must not be empty"),
        ({"max_tokens": 0}, "INVALID_ARGUMENT", "sampling.max_tokens must be >= 1, got 0"),
        ({"temperature": -1.0}, "INVALID_ARGUMENT", "sampling.temperature must be >= 0"),
        ({"prompt": []}, "INVALID_ARGUMENT", "prompt must not be empty"),
        ({"prompt": [1, 9999]}, "INVALID_ARGUMENT", "prompt.token_ids[1] = 9999 is outside"),
        (
            {"params": {"do_remote_prefill": True, "remote_engine_id": "p0"}},
            "INVALID_ARGUMENT",
            "kv_transfer_params.remote_request_id is missing",
        ),
        (
            {"params": {"do_remote_prefill": "yes"}},
            "INVALID_ARGUMENT",
            "kv_transfer_params.do_remote_prefill must be a bool",
        ),
        ({"prompt": "x" * 2000}, "RESOURCE_EXHAUSTED", "but the pool has only 96"),
    ],
)
def test_bad_requests_are_rejected_with_the_field_named(pair, expected, change, code, message):
    _, decode = pair
    request = generate_request(
        change.get("request_id", "bad"),
        change.get("prompt", PROMPTS[0]),
        change.get("max_tokens", 4),
        temperature=change.get("temperature"),
        kv_transfer_params=change.get("params"),
    )
    with GenerationClient(decode.address) as client:
        with pytest.raises(grpc.RpcError) as failed:
            client.generate(request)
        assert failed.value.code().name == code
        assert message in failed.value.details()
        # Still serving, nothing held.
        result = client.generate(generate_request("after-bad", PROMPTS[0], MAX_TOKENS))
    assert result.token_ids == expected[0]
    assert admin(decode.address, "status").num_used_blocks == 0


def test_malformed_params_json_and_duplicate_ids(pair):
    prefill, _ = pair
    request = generate_request("json", PROMPTS[0], 2)
    request.kv_transfer_params_json = "[1, 2]"
    with GenerationClient(prefill.address) as client:
        with pytest.raises(grpc.RpcError, match="kv_transfer_params_json must be a JSON object"):
            client.generate(request)
        stream = client.stream(generate_request("dup", PROMPTS[2], 200))
        next(stream)
        with pytest.raises(grpc.RpcError) as failed:
            client.generate(generate_request("dup", PROMPTS[0], 2))
        assert failed.value.code() == grpc.StatusCode.ALREADY_EXISTS
        stream.cancel()
    wait_for_free_blocks(prefill.address)


def test_cancelled_call_aborts_the_request_and_frees_its_blocks(pair):
    _, decode = pair
    with GenerationClient(decode.address) as client:
        stream = client.stream(generate_request("cancel-me", PROMPTS[2], 400, ignore_eos=True))
        next(stream)
        assert admin(decode.address, "status").num_used_blocks > 0
        stream.cancel()
    wait_for_free_blocks(decode.address)
    assert admin(decode.address, "status").counters["requests_aborted"] >= 1


def test_admin_transfers_show_kv_held_for_a_consumer_and_abort_gives_it_back(pair):
    prefill, _ = pair
    with GenerationClient(prefill.address) as client:
        first = client.generate(
            generate_request("held", PROMPTS[2], 1, kv_transfer_params=REMOTE_DECODE)
        )
    (held,) = [t for t in admin(prefill.address, "transfers") if t.request_id == "held"]
    assert held.direction.name == "SEND"
    assert held.num_blocks == len(first.kv_transfer_params["remote_block_ids"])
    assert held.num_bytes > 0
    assert admin(prefill.address, "abort", "no-such-request") is False
    # An operator's abort of a finished request gives back the KV it holds for a consumer.
    assert admin(prefill.address, "abort", "held") is True
    assert admin(prefill.address, "transfers") == []
    assert admin(prefill.address, "abort", "held") is False
    with GenerationClient(prefill.address) as client:
        assert client.release_kv("held", first.kv_transfer_params) is False


def test_release_kv_frees_held_kv_at_once_and_only_with_its_secret(pair):
    prefill, _ = pair
    with GenerationClient(prefill.address) as client:
        first = client.generate(
            generate_request("release-me", PROMPTS[2], 1, kv_transfer_params=REMOTE_DECODE)
        )
        params = first.kv_transfer_params
        assert held_blocks(prefill.address, "release-me") == len(params["remote_block_ids"])
        before = admin(prefill.address, "status").counters["kv_releases"]
        for change, code, message in [
            ({"remote_kv_secret": "guess"}, "PERMISSION_DENIED", "wrong kv secret"),
            ({"remote_engine_id": "p9"}, "INVALID_ARGUMENT", "kv_transfer_params.remote_engine_id"),
        ]:
            with pytest.raises(grpc.RpcError) as refused:
                client.release_kv("release-me", {**params, **change})
            assert refused.value.code().name == code
            assert message in refused.value.details()
        with pytest.raises(grpc.RpcError) as refused:
            client.release_kv("release-me", "{nope")
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "kv_transfer_params_json is not valid JSON" in refused.value.details()
        assert held_blocks(prefill.address, "release-me") > 0  # all refused: still held
        # The params exactly as returned: freed at the next step, far inside the 30 s lease.
        assert client.release_kv("release-me", params) is True
        wait_until(
            lambda: held_blocks(prefill.address, "release-me") == 0, "released blocks freed", 10
        )
        assert client.release_kv("release-me", params) is False  # idempotent
    assert admin(prefill.address, "status").counters["kv_releases"] == before + 1


def held_blocks(address: str, request_id: str) -> int:
    """The blocks a prefill daemon still holds for ``request_id`` (KVAdmin ListTransfers)."""
    return sum(t.num_blocks for t in admin(address, "transfers") if t.request_id == request_id)


def test_messages_up_to_the_shared_limit_reach_the_engine(pair):
    _, decode = pair
    limit = grpc_message_limit(DEFAULT_MAX_REQUEST_BYTES)
    with GenerationClient(decode.address) as client:
        # A prompt as long as the router lets through arrives; the engine says why it cannot run.
        fits = "x" * DEFAULT_MAX_REQUEST_BYTES
        with pytest.raises(grpc.RpcError) as refused:
            client.generate(generate_request("big", fits, 1))
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert refused.value.details().endswith(
            f"prompt has {DEFAULT_MAX_REQUEST_BYTES} tokens but max_model_len is 2048 "
            "(no room to generate)"
        )
        # Past the gRPC limit: refused by gRPC before the daemon parses anything.
        with pytest.raises(grpc.RpcError) as refused:
            client.generate(generate_request("bigger", "x" * limit, 1))
        assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "larger than max" in refused.value.details()
        assert f"vs. {limit}" in refused.value.details()
    assert admin(decode.address, "status").num_used_blocks == 0


def test_health_reflection_and_metrics(pair):
    prefill, decode = pair
    for daemon in (prefill, decode):
        assert asyncio.run(check_health(daemon.address)) == "SERVING"
        assert asyncio.run(check_health(daemon.address, "kvtransfer.v1.Generation")) == "SERVING"
    assert asyncio.run(check_health(prefill.address, "kvtransfer.v1.KVHandshake")) == "SERVING"
    port = decode.ready["metrics_port"]
    body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    assert 'kvtransfer_requests_total{engine_id="d0",finish_reason="length",role="decode"}' in body
    assert "kvtransfer_time_to_first_token_seconds_bucket" in body
    assert "kvtransfer_kv_transfer_bytes_count" in body


def test_drain_stops_admitting_and_sigterm_finishes_in_flight_requests(tmp_path):
    expected = colocated([PROMPTS[2]], 120)
    prefill = start_daemon("prefill", tmp_path, "--engine-id", "drain-p")
    decode = start_daemon("decode", tmp_path, "--engine-id", "drain-d")
    with running(decode, prefill):
        _, warm = pd(prefill, decode, "warm", PROMPTS[2], 120)
        assert warm.token_ids == expected[0]
        results: dict[str, object] = {}

        def run(request_id: str) -> None:
            try:
                results[request_id] = pd(prefill, decode, request_id, PROMPTS[2], 120)[1]
            except grpc.RpcError as exc:
                results[request_id] = exc

        threads = [threading.Thread(target=run, args=(f"load-{i}",)) for i in range(3)]
        for thread in threads:
            thread.start()
        wait_until(
            lambda: admin(decode.address, "status").counters["requests_started"] >= 4,
            "the decode requests started",
        )
        decode.popen.send_signal(15)
        for thread in threads:
            thread.join(60)
        assert decode.popen.wait(60) == 0
        # Each request either completed or was told why: none vanished.
        for request_id in ("load-0", "load-1", "load-2"):
            outcome = results[request_id]
            assert not isinstance(outcome, Exception), outcome
            assert outcome.token_ids == expected[0]
        assert exit_used_blocks(decode) == 0
        # The prefill daemon drains through the admin call, then refuses new work.
        assert admin(prefill.address, "drain") == 0
        assert asyncio.run(check_health(prefill.address)) == "NOT_SERVING"
        with GenerationClient(prefill.address) as client, pytest.raises(grpc.RpcError) as refused:
            client.generate(generate_request("late", PROMPTS[0], 1))
        assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
        assert "draining" in refused.value.details()
        assert prefill.terminate() == 0
    assert exit_used_blocks(prefill) == 0


@pytest.mark.parametrize("order", ["generate-first", "continue-first"])
def test_a_request_awaiting_its_first_token_continues_after_it(pair, expected, order):
    """Without KV to load, a request started with await_generated_tokens computes nothing until
    Continue gives it the first token (a Continue may also come first: calls are unordered);
    it then equals a colocated run, the first token not streamed again."""
    _, decode = pair
    rid = f"await-{order}"
    request = generate_request(rid, PROMPTS[1], MAX_TOKENS)
    request.await_generated_tokens = True
    with GenerationClient(decode.address) as client:
        if order == "continue-first":
            client.continue_request(rid, expected[1][:1])
            result = client.generate(request)
        else:
            before = admin(decode.address, "status").counters["requests_started"]
            answer: list[GenerateResult] = []
            thread = threading.Thread(target=lambda: answer.append(client.generate(request)))
            thread.start()
            wait_until(
                lambda: admin(decode.address, "status").counters["requests_started"] > before,
                "the request admitted",
            )
            # Not synchronisation: a window in which the request must stay unfinished (it
            # computes nothing until Continue), so there is no event to wait for.
            time.sleep(0.2)
            assert thread.is_alive()
            client.continue_request(rid, expected[1][:1])
            thread.join(60)
            (result,) = answer
        assert result.finish_reason == "length"
        assert result.token_ids == expected[1][1:]
    wait_for_free_blocks(decode.address)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (
            lambda r: r.generated_token_ids.extend([65, 70000]),
            "generated_token_ids[1] = 70000 is outside the vocabulary",
        ),
        (
            lambda r: r.generated_token_ids.extend([65] * MAX_TOKENS),
            f"generated_token_ids holds {MAX_TOKENS} tokens, max_tokens {MAX_TOKENS} leaves "
            "nothing to generate",
        ),
        (
            lambda r: (
                r.generated_token_ids.append(65),
                setattr(r, "await_generated_tokens", True),
            ),
            "await_generated_tokens: the request already has generated_token_ids",
        ),
    ],
    ids=["outside-vocab", "nothing-left", "both"],
)
def test_bad_generated_tokens_are_refused_naming_the_field(pair, change, message):
    _, decode = pair
    request = generate_request("bad-generated", PROMPTS[0], MAX_TOKENS)
    change(request)
    with GenerationClient(decode.address) as client:
        with pytest.raises(grpc.RpcError) as info:
            client.generate(request)
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert message in info.value.details()
        with pytest.raises(grpc.RpcError) as info:
            client.continue_request("bad-generated", [70000])
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "generated_token_ids[0] = 70000 is outside the vocabulary" in info.value.details()
    assert admin(decode.address, "status").num_used_blocks == 0
