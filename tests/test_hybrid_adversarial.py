"""Hybrid models served disaggregated, attacked as a careless or hostile user would: producers
killed during the pull, loads cancelled or aborted half-way, decode pools so small that requests
preempt each other, prompts long enough to be prefilled in chunks, forged or mangled
``kv_transfer_params``, request ids reused, prefills aborted in the queue, and producers and
consumers of different models paired.

Real daemons (`serve_helpers.pair.DaemonPair`) on both hybrid presets: ``builtin:tiny-hybrid``
(sliding-window layers beside full attention) and ``builtin:tiny-mamba`` (Mamba2 layers, one
state block per request, beside full attention; its decode is handed the prefill's first token,
as from the router). Wherever a request should succeed, its tokens equal a colocated run's;
wherever it should fail, only that request fails, typed, with a message naming the problem; and
afterwards no KV block is in use on either side and both daemons still serve.
"""

from __future__ import annotations

import functools
import json
import math
import threading
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import grpc
import pytest
from serve_helpers.daemons import BLOCK_SIZE, NUM_KV_BLOCKS, PROMPTS, admin, colocated
from serve_helpers.hybrid import window_tail_blocks
from serve_helpers.pair import REMOTE_DECODE, DaemonPair, Stopped
from waiting import wait_until

from kvtransfer.clients.generation import GenerateResult, GenerationClient, generate_request
from kvtransfer.engine.config import EngineConfig
from kvtransfer.engine.llm import LLM
from kvtransfer.engine.sampling_params import SamplingParams
from kvtransfer.v1 import generation_pb2

pytestmark = pytest.mark.integration

HYBRID = "builtin:tiny-hybrid"
MAMBA = "builtin:tiny-mamba"
DENSE = "builtin:tiny"
MAX_TOKENS = 6
CALL_TIMEOUT_S = 120.0
CLEAN_EXIT = {"decode": Stopped(0, 0), "prefill": Stopped(0, 0)}
# The shared pairs' decode pools: small enough that a handful of concurrent decodes preempt
# each other, large enough for one 600-token load (a window group counts every block of the
# prompt until it is computed: 2 x 38 blocks for tiny-hybrid, 38 + 1 for tiny-mamba).
DECODE_BLOCKS = {HYBRID: 80, MAMBA: 48}
# Prompts of one token per byte (the built-in tokenizer); PROMPTS[2] is 222 tokens: 14 blocks.
LONG = PROMPTS[2]


# ---------------------------------------------------------------------- references


@functools.cache
def _reference(model: str, prompts: tuple[Any, ...], max_tokens: int, ignore_eos: bool):
    sampling = {"ignore_eos": True} if ignore_eos else None
    return tuple(
        tuple(tokens)
        for tokens in colocated(
            [list(p) if isinstance(p, tuple) else p for p in prompts],
            max_tokens,
            model=model,
            sampling=sampling,
        )
    )


def colocated_tokens(
    model: str,
    prompts: Sequence[str | Sequence[int]],
    max_tokens: int = MAX_TOKENS,
    *,
    ignore_eos: bool = False,
) -> list[list[int]]:
    """What the decode should return: a colocated run's tokens (for tiny-mamba without the
    first, which the prefill computed and the decode was handed)."""
    key = tuple(p if isinstance(p, str) else tuple(p) for p in prompts)
    tokens = _reference(model, key, max_tokens, ignore_eos)
    return [list(t[1:] if model == MAMBA else t) for t in tokens]


# ---------------------------------------------------------------------- daemons


class Served:
    """A started pair of one model, with the P/D calls these tests make."""

    def __init__(self, pair: DaemonPair, model: str) -> None:
        self.pair = pair
        self.model = model
        self._ids = iter(range(10**9))

    def rid(self, what: str) -> str:
        return f"{self.pair.name}-{what}-{next(self._ids)}"

    def prefill(self, prompt: str | Sequence[int], request_id: str) -> GenerateResult:
        (prefilled,) = self.pair.run_prefill([prompt], [request_id])
        assert prefilled.finish_reason == "length", prefilled.error
        assert prefilled.kv_transfer_params["remote_num_tokens"] == len(_ids_of(prompt))
        return prefilled

    def decode_request(
        self,
        prefilled: GenerateResult,
        prompt: str | Sequence[int],
        params: dict[str, Any] | None,
        max_tokens: int = MAX_TOKENS,
        *,
        request_id: str | None = None,
        for_model: str | None = None,
        **options: Any,
    ) -> generation_pb2.GenerateRequest:
        """The decode's request for ``prefilled``: a tiny-mamba decode is handed the first
        token (``for_model``: the decode's model when it is another pair's)."""
        message = generate_request(
            request_id or prefilled.request_id,
            prompt,
            max_tokens,
            kv_transfer_params=params,
            **options,
        )
        if (for_model or self.model) == MAMBA:
            message.generated_token_ids.extend(prefilled.token_ids)
        return message

    def decode(self, message: generation_pb2.GenerateRequest) -> GenerateResult:
        with GenerationClient(self.pair.decode.address) as client:
            return client.generate(message, CALL_TIMEOUT_S)

    def release(self, prefilled: GenerateResult) -> None:
        """Give the prefill's KV back (idempotent: a consumer may have released it already)."""
        with GenerationClient(self.pair.prefill.address) as client:
            client.release_kv(prefilled.request_id, prefilled.kv_transfer_params)

    def pd(self, prompt: str | Sequence[int], max_tokens: int = MAX_TOKENS) -> GenerateResult:
        prefilled = self.prefill(prompt, self.rid("ok"))
        params = prefilled.kv_transfer_params
        return self.decode(self.decode_request(prefilled, prompt, params, max_tokens))

    def assert_serving(self) -> None:
        """No KV block held on either side, and the next P/D request equals colocated."""
        self.pair.wait_no_blocks_in_use()
        result = self.pd(PROMPTS[1])
        assert result.finish_reason == "length", result.error
        assert result.token_ids == colocated_tokens(self.model, [PROMPTS[1]])[0]
        self.pair.wait_no_blocks_in_use()


def _ids_of(prompt: str | Sequence[int]) -> list[int]:
    return list(prompt.encode()) if isinstance(prompt, str) else list(prompt)


def _start(log_dir, name: str, model: str, **options: Any) -> DaemonPair:
    return DaemonPair.start(log_dir, name=name, common_flags=["--model", model], **options)


@pytest.fixture(scope="module")
def shared(tmp_path_factory) -> Iterator[dict[str, Served]]:
    """One pair per model, reused by the tests that leave both daemons serving (tagged data
    plane: a frozen producer holds a pull posted; kv_load_failure_policy "fail"). Each must stop
    with no block in use."""
    logs = tmp_path_factory.mktemp("hybrid-adversarial")
    plans = {
        "hy": (HYBRID, ["--num-kv-blocks", str(DECODE_BLOCKS[HYBRID])]),
        "ma": (MAMBA, ["--num-kv-blocks", str(DECODE_BLOCKS[MAMBA])]),
        "de": (DENSE, []),
    }
    extra = {"data_plane": "tagged", "kv_lease_s": 120.0, "transfer_timeout_s": 60.0}
    with ThreadPoolExecutor(len(plans)) as pool:
        futures = {
            name: pool.submit(_start, logs, name, model, decode_flags=flags, extra_config=extra)
            for name, (model, flags) in plans.items()
        }
    pairs = {name: f.result() for name, f in futures.items() if f.exception() is None}
    try:
        for future in futures.values():
            future.result()  # a failed start fails the module, the others stopped below
        yield {name: Served(pairs[name], plans[name][0]) for name in plans}
    finally:
        stopped = {name: pair.stop() for name, pair in pairs.items()}
    assert stopped == dict.fromkeys(plans, CLEAN_EXIT)


@pytest.fixture
def hybrid(shared) -> Served:
    return shared["hy"]


@pytest.fixture
def mamba(shared) -> Served:
    return shared["ma"]


def _served(shared: dict[str, Served], model: str) -> Served:
    return {served.model: served for served in shared.values()}[model]


# ---------------------------------------------------------------------- malformed params

# (id, model, how to mangle (full-attention list, other group's list), where it fails: a gRPC
# code when the daemon refuses the call, else the request's error, and what that says).
Mangle = Callable[[list[int], list[int]], Any]
_SHAPE = "kv_transfer_params.remote_block_ids must be a list of block ids (ints >= 0)"
MALFORMED: list[tuple[str, str, Mangle, str | None, Sequence[str]]] = [
    # Both models: the lists' shape and the full-attention group.
    *[
        case
        for model in (HYBRID, MAMBA)
        for case in [
            (
                "flat-list-for-two-groups",
                model,
                lambda f, o: f,
                None,
                ["remote_block_ids holds 1 block list(s); this engine has 2 KV cache group(s)"],
            ),
            (
                "three-lists",
                model,
                lambda f, o: [f, o, [1]],
                None,
                ["remote_block_ids holds 3 block list(s); this engine has 2 KV cache group(s)"],
            ),
            (
                "full-attention-one-short",
                model,
                lambda f, o: [f[:-1], o],
                None,
                [
                    "holds 13 blocks for the full-attention group (2 layers), "
                    "remote_num_tokens 222 needs 14"
                ],
            ),
            (
                "full-attention-one-long",
                model,
                lambda f, o: [[*f, f[-1]], o],
                None,
                [
                    "RemoteLayoutError: kv_transfer_params.remote_block_ids holds 15 blocks for "
                    "the full-attention group (2 layers), remote_num_tokens 222 needs exactly 14"
                ],
            ),
            ("negative-id", model, lambda f, o: [[*f[:-1], -1], o], "INVALID_ARGUMENT", [_SHAPE]),
            ("bool-id", model, lambda f, o: [[*f[:-1], True], o], "INVALID_ARGUMENT", [_SHAPE]),
            ("nested-too-deep", model, lambda f, o: [[f], [o]], "INVALID_ARGUMENT", [_SHAPE]),
            (
                "full-attention-id-out-of-range",
                model,
                lambda f, o: [[*f[:-1], 10**6], o],
                None,
                ["remote block id 1000000 out of range for layer 'model.layers.1.self_attn'"],
            ),
            (
                "full-attention-id-repeated",
                model,
                lambda f, o: [[*f[:-1], f[0]], o],
                None,
                ["ACCESS_DENIED", "blocks are not lease", "positions [0, 14)"],
            ),
        ]
    ],
    # tiny-hybrid: its sliding-window group (window 24: at most 3 blocks of 16 tokens).
    (
        "window-longer-than-it-reaches",
        HYBRID,
        lambda f, o: [f, f[-4:]],
        None,
        [
            "holds 4 blocks for the sliding-window group (window 24) (2 layers); its window "
            "reaches at most 3 of engine 'hy-prefill''s 16-token blocks"
        ],
    ),
    ("window-empty", HYBRID, lambda f, o: [f, []], None, ["the sliding-window group (window 24)"]),
    (
        "window-ids-not-the-leases",
        HYBRID,
        lambda f, o: [f, f[-len(o) :]],
        None,
        ["ACCESS_DENIED", "blocks are not lease", "positions [14, 16)"],
    ),
    (
        "window-id-out-of-range",
        HYBRID,
        lambda f, o: [f, [*o[:-1], 10**6]],
        None,
        ["remote block id 1000000 out of range for layer 'model.layers.0.self_attn'"],
    ),
    (
        "groups-swapped",
        HYBRID,
        lambda f, o: [o, f],
        None,
        ["holds 2 blocks for the full-attention group (2 layers), remote_num_tokens 222 needs 14"],
    ),
    # tiny-mamba: its recurrent-state group (one state block per request).
    (
        "two-state-blocks",
        MAMBA,
        lambda f, o: [f, f[-2:]],
        None,
        ["the recurrent-state group (2 layers): the producer lists 2 state blocks, not one"],
    ),
    (
        "no-state-block",
        MAMBA,
        lambda f, o: [f, []],
        None,
        ["the recurrent-state group (2 layers): the producer lists 0 state blocks, not one"],
    ),
    (
        "state-block-not-the-leases",
        MAMBA,
        lambda f, o: [f, [f[-1]]],
        None,
        ["ACCESS_DENIED", "blocks are not lease", "positions [14, 15)"],
    ),
    (
        "state-block-is-the-null-block",
        MAMBA,
        lambda f, o: [f, [0]],
        None,
        ["ACCESS_DENIED", "block(s) 0 do not belong to lease"],
    ),
    (
        "state-block-out-of-range",
        MAMBA,
        lambda f, o: [f, [10**6]],
        None,
        ["remote block id 1000000 out of range for layer 'model.layers.0.mamba'"],
    ),
]


@pytest.mark.parametrize(
    ("model", "mangle", "code", "says"),
    [pytest.param(*case[1:], id=f"{case[1].split(':')[1]}-{case[0]}") for case in MALFORMED],
)
def test_a_mangled_block_list_fails_only_its_request_naming_the_problem(
    shared, model, mangle, code, says
):
    """The params a prefill returned, with ``remote_block_ids`` mangled: the decode refuses the
    call (malformed JSON shapes) or fails the request (a shape the engine cannot use, or blocks
    the producer does not lend at those positions), naming the group or lease at fault; the
    producer's blocks are given back, and both daemons go on serving."""
    served = _served(shared, model)
    rid = served.rid("mangled")
    prefilled = served.prefill(LONG, rid)
    params = dict(prefilled.kv_transfer_params)
    full, other = params["remote_block_ids"]
    params["remote_block_ids"] = mangle(list(full), list(other))
    try:
        message = served.decode_request(prefilled, LONG, params)
        if code is not None:
            with pytest.raises(grpc.RpcError) as refused:
                served.decode(message)
            assert refused.value.code().name == code
            error = refused.value.details()
        else:
            result = served.decode(message)
            assert result.finish_reason == "error"
            assert result.token_ids == []
            error = result.error
            assert error.startswith(
                (
                    f"KV load failed for request {rid} (kv_load_failure_policy=fail): ",
                    f"KV connector UcxConnector.get_num_new_matched_tokens raised for request "
                    f"{rid}: ValueError: ",
                    f"KV connector UcxConnector.update_state_after_alloc raised for request "
                    f"{rid}: ValueError: ",
                )
            ), error
        for words in says:
            assert words in error, error
    finally:
        served.release(prefilled)  # a refused call named no lease to give back
    served.assert_serving()


@pytest.mark.parametrize("model", [HYBRID, MAMBA])
def test_a_lease_released_before_the_pull_fails_the_load_typed(shared, model):
    served = _served(shared, model)
    rid = served.rid("released")
    prefilled = served.prefill(LONG, rid)
    served.release(prefilled)
    result = served.decode(served.decode_request(prefilled, LONG, prefilled.kv_transfer_params))
    assert result.finish_reason == "error"
    assert result.error.startswith(
        f"KV load failed for request {rid} (kv_load_failure_policy=fail)"
    )
    assert f"lease '{rid}' has ended (its consumer released it)" in result.error
    served.assert_serving()


# ---------------------------------------------------------------------- cancel and abort


def _stream_in_background(
    address: str, message: generation_pb2.GenerateRequest
) -> tuple[Any, threading.Thread, list[Any]]:
    """A streaming Generate call read on a thread: (call, thread, messages or the RpcError)."""
    client = GenerationClient(address)
    call = client.stream(message)
    seen: list[Any] = []

    def read() -> None:
        try:
            seen.extend(call)
        except grpc.RpcError as exc:
            seen.append(exc)
        finally:
            client.close()

    thread = threading.Thread(target=read, name=f"stream-{message.request_id}")
    thread.start()
    return call, thread, seen


@pytest.mark.parametrize("how", ["cancel", "abort"])
@pytest.mark.parametrize("model", [HYBRID, MAMBA])
def test_a_decode_stopped_while_it_pulls_gives_every_block_back(shared, model, how):
    """The producer frozen (its tagged pulls stay posted), the decode's call is cancelled by
    its client or aborted by an operator mid-load: the decode gives its blocks (every group's)
    back at once, without waiting for the producer, and tells the producer to free its own
    once it runs again."""
    served = _served(shared, model)
    pair = served.pair
    served.pd(PROMPTS[0])  # handshake done: the next load goes straight to its pulls
    rid = served.rid(how)
    prefilled = served.prefill(LONG, rid)
    message = served.decode_request(prefilled, LONG, prefilled.kv_transfer_params)
    pair.pause("prefill")
    try:
        call, thread, seen = _stream_in_background(pair.decode.address, message)
        pair.wait_loading(rid, for_at_least_s=0.3)
        assert pair.status("decode").num_used_blocks > 0
        if how == "cancel":
            call.cancel()
        else:
            assert admin(pair.decode.address, "abort", rid) is True
        thread.join(30)
        assert not thread.is_alive()
        wait_until(
            lambda: pair.status("decode").num_used_blocks == 0,
            "the stopped decode gave its blocks back while the producer is frozen",
            10,
        )
        assert admin(pair.decode.address, "transfers") == []
    finally:
        pair.resume("prefill")
    if how == "cancel":
        (outcome,) = seen
        assert isinstance(outcome, grpc.RpcError) and outcome.code() is grpc.StatusCode.CANCELLED
    else:
        assert seen[-1].finished and seen[-1].finish_reason == "abort"
        assert [t for m in seen for t in m.token_ids] == []
    pair.wait_no_blocks_in_use()  # the producer's lease ended by the decode's release
    assert admin(pair.prefill.address, "transfers") == []
    served.assert_serving()


# ---------------------------------------------------------------------- pool pressure


@pytest.mark.parametrize("model", [HYBRID, MAMBA])
def test_concurrent_decodes_in_a_tiny_pool_preempt_each_other_and_equal_colocated(shared, model):
    """Six decodes sent at once to a decode whose pool holds about three of them at their
    final length: the running ones preempt the latest admitted, which compute again from
    position 0 (a window group from what its prefix cache still has, a recurrent state from
    nothing). Every token equals colocated, and every block (every group's) comes back."""
    served = _served(shared, model)
    prompts = [[(7 * i + 13 * j + j // 5) % 200 + 32 for j in range(150 + 9 * i)] for i in range(6)]
    max_tokens = 60
    expected = colocated_tokens(model, prompts, max_tokens, ignore_eos=True)
    prefilled = [served.prefill(p, served.rid("pressure")) for p in prompts]
    messages = [
        served.decode_request(f, p, f.kv_transfer_params, max_tokens, ignore_eos=True)
        for f, p in zip(prefilled, prompts, strict=True)
    ]
    streams = [_stream_in_background(served.pair.decode.address, m) for m in messages]
    results = []
    for _, thread, seen in streams:
        thread.join(CALL_TIMEOUT_S)
        assert not thread.is_alive()
        assert all(isinstance(m, generation_pb2.GenerateResponse) for m in seen), seen[-1:]
        results.append(seen)
    for seen, want in zip(results, expected, strict=True):
        assert seen[-1].finish_reason == "length", seen[-1].error
        assert [t for m in seen for t in m.token_ids] == want
    # A request computing more than one token in a step is on its timeline ("model.layer"
    # spans): a decode that loaded its prompt computes one per step, unless it was preempted
    # and computes its tokens again.
    recomputed = [any(s.name == "model.layer" for m in seen for s in m.spans) for seen in results]
    assert any(recomputed), "no decode was preempted: the pool is not small enough"
    served.assert_serving()


@pytest.mark.parametrize("model", [HYBRID, MAMBA])
def test_a_prompt_prefilled_in_chunks_moves_and_equals_colocated(shared, model):
    """600 tokens: the prefill computes them in two steps of at most 512 (the engine's budget),
    the window releasing blocks and the state carried between them; the decode receives every
    full-attention block and the window's tail (or the one state block)."""
    served = _served(shared, model)
    prompt = [(11 * j + j // 7) % 250 + 3 for j in range(600)]
    result = served.pd(prompt)
    assert result.finish_reason == "length", result.error
    assert result.token_ids == colocated_tokens(model, [prompt])[0]
    full = math.ceil(600 / BLOCK_SIZE)
    other = window_tail_blocks(600) if model == HYBRID else 1
    assert result.metrics.kv_blocks_received == full + other
    assert result.metrics.num_recomputed_tokens == 0
    served.assert_serving()


# ---------------------------------------------------------------------- mismatched models


def _mismatch(prefill_model: str, decode_model: str, prompt: str, *says: str):
    name = f"{prefill_model.split(':')[1]}-to-{decode_model.split(':')[1]}-{len(prompt)}-tokens"
    return pytest.param(prefill_model, decode_model, prompt, says, id=name)


_COMPAT = "HandshakeCompatibilityError: engine '{name}-prefill' at "
_MODELS = "is incompatible with this engine: model: local='{d}' remote='{p}'"


@pytest.mark.parametrize(
    ("prefill_model", "decode_model", "prompt", "says"),
    [
        _mismatch(
            DENSE,
            HYBRID,
            LONG,
            "remote_block_ids holds 1 block list(s); this engine has 2 KV cache group(s)",
        ),
        _mismatch(
            HYBRID,
            DENSE,
            LONG,
            "remote_block_ids holds 2 block list(s); this engine has 1 KV cache group(s)",
        ),
        _mismatch(HYBRID, MAMBA, PROMPTS[0], _COMPAT, _MODELS),
        _mismatch(MAMBA, HYBRID, PROMPTS[0], _COMPAT, _MODELS),
        _mismatch(HYBRID, MAMBA, LONG, _COMPAT, _MODELS),
        _mismatch(MAMBA, HYBRID, LONG, _COMPAT, _MODELS),
    ],
)
def test_a_producer_of_another_model_is_refused_naming_both_sides(
    shared, prefill_model, decode_model, prompt, says
):
    """A decode handed the params of a prefill serving another model (dense, the other hybrid
    preset) fails that request naming both sides, whatever the prompt's length; nothing is
    moved, and every daemon goes on serving."""
    producer, consumer = _served(shared, prefill_model), _served(shared, decode_model)
    short = {DENSE: "de", HYBRID: "hy", MAMBA: "ma"}
    rid = producer.rid("mismatch")
    prefilled = producer.prefill(prompt, rid)
    try:
        message = producer.decode_request(
            prefilled, prompt, prefilled.kv_transfer_params, for_model=decode_model
        )
        result = consumer.decode(message)
        assert result.finish_reason == "error"
        assert result.token_ids == []
        for words in says:
            words = words.format(name=short[prefill_model], p=prefill_model, d=decode_model)
            assert words in result.error, result.error
    finally:
        producer.release(prefilled)
    for served in (consumer, producer):
        served.assert_serving()


# ---------------------------------------------------------------------- request ids and aborts


def test_a_request_id_retried_after_a_failed_load_is_served(hybrid):
    """A client retries its decode under the same request id after a refused pull (a new
    prefill, good params): the retry is served and equals colocated."""
    rid = hybrid.rid("retry")
    first = hybrid.prefill(LONG, hybrid.rid("retry-a"))
    second = None
    try:
        forged = {**first.kv_transfer_params, "remote_kv_secret": "x" * 43}
        failed = hybrid.decode(hybrid.decode_request(first, LONG, forged, request_id=rid))
        assert failed.finish_reason == "error"
        assert "ACCESS_DENIED): wrong secret for lease" in failed.error
        hybrid.release(first)
        hybrid.pair.wait_no_blocks_in_use()
        second = hybrid.prefill(LONG, hybrid.rid("retry-b"))
        retried = hybrid.decode(
            hybrid.decode_request(second, LONG, second.kv_transfer_params, request_id=rid)
        )
        assert retried.error == ""
        assert retried.token_ids == colocated_tokens(HYBRID, [LONG])[0]
    finally:
        hybrid.release(first)
        if second is not None:
            hybrid.release(second)
        hybrid.pair.wait_no_blocks_in_use()


def test_the_params_of_a_prefill_aborted_in_its_queue_let_the_decode_compute_the_prompt(hybrid):
    """A prefill aborted while it waits for blocks holds nothing, and says so: its params carry
    ``remote_num_tokens`` 0 and no block. A decode handed them computes the prompt itself (as a
    dense one does) and equals colocated, whatever the empty lists' shape (one per group, or an
    older producer's flat ``[]``)."""
    pair = hybrid.pair
    # Five leases of 16 blocks each (14 full-attention, the window's 2) leave 15 of 95 free:
    # a sixth 222-token prompt (28 blocks while computed) waits.
    held = []
    try:
        for i in range(5):
            held.append(hybrid.prefill(chr(65 + i) + LONG[1:], hybrid.rid("hold")))
        assert pair.status("prefill").num_used_blocks == 80
        rid = hybrid.rid("queued")
        queued_prompt = "Q" + LONG[1:]
        message = generate_request(rid, queued_prompt, 1, kv_transfer_params=dict(REMOTE_DECODE))
        _, thread, seen = _stream_in_background(pair.prefill.address, message)
        wait_until(
            lambda: pair.status("prefill").num_waiting_requests == 1, "the prefill queued", 30
        )
        assert admin(pair.prefill.address, "abort", rid) is True
        thread.join(30)
        final = seen[-1]
        assert final.finish_reason == "abort"
        params = json.loads(final.kv_transfer_params_json)
        assert params["remote_num_tokens"] == 0
        assert params["remote_block_ids"] in ([], [[], []])
        for shape in (params["remote_block_ids"], [], [[], []]):
            result = hybrid.decode(
                generate_request(
                    hybrid.rid("nothing-held"),
                    queued_prompt,
                    MAX_TOKENS,
                    kv_transfer_params={**params, "remote_block_ids": shape},
                )
            )
            assert result.error == "", shape
            assert result.token_ids == colocated_tokens(HYBRID, [queued_prompt])[0]
            assert result.metrics.kv_blocks_received == 0
    finally:
        for prefilled in held:
            hybrid.release(prefilled)
        pair.wait_no_blocks_in_use()


# ---------------------------------------------------------------------- producer death


@pytest.mark.parametrize("model", [HYBRID, MAMBA])
def test_a_producer_killed_during_the_pull_is_recomputed_to_colocated_tokens(tmp_path, model):
    """kv_load_failure_policy "recompute": the producer dies while the decode's pulls are
    posted (every group's blocks half-read, a state block maybe half-written); the decode
    computes the prompt itself from position 0 (a recurrent state from nothing) and equals
    colocated; its blocks all come back and it goes on serving."""
    extra = {"data_plane": "tagged", "kv_lease_s": 60.0, "transfer_timeout_s": 60.0}
    pair = _start(tmp_path, "kill", model, kv_load_failure_policy="recompute", extra_config=extra)
    with pair:
        served = Served(pair, model)
        served.pd(PROMPTS[0])  # handshake done: the next load goes straight to its pulls
        rid = served.rid("killed")
        prefilled = served.prefill(LONG, rid)
        message = served.decode_request(prefilled, LONG, prefilled.kv_transfer_params)
        pair.pause("prefill")
        _, thread, seen = _stream_in_background(pair.decode.address, message)
        pair.wait_loading(rid, for_at_least_s=0.3)
        pair.kill("prefill")
        thread.join(CALL_TIMEOUT_S)
        assert not thread.is_alive()
        final = seen[-1]
        assert isinstance(final, generation_pb2.GenerateResponse), final
        assert final.finish_reason == "length", final.error
        assert [t for m in seen for t in m.token_ids] == colocated_tokens(model, [LONG])[0]
        assert final.metrics.num_recomputed_tokens == len(LONG)
        pair.wait_no_blocks_in_use()
        # Still serving: a request of its own (no prefill to pull from any more).
        with GenerationClient(pair.decode.address) as client:
            alone = client.generate(generate_request("alone", PROMPTS[1], MAX_TOKENS), 60)
        reference = colocated(PROMPTS[1:2], MAX_TOKENS, model=model)[0]
        assert alone.token_ids == reference
        pair.wait_no_blocks_in_use()
        failures = pair.failures("decode")
        stopped = pair.stop()
    assert failures == {"kv_load_recomputed": 1.0}
    assert stopped == {"decode": Stopped(0, 0), "prefill": Stopped(-9, None)}


def _colocated_with_logprobs(model: str, prompt: list[int], max_tokens: int):
    config = EngineConfig(model=model, block_size=BLOCK_SIZE, num_kv_blocks=NUM_KV_BLOCKS)
    with LLM(config) as llm:
        (output,) = llm.generate([prompt], SamplingParams(max_tokens=max_tokens, logprobs=0))
    return output.token_ids, [entry.logprob for entry in output.logprobs]


def test_a_load_recomputed_after_a_decode_prefix_hit_equals_colocated(tmp_path):
    """A second turn whose first turn the decode has cached (11 blocks in both groups): the
    producer is killed before the pull, and the decode recomputes the 13 tokens after its
    prefix hit. Its tokens and log-probabilities equal colocated."""
    first = list(PROMPTS[2].encode())[:173]
    max_tokens = 24
    pair = _start(tmp_path, "rehit", HYBRID, kv_load_failure_policy="recompute")
    with pair:
        served = Served(pair, HYBRID)
        (turn,) = pair.generate([first], MAX_TOKENS)
        second = [*first, *turn.token_ids, *b" And then?"]
        prefilled = served.prefill(second, served.rid("second"))
        pair.kill("prefill")
        with GenerationClient(pair.decode.address) as client:
            answer = client.generate(
                generate_request(
                    prefilled.request_id,
                    second,
                    max_tokens,
                    logprobs=0,
                    kv_transfer_params=prefilled.kv_transfer_params,
                ),
                CALL_TIMEOUT_S,
            )
        pair.wait_no_blocks_in_use()
        pair.stop()
    assert answer.finish_reason == "length", answer.error
    # The first turn's 176 tokens hit on the decode; the 13 after them were recomputed.
    assert (answer.metrics.num_cached_tokens, answer.metrics.num_recomputed_tokens) == (176, 13)
    tokens, logprobs = _colocated_with_logprobs(HYBRID, second, max_tokens)
    got = [entry.sampled.logprob for entry in answer.logprobs]
    assert max(abs(a - b) for a, b in zip(got, logprobs, strict=True)) < 1e-3
    assert answer.token_ids == tokens
