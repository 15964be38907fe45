"""Log-probabilities of output tokens: the raw model distribution at each sampled position,
exact against the logits the engine sampled from, unchanged by speculative decoding, TP, and the
daemon's streaming (one entry per token of each message, none for held-back or stop tokens)."""

from __future__ import annotations

import math

import grpc
import pytest
import torch
from serve_helpers.daemons import running, start_daemon

from kvtransfer.engine.config import EngineConfig, SpeculativeConfig
from kvtransfer.engine.llm import LLM
from kvtransfer.engine.sampler import token_logprobs
from kvtransfer.engine.sampling_params import SamplingParams
from kvtransfer.serve.client import GenerationClient, generate_request

PROMPTS = [[10, 11, 12, 13] * 6, [(3 * i) % 97 + 5 for i in range(30)], "Hello, world"]
K = 5


def generate(params: SamplingParams, **config):
    with LLM(EngineConfig(model="builtin", block_size=8, **config)) as llm:
        outputs = llm.generate(PROMPTS, params)
        llm.engine.drain()
        llm.engine.check_no_leaks()
        return outputs


@pytest.mark.parametrize(
    "sampling", [{}, {"temperature": 0.8, "top_k": 30, "seed": 3}], ids=["greedy", "seeded"]
)
def test_logprobs_are_the_log_softmax_of_the_sampled_logits(sampling):
    params = SamplingParams(max_tokens=12, ignore_eos=True, logprobs=K, return_logits=True)
    for output in generate(SamplingParams(**{**params.__dict__, **sampling})):
        assert len(output.logprobs) == len(output.token_ids) == 12
        reference = torch.log_softmax(output.logits.float(), dim=-1)
        for row, (token, entry) in enumerate(zip(output.token_ids, output.logprobs, strict=True)):
            assert entry.token_id == token
            assert entry.logprob == pytest.approx(reference[row, token].item(), abs=1e-6)
            values, ids = torch.sort(reference[row], descending=True, stable=True)
            assert [t for t, _ in entry.top] == ids[:K].tolist()
            assert [v for _, v in entry.top] == pytest.approx(values[:K].tolist(), abs=1e-6)
            if not sampling:  # greedy picks the most likely token
                assert entry.top[0][0] == token


def test_zero_asks_for_the_sampled_token_alone_and_none_computes_nothing():
    zero = generate(SamplingParams(max_tokens=4, logprobs=0))
    assert all(len(o.logprobs) == len(o.token_ids) for o in zero)
    assert all(entry.top == () for o in zero for entry in o.logprobs)
    assert all(o.logprobs == [] for o in generate(SamplingParams(max_tokens=4)))
    with pytest.raises(ValueError, match=r"logprobs must be in \[0, 20\], got 21"):
        SamplingParams(logprobs=21)


def test_ties_go_to_the_lower_id():
    logits = torch.tensor([[1.0, 3.0, 3.0, 0.0, 3.0]])
    (entry,) = token_logprobs(logits, [4], 3)
    assert [t for t, _ in entry.top] == [1, 2, 4]
    assert entry.logprob == pytest.approx(entry.top[0][1])
    with pytest.raises(ValueError, match="for 2 tokens"):
        token_logprobs(logits, [1, 2], 1)


def test_speculative_decoding_and_tp_give_the_same_logprobs():
    params = SamplingParams(max_tokens=16, ignore_eos=True, logprobs=2)
    plain = generate(params)
    for variant in (
        {"speculative": SpeculativeConfig(method="ngram", num_speculative_tokens=3)},
        {"tensor_parallel_size": 2},
    ):
        other = generate(params, **variant)
        for a, b in zip(plain, other, strict=True):
            assert a.token_ids == b.token_ids
            for x, y in zip(a.logprobs, b.logprobs, strict=True):
                assert x.token_id == y.token_id
                assert math.isclose(x.logprob, y.logprob, abs_tol=1e-4)
                assert [t for t, _ in x.top] == [t for t, _ in y.top]


def test_daemon_streams_one_entry_per_token_and_checks_the_bound(tmp_path):
    daemon = start_daemon("decode", tmp_path)
    with running(daemon), GenerationClient(daemon.address) as client:
        # A stop string cuts the stream: no entry for tokens that were not sent.
        request = generate_request("lp", PROMPTS[2], 24, logprobs=3, ignore_eos=True)
        messages = list(client.stream(request))
        for message in messages:
            assert len(message.logprobs) == len(message.token_ids)
            for token, entry in zip(message.token_ids, message.logprobs, strict=True):
                assert entry.sampled.token_id == token
                assert len(entry.top) == 3
                assert entry.top[0].logprob >= entry.top[1].logprob >= entry.top[2].logprob
                assert entry.sampled.token == daemon_token_text(token)
        whole = client.generate(generate_request("lp2", PROMPTS[2], 24, logprobs=3))
        stop = whole.text[4:6]
        cut = client.generate(generate_request("lp3", PROMPTS[2], 24, logprobs=3, stop=[stop]))
        assert cut.finish_reason == "stop"
        assert len(cut.logprobs) == len(cut.token_ids) < len(whole.token_ids)
        assert [e.sampled.token_id for e in cut.logprobs] == cut.token_ids
        with pytest.raises(grpc.RpcError) as raised:
            client.generate(generate_request("lp4", PROMPTS[2], 4, logprobs=21))
        assert raised.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "sampling.logprobs must be in [0, 20], got 21" in raised.value.details()


def daemon_token_text(token: int) -> str:
    """The built-in byte vocabulary: a byte alone, or a special token's name."""
    specials = {256: "<bos>", 257: "<eos>", 258: "<pad>"}
    return specials.get(token) or bytes([token]).decode("utf-8", "replace")
