"""The official ``openai`` client against the router and real daemons (separate processes) on a
Hugging Face model directory written by ``kvtransfer model init``.

Every answer is checked against a colocated reference: token ids against the in-process engine
(chat prompts tokenized by ``transformers``' ``apply_chat_template`` on the same directory),
log-probabilities against a plain ``Generate`` on the prefill daemon (the same engine, no
transfer). Errors must reach the client as its typed exceptions.
"""

from __future__ import annotations

import math

import openai
import pytest
from serve_helpers.daemons import colocated, exit_used_blocks, running, start_daemon, start_router
from transformers import AutoTokenizer

from kvtransfer.clients.generation import GenerationClient, generate_request
from kvtransfer.engine.model.builtin import init_model_dir

pytestmark = [pytest.mark.integration, pytest.mark.client]

MODEL_NAME = "tiny-chat"
MAX_TOKENS = 8
PROMPTS = ["Hello there, how", "The KV cache moves from one engine to another"]
CONVERSATION = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Name a colour."},
    {"role": "assistant", "content": "Blue."},
    {"role": "user", "content": "Another one, with ünïcode?"},
]
SAMPLING = {"temperature": 0.9, "top_p": 0.95}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return init_model_dir(tmp_path_factory.mktemp("model") / "tiny", "tiny")


@pytest.fixture(scope="module")
def cluster(tmp_path_factory, model_dir):
    logs = tmp_path_factory.mktemp("client")
    flags = ("--model", str(model_dir))
    prefill = start_daemon("prefill", logs, *flags, "--engine-id", "p")
    decode = start_daemon("decode", logs, *flags, "--engine-id", "d")
    router = start_router(logs, [prefill], [decode], "--model-name", MODEL_NAME)
    with running(router, decode, prefill):
        client = openai.OpenAI(base_url=f"{router.address}/v1", api_key="unused", max_retries=0)
        yield client, prefill
    assert exit_used_blocks(prefill) == exit_used_blocks(decode) == 0


def reference(model_dir, prompts, max_tokens=MAX_TOKENS, **sampling):
    return colocated(prompts, max_tokens, sampling=sampling or None, model=str(model_dir))


def chat_prompt_ids(model_dir, messages=CONVERSATION) -> list[int]:
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


def token_ids(choice_or_response) -> list[int]:
    return choice_or_response.model_extra["kvtransfer"]["token_ids"]


# ---------------------------------------------------------------------- completions


def test_completions_string_ids_and_batches_equal_colocated(cluster, model_dir):
    client, _ = cluster
    expected = reference(model_dir, PROMPTS)
    one = client.completions.create(model=MODEL_NAME, prompt=PROMPTS[0], max_tokens=MAX_TOKENS)
    assert token_ids(one) == expected[0]
    assert one.usage.completion_tokens == MAX_TOKENS
    ids = AutoTokenizer.from_pretrained(str(model_dir))(PROMPTS[1])["input_ids"]
    batch = client.completions.create(
        model=MODEL_NAME, prompt=[PROMPTS[0], ids], max_tokens=MAX_TOKENS
    )
    assert [c.index for c in batch.choices] == [0, 1]
    assert [token_ids(c) for c in batch.choices] == expected
    assert batch.choices[0].text == one.choices[0].text
    assert batch.usage.prompt_tokens == one.usage.prompt_tokens + len(ids)
    assert batch.usage.completion_tokens == 2 * MAX_TOKENS


def test_n_samples_each_equal_colocated_with_its_seed(cluster, model_dir):
    client, _ = cluster
    answer = client.completions.create(
        model=MODEL_NAME, prompt=PROMPTS[1], max_tokens=MAX_TOKENS, n=3, seed=11, **SAMPLING
    )
    got = [token_ids(c) for c in answer.choices]
    for sample in range(3):
        assert got[sample] == reference(model_dir, PROMPTS[1:], seed=11 + sample, **SAMPLING)[0]
    assert len({tuple(t) for t in got}) > 1  # the samples really differ
    # The prompt is counted once, as OpenAI does.
    prompt_tokens = client.completions.create(
        model=MODEL_NAME, prompt=PROMPTS[1], max_tokens=1
    ).usage.prompt_tokens
    assert answer.usage.prompt_tokens == prompt_tokens
    assert answer.usage.completion_tokens == 3 * MAX_TOKENS


def test_streams_carry_every_choice_and_usage_last(cluster, model_dir):
    client, _ = cluster
    chunks = list(
        client.completions.create(
            model=MODEL_NAME,
            prompt=PROMPTS,
            max_tokens=MAX_TOKENS,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    texts = ["", ""]
    for chunk in chunks[:-1]:
        assert chunk.usage is None
        for choice in chunk.choices:
            texts[choice.index] += choice.text
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 2 * MAX_TOKENS
    whole = client.completions.create(model=MODEL_NAME, prompt=PROMPTS, max_tokens=MAX_TOKENS)
    assert texts == [c.text for c in whole.choices]
    assert whole.usage.prompt_tokens == chunks[-1].usage.prompt_tokens


def test_echo_prepends_the_prompt(cluster):
    client, _ = cluster
    plain = client.completions.create(model=MODEL_NAME, prompt=PROMPTS[0], max_tokens=MAX_TOKENS)
    echoed = client.completions.create(
        model=MODEL_NAME, prompt=PROMPTS[0], max_tokens=MAX_TOKENS, echo=True
    )
    assert echoed.choices[0].text == PROMPTS[0] + plain.choices[0].text


def colocated_logprobs(prefill, prompt, k: int, **sampling):
    """The same engine without a transfer: a plain Generate on the prefill daemon."""
    request = generate_request("ref-logprobs", prompt, MAX_TOKENS, logprobs=k, **sampling)
    with GenerationClient(prefill.address) as client:
        return client.generate(request).logprobs


@pytest.mark.parametrize("sampling", [{}, {"seed": 5, **SAMPLING}], ids=["greedy", "seeded"])
def test_completion_logprobs_equal_colocated(cluster, sampling):
    client, prefill = cluster
    answer = client.completions.create(
        model=MODEL_NAME, prompt=PROMPTS[1], max_tokens=MAX_TOKENS, logprobs=3, **sampling
    )
    logprobs = answer.choices[0].logprobs
    expected = colocated_logprobs(prefill, PROMPTS[1], 3, **sampling)
    assert len(logprobs.tokens) == len(expected) == MAX_TOKENS
    assert logprobs.tokens == [e.sampled.token for e in expected]
    for got, want in zip(logprobs.token_logprobs, expected, strict=True):
        assert math.isclose(got, want.sampled.logprob, abs_tol=1e-4)
    for got, want in zip(logprobs.top_logprobs, expected, strict=True):
        assert len(want.top) == 3
        assert list(got) == list(dict.fromkeys(t.token for t in want.top))
    offsets = logprobs.text_offset
    assert offsets[0] == 0 and offsets == sorted(offsets)
    if not sampling:  # greedy: the sampled token is the most likely one
        for got, top in zip(logprobs.token_logprobs, logprobs.top_logprobs, strict=True):
            assert math.isclose(got, max(top.values()), abs_tol=1e-6)


# ---------------------------------------------------------------------- chat


def test_chat_equals_colocated_on_the_templated_prompt(cluster, model_dir):
    client, _ = cluster
    prompt = chat_prompt_ids(model_dir)
    expected = reference(model_dir, [prompt])[0]
    answer = client.chat.completions.create(
        model=MODEL_NAME, messages=CONVERSATION, max_tokens=MAX_TOKENS
    )
    assert answer.object == "chat.completion"
    assert answer.choices[0].message.role == "assistant"
    assert token_ids(answer) == expected
    assert answer.usage.prompt_tokens == len(prompt)
    assert answer.usage.completion_tokens == MAX_TOKENS
    # max_completion_tokens is the newer name of the same limit.
    newer = client.chat.completions.create(
        model=MODEL_NAME, messages=CONVERSATION, max_completion_tokens=3
    )
    assert token_ids(newer) == expected[:3]


def test_chat_stream_n_seeds_and_usage(cluster, model_dir):
    client, _ = cluster
    prompt = chat_prompt_ids(model_dir)
    chunks = list(
        client.chat.completions.create(
            model=MODEL_NAME,
            messages=CONVERSATION,
            max_tokens=MAX_TOKENS,
            n=2,
            seed=21,
            stream=True,
            stream_options={"include_usage": True},
            **SAMPLING,
        )
    )
    texts, roles, finished, ids = ["", ""], [None, None], [None, None], [[], []]
    for chunk in chunks[:-1]:
        assert chunk.object == "chat.completion.chunk"
        for choice in chunk.choices:
            texts[choice.index] += choice.delta.content or ""
            roles[choice.index] = roles[choice.index] or choice.delta.role
            if choice.finish_reason is not None:
                finished[choice.index] = choice.finish_reason
                ids[choice.index] = chunk.model_extra["kvtransfer"]["token_ids"]
    assert roles == ["assistant", "assistant"] and finished == ["length", "length"]
    for sample in range(2):
        assert ids[sample] == reference(model_dir, [prompt], seed=21 + sample, **SAMPLING)[0]
    usage = chunks[-1].usage
    assert chunks[-1].choices == [] and usage.prompt_tokens == len(prompt)
    assert usage.completion_tokens == 2 * MAX_TOKENS
    whole = client.chat.completions.create(
        model=MODEL_NAME, messages=CONVERSATION, max_tokens=MAX_TOKENS, n=2, seed=21, **SAMPLING
    )
    assert texts == [c.message.content for c in whole.choices]


def test_chat_logprobs(cluster, model_dir):
    client, prefill = cluster
    answer = client.chat.completions.create(
        model=MODEL_NAME,
        messages=CONVERSATION,
        max_tokens=MAX_TOKENS,
        logprobs=True,
        top_logprobs=2,
    )
    content = answer.choices[0].logprobs.content
    expected = colocated_logprobs(prefill, chat_prompt_ids(model_dir), 2)
    assert [c.token for c in content] == [e.sampled.token for e in expected]
    for got, want in zip(content, expected, strict=True):
        assert math.isclose(got.logprob, want.sampled.logprob, abs_tol=1e-4)
        assert got.bytes == list(got.token.encode("utf-8"))
        assert [t.token for t in got.top_logprobs] == [t.token for t in want.top]
    plain = client.chat.completions.create(
        model=MODEL_NAME, messages=CONVERSATION, max_tokens=2, user="someone"
    )
    assert plain.choices[0].logprobs is None


def test_content_parts_are_joined_text(cluster):
    client, _ = cluster
    parts = [{"type": "text", "text": "Name a"}, {"type": "text", "text": "colour."}]
    as_parts = client.chat.completions.create(
        model=MODEL_NAME, messages=[{"role": "user", "content": parts}], max_tokens=4
    )
    as_text = client.chat.completions.create(
        model=MODEL_NAME, messages=[{"role": "user", "content": "Name a\ncolour."}], max_tokens=4
    )
    assert token_ids(as_parts) == token_ids(as_text)


# ---------------------------------------------------------------------- errors


def test_errors_are_the_clients_typed_exceptions(cluster):
    client, _ = cluster
    tool = {"type": "function", "function": {"name": "f", "parameters": {}}}
    image = [{"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}]
    cases = [
        ({"tools": [tool]}, "tools", "tools: not supported"),
        ({"messages": [{"role": "user", "content": image}]}, "messages", "only text parts"),
        ({"n": 200}, "n", "less than or equal to 128"),
        ({"top_logprobs": 2}, "top_logprobs", "requires logprobs"),
        ({"response_format": {"type": "json_object"}}, "response_format", "json_object"),
    ]
    for fields, param, message in cases:
        body = {"model": MODEL_NAME, "messages": CONVERSATION, "max_tokens": 2, **fields}
        with pytest.raises(openai.BadRequestError) as raised:
            client.chat.completions.create(**body)
        assert raised.value.param == param and message in raised.value.message
    with pytest.raises(openai.NotFoundError) as raised:
        client.completions.create(model="nope", prompt="x", max_tokens=2)
    assert raised.value.code == "model_not_found"
    with pytest.raises(openai.NotFoundError) as raised:
        client.embeddings.create(model=MODEL_NAME, input="x")
    assert "/v1/embeddings" in raised.value.message
    with pytest.raises(openai.BadRequestError) as raised:
        client.completions.create(model=MODEL_NAME, prompt="x", max_tokens=2, logprobs=21)
    assert raised.value.param == "logprobs"
    # The daemons are untouched by all of it.
    assert client.completions.create(model=MODEL_NAME, prompt="x", max_tokens=2).choices
