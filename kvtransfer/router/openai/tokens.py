"""`RouteTokenizer`: a prompt's token ids in the router, as the daemons will compute them.

The prefix index needs the prompt's tokens before any daemon sees it. `RouteTokenizer` loads the
model's tokenizer and chat template the way the daemons do (`load_tokenizer`,
`ChatTemplate.for_model` with the same ``--chat-template`` override) and turns a prompt into
tokens with the daemons' own function (`kvtransfer.serve.requests.prompt_token_ids`), so a text,
token-id or chat prompt gets exactly the ids the engine will cache. Give the router the model
directory (and template) its daemons load; tokens from another tokenizer would only make the
cache look colder than it is, never change an answer.

`RouteTokenizer.route_tokens` is a `policy.PromptTokenizer`: ``make_app(config,
tokenizer=RouteTokenizer(model).route_tokens)``.
"""

from __future__ import annotations

import logging
from pathlib import Path

from kvtransfer.clients.generation import generate_request
from kvtransfer.engine.model.chat_template import ChatTemplate
from kvtransfer.engine.model.loader import load_model_config, load_tokenizer
from kvtransfer.router.openai.requests import ChatMessages, Prompt
from kvtransfer.serve.requests import RequestError, prompt_token_ids
from kvtransfer.v1 import generation_pb2

logger = logging.getLogger("kvtransfer.router.tokens")


class RouteTokenizer:
    def __init__(self, model: str, chat_template: str | Path | None = None) -> None:
        """``model``: ``builtin[:preset]`` or a Hugging Face model directory, as the daemons'
        ``--model``; ``chat_template``: their ``--chat-template`` file, if they have one."""
        self.model = model
        self._tokenizer = load_tokenizer(model)
        self._template = ChatTemplate.for_model(model, chat_template)
        self._vocab_size = load_model_config(model).vocab_size

    def route_tokens(self, prompt: Prompt) -> tuple[int, ...] | None:
        """``prompt``'s token ids as the daemons will compute them; ``None`` when the daemons
        would refuse it (they then say why)."""
        if isinstance(prompt, ChatMessages):
            prompt = generation_pb2.ChatPrompt(
                messages_json=prompt.messages_json,
                add_generation_prompt=prompt.add_generation_prompt,
            )
        message = generate_request("route", prompt, max_tokens=1)
        try:
            return prompt_token_ids(message, self._tokenizer, self._vocab_size, self._template)
        except RequestError as exc:
            logger.debug("no route tokens: %s", exc)
            return None
