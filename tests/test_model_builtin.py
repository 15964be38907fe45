"""Built-in presets: deterministic weights, shapes that split, a useful tiny model, and the
Hugging Face directory they write."""

from __future__ import annotations

import json

import pytest
import tokenizers
import torch
from engine_helpers.dense_reference import SeqChunk, paged_step

from kvtransfer.engine.model import builtin
from kvtransfer.engine.model.builtin import (
    builtin_model_config,
    builtin_preset_names,
    builtin_weights,
    init_model_dir,
    write_builtin_model,
)
from kvtransfer.engine.model.llama import LlamaForCausalLM, num_parameters
from kvtransfer.engine.model.loader import (
    iter_weights,
    load_model,
    load_model_config,
    load_tokenizer,
)
from kvtransfer.engine.model.tokenizer import Tokenizer
from kvtransfer.engine.parallel import ParallelRank

pytestmark = pytest.mark.unit

TEXTS = ["Hello, world!", "naïve café — 日本語 🙂", "<bos>tagged<eos> <pad>", "", "\x00\x7f\n\t"]


def test_presets_and_their_configs():
    assert builtin_preset_names() == ("tiny", "tiny-draft", "small", "tiny-hybrid", "tiny-mamba")
    tiny = builtin_model_config("tiny")
    assert (tiny.vocab_size, tiny.bos_token_id, tiny.eos_token_id) == (259, 256, 257)
    assert (tiny.num_hidden_layers, tiny.num_attention_heads, tiny.num_key_value_heads) == (4, 4, 2)
    assert tiny.tie_word_embeddings is False
    draft = builtin_model_config("tiny-draft")
    assert draft.num_hidden_layers == 2
    with pytest.raises(ValueError) as info:
        builtin_model_config("huge")
    assert str(info.value) == (
        "unknown built-in model preset 'huge'; known presets: tiny, tiny-draft, small, "
        "tiny-hybrid, tiny-mamba"
    )


def test_weights_are_deterministic_and_match_the_parameter_count():
    first = builtin_weights("tiny")
    builtin._cached_weights.cache_clear()
    second = builtin_weights("tiny")
    assert first.keys() == second.keys()
    assert all(torch.equal(first[name], second[name]) for name in first)
    assert first is not second  # callers get their own dict
    assert sum(t.numel() for t in first.values()) == num_parameters(builtin_model_config("tiny"))


def test_small_preset_has_about_100m_parameters():
    assert 80_000_000 <= num_parameters(builtin_model_config("small")) <= 130_000_000


def test_tiny_draft_is_the_first_two_layers_of_tiny():
    tiny, draft = builtin_weights("tiny"), builtin_weights("tiny-draft")
    kept = {n for n in tiny if not n.startswith(("model.layers.2.", "model.layers.3."))}
    assert draft.keys() == kept
    assert all(torch.equal(draft[name], tiny[name]) for name in draft)


@pytest.mark.parametrize("tp", [1, 2, 4])
@pytest.mark.parametrize("pp", [1, 2, 4])
def test_tiny_splits_over_every_supported_layout(tp, pp):
    config = builtin_model_config("tiny")
    for pp_rank in range(pp):
        for tp_rank in range(tp):
            model = LlamaForCausalLM(config, ParallelRank(tp_rank, tp, pp_rank, pp))
            assert len(model.layer_names()) == 4 // pp


def _greedy(model: LlamaForCausalLM, prompt: list[int], steps: int) -> list[int]:
    caches = [torch.zeros(model.kv_cache_shape(16, 8)) for _ in model.layer_names()]
    blocks = list(range(16))
    tokens = list(prompt)
    done = 0
    for _ in range(steps):
        step = paged_step([SeqChunk(tokens, done, blocks)], 8)
        hidden = model(step.input_ids, step.positions, caches, step.attn_metadata)
        done = len(tokens)
        tokens.append(int(model.compute_logits(hidden)[-1].argmax()))
    return tokens[len(prompt) :]


def test_tiny_babbles_printable_text_that_tiny_draft_often_predicts():
    tiny, draft = load_model("builtin"), load_model("builtin:tiny-draft")
    tokenizer = load_tokenizer("builtin")
    agreed = total = 0
    for prompt in ("Hello, world", "The quick brown fox", "def f(x):", "Once upon a time"):
        ids = tokenizer.encode(prompt)
        output = _greedy(tiny, ids, 24)
        assert len(set(output)) >= 5, output  # not one token (or a 2-cycle) forever
        assert all(32 <= t < 127 or t in (9, 10) for t in output), output
        # The draft's next-token guess at every position of tiny's own continuation.
        context = ids + output[:-1]
        step = paged_step([SeqChunk(context, 0, list(range(8)))], 8)
        caches = [torch.zeros(draft.kv_cache_shape(8, 8)) for _ in draft.layer_names()]
        hidden = draft(step.input_ids, step.positions, caches, step.attn_metadata)
        guesses = draft.compute_logits(hidden).argmax(-1)[len(ids) - 1 :].tolist()
        agreed += sum(g == t for g, t in zip(guesses, output, strict=True))
        total += len(output)
    assert agreed / total >= 0.5


def test_written_directory_round_trips_config_weights_and_tokenizer(tmp_path):
    directory = write_builtin_model(tmp_path / "tiny")
    assert directory == tmp_path / "tiny"
    assert sorted(p.name for p in directory.iterdir()) == [
        "config.json",
        "generation_config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
    ]
    hf_config = json.loads((directory / "config.json").read_text())
    assert (hf_config["architectures"], hf_config["model_type"]) == (["LlamaForCausalLM"], "llama")
    assert load_model_config(str(directory)) == builtin_model_config("tiny")
    loaded = dict(iter_weights(str(directory)))
    expected = builtin_weights("tiny")
    assert loaded.keys() == expected.keys()
    assert all(torch.equal(loaded[name], expected[name]) for name in expected)

    from_file = load_tokenizer(str(directory))
    byte_level = Tokenizer.byte_level()
    raw = tokenizers.Tokenizer.from_file(str(directory / "tokenizer.json"))
    for text in TEXTS:
        ids = byte_level.encode(text)
        assert from_file.encode(text) == ids == raw.encode(text).ids
        assert from_file.decode(ids) == byte_level.decode(ids)
    assert (from_file.eos_token_ids, from_file.bos_token_id, from_file.pad_token_id) == (
        (257,),
        256,
        258,
    )
    assert from_file.vocab_size == byte_level.vocab_size == 259


def test_draft_directory_holds_only_its_layers(tmp_path):
    directory = write_builtin_model(tmp_path / "draft", "tiny-draft")
    assert load_model_config(str(directory)) == builtin_model_config("tiny-draft")
    assert {n.split(".")[2] for n in dict(iter_weights(str(directory))) if ".layers." in n} == {
        "0",
        "1",
    }


def test_init_model_dir_refuses_to_overwrite(tmp_path):
    assert init_model_dir(str(tmp_path / "new"), "tiny-draft") == tmp_path / "new"
    empty = tmp_path / "empty"
    empty.mkdir()
    assert init_model_dir(empty, "tiny") == empty
    with pytest.raises(ValueError) as info:
        init_model_dir(empty, "tiny")
    assert str(info.value) == f"refusing to write a model into non-empty directory {empty}"
    with pytest.raises(ValueError, match="unknown built-in model preset 'big'"):
        init_model_dir(tmp_path / "other", "big")
    assert not (tmp_path / "other").exists()


def test_builtin_model_names_resolve():
    assert load_model_config("builtin") == builtin_model_config("tiny")
    assert load_model_config("builtin:small") == builtin_model_config("small")
    with pytest.raises(ValueError, match="unknown built-in model preset 'nope'"):
        load_model_config("builtin:nope")
    with pytest.raises(ValueError, match="unknown built-in model preset 'nope'"):
        load_tokenizer("builtin:nope")
