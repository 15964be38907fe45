"""Chat templates: our rendering plus tokenization equals Hugging Face's
``apply_chat_template(..., tokenize=True)`` on the same checkpoint, for the built-in template and
real-world ones (Qwen2's ChatML, Llama 2's); a template's ``raise_exception`` and a missing
template are typed errors; a daemon renders ``ChatPrompt`` and returns the prompt's tokens."""

from __future__ import annotations

import json

import grpc
import pytest
from serve_helpers.daemons import running, start_daemon
from transformers import AutoTokenizer

from kvtransfer.clients.generation import GenerationClient, generate_request
from kvtransfer.engine.model.builtin import init_model_dir
from kvtransfer.engine.model.chat_template import ChatTemplate, ChatTemplateError
from kvtransfer.engine.model.loader import load_tokenizer
from kvtransfer.v1 import generation_pb2

pytestmark = pytest.mark.integration

# Qwen2's template as its checkpoints ship it: ChatML with a default system message.
CHATML = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n' }}{% endif %}"
    "{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
# Llama 2's: system folded into the first user turn, roles must alternate.
LLAMA2 = (
    "{% if messages[0]['role'] == 'system' %}{% set loop_messages = messages[1:] %}"
    "{% set system_message = messages[0]['content'] %}{% else %}"
    "{% set loop_messages = messages %}{% set system_message = false %}{% endif %}"
    "{% for message in loop_messages %}"
    "{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}"
    "{% endif %}{% if loop.index0 == 0 and system_message != false %}"
    "{% set content = '<<SYS>>\\n' + system_message + '\\n<</SYS>>\\n\\n' + message['content'] %}"
    "{% else %}{% set content = message['content'] %}{% endif %}"
    "{% if message['role'] == 'user' %}"
    "{{ bos_token + '[INST] ' + content.strip() + ' [/INST]' }}"
    "{% elif message['role'] == 'assistant' %}{{ ' '  + content.strip() + ' ' + eos_token }}"
    "{% endif %}{% endfor %}"
)
CONVERSATIONS = [
    [{"role": "user", "content": "Hi"}],
    [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Name a colour."},
        {"role": "assistant", "content": "Blue."},
        {"role": "user", "content": "Another, with ünïcode — and <eos> text?"},
    ],
    [{"role": "user", "content": "  spaced  "}, {"role": "assistant", "content": "ok"}],
]


@pytest.fixture(scope="module")
def builtin_dir(tmp_path_factory):
    return init_model_dir(tmp_path_factory.mktemp("m") / "tiny", "tiny")


def with_template(directory, template, tmp_path):
    """A copy of the checkpoint's tokenizer files with ``template`` in tokenizer_config.json."""
    target = tmp_path / "templated"
    target.mkdir()
    for name in ("config.json", "tokenizer.json"):
        (target / name).write_text((directory / name).read_text())
    config = json.loads((directory / "tokenizer_config.json").read_text())
    (target / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": template}))
    return target


def ours(directory, messages, add_generation_prompt) -> list[int]:
    text = ChatTemplate.for_model(str(directory)).render(messages, add_generation_prompt)
    return load_tokenizer(str(directory)).encode(text, add_special_tokens=False)


def huggingface(directory, messages, add_generation_prompt) -> list[int]:
    tokenizer = AutoTokenizer.from_pretrained(str(directory))
    ids = tokenizer.apply_chat_template(
        messages, add_generation_prompt=add_generation_prompt, tokenize=True
    )
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


@pytest.mark.parametrize("template", ["builtin", "chatml", "llama2"])
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_tokens_equal_hugging_face(builtin_dir, tmp_path, template, add_generation_prompt):
    directory = builtin_dir
    if template != "builtin":
        directory = with_template(
            builtin_dir, {"chatml": CHATML, "llama2": LLAMA2}[template], tmp_path
        )
    for messages in CONVERSATIONS:
        if template == "llama2" and messages[-1]["role"] == "assistant" and add_generation_prompt:
            continue  # Llama 2 has no generation prompt: the same tokens as without
        expected = huggingface(directory, messages, add_generation_prompt)
        assert ours(directory, messages, add_generation_prompt) == expected, messages
    assert ours(directory, CONVERSATIONS[1], add_generation_prompt)  # not vacuous


def test_the_builtin_template_is_the_documented_one(builtin_dir):
    text = ChatTemplate.for_model("builtin").render(CONVERSATIONS[1][:2], True)
    assert text == "<bos><|system|>\nBe brief.\n<|user|>\nName a colour.\n<|assistant|>\n"
    assert ChatTemplate.for_model(str(builtin_dir)).render(CONVERSATIONS[1][:2], True) == text


def test_template_refusals_and_missing_templates_are_typed(builtin_dir, tmp_path):
    llama = ChatTemplate.for_model(str(with_template(builtin_dir, LLAMA2, tmp_path)))
    with pytest.raises(ChatTemplateError, match=r"^Conversation roles must alternate"):
        llama.render([{"role": "user", "content": "a"}, {"role": "user", "content": "b"}], True)
    bare = tmp_path / "bare"
    bare.mkdir()
    (bare / "tokenizer_config.json").write_text("{}")
    with pytest.raises(ChatTemplateError, match=r"no chat template.*--chat-template FILE"):
        ChatTemplate.for_model(str(bare)).render(CONVERSATIONS[0], True)
    broken = tmp_path / "broken.jinja"
    broken.write_text("{% for m in messages %}{{ m.content }}")
    with pytest.raises(ChatTemplateError, match=f"chat template {broken}: syntax error at line 1"):
        ChatTemplate.for_model("builtin", broken)
    override = tmp_path / "plain.jinja"
    override.write_text("{% for m in messages %}{{ m.content | upper }}{% endfor %}")
    assert ChatTemplate.for_model(str(builtin_dir), override).render(CONVERSATIONS[0], True) == "HI"


def test_a_daemon_renders_chat_prompts_and_returns_their_tokens(builtin_dir, tmp_path):
    daemon = start_daemon("decode", tmp_path, "--model", str(builtin_dir))
    messages = CONVERSATIONS[1]
    prompt = generation_pb2.ChatPrompt(
        messages_json=json.dumps(messages), add_generation_prompt=True
    )
    expected = huggingface(builtin_dir, messages, True)
    with running(daemon), GenerationClient(daemon.address) as client:
        result = client.generate(generate_request("chat", prompt, 4))
        assert result.prompt_token_ids == expected
        assert result.num_prompt_tokens == len(expected)
        by_ids = client.generate(generate_request("ids", expected, 4))
        assert by_ids.token_ids == result.token_ids and by_ids.prompt_token_ids == []
        bad = [
            ("not json", "prompt.chat.messages_json: not valid JSON"),
            ("[]", "prompt.chat.messages_json: must be a non-empty JSON array"),
            ('[{"content": "x"}]', "prompt.chat.messages_json[0]: must be an object with"),
        ]
        for index, (messages_json, message) in enumerate(bad):
            request = generate_request(
                f"bad{index}", generation_pb2.ChatPrompt(messages_json=messages_json), 4
            )
            with pytest.raises(grpc.RpcError) as raised:
                client.generate(request)
            assert raised.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert message in raised.value.details()
        assert client.generate(generate_request("after", expected, 2)).finish_reason == "length"
