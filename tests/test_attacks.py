"""Issue 10's attacks on the KV of other requests, replayed against real daemons.

A prefill and a decode daemon run as processes (real gRPC on 127.0.0.1, real UCX between their
workers; the decode runs ``kv_load_failure_policy=fail``). Each test plays an attacker who is an
ordinary client of both daemons: it may hold leases of its own (any client may prefill) and it
knows other requests' ids and block ids (both are guessable), but never their
``remote_kv_secret``. Every attack must end in a typed refusal: an ``error`` finish with no token
(the reason in the decode daemon's log), PERMISSION_DENIED from the notify service or
``ReleaseKV``, ACCESS_DENIED from a worker's agent; the victim's own decode must still give the
tokens of a colocated run; and nothing may leak: both daemons report 0 KV blocks in use through
KVAdmin after each test (well within the lease, so expiry cannot hide a leak) and at exit.

The last tests go beyond the issue's list: a client that forges the parameters of its *own*
lease (a prompt digest of another prompt, or its own blocks in another order) must not get its
KV into the decode's prefix cache under another prompt, where other clients' requests would be
computed from it.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from typing import Any

import grpc
import pytest
import torch
from serve_helpers.daemons import (
    BLOCK_SIZE,
    admin,
    colocated,
    exit_used_blocks,
    running,
    start_daemon,
)
from waiting import wait_until

from kvtransfer.clients.control import fetch_handshake_sync
from kvtransfer.clients.generation import GenerateResult, GenerationClient, generate_request
from kvtransfer.connectors.ucx.metadata import UcxHandshakeMetadata, prompt_digest
from kvtransfer.control import CompatibilityInfo
from kvtransfer.serve.launcher import ServiceProcess
from kvtransfer.transport import (
    ErrorCode,
    KVTransferAgent,
    LeaseAccess,
    PullSpec,
    RemoteTransferError,
    TransportConfig,
    new_secret,
)
from kvtransfer.v1 import handshake_pb2, handshake_pb2_grpc

pytestmark = pytest.mark.integration

MAX_TOKENS = 8
LEASE_S = 30.0  # the shared prefill's lease: far beyond every wait below
SHORT_LEASE_S = 2.0
# Blocks must be back well before any lease could have freed them.
SETTLE_S = 10.0
REMOTE_DECODE = {"do_remote_decode": True}
NOTIFY = "/kvtransfer.v1.UcxConnectorNotify"

# Every decode below gets a prompt of its own: a prompt the decode engine has in its prefix cache
# would need no pull, and the pull is what is attacked. The tag leads, so no two prompts share a
# block; 40 tokens are 3 blocks, the last one partial (never fully cached).
PROMPT_LEN = 40
TAGS = (
    "live-victim",
    "live-thief",
    "freed-victim",
    "freed-thief",
    "freed-after",
    "ids-range",
    "ids-longer",
    "ids-shorter",
    "ids-outside",
    "ids-negative",
    "ids-after",
    "digest-own",
    "digest-other",
    "notify-victim",
    "notify-thief",
    "short-victim",
    "short-after",
    "rkv-victim",
    "rkv-thief",
    "rkv-freed",
    "raw-victim",
    "raw-thief",
    "poison-own",
    "poison-other",
    "order-reversed",
    "order-repeated",
)


def _prompt(tag: str) -> str:
    text = f"{tag} | disaggregated prefill hands its KV blocks to decode"
    assert len(text) >= PROMPT_LEN
    return text[:PROMPT_LEN]


PROMPTS = {tag: _prompt(tag) for tag in TAGS}
assert len({prompt[:BLOCK_SIZE] for prompt in PROMPTS.values()}) == len(PROMPTS)
NUM_BLOCKS = -(-PROMPT_LEN // BLOCK_SIZE)


@pytest.fixture(scope="module")
def expected() -> dict[str, list[int]]:
    tokens = colocated(list(PROMPTS.values()), MAX_TOKENS)
    return dict(zip(PROMPTS, tokens, strict=True))


@pytest.fixture(scope="module")
def pair(tmp_path_factory) -> Iterator[tuple[ServiceProcess, ServiceProcess]]:
    logs = tmp_path_factory.mktemp("attacks")
    prefill = start_daemon(
        "prefill",
        logs,
        "--engine-id",
        "atk-p",
        kv={"kv_connector_extra_config": {"kv_lease_s": LEASE_S}},
    )
    try:
        decode = start_daemon(
            "decode", logs, "--engine-id", "atk-d", kv={"kv_load_failure_policy": "fail"}
        )
    except BaseException:
        prefill.terminate()
        raise
    with running(decode, prefill):
        yield prefill, decode
        settle(prefill, decode)
    assert exit_used_blocks(prefill) == 0
    assert exit_used_blocks(decode) == 0


# ---------------------------------------------------------------------------- helpers


def hold(prefill: ServiceProcess, request_id: str, tag: str) -> dict[str, Any]:
    """Prefill ``tag``'s prompt with its KV held for a decode: the params a client gets."""
    with GenerationClient(prefill.address) as client:
        first = client.generate(
            generate_request(request_id, PROMPTS[tag], 1, kv_transfer_params=REMOTE_DECODE)
        )
    assert first.finish_reason == "length", first.error
    params = first.kv_transfer_params
    assert params is not None
    assert params["remote_request_id"] == request_id
    assert len(params["remote_block_ids"]) == NUM_BLOCKS
    assert params["remote_prompt_digest"] == prompt_digest(list(PROMPTS[tag].encode()))
    assert len(params["remote_kv_secret"]) >= 32
    return params


def run_decode(
    decode: ServiceProcess, request_id: str, tag: str, params: dict[str, Any] | None
) -> GenerateResult:
    with GenerationClient(decode.address) as client:
        return client.generate(
            generate_request(request_id, PROMPTS[tag], MAX_TOKENS, kv_transfer_params=params)
        )


def assert_served(result: GenerateResult, tokens: list[int]) -> None:
    """A legitimate decode: the prompt's own KV pulled, the tokens of a colocated run."""
    assert result.finish_reason == "length", result.error
    assert result.token_ids == tokens
    assert result.metrics.num_recomputed_tokens == 0
    assert result.metrics.kv_blocks_received == NUM_BLOCKS


def log_line(process: ServiceProcess, *needles: str, timeout_s: float = 10.0) -> str:
    """The first line of ``process``'s log holding every needle (logs are written a moment
    after the reply)."""

    def found() -> str | None:
        lines = process.log_path.read_text(errors="replace").splitlines()
        return next((line for line in lines if all(n in line for n in needles)), None)

    return wait_until(
        found,
        lambda: (
            f"a line of {process.name}'s log holding {needles}; its tail:\n{process.log_tail(30)}\n"
        ),
        timeout_s,
    )


def assert_refused(result: GenerateResult, *error: str) -> None:
    """An attack's decode: an error finish, not one token computed."""
    assert result.finish_reason == "error", (
        f"attack {result.request_id!r} was served: finish {result.finish_reason!r}, "
        f"tokens {result.token_ids}"
    )
    assert result.token_ids == [] and result.text == ""
    assert result.metrics.kv_blocks_received == 0
    for needle in error:
        assert needle in result.error, result.error


def assert_load_refused(
    decode: ServiceProcess, result: GenerateResult, *reason: str, code: str = "ACCESS_DENIED"
) -> str:
    """Refused by the producer's worker; the decode daemon logs the typed reason."""
    assert_refused(result, "KV load failed", "kv_load_failure_policy=fail")
    return log_line(
        decode, f"loading KV of request {result.request_id} from engine", f"({code})", *reason
    )


def used_blocks(process: ServiceProcess) -> int:
    return admin(process.address, "status").num_used_blocks


def settle(*daemons: ServiceProcess, timeout_s: float = SETTLE_S) -> None:
    """Every daemon reports 0 KV blocks in use, within ``timeout_s`` (below the lease)."""

    def used() -> dict[str, int]:
        return {daemon.name: n for daemon in daemons if (n := used_blocks(daemon))}

    wait_until(lambda: not used(), lambda: f"no KV block in use (still used: {used()})", timeout_s)


def release_kv(prefill: ServiceProcess, params: dict[str, Any]) -> bool:
    with GenerationClient(prefill.address) as client:
        return client.release_kv(params["remote_request_id"], params)


def notify(params: dict[str, Any], method: str, body: dict[str, Any]) -> dict[str, Any]:
    """A raw call to the producer's notify service on its kv_port, as an attacker sends it."""
    address = f"{params['remote_host']}:{params['remote_port']}"
    with grpc.insecure_channel(address) as channel:
        reply = channel.unary_unary(f"{NOTIFY}/{method}")(json.dumps(body).encode(), timeout=5)
    return json.loads(reply)


def forged_release(params: dict[str, Any], *claims: tuple[str, str]) -> dict[str, Any]:
    done = [{"request_id": rid, "num_blocks": 0, "secret": secret} for rid, secret in claims]
    body = {
        "engine_id": params["remote_engine_id"],
        "generation": params["remote_generation"],
        "done": done,
    }
    return notify(params, "Release", body)


def forged_keep_alive(params: dict[str, Any], *claims: tuple[str, str]) -> dict[str, Any]:
    leases = [{"request_id": rid, "secret": secret} for rid, secret in claims]
    body = {
        "engine_id": params["remote_engine_id"],
        "generation": params["remote_generation"],
        "leases": leases,
    }
    return notify(params, "KeepAlive", body)


def rpc_refusal(call, *args: Any) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as refused:
        call(*args)
    return refused.value


# ---------------------------------------------------------------------------- attacks


def test_another_live_requests_kv_cannot_be_read(pair, expected):
    """Attack 1: a decode request names a live request's lease and blocks with a guessed
    secret, with the thief's own (valid) secret, or takes the thief's own lease and the
    victim's block ids. Each is refused by the producer's worker (ACCESS_DENIED); the victim's
    lease is untouched and its decode gives the colocated tokens."""
    prefill, decode = pair
    victim = hold(prefill, "victim-live", "live-victim")
    thief = hold(prefill, "thief-live", "live-thief")
    assert not set(victim["remote_block_ids"]) & set(thief["remote_block_ids"])
    attacks = [
        (
            "live-guessed-secret",
            {
                **victim,
                "remote_kv_secret": new_secret(),
                "remote_prompt_digest": thief["remote_prompt_digest"],
            },
            "wrong secret for lease 'victim-live'",
        ),
        (
            "live-own-secret",
            {
                **thief,
                "remote_request_id": "victim-live",
                "remote_block_ids": victim["remote_block_ids"],
            },
            "wrong secret for lease 'victim-live'",
        ),
        (
            "live-own-lease",
            {**thief, "remote_block_ids": victim["remote_block_ids"]},
            "do not belong to lease 'thief-live'",
        ),
    ]
    for request_id, params, reason in attacks:
        result = run_decode(decode, request_id, "live-thief", params)
        assert_load_refused(decode, result, reason)
    # The thief's refused Release for the victim's lease changed nothing either.
    log_line(decode, "Release of ['victim-live']", "wrong kv secret")
    assert_served(run_decode(decode, "victim-live", "live-victim", victim), expected["live-victim"])
    release_kv(prefill, thief)  # the thief's own lease, if its refused load left it held
    settle(prefill, decode)


def test_a_released_requests_kv_cannot_be_read(pair, expected):
    """Attack 2: the same once the victim's decode finished and its blocks were freed; the
    victim's exact params replayed (right secret) are refused too: its lease has ended."""
    prefill, decode = pair
    victim = hold(prefill, "victim-freed", "freed-victim")
    # Held before the victim's blocks are freed, so they cannot be the thief's blocks later.
    thief = hold(prefill, "thief-freed", "freed-thief")
    assert not set(victim["remote_block_ids"]) & set(thief["remote_block_ids"])
    assert_served(
        run_decode(decode, "victim-freed", "freed-victim", victim), expected["freed-victim"]
    )
    wait_until(
        lambda: used_blocks(prefill) == NUM_BLOCKS,
        "the victim's blocks freed (only the thief's lease left)",
        SETTLE_S,
    )
    attacks = [
        ("freed-replay", "freed-victim", victim, "lease 'victim-freed' has ended"),
        (
            "freed-guessed-secret",
            "freed-thief",
            {
                **victim,
                "remote_kv_secret": new_secret(),
                "remote_prompt_digest": thief["remote_prompt_digest"],
            },
            "lease 'victim-freed' has ended",
        ),
        (
            "freed-own-secret",
            "freed-thief",
            {
                **thief,
                "remote_request_id": "victim-freed",
                "remote_block_ids": victim["remote_block_ids"],
            },
            "lease 'victim-freed' has ended",
        ),
        (
            "freed-own-lease",
            "freed-thief",
            {**thief, "remote_block_ids": victim["remote_block_ids"]},
            "do not belong to lease 'thief-freed'",
        ),
    ]
    for request_id, tag, params, reason in attacks:
        result = run_decode(decode, request_id, tag, params)
        assert_load_refused(decode, result, reason)
    release_kv(prefill, thief)
    # Still serving: a legitimate request equals colocated.
    after = hold(prefill, "after-freed", "freed-after")
    assert_served(run_decode(decode, "after-freed", "freed-after", after), expected["freed-after"])
    settle(prefill, decode)


@pytest.mark.parametrize(
    ("case", "forge", "where", "reason"),
    [
        (
            "range",
            lambda ids: list(range(100000)),
            "load",
            "remote_block_ids holds 100000 blocks, remote_num_tokens 40 needs exactly 3",
        ),
        (
            "longer",
            lambda ids: [*ids, ids[-1] + 1],
            "load",
            "remote_block_ids holds 4 blocks, remote_num_tokens 40 needs exactly 3",
        ),
        (
            "shorter",
            lambda ids: ids[:-1],
            "hook",
            "remote_block_ids holds 2 blocks, remote_num_tokens 40 needs 3",
        ),
        ("outside", lambda ids: [100000 + i for i in range(len(ids))], "load", "out of range"),
    ],
)
def test_forged_block_lists_are_typed_errors(pair, case, forge, where, reason):
    """Attack 3: the thief's own lease with a block list out of range, longer or shorter than
    the prompt needs: a typed error naming the list, never tokens from blocks it picked."""
    prefill, decode = pair
    tag = f"ids-{case}"
    own = hold(prefill, f"thief-ids-{case}", tag)
    params = {**own, "remote_block_ids": forge(own["remote_block_ids"])}
    result = run_decode(decode, f"ids-{case}", tag, params)
    if where == "hook":
        assert_refused(result, reason)
        log_line(decode, f"[request_id=ids-{case}] failed:", reason)
    else:
        assert_refused(result, "KV load failed")
        log_line(decode, f"loading KV of request ids-{case} from engine", reason)
    release_kv(prefill, own)
    settle(prefill, decode)


def test_negative_block_ids_are_rejected_before_anything_is_held(pair, expected):
    prefill, decode = pair
    own = hold(prefill, "thief-ids-negative", "ids-negative")
    params = {**own, "remote_block_ids": [-1, *own["remote_block_ids"][1:]]}
    refusal = rpc_refusal(run_decode, decode, "ids-negative", "ids-negative", params)
    assert refusal.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "kv_transfer_params.remote_block_ids must be a list of block ids" in refusal.details()
    assert release_kv(prefill, own) is True
    after = hold(prefill, "after-ids", "ids-after")
    assert_served(run_decode(decode, "after-ids", "ids-after", after), expected["ids-after"])
    settle(prefill, decode)


def test_a_prompt_other_than_the_prefilled_one_is_refused(pair, expected):
    """Attack 4: the decode prompt differs from the one prefill computed (same length, or a
    prefix of it): an error naming the prompt digest mismatch, before any pull."""
    prefill, decode = pair
    for request_id, prompt in (
        ("digest-other", PROMPTS["digest-other"]),
        ("digest-prefix", PROMPTS["digest-own"][:20]),
    ):
        own = hold(prefill, f"thief-{request_id}", "digest-own")
        with GenerationClient(decode.address) as client:
            result = client.generate(
                generate_request(request_id, prompt, MAX_TOKENS, kv_transfer_params=own)
            )
        assert_refused(result, "kv_transfer_params.remote_prompt_digest mismatch")
        log_line(decode, f"[request_id={request_id}] failed:", "remote_prompt_digest mismatch")
        release_kv(prefill, own)
    # The prefilled prompt itself still decodes.
    own = hold(prefill, "digest-own", "digest-own")
    assert_served(run_decode(decode, "digest-own", "digest-own", own), expected["digest-own"])
    settle(prefill, decode)


def test_forged_release_and_keep_alive_on_the_kv_port_are_refused(pair, expected):
    """Attack 5a: Release and KeepAlive sent straight to the producer's kv_port for a victim's
    lease, with a guessed secret, with the thief's own secret, or batched with the thief's own
    valid claim: PERMISSION_DENIED, nothing changed (not even the valid claim); malformed ones
    are INVALID_ARGUMENT. The victim's decode still gives the colocated tokens."""
    prefill, decode = pair
    victim = hold(prefill, "victim-notify", "notify-victim")
    thief = hold(prefill, "thief-notify", "notify-thief")
    guess = ("victim-notify", new_secret())
    stolen = ("victim-notify", thief["remote_kv_secret"])
    own = ("thief-notify", thief["remote_kv_secret"])
    for forge in (forged_release, forged_keep_alive):
        for claims in ((guess,), (stolen,), (own, guess)):
            refusal = rpc_refusal(forge, victim, *claims)
            assert refusal.code() == grpc.StatusCode.PERMISSION_DENIED, refusal
            assert "wrong kv secret for held request(s) ['victim-notify']" in refusal.details()
    for secret in ("", None):
        body = {"engine_id": "atk-p", "done": [{"request_id": "victim-notify", "num_blocks": 0}]}
        if secret is not None:
            body["done"][0]["secret"] = secret
        refusal = rpc_refusal(notify, victim, "Release", body)
        assert refusal.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "malformed ReleaseRequest" in refusal.details()
    assert used_blocks(prefill) == 2 * NUM_BLOCKS
    assert_served(
        run_decode(decode, "victim-notify", "notify-victim", victim), expected["notify-victim"]
    )
    # The thief's valid claim was refused with the forged one: its lease is still held.
    assert release_kv(prefill, thief) is True
    settle(prefill, decode)


def test_forged_keep_alives_cannot_hold_blocks_beyond_the_lease(pair, expected, tmp_path):
    """Attack 5b: a producer with a 2 s lease; an attacker sends KeepAlives for the victim's
    lease every 0.1 s. Each is refused while the lease is held; the blocks are freed when the
    lease runs out, not later (nor sooner), and the victim's params then read nothing."""
    _, decode = pair
    prefill = start_daemon(
        "prefill",
        tmp_path,
        "--engine-id",
        "atk-short",
        kv={"kv_connector_extra_config": {"kv_lease_s": SHORT_LEASE_S}},
        name="prefill-short-lease",
    )
    with running(prefill):
        victim = hold(prefill, "victim-short", "short-victim")
        held_at = time.monotonic()
        replies: list[tuple[float, str]] = []
        stop = threading.Event()

        def keep_alive_forever() -> None:
            while not stop.is_set():
                try:
                    reply = forged_keep_alive(victim, ("victim-short", new_secret()))
                    outcome = "known" if "victim-short" in reply["known"] else "not held"
                except grpc.RpcError as exc:
                    outcome = exc.code().name
                replies.append((time.monotonic() - held_at, outcome))
                stop.wait(0.1)

        attacker = threading.Thread(target=keep_alive_forever, daemon=True)
        attacker.start()
        try:
            wait_until(
                lambda: used_blocks(prefill) == 0,
                lambda: (
                    f"blocks freed at the end of a {SHORT_LEASE_S} s lease (forged "
                    f"keep-alives: {replies[-5:]})"
                ),
                held_at + SHORT_LEASE_S + 6.0 - time.monotonic(),
            )
            freed_after = time.monotonic() - held_at
            # The attacker goes on after the lease ended: its keep-alives revive nothing.
            wait_until(
                lambda: sum(t > freed_after + 0.2 for t, _ in replies) >= 3,
                "forged keep-alives sent after the lease ended",
            )
            assert used_blocks(prefill) == 0
        finally:
            stop.set()
            attacker.join(10)
        assert freed_after >= SHORT_LEASE_S - 0.5, f"freed after {freed_after:.2f} s"
        outcomes = {outcome for _, outcome in replies}
        assert "known" not in outcomes, replies
        assert outcomes <= {"PERMISSION_DENIED", "not held"}, replies
        assert [o for t, o in replies if t < SHORT_LEASE_S - 0.5] and all(
            o == "PERMISSION_DENIED" for t, o in replies if t < SHORT_LEASE_S - 0.5
        ), replies
        assert [o for t, o in replies if t > freed_after + 0.2], replies  # sent on after expiry
        # After expiry nothing of the lease can be read, not even with its own params.
        result = run_decode(decode, "victim-short", "short-victim", victim)
        assert_load_refused(decode, result, "lease 'victim-short' has ended")
        # This producer still serves.
        after = hold(prefill, "after-short", "short-after")
        assert_served(
            run_decode(decode, "after-short", "short-after", after), expected["short-after"]
        )
        settle(prefill, decode)
    assert exit_used_blocks(prefill) == 0


def test_release_kv_needs_the_lease_secret(pair, expected):
    """Attack 6: Generation.ReleaseKV on the prefill daemon for a victim's lease with a guessed
    secret or the thief's own secret: PERMISSION_DENIED, the victim unaffected. With the right
    secret: released at once (not at the lease's end), and its params read nothing after."""
    prefill, decode = pair
    victim = hold(prefill, "victim-rkv", "rkv-victim")
    thief = hold(prefill, "thief-rkv", "rkv-thief")
    for forged in (
        {**victim, "remote_kv_secret": new_secret()},
        {
            **thief,
            "remote_request_id": "victim-rkv",
            "remote_block_ids": victim["remote_block_ids"],
        },
    ):
        refusal = rpc_refusal(release_kv, prefill, forged)
        assert refusal.code() == grpc.StatusCode.PERMISSION_DENIED
        assert "wrong kv secret for held request(s) ['victim-rkv']" in refusal.details()
    refusal = rpc_refusal(release_kv, prefill, {**victim, "remote_engine_id": "elsewhere"})
    assert refusal.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert_served(run_decode(decode, "victim-rkv", "rkv-victim", victim), expected["rkv-victim"])
    assert release_kv(prefill, thief) is True
    settle(prefill, decode)

    freed = hold(prefill, "freed-rkv", "rkv-freed")
    released_at = time.monotonic()
    assert release_kv(prefill, freed) is True
    wait_until(
        lambda: used_blocks(prefill) == 0,
        "ReleaseKV frees the blocks",
        released_at + 5.0 - time.monotonic(),
    )
    assert release_kv(prefill, freed) is False
    result = run_decode(decode, "freed-rkv", "rkv-freed", freed)
    assert_load_refused(decode, result, "lease 'freed-rkv' has ended")
    settle(prefill, decode)


def _compat_of(address: str) -> CompatibilityInfo:
    """What any client learns from a producer's public handshake reply."""
    with grpc.insecure_channel(address) as channel:
        reply = handshake_pb2_grpc.KVHandshakeStub(channel).GetHandshake(
            handshake_pb2.GetHandshakeRequest(all_ranks=True), timeout=5
        )
    return CompatibilityInfo.from_proto(reply.payloads[0].compat)


def test_raw_ucx_pulls_need_the_lease_and_its_secret(pair):
    """Attack 7: a client with its own UCX agent pulls straight from the prefill worker (its
    address from the public KVHandshake payload): without a lease, with a made-up lease, with
    a guessed or another lease's secret, or with its own lease for blocks outside it. Each is
    a RemoteTransferError with code ACCESS_DENIED and writes nothing; its own lease's blocks
    are served (the route works: the refusals are the capability's)."""
    prefill, decode = pair
    victim = hold(prefill, "victim-raw", "raw-victim")
    thief = hold(prefill, "thief-raw", "raw-thief")
    address = f"{victim['remote_host']}:{victim['remote_port']}"
    fetched = fetch_handshake_sync(
        address, victim["remote_engine_id"], _compat_of(address), UcxHandshakeMetadata, timeout_s=5
    )
    ((rank, worker),) = fetched.metadata.items()
    assert rank == (0, 0)
    layouts = worker.layouts()
    caches = {
        name: torch.zeros(
            (2 * NUM_BLOCKS, 2, lay.num_kv_heads, lay.block_size, lay.head_dim),
            dtype=getattr(torch, lay.dtype),
        )
        for name, lay in layouts.items()
    }
    victim_ids = victim["remote_block_ids"]
    thief_ids = thief["remote_block_ids"]
    used = set(victim_ids) | set(thief_ids)
    unleased = [b for b in range(worker.num_blocks - 1, -1, -1) if b not in used][:NUM_BLOCKS]
    own_lease = LeaseAccess("thief-raw", thief["remote_kv_secret"], thief["remote_prompt_digest"])
    attempts = [
        # First: a made-up lease waits for its grant (grant_wait_s) before it is refused.
        ("made-up lease", victim_ids, LeaseAccess("nobody", new_secret()), "'nobody' is unknown"),
        ("no lease", victim_ids, None, "presents no lease"),
        (
            "guessed secret",
            victim_ids,
            LeaseAccess("victim-raw", new_secret()),
            "wrong secret for lease 'victim-raw'",
        ),
        (
            "another lease's secret",
            victim_ids,
            LeaseAccess("victim-raw", thief["remote_kv_secret"]),
            "wrong secret for lease 'victim-raw'",
        ),
        ("own lease, victim's blocks", victim_ids, own_lease, "do not belong to lease"),
        ("own lease, unleased blocks", unleased, own_lease, "do not belong to lease"),
        ("own lease, one block more", [*thief_ids, victim_ids[0]], own_lease, "do not belong"),
        ("own lease, reordered", thief_ids[::-1], own_lease, "reordered, repeated or shifted"),
        (
            "own lease, another prompt",
            thief_ids,
            LeaseAccess("thief-raw", thief["remote_kv_secret"], victim["remote_prompt_digest"]),
            "holds the KV of another prompt",
        ),
    ]
    agent = KVTransferAgent(TransportConfig(timeout_s=30.0, connect_timeout_s=5.0))
    try:
        agent.register_kv_caches(caches)
        peer = agent.connect(worker.agent_address_bytes(), layouts=layouts)

        def pull(label: str, blocks: list[int], lease: LeaseAccess | None):
            return agent.pull(
                peer,
                PullSpec(
                    request_id=f"raw-{label.replace(' ', '-')}",
                    layer_names=tuple(layouts),
                    remote_block_ids=tuple(blocks),
                    local_block_ids=tuple(range(len(blocks))),
                    lease=lease,
                ),
            )

        handles = [
            (label, reason, pull(label, blocks, lease)) for label, blocks, lease, reason in attempts
        ]
        for label, reason, handle in handles:
            with pytest.raises(RemoteTransferError) as refused:
                handle.result(40)
            assert refused.value.code == ErrorCode.ACCESS_DENIED, (label, refused.value)
            assert reason in str(refused.value), (label, refused.value)
        assert all(not cache.any() for cache in caches.values()), "a refused pull wrote KV"
        served = pull("own lease", thief_ids, own_lease).result(40)
        assert served.payload_bytes > 0
        assert all(cache.any() for cache in caches.values())
    finally:
        agent.close()
    assert release_kv(prefill, victim) is True
    assert release_kv(prefill, thief) is True
    settle(prefill, decode)


# ------------------------------------------------------ beyond the list: own leases


def test_a_forged_prompt_digest_cannot_put_kv_under_another_prompt(pair, expected):
    """The thief holds a lease for its own prompt, then decodes *another* prompt with that
    lease and a digest it computed of the other prompt (the digest is the client's to send).
    Secure: that decode is refused (or computes the other prompt's own KV), and a later
    victim request for the other prompt on this decode gets the colocated tokens, never
    tokens computed from the thief's KV through the decode's prefix cache."""
    prefill, decode = pair
    own = hold(prefill, "thief-poison", "poison-own")
    forged = {**own, "remote_prompt_digest": prompt_digest(list(PROMPTS["poison-other"].encode()))}
    attack = run_decode(decode, "poison-forged", "poison-other", forged)
    victim = hold(prefill, "victim-poison", "poison-other")
    served = run_decode(decode, "victim-poison", "poison-other", victim)
    release_kv(prefill, own)
    release_kv(prefill, victim)
    settle(prefill, decode)
    assert served.token_ids == expected["poison-other"], (
        f"a victim's request was computed from the thief's KV: tokens {served.token_ids}, "
        f"colocated {expected['poison-other']} ({served.metrics.kv_blocks_received} of "
        f"{NUM_BLOCKS} blocks pulled, the rest from the decode's prefix cache); the thief's "
        f"forged decode finished "
        f"{attack.finish_reason!r} with {attack.token_ids} (the thief's own prompt gives "
        f"{expected['poison-own']})"
    )
    assert attack.finish_reason == "error" or attack.token_ids == expected["poison-other"], (
        f"the forged digest was accepted: tokens {attack.token_ids} computed from "
        f"another prompt's KV"
    )


@pytest.mark.parametrize(
    ("case", "reorder"),
    [("reversed", lambda ids: ids[::-1]), ("repeated", lambda ids: [ids[0]] * len(ids))],
)
def test_own_blocks_in_another_order_cannot_poison_the_prompt(pair, expected, case, reorder):
    """The thief's own lease with its own block ids reordered or repeated (every id is in the
    lease, the count is exact). Secure: refused (or the prompt's own KV is used), and a later
    victim request for the same prompt gets the colocated tokens."""
    prefill, decode = pair
    tag = f"order-{case}"
    own = hold(prefill, f"thief-{tag}", tag)
    attack = run_decode(
        decode, f"{tag}-forged", tag, {**own, "remote_block_ids": reorder(own["remote_block_ids"])}
    )
    victim = hold(prefill, f"victim-{tag}", tag)
    served = run_decode(decode, f"victim-{tag}", tag, victim)
    release_kv(prefill, own)
    release_kv(prefill, victim)
    settle(prefill, decode)
    assert served.token_ids == expected[tag], (
        f"a victim's request was computed from KV the thief put in the decode's prefix cache: "
        f"tokens {served.token_ids}, colocated {expected[tag]} "
        f"({served.metrics.kv_blocks_received} of {NUM_BLOCKS} blocks pulled, the rest from "
        f"the decode's prefix cache); the thief's decode finished "
        f"{attack.finish_reason!r} with {attack.token_ids}"
    )
    assert attack.finish_reason == "error" or attack.token_ids == expected[tag], (
        f"blocks in another order were accepted: tokens {attack.token_ids}, "
        f"colocated {expected[tag]}"
    )
