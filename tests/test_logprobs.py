"""Log-probabilities of output tokens: the raw model distribution at each sampled position,
exact against a dense forward of the same weights, unchanged by sampling temperature,
speculative decoding, TP and PP, kept aligned with the tokens when a stop or max_tokens cuts an
accepted run, and streamed by the daemons with one entry per token of each message (P/D
included: the prefill's first token and the decode's tokens together equal a colocated run)."""

from __future__ import annotations

import json
import math
from collections.abc import Sequence

import grpc
import pytest
import torch
from engine_helpers.dense_reference import dense_logits
from engine_helpers.scheduler_helpers import make_request, make_scheduler
from serve_helpers.daemons import BLOCK_SIZE, NUM_KV_BLOCKS, daemon_pair

from kvtransfer.clients.generation import GenerationClient, generate_request
from kvtransfer.engine.config import EngineConfig, SpeculativeConfig
from kvtransfer.engine.executor.messages import dumps, loads
from kvtransfer.engine.llm import LLM, RequestOutput
from kvtransfer.engine.model.builtin import builtin_model_config, builtin_weights
from kvtransfer.engine.model.tokenizer import BYTE_VOCAB_SIZE, Tokenizer
from kvtransfer.engine.outputs import ModelRunnerOutput, TokenLogprobs
from kvtransfer.engine.runner.sampler import token_logprobs
from kvtransfer.engine.sampling_params import SamplingParams
from kvtransfer.serve.generation import _logprobs_messages
from kvtransfer.v1 import generation_pb2

pytestmark = pytest.mark.integration

# Token-id prompts, so the dense reference sees exactly what the engine saw; the first repeats
# itself, which gives the n-gram drafter something to propose.
PROMPTS = [[10, 11, 12, 13] * 6, [(3 * i) % 97 + 5 for i in range(30)]]
K = 5
SEEDED = {"temperature": 0.8, "top_k": 30, "seed": 3}
# Engine logits agree with the dense float64 forward to 2e-4 (tests/test_engine_vs_dense.py);
# a log-softmax value adds the log-sum-exp's error on top of the logit's.
DENSE_ATOL = 5e-4


def generate(
    params: SamplingParams, prompts: Sequence[Sequence[int]] = PROMPTS, **config
) -> list[RequestOutput]:
    with LLM(EngineConfig(model="builtin", block_size=8, **config)) as llm:
        outputs = llm.generate([list(p) for p in prompts], params)
        llm.engine.drain()
        llm.engine.check_no_leaks()
        return outputs


def top_ids(entry: TokenLogprobs) -> list[int]:
    return [token for token, _ in entry.top]


@pytest.mark.parametrize("sampling", [{}, SEEDED], ids=["greedy", "seeded"])
def test_logprobs_are_the_raw_log_softmax_of_a_dense_forward(sampling):
    params = SamplingParams(
        max_tokens=12, ignore_eos=True, logprobs=K, return_logits=True, **sampling
    )
    config, weights = builtin_model_config("tiny"), builtin_weights("tiny")
    differs_from_argmax = 0
    for prompt, output in zip(PROMPTS, generate(params), strict=True):
        assert len(output.logprobs) == len(output.token_ids) == 12
        tokens = prompt + output.token_ids
        dense = torch.log_softmax(dense_logits(config, weights, tokens[:-1]), dim=-1)
        dense = dense[len(prompt) - 1 :]
        # The logits the sampler used, bit for bit: the ranking (ties by id) is checked on them.
        engine = torch.log_softmax(output.logits.float(), dim=-1)
        for row, (token, entry) in enumerate(zip(output.token_ids, output.logprobs, strict=True)):
            assert entry.token_id == token
            # Raw distribution: with temperature 0.8 the sampled distribution differs, this not.
            assert entry.logprob == pytest.approx(dense[row, token].item(), abs=DENSE_ATOL)
            assert entry.logprob == pytest.approx(engine[row, token].item(), abs=1e-6)
            values, ids = torch.sort(engine[row], descending=True, stable=True)
            assert top_ids(entry) == ids[:K].tolist()
            assert [v for _, v in entry.top] == pytest.approx(values[:K].tolist(), abs=1e-6)
            dense_top = torch.sort(dense[row], descending=True).values[:K]
            assert [v for _, v in entry.top] == pytest.approx(dense_top.tolist(), abs=DENSE_ATOL)
            if not sampling:  # greedy picks the most likely token
                assert top_ids(entry)[0] == token
                assert entry.logprob == entry.top[0][1]
            differs_from_argmax += top_ids(entry)[0] != token
    if sampling:
        # The seeded run really sampled: some token is not the most likely one.
        assert differs_from_argmax > 0


def test_zero_asks_for_the_sampled_token_alone_and_unset_computes_nothing():
    zero = generate(SamplingParams(max_tokens=4, ignore_eos=True, logprobs=0))
    assert all(len(o.logprobs) == len(o.token_ids) == 4 for o in zero)
    assert all(entry.top == () for o in zero for entry in o.logprobs)
    assert all(o.logprobs == [] for o in generate(SamplingParams(max_tokens=4)))
    for bad in (-1, 21):
        with pytest.raises(ValueError, match=rf"logprobs must be in \[0, 20\], got {bad}"):
            SamplingParams(logprobs=bad)


def test_ties_go_to_the_lower_id_and_rows_must_match_tokens():
    logits = torch.tensor([[1.0, 3.0, 3.0, 0.0, 3.0], [0.0, 0.0, 0.0, 0.0, 0.0]])
    first, uniform = token_logprobs(logits, [4, 3], 3)
    assert top_ids(first) == [1, 2, 4]
    assert first.logprob == first.top[0][1] == first.top[2][1]
    assert top_ids(uniform) == [0, 1, 2]
    assert uniform.logprob == pytest.approx(-math.log(5))
    assert token_logprobs(logits, [4, 3], 0)[0].top == ()
    with pytest.raises(ValueError, match="for 3 tokens"):
        token_logprobs(logits, [1, 2, 3], 1)


@pytest.mark.parametrize("sampling", [{}, SEEDED], ids=["greedy", "seeded"])
def test_speculative_decoding_tp_and_pp_give_the_same_logprobs(sampling):
    params = SamplingParams(max_tokens=16, ignore_eos=True, logprobs=2, **sampling)
    plain = generate(params)
    variants = {
        "ngram": {"speculative": SpeculativeConfig(method="ngram", num_speculative_tokens=3)},
        "draft": {"speculative": SpeculativeConfig(method="draft", num_speculative_tokens=3)},
        "tp2": {"tensor_parallel_size": 2},
        "pp2": {"pipeline_parallel_size": 2},
    }
    for name, variant in variants.items():
        other = generate(params, **variant)
        if name == "draft":
            # Drafts were both accepted and rejected (the n-gram drafter's are mostly all
            # accepted or none proposed): a rejected draft's position must not report.
            drafted = sum(o.num_draft_tokens for o in other)
            accepted = sum(o.num_accepted_tokens for o in other)
            assert 0 < accepted < drafted
        for a, b in zip(plain, other, strict=True):
            assert a.token_ids == b.token_ids, name
            assert len(b.logprobs) == len(b.token_ids), name
            for x, y in zip(a.logprobs, b.logprobs, strict=True):
                assert x.token_id == y.token_id
                assert math.isclose(x.logprob, y.logprob, abs_tol=1e-4), name
                assert top_ids(x) == top_ids(y), name


def entries(*tokens: int) -> tuple[TokenLogprobs, ...]:
    return tuple(TokenLogprobs(t, -float(t), ((t, -float(t)),)) for t in tokens)


@pytest.mark.parametrize("stop", ["eos", "stop_token_ids"])
def test_a_stop_inside_an_accepted_run_cuts_tokens_and_logprobs_alike(stop):
    """The runner reports every accepted token; a stop token inside the run cuts the tokens
    after it, and their logprobs with them. (max_tokens never cuts a run: drafts are trimmed
    to what max_tokens leaves.)"""
    spec = SpeculativeConfig(method="ngram", num_speculative_tokens=3)
    sched = make_scheduler(speculative=spec, eos_token_id=63 if stop == "eos" else None)
    stops = {"stop_token_ids": (63,)} if stop == "stop_token_ids" else {}
    sched.add_request(make_request("a", [1, 2, 3], max_tokens=10, logprobs=1, **stops))
    so = sched.schedule()
    first = ModelRunnerOutput(
        req_ids=["a"],
        req_id_to_index={"a": 0},
        sampled_token_ids=[[5]],
        spec_token_ids=[[6, 63, 7]],
        sampled_logprobs={"a": entries(5)},
    )
    (out,) = sched.update_from_output(so, first)
    assert (out.new_token_ids, out.logprobs) == ((5,), entries(5))
    so = sched.schedule()
    assert dict(so.scheduled_spec_decode_tokens) == {"a": (6, 63, 7)}
    run = ModelRunnerOutput(
        req_ids=["a"],
        req_id_to_index={"a": 0},
        sampled_token_ids=[[6, 63, 7, 8]],
        sampled_logprobs={"a": entries(6, 63, 7, 8)},
    )
    (out,) = sched.update_from_output(so, run)
    assert (out.finish_reason, out.new_token_ids) == ("stop", (6, 63))
    assert out.logprobs == entries(6, 63)
    sched.block_manager.check_no_leaks()


def test_a_runner_output_with_the_wrong_number_of_logprobs_is_refused():
    sched = make_scheduler()
    sched.add_request(make_request("a", [1, 2, 3], max_tokens=4, logprobs=0))
    so = sched.schedule()
    for wrong in ({}, {"a": entries(5, 6)}):
        mro = ModelRunnerOutput(
            req_ids=["a"], req_id_to_index={"a": 0}, sampled_token_ids=[[5]], sampled_logprobs=wrong
        )
        with pytest.raises(ValueError, match=rf"{len(wrong.get('a', ()))} logprobs entries for 1"):
            sched.update_from_output(so, mro)


def test_logprobs_survive_the_pipe_between_processes():
    output = ModelRunnerOutput(
        req_ids=("a",), sampled_token_ids=((5,),), sampled_logprobs={"a": entries(5)}
    )
    assert loads(dumps(output)).sampled_logprobs == {"a": entries(5)}
    assert dict(loads(dumps(ModelRunnerOutput())).sampled_logprobs) == {}


# ---------------------------------------------------------------------- daemons

TEXT = "Disaggregated serving moves the prompt's KV cache."
DAEMON_TOKENS = 10


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    logs = tmp_path_factory.mktemp("logprobs-daemons")
    with daemon_pair(logs, ["--engine-id", "p0"], ["--engine-id", "d0"]) as pair:
        yield pair


@pytest.fixture(scope="module")
def colocated_logprobs() -> list[TokenLogprobs]:
    config = EngineConfig(block_size=BLOCK_SIZE, num_kv_blocks=NUM_KV_BLOCKS)
    params = SamplingParams(max_tokens=DAEMON_TOKENS, ignore_eos=True, logprobs=3)
    with LLM(config) as llm:
        (output,) = llm.generate([TEXT], params)
    return output.logprobs


def daemon_token_text(token: int) -> str:
    """The built-in byte vocabulary: a byte alone, or a special token's name."""
    specials = {256: "<bos>", 257: "<eos>", 258: "<pad>"}
    return specials.get(token) or bytes([token]).decode("utf-8", "replace")


def assert_aligned(messages: list[generation_pb2.GenerateResponse], k: int) -> None:
    for message in messages:
        assert len(message.logprobs) == len(message.token_ids)
        for token, entry in zip(message.token_ids, message.logprobs, strict=True):
            assert entry.sampled.token_id == token
            assert entry.sampled.token == daemon_token_text(token)
            assert len(entry.top) == k
            assert [t.token for t in entry.top] == [
                daemon_token_text(t.token_id) for t in entry.top
            ]
            values = [t.logprob for t in entry.top]
            assert values == sorted(values, reverse=True)


def assert_equal_to_colocated(
    got: Sequence[generation_pb2.OutputLogprobs], want: Sequence[TokenLogprobs]
) -> None:
    assert [e.sampled.token_id for e in got] == [e.token_id for e in want]
    for g, w in zip(got, want, strict=True):
        assert math.isclose(g.sampled.logprob, w.logprob, abs_tol=1e-4)
        assert [t.token_id for t in g.top] == top_ids(w)


def test_daemon_streams_one_entry_per_token_and_checks_the_bound(pair, colocated_logprobs):
    _, decode = pair
    with GenerationClient(decode.address) as client:
        request = generate_request("lp", TEXT, DAEMON_TOKENS, logprobs=3, ignore_eos=True)
        messages = list(client.stream(request))
        assert len(messages) > 1  # streamed: alignment is per message, not only overall
        assert_aligned(messages, 3)
        assert_equal_to_colocated([e for m in messages for e in m.logprobs], colocated_logprobs)

        plain = client.generate(generate_request("plain", TEXT, 4, ignore_eos=True))
        assert len(plain.token_ids) == 4 and plain.logprobs == []

        # A stop string cuts the stream: no entry for the tokens that made it or came after.
        whole = client.generate(generate_request("lp2", TEXT, DAEMON_TOKENS, logprobs=0))
        stop = whole.text[4:6]
        cut = client.generate(generate_request("lp3", TEXT, DAEMON_TOKENS, logprobs=0, stop=[stop]))
        assert cut.finish_reason == "stop"
        assert len(cut.token_ids) < len(whole.token_ids)
        assert [e.sampled.token_id for e in cut.logprobs] == cut.token_ids
        assert all(len(e.top) == 0 for e in cut.logprobs)

        for bad in (21, 1000):
            with pytest.raises(grpc.RpcError) as raised:
                client.generate(generate_request("lp4", TEXT, 4, logprobs=bad))
            assert raised.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert f"sampling.logprobs must be in [0, 20], got {bad}" in raised.value.details()


def test_disaggregated_logprobs_equal_colocated(pair, colocated_logprobs):
    """The prefill's final message carries the first token's entry; the decode, given that
    token, streams the rest without repeating it."""
    prefill, decode = pair
    with GenerationClient(prefill.address) as p, GenerationClient(decode.address) as d:
        first = list(
            p.stream(
                generate_request(
                    "pd", TEXT, 1, logprobs=3, kv_transfer_params={"do_remote_decode": True}
                )
            )
        )
        assert first[-1].finish_reason == "length", first[-1].error
        assert_aligned(first, 3)
        (token,) = [t for m in first for t in m.token_ids]
        params = generate_request(
            "pd",
            TEXT,
            DAEMON_TOKENS,
            logprobs=3,
            ignore_eos=True,
            kv_transfer_params=json.loads(first[-1].kv_transfer_params_json),
        )
        params.generated_token_ids.append(token)
        rest = list(d.stream(params))
        assert rest[-1].finish_reason == "length", rest[-1].error
        assert_aligned(rest, 3)
    streamed = [e for m in first + rest for e in m.logprobs]
    assert_equal_to_colocated(streamed, colocated_logprobs)


def test_an_id_past_the_tokenizers_vocabulary_has_no_text_and_does_not_fail_the_stream():
    # A checkpoint whose embedding rows are padded past its tokenizer (e.g. 259 -> 264 here).
    tokenizer = Tokenizer.byte_level()
    entry = TokenLogprobs(65, -0.5, ((65, -0.5), (BYTE_VOCAB_SIZE + 4, -1.5), (257, -2.0)))
    (message,) = _logprobs_messages([entry], tokenizer)
    assert (message.sampled.token_id, message.sampled.token) == (65, "A")
    assert [(t.token_id, t.token) for t in message.top] == [
        (65, "A"),
        (BYTE_VOCAB_SIZE + 4, ""),
        (257, "<eos>"),
    ]
    assert [t.logprob for t in message.top] == [-0.5, -1.5, -2.0]
