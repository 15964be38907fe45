"""`ChatTemplate`: a conversation rendered into a prompt, as Hugging Face's
``apply_chat_template`` renders it for the same checkpoint.

Where the template comes from, first found wins: an explicit Jinja file (the daemon's
``--chat-template``); the checkpoint's ``tokenizer_config.json`` ``chat_template`` (a string,
or a list of named templates of which "default" is used); its ``chat_template.jinja``; its
``chat_template.json``. The built-in models use `BUILTIN_CHAT_TEMPLATE`::

    <bos><|system|>\\nYou are terse.\\n<|user|>\\nHi\\n<|assistant|>\\n

that is ``bos_token``, then per message ``<|role|>``, a newline, the content and a newline, and
with ``add_generation_prompt`` the header ``<|assistant|>`` and a newline. ``kvtransfer model
init`` writes it into the directory's ``tokenizer_config.json`` so that Hugging Face tools render
the same prompt. A checkpoint without any template has none: rendering a chat then fails.

Rendering follows transformers' environment, so real-world templates give the same text: a
sandboxed, immutable Jinja environment with ``trim_blocks`` and ``lstrip_blocks``, the
``loopcontrols`` extension, a ``tojson`` filter that keeps non-ASCII text and key order, the
globals ``raise_exception(message)`` (a template refusing a conversation, e.g. roles that do not
alternate: `ChatTemplateError` with its message) and ``strftime_now(format)``, and the variables
``messages``, ``add_generation_prompt``, ``tools``/``documents`` (``None``: not supported here)
and every special token of the tokenizer config (``bos_token``, ``eos_token``, ...). The prompt
is then tokenized without adding special tokens: the template wrote them.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any, NoReturn

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment

from kvtransfer.engine.model.tokenizer import BOS_TOKEN, EOS_TOKEN, PAD_TOKEN

BUILTIN_CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{{ '<|' + message['role'] + '|>\\n' + message['content'] + '\\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|assistant|>\\n' }}{% endif %}"
)
BUILTIN_SPECIAL_TOKENS: Mapping[str, str] = {
    "bos_token": BOS_TOKEN,
    "eos_token": EOS_TOKEN,
    "pad_token": PAD_TOKEN,
}
_NO_TEMPLATE = (
    "this model has no chat template (none in its tokenizer_config.json, chat_template.jinja "
    "or chat_template.json): start the daemon with --chat-template FILE"
)


class ChatTemplateError(ValueError):
    """A template that cannot be loaded, or that refused (or failed on) a conversation."""


@dataclass(frozen=True)
class ChatTemplate:
    """A compiled template and the special tokens it is rendered with; ``origin`` says where
    it came from (errors name it). ``source`` ``None``: the model has no template."""

    source: str | None
    special_tokens: Mapping[str, str]
    origin: str
    _compiled: jinja2.Template | None = field(default=None, compare=False, repr=False)

    def __post_init__(self) -> None:
        if self.source is not None:
            object.__setattr__(self, "_compiled", _compile(self.source, self.origin))

    @classmethod
    def for_model(cls, model: str, override: str | Path | None = None) -> ChatTemplate:
        """The template of ``model`` (``"builtin[:preset]"`` or a checkpoint directory), or
        the Jinja file ``override``."""
        specials = dict(BUILTIN_SPECIAL_TOKENS) if _is_builtin(model) else {}
        config: dict[str, Any] = {}
        if not _is_builtin(model):
            config = _read_json(Path(model) / "tokenizer_config.json")
            specials = _special_tokens(config)
        if override is not None:
            path = Path(override)
            try:
                source = path.read_text(encoding="utf-8")
            except OSError as exc:
                raise ChatTemplateError(f"cannot read chat template {path}: {exc}") from None
            return cls(source, specials, str(path))
        if _is_builtin(model):
            return cls(BUILTIN_CHAT_TEMPLATE, specials, "the built-in template")
        source, origin = _checkpoint_template(Path(model), config)
        return cls(source, specials, origin)

    def render(self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool) -> str:
        if self._compiled is None:
            raise ChatTemplateError(_NO_TEMPLATE)
        try:
            return self._compiled.render(
                messages=list(messages),
                add_generation_prompt=add_generation_prompt,
                tools=None,
                documents=None,
                **self.special_tokens,
            )
        except ChatTemplateError:
            raise
        except jinja2.TemplateError as exc:
            raise ChatTemplateError(f"the chat template ({self.origin}) failed: {exc}") from None
        except (TypeError, ValueError, KeyError, AttributeError, IndexError) as exc:
            # A template indexing content that is not there, or adding a list to a string.
            raise ChatTemplateError(
                f"the chat template ({self.origin}) failed on this conversation: "
                f"{type(exc).__name__}: {exc}"
            ) from None


def _is_builtin(model: str) -> bool:
    return model == "builtin" or model.startswith("builtin:")


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise ChatTemplateError(f"cannot read {path}: {exc}") from None
    return data if isinstance(data, dict) else {}


def _special_tokens(config: Mapping[str, Any]) -> dict[str, str]:
    """``*_token`` entries of a tokenizer config: strings, or AddedToken objects."""
    tokens = {}
    for key, value in config.items():
        if not key.endswith("_token"):
            continue
        if isinstance(value, dict):
            value = value.get("content")
        if isinstance(value, str):
            tokens[key] = value
    return tokens


def _checkpoint_template(directory: Path, config: Mapping[str, Any]) -> tuple[str | None, str]:
    template = config.get("chat_template")
    origin = str(directory / "tokenizer_config.json")
    if isinstance(template, list):
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default")
    if isinstance(template, str):
        return template, origin
    jinja_file = directory / "chat_template.jinja"
    if jinja_file.is_file():
        return jinja_file.read_text(encoding="utf-8"), str(jinja_file)
    json_file = directory / "chat_template.json"
    template = _read_json(json_file).get("chat_template")
    if isinstance(template, str):
        return template, str(json_file)
    return None, str(directory)


def _raise_exception(message: str) -> NoReturn:
    raise ChatTemplateError(message)


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    # Jinja's own tojson escapes HTML characters and sorts keys, which changes the prompt.
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _compile(source: str, origin: str) -> jinja2.Template:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    try:
        return env.from_string(source)
    except jinja2.TemplateSyntaxError as exc:
        raise ChatTemplateError(
            f"chat template {origin}: syntax error at line {exc.lineno}: {exc.message}"
        ) from None
