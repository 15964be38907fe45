"""Issue 10's attacks on the KV of other requests, replayed against real daemons, on the three
data planes.

A prefill and a decode daemon run as processes (real gRPC on 127.0.0.1, real UCX between their
workers; the decode runs ``kv_load_failure_policy=fail``), once per data plane
(``kv_connector_extra_config.data_plane`` of both). Each test plays an attacker who is an
ordinary client of both daemons: it may hold leases of its own (any client may prefill) and it
knows other requests' ids and block ids (both are guessable), but never their
``remote_kv_secret``. Every attack must end in a typed refusal: an ``error`` finish with no
token (the reason in the decode daemon's log), PERMISSION_DENIED from the notify service or
``ReleaseKV``, ACCESS_DENIED from a worker's agent; the one exception is what the RMA plane
states it does not stop (below), which the raw-UCX test shows succeeding. The victim's own
decode must still give the tokens of a colocated run; and nothing may leak: both daemons report
0 KV blocks in use through KVAdmin after each test (well within the lease, so expiry cannot hide
a leak) and at exit.

Where the refusal comes from depends on the plane:

* ``tagged``: every pull is a request the producer's worker checks (lease, secret, prompt
  digest, the blocks at their positions) and refuses with ACCESS_DENIED and its reason.
* ``push``: the decode asks each producer worker to write a load into its blocks, presenting
  the lease; the producer's server checks it as it checks a tagged pull (lease, secret, prompt
  digest, the blocks at their positions) and refuses the ask with ACCESS_DENIED and its reason.
  A push producer serves one-sided reads too: the raw-UCX test meets RMA's stated limit there.
* ``rma``: a decode worker asks each producer worker once for its memory keys, presenting the
  lease of the load that needs them; the producer checks that lease as it checks a tagged pull,
  bar the blocks (a refusal is ACCESS_DENIED, as tagged). From then on the decode reads one-sided
  and the producer sees no read: the honest decode checks the producer's lease table itself
  (the lease's row, its prompt tag and block-list tag) and refuses locally (``AccessDenied``, no
  producer code), or its liveness probe finds the producer no longer holds the lease
  (``LeaseLostError``). The fixture's warm-up decode gets the decode those keys, so each attack
  below meets the one-sided checks whatever runs first. The plane's stated limit is shown, not
  hidden: a peer that presented one valid lease of its own holds the keys and reads any
  registered block of that producer worker with raw reads (the raw-UCX test).

The last tests go beyond the issue's list: a client that forges the parameters of its *own*
lease (a prompt digest of another prompt, or its own blocks in another order) must not get its
KV into the decode's prefix cache under another prompt, where other clients' requests would be
computed from it; on both planes it is refused.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
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
    PeerHandle,
    PullSpec,
    RemoteTransferError,
    TransportConfig,
    new_secret,
)
from kvtransfer.transport.rma import RmaKeys
from kvtransfer.transport.rma_layout import LayerMemory, concat_runs, layer_runs
from kvtransfer.transport.ucp_rma import Gets, destroy_key, unpack_key
from kvtransfer.v1 import handshake_pb2, handshake_pb2_grpc

pytestmark = pytest.mark.integration

MAX_TOKENS = 8
LEASE_S = 30.0  # the shared prefill's lease: far beyond every wait below
SHORT_LEASE_S = 2.0
# Blocks must be back well before any lease could have freed them.
SETTLE_S = 10.0
REMOTE_DECODE = {"do_remote_decode": True}
NOTIFY = "/kvtransfer.v1.UcxConnectorNotify"
PLANES = ("rma", "tagged", "push")

# Every decode below gets a prompt of its own: a prompt the decode engine has in its prefix cache
# would need no pull, and the pull is what is attacked. The tag leads, so no two prompts share a
# block; 40 tokens are 3 blocks, the last one partial (never fully cached).
PROMPT_LEN = 40
TAGS = (
    "warm-up",
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
    "raw-freed",
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


@pytest.fixture(scope="module", params=PLANES)
def plane(request) -> str:
    """The data plane both daemons run (``kv_connector_extra_config.data_plane``)."""
    return request.param


@pytest.fixture(scope="module")
def pair(plane, expected, tmp_path_factory) -> Iterator[tuple[ServiceProcess, ServiceProcess]]:
    logs = tmp_path_factory.mktemp(f"attacks-{plane}")
    prefill = start_daemon(
        "prefill",
        logs,
        "--engine-id",
        "atk-p",
        kv={"kv_connector_extra_config": {"kv_lease_s": LEASE_S, "data_plane": plane}},
    )
    try:
        decode = start_daemon(
            "decode",
            logs,
            "--engine-id",
            "atk-d",
            kv={
                "kv_load_failure_policy": "fail",
                "kv_connector_extra_config": {"data_plane": plane},
            },
        )
    except BaseException:
        prefill.terminate()
        raise
    with running(decode, prefill):
        # A legitimate decode first. On the RMA plane it gets the decode the producer worker's
        # keys (asked for once, with this lease), so every attack below meets the one-sided
        # checks of the lease table, whichever test runs first; without it the first attack
        # would be a refused keys request instead. On the tagged plane it only shows the pair
        # serves.
        warm = hold(prefill, "warm-up", "warm-up")
        assert_served(run_decode(decode, "warm-up", "warm-up", warm), expected["warm-up"])
        settle(prefill, decode)
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


@dataclass(frozen=True)
class Refusal:
    """Why a load is refused, as the decode daemon logs it: ``loading KV of request R from
    engine E failed: <head>...<reason>``. ``by_producer``: the producer's worker refused it and
    its ACCESS_DENIED code is in the line; else the decode refused it itself (RMA mode: its
    one-sided checks, its liveness probe) and no producer code is."""

    head: str
    reason: str
    by_producer: bool


def producer_refused(reason: str, what: str = "pull") -> Refusal:
    """Refused by the producer's worker: a tagged pull, or (``what="keys request"``) the keys
    request of a decode that holds no keys of that worker yet (RMA mode)."""
    return Refusal(f"RemoteTransferError: {what} ", reason, True)


def one_sided(reason: str) -> Refusal:
    """RMA mode: refused by the decode's one-sided check of the producer's lease table."""
    return Refusal("AccessDenied: ", reason, False)


def not_held(lease: str) -> Refusal:
    """RMA mode: a lease presented with another secret than its own has no row in the
    producer's lease table (the row's token derives from the secret). The decode does not give
    up on a missing row by itself (the grant may still be on its way to the producer's
    workers); its liveness probe asks the producer, with that secret, whether it holds the
    lease (a KeepAlive every 4th probe, about 1 s in), which refuses it with
    PERMISSION_DENIED: that refusal ends the load."""
    return one_sided(
        f"refuses the secret of request {lease!r} (its KeepAlive answered PERMISSION_DENIED)"
    )


def block_list_mismatch(lease: str) -> Refusal:
    """RMA mode: the pull's blocks are the params' list at their positions, but the params'
    list (forged, consistent with itself) is not the one the producer's row was written for."""
    return one_sided(
        f"lease {lease!r} holds other blocks, or these in another order, than the pull was told "
        "(block list mismatch, one-sided check)"
    )


def lease_lost(lease: str) -> Refusal:
    """RMA mode: a lease the producer no longer holds (released or expired) has no row either,
    but while the decode waits for the row its liveness probe asks the producer whether it
    still holds the lease (a KeepAlive every 4th probe, about 1 s in; whatever the secret, an
    ended lease is simply not "known"): it ends the wait with `LeaseLostError`."""
    return Refusal("LeaseLostError: ", f"no longer holds request {lease!r}", False)


def per_plane(plane: str, *, tagged: Refusal, rma: Refusal) -> Refusal:
    """The plane's refusal of one attack. Push: the producer's server refuses the decode's ask
    to be written, with the check (and the words) a tagged pull meets."""
    if plane == "push":
        assert tagged.by_producer, tagged
        return producer_refused(tagged.reason, "push ask request")
    return {"tagged": tagged, "rma": rma}[plane]


def assert_load_refused(decode: ServiceProcess, result: GenerateResult, why: Refusal) -> str:
    """The load was refused: an error finish, and the decode daemon logs the typed reason."""
    assert_refused(result, "KV load failed", "kv_load_failure_policy=fail")
    line = log_line(decode, f"loading KV of request {result.request_id} from engine")
    assert f" failed: {why.head}" in line and why.reason in line, (why, line)
    assert ("(ACCESS_DENIED)" in line) == why.by_producer, (why, line)
    return line


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


def test_another_live_requests_kv_cannot_be_read(pair, plane, expected):
    """Attack 1: a decode request names a live request's lease and blocks with a guessed
    secret, with the thief's own (valid) secret, or takes the thief's own lease and the
    victim's block ids. Tagged: each is refused by the producer's worker (ACCESS_DENIED). RMA:
    by the decode's one-sided checks (a wrong secret finds no row of the lease, the thief's
    own row holds another block list). The victim's lease is untouched and its decode gives
    the colocated tokens."""
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
            per_plane(
                plane,
                tagged=producer_refused("wrong secret for lease 'victim-live'"),
                rma=not_held("victim-live"),
            ),
        ),
        (
            "live-own-secret",
            {
                **thief,
                "remote_request_id": "victim-live",
                "remote_block_ids": victim["remote_block_ids"],
            },
            per_plane(
                plane,
                tagged=producer_refused("wrong secret for lease 'victim-live'"),
                rma=not_held("victim-live"),
            ),
        ),
        (
            "live-own-lease",
            {**thief, "remote_block_ids": victim["remote_block_ids"]},
            per_plane(
                plane,
                tagged=producer_refused("do not belong to lease 'thief-live'"),
                rma=block_list_mismatch("thief-live"),
            ),
        ),
    ]
    for request_id, params, why in attacks:
        result = run_decode(decode, request_id, "live-thief", params)
        assert_load_refused(decode, result, why)
    # The thief's refused Release for the victim's lease changed nothing either.
    log_line(decode, "Release of ['victim-live']", "wrong kv secret")
    assert_served(run_decode(decode, "victim-live", "live-victim", victim), expected["live-victim"])
    release_kv(prefill, thief)  # the thief's own lease, if its refused load left it held
    settle(prefill, decode)


def test_a_released_requests_kv_cannot_be_read(pair, plane, expected):
    """Attack 2: the same once the victim's decode finished and its blocks were freed; the
    victim's exact params replayed (right secret) are refused too: its lease has ended (RMA:
    the decode's liveness probe learns the producer no longer holds it)."""
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
    ended = per_plane(
        plane,
        tagged=producer_refused("lease 'victim-freed' has ended"),
        rma=lease_lost("victim-freed"),
    )
    attacks = [
        ("freed-replay", "freed-victim", victim, ended),
        (
            "freed-guessed-secret",
            "freed-thief",
            {
                **victim,
                "remote_kv_secret": new_secret(),
                "remote_prompt_digest": thief["remote_prompt_digest"],
            },
            ended,
        ),
        (
            "freed-own-secret",
            "freed-thief",
            {
                **thief,
                "remote_request_id": "victim-freed",
                "remote_block_ids": victim["remote_block_ids"],
            },
            ended,
        ),
        (
            "freed-own-lease",
            "freed-thief",
            {**thief, "remote_block_ids": victim["remote_block_ids"]},
            per_plane(
                plane,
                tagged=producer_refused("do not belong to lease 'thief-freed'"),
                rma=block_list_mismatch("thief-freed"),
            ),
        ),
    ]
    for request_id, tag, params, why in attacks:
        result = run_decode(decode, request_id, tag, params)
        assert_load_refused(decode, result, why)
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


def test_forged_keep_alives_cannot_hold_blocks_beyond_the_lease(pair, plane, expected, tmp_path):
    """Attack 5b: a producer with a 2 s lease; an attacker sends KeepAlives for the victim's
    lease every 0.1 s. Each is refused while the lease is held; the blocks are freed when the
    lease runs out, not later (nor sooner), and the victim's params then read nothing."""
    _, decode = pair
    prefill = start_daemon(
        "prefill",
        tmp_path,
        "--engine-id",
        "atk-short",
        kv={"kv_connector_extra_config": {"kv_lease_s": SHORT_LEASE_S, "data_plane": plane}},
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
        # After expiry nothing of the lease can be read, not even with its own params. RMA:
        # the decode has no keys of this producer yet, so it asks for them with that lease,
        # and the producer refuses as it refuses a tagged pull.
        result = run_decode(decode, "victim-short", "short-victim", victim)
        ended = "lease 'victim-short' expired: no keep-alive from its consumer within"
        assert_load_refused(
            decode,
            result,
            per_plane(
                plane,
                tagged=producer_refused(ended),
                rma=producer_refused(ended, "keys request"),
            ),
        )
        # This producer still serves.
        after = hold(prefill, "after-short", "short-after")
        assert_served(
            run_decode(decode, "after-short", "short-after", after), expected["short-after"]
        )
        settle(prefill, decode)
    assert exit_used_blocks(prefill) == 0


def test_release_kv_needs_the_lease_secret(pair, plane, expected):
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
    assert_load_refused(
        decode,
        result,
        per_plane(
            plane,
            tagged=producer_refused("lease 'freed-rkv' has ended"),
            rma=lease_lost("freed-rkv"),
        ),
    )
    settle(prefill, decode)


def _compat_of(address: str) -> CompatibilityInfo:
    """What any client learns from a producer's public handshake reply."""
    with grpc.insecure_channel(address) as channel:
        reply = handshake_pb2_grpc.KVHandshakeStub(channel).GetHandshake(
            handshake_pb2.GetHandshakeRequest(all_ranks=True), timeout=5
        )
    return CompatibilityInfo.from_proto(reply.payloads[0].compat)


def _lease_of(params: dict[str, Any]) -> LeaseAccess:
    """What a legitimate reader of ``params``' lease presents (as the decode does)."""
    return LeaseAccess(
        params["remote_request_id"],
        params["remote_kv_secret"],
        params["remote_prompt_digest"],
        0,
        tuple(params["remote_block_ids"]),
    )


def _raw_read(
    agent: KVTransferAgent,
    peer: PeerHandle,
    keys: RmaKeys,
    caches: dict[str, torch.Tensor],
    remote_ids: list[int],
    local_ids: range,
) -> None:
    """What the holder of a producer's keys can do without the library's checks: plan the runs
    of any blocks from the keys' layer descriptions and read them with raw UCX gets on its
    endpoint. No lease is presented, no lease row read, and the producer runs none of its code
    (UCX serves the read)."""
    runs = concat_runs(
        [
            layer_runs(
                LayerMemory.of(name, cache),
                keys.layers[name],
                local_ids,
                remote_ids,
                range(cache.shape[2]),
                range(keys.layers[name].shape[2]),
            )
            for name, cache in caches.items()
        ]
    )
    loop = agent._loop
    endpoint = loop.endpoint_handle(peer.ucx_address)
    assert endpoint is not None
    rkeys = [unpack_key(endpoint, region.key) for region in keys.regions]
    try:
        gets = Gets(loop.worker_handle, endpoint)
        gets.post_many(
            runs.local.tolist(),
            runs.lengths.tolist(),
            runs.remote.tolist(),
            [rkeys[k] for k in runs.keys.tolist()],
        )
        gets.flush()
        wait_until(gets.poll, "raw gets completed", 20.0, interval=0.001)
    finally:
        for rkey in rkeys:
            destroy_key(rkey)


def test_raw_ucx_pulls_need_the_lease_and_its_secret(pair, plane):
    """Attack 7: a client with its own UCX agent goes straight to the prefill worker (its
    address from the public KVHandshake payload) and asks it for KV: without a lease, with a
    made-up or an ended lease, with a guessed or another lease's secret, with its own lease for
    another prompt. Each is a RemoteTransferError with code ACCESS_DENIED and writes nothing.
    (The client asks for one-sided keys first, as an attacker would, whatever the plane.)

    Tagged: the producer hands no keys (its own lease does not get them either); every read
    is a request it checks, so its own lease for blocks outside it (the victim's, a released
    lease's, one more) or in another order is refused too, and its own lease's blocks are
    served (the route works: the refusals are the capability's).

    RMA: the refusals above are of keys requests. With its own valid lease the client gets the
    keys and then, the plane's stated limit, reads any registered block of that worker with
    raw UCX gets, no lease presented: the live victim's blocks, and a lease's blocks after its
    release, byte for byte what legitimate readers of those leases got."""
    prefill, decode = pair
    victim = hold(prefill, "victim-raw", "raw-victim")
    thief = hold(prefill, "thief-raw", "raw-thief")
    freed = hold(prefill, "freed-raw", "raw-freed")
    address = f"{victim['remote_host']}:{victim['remote_port']}"
    fetched = fetch_handshake_sync(
        address, victim["remote_engine_id"], _compat_of(address), UcxHandshakeMetadata, timeout_s=5
    )
    ((rank, worker),) = fetched.metadata.items()
    assert rank == (0, 0)
    assert worker.data_plane == plane
    layouts = worker.layouts()

    def zeros(num_blocks: int) -> dict[str, torch.Tensor]:
        return {
            name: torch.zeros(
                (num_blocks, 2, lay.num_kv_heads, lay.block_size, lay.head_dim),
                dtype=getattr(torch, lay.dtype),
            )
            for name, lay in layouts.items()
        }

    def pull(
        agent: KVTransferAgent,
        peer: PeerHandle,
        label: str,
        blocks: list[int],
        lease: LeaseAccess | None,
        local: range | None = None,
    ):
        return agent.pull(
            peer,
            PullSpec(
                request_id=f"raw-{label.replace(' ', '-')}",
                layer_names=tuple(layouts),
                remote_block_ids=tuple(blocks),
                local_block_ids=tuple(local or range(len(blocks))),
                lease=lease,
            ),
        )

    victim_ids = victim["remote_block_ids"]
    thief_ids = thief["remote_block_ids"]
    freed_ids = freed["remote_block_ids"]
    assert len(set(victim_ids) | set(thief_ids) | set(freed_ids)) == 3 * NUM_BLOCKS
    config = TransportConfig(timeout_s=30.0, connect_timeout_s=5.0)
    # What legitimate readers of the victim's lease and of the freed one get (the latter before
    # its release): real KV, the reference for the raw reads below.
    legit = zeros(2 * NUM_BLOCKS)
    with KVTransferAgent(config) as reader:
        reader.register_kv_caches(legit)
        honest = reader.connect(
            worker.agent_address_bytes(), layouts=layouts, one_sided=plane != "tagged"
        )
        pull(reader, honest, "legit victim", victim_ids, _lease_of(victim)).result(40)
        pull(reader, honest, "legit freed", freed_ids, _lease_of(freed), range(3, 6)).result(40)
    assert all(cache[: 2 * NUM_BLOCKS].any() for cache in legit.values())
    assert release_kv(prefill, freed) is True
    # The freed lease's blocks are back in the prefill's pool (its prefix cache: KV kept).
    wait_until(
        lambda: used_blocks(prefill) == 2 * NUM_BLOCKS,
        "the freed lease's blocks released",
        SETTLE_S,
    )

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
        ("ended lease", freed_ids, _lease_of(freed), "lease 'freed-raw' has ended"),
        (
            "own lease, another prompt",
            thief_ids,
            LeaseAccess("thief-raw", thief["remote_kv_secret"], victim["remote_prompt_digest"]),
            "holds the KV of another prompt",
        ),
    ]
    if plane == "tagged":
        # Every read names its blocks to the producer, which checks them against the lease.
        attempts += [
            ("own lease, victim's blocks", victim_ids, own_lease, "do not belong to lease"),
            ("own lease, released blocks", freed_ids, own_lease, "do not belong to lease"),
            ("own lease, one block more", [*thief_ids, victim_ids[0]], own_lease, "do not belong"),
            ("own lease, reordered", thief_ids[::-1], own_lease, "reordered, repeated or shifted"),
        ]
    # RMA: a keys request refused; tagged: a pull (the keys request was answered "tagged
    # only" before any lease check).
    # A push producer serves one-sided reads as an RMA one does.
    refused_what = {"rma": "keys request refused by ", "tagged": "pull "}[
        "tagged" if plane == "tagged" else "rma"
    ]
    caches = zeros(3 * NUM_BLOCKS)
    agent = KVTransferAgent(config)
    try:
        agent.register_kv_caches(caches)
        peer = agent.connect(worker.agent_address_bytes(), layouts=layouts, one_sided=True)
        handles = [
            (label, reason, pull(agent, peer, label, blocks, lease))
            for label, blocks, lease, reason in attempts
        ]
        for label, reason, handle in handles:
            with pytest.raises(RemoteTransferError) as refused:
                handle.result(40)
            # A made-up lease is "not granted" (a legitimate reader may ask again while the
            # producer's scheduler says it holds the request; this one's never does).
            code = (
                ErrorCode.LEASE_NOT_GRANTED if label == "made-up lease" else ErrorCode.ACCESS_DENIED
            )
            assert refused.value.code == code, (label, refused.value)
            assert reason in str(refused.value), (label, refused.value)
            assert str(refused.value).startswith(refused_what), (label, refused.value)
        assert all(not cache.any() for cache in caches.values()), "a refused pull wrote KV"
        served = pull(agent, peer, "own lease", thief_ids, own_lease).result(40)
        assert served.payload_bytes > 0
        assert all(cache[:NUM_BLOCKS].any() for cache in caches.values())
        assert peer.ucx_address in agent._rma_peers
        held = agent._rma_peers[peer.ucx_address]
        if plane == "tagged":
            assert held is None, "a tagged producer handed one-sided keys"
        else:
            assert held is not None, "a valid lease of its own did not get the keys"
            # The stated limit of RMA mode: with the keys, any registered block, leased to
            # another client or to nobody, is read without a lease.
            _raw_read(agent, peer, held.keys, caches, victim_ids, range(3, 6))
            _raw_read(agent, peer, held.keys, caches, freed_ids, range(6, 9))
            for name, cache in caches.items():
                assert torch.equal(cache[3:9], legit[name]), name
    finally:
        agent.close()
        # Released even when an assertion failed: a leak would fail the tests that follow.
        released = [release_kv(prefill, victim), release_kv(prefill, thief)]
    assert released == [True, True]
    settle(prefill, decode)


# ------------------------------------------------------ beyond the list: own leases


def test_a_forged_prompt_digest_cannot_put_kv_under_another_prompt(pair, plane, expected):
    """The thief holds a lease for its own prompt, then decodes *another* prompt with that
    lease and a digest it computed of the other prompt (the digest is the client's to send).
    A later victim request for the other prompt on this decode gets the colocated tokens, never
    tokens computed from the thief's KV through the decode's prefix cache; the forged decode is
    refused (tagged: by the producer's worker; RMA: the prompt tag of the lease's row differs)."""
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
    mismatch = "lease 'thief-poison' holds the KV of another prompt than the one the pull is for"
    assert_load_refused(
        decode,
        attack,
        per_plane(
            plane,
            tagged=producer_refused(f"{mismatch} (prompt digest mismatch)"),
            rma=one_sided(f"{mismatch} (prompt digest mismatch, one-sided check)"),
        ),
    )


@pytest.mark.parametrize(
    ("case", "reorder"),
    [("reversed", lambda ids: ids[::-1]), ("repeated", lambda ids: [ids[0]] * len(ids))],
)
def test_own_blocks_in_another_order_cannot_poison_the_prompt(pair, plane, expected, case, reorder):
    """The thief's own lease with its own block ids reordered or repeated (every id is in the
    lease, the count is exact). A later victim request for the same prompt gets the colocated
    tokens; the forged decode is refused (tagged: by the producer's worker, the blocks are not
    the lease's at their positions; RMA: the block-list tag of the lease's row differs)."""
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
    assert_load_refused(
        decode,
        attack,
        per_plane(
            plane,
            tagged=producer_refused(
                f"blocks are not lease 'thief-{tag}''s blocks at positions [0, {NUM_BLOCKS}) "
                "(reordered, repeated or shifted)"
            ),
            rma=block_list_mismatch(f"thief-{tag}"),
        ),
    )
