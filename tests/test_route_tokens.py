"""Prompt tokens in the router (`RouteTokenizer`): the ids a daemon's Generation service computes
for the same text, token-id or chat prompt (its own parse, on the message the router sends), so
the prefix index keys what the engines cache."""

from __future__ import annotations

import json

import pytest

from kvtransfer.engine.model.chat_template import ChatTemplate
from kvtransfer.engine.model.loader import load_tokenizer
from kvtransfer.router.daemon_flow.upstream import generate_request
from kvtransfer.router.openai.requests import ChatMessages, parse_chat_request
from kvtransfer.router.openai.tokens import RouteTokenizer
from kvtransfer.serve.requests import parse_generate_request

pytestmark = pytest.mark.unit

MESSAGES = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "What moves between prefill and decode?"},
]


@pytest.fixture(scope="module")
def tokens() -> RouteTokenizer:
    return RouteTokenizer("builtin")


def _daemon_ids(choice, template: ChatTemplate | None = None) -> tuple[int, ...]:
    """What a daemon parses out of the Generate message the router sends for ``choice``."""
    message = generate_request("rid", choice, choice.prompt, max_tokens=choice.max_tokens)
    tokenizer = load_tokenizer("builtin")
    template = template or ChatTemplate.for_model("builtin")
    return parse_generate_request(message, tokenizer, 50_000, template).prompt_token_ids


def test_chat_prompts_get_the_daemons_rendering(tokens):
    (choice,) = parse_chat_request({"messages": MESSAGES}).choices()
    ids = tokens.route_tokens(choice.prompt)
    assert ids == _daemon_ids(choice)
    # Rendered by the template (special tokens written by it), not the text tokenized plainly.
    assert ids != tuple(load_tokenizer("builtin").encode(MESSAGES[1]["content"]))
    no_prompt = ChatMessages(json.dumps(MESSAGES), add_generation_prompt=False)
    assert tokens.route_tokens(no_prompt) != ids


def test_text_and_token_prompts(tokens):
    text = "Disaggregated serving moves the prompt's KV cache. " * 3
    assert tokens.route_tokens(text) == tuple(load_tokenizer("builtin").encode(text))
    assert tokens.route_tokens((5, 6, 7)) == (5, 6, 7)


def test_a_chat_template_override_is_used(tmp_path):
    template = tmp_path / "t.jinja"
    template.write_text("{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}")
    tokens = RouteTokenizer("builtin", template)
    (choice,) = parse_chat_request({"messages": MESSAGES}).choices()
    assert tokens.route_tokens(choice.prompt) == _daemon_ids(
        choice, ChatTemplate.for_model("builtin", template)
    )


def test_prompts_the_daemons_refuse_have_no_route_tokens(tokens):
    assert tokens.route_tokens((10**9,)) is None  # outside the vocabulary
    assert tokens.route_tokens(ChatMessages("[]")) is None
