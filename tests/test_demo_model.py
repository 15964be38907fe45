"""The shipped demo model (kvtransfer/models/demo-llama) read as any Hugging Face directory: its
config, its tokenizer, and its weights computing the same next tokens in the engine's paged
model, a dense reference, the training script's network and transformers."""

from __future__ import annotations

import json
import math

import pytest
import torch
from engine_helpers.dense_reference import SeqChunk, dense_logits, paged_step
from safetensors.torch import load_file
from script_modules import load_script

from kvtransfer.engine.model.llama import LlamaForCausalLM
from kvtransfer.engine.model.loader import (
    iter_weights,
    load_model,
    load_model_config,
    load_tokenizer,
)
from kvtransfer.models import DEMO_MODEL, demo_model_dir, resolve_model

pytestmark = pytest.mark.unit

DIRECTORY = demo_model_dir()
MODEL = str(DIRECTORY)
PROMPT = "The demo starts a prefill daemon,"
NEW_TOKENS = 16


def _engine_logits(model: LlamaForCausalLM, tokens: list[int]) -> torch.Tensor:
    """Every position's logits from the engine's model over a paged cache (16-token blocks)."""
    blocks = list(range(math.ceil(len(tokens) / 16)))
    caches = [torch.zeros(model.kv_cache_shape(len(blocks), 16)) for _ in model.layer_names()]
    step = paged_step([SeqChunk(tokens, 0, blocks)], 16)
    return model.compute_logits(model(step.input_ids, step.positions, caches, step.attn_metadata))


@pytest.fixture(scope="module")
def greedy_tokens() -> list[int]:
    """``PROMPT`` and its greedy continuation, as the engine's model computes it."""
    model = load_model(MODEL)
    tokens = load_tokenizer(MODEL).encode(PROMPT)
    with torch.no_grad():
        for _ in range(NEW_TOKENS):
            tokens.append(int(_engine_logits(model, tokens)[-1].argmax()))
    return tokens


def test_the_demo_name_resolves_to_the_package_directory():
    assert resolve_model(DEMO_MODEL) == MODEL
    assert resolve_model("builtin:tiny") == "builtin:tiny"
    assert sorted(p.name for p in DIRECTORY.iterdir()) == [
        "README.md",
        "config.json",
        "corpus.json",
        "generation_config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
        "training.json",
    ]


def test_config_is_a_small_llama_with_grouped_query_attention():
    config = load_model_config(MODEL)
    assert config.architecture == "llama"
    assert config.num_key_value_heads < config.num_attention_heads
    assert config.tie_word_embeddings
    # Tied: the checkpoint holds no lm_head, as transformers saves it.
    assert "lm_head.weight" not in dict(iter_weights(MODEL))
    assert (DIRECTORY / "model.safetensors").stat().st_size < 8 * 1024 * 1024
    tokenizer = load_tokenizer(MODEL)
    assert tokenizer.vocab_size == config.vocab_size
    assert tokenizer.eos_token_ids == (config.eos_token_id,)
    assert tokenizer.decode([config.eos_token_id], skip_special_tokens=False) == "<eos>"


def test_tokenizer_round_trips_the_docs_it_was_trained_on():
    tokenizer = load_tokenizer(MODEL)
    root = DIRECTORY.parents[2]
    tokens = size = 0
    for path in [root / "README.md", *sorted((root / "docs").glob("*.md"))]:
        text = path.read_text()
        ids = tokenizer.encode(text)
        # Not skipped: the docs spell special tokens ("<bos>") that encode to their ids.
        assert tokenizer.decode(ids, skip_special_tokens=False) == text, path.name
        # Bytes alone would be one token per byte. Tables of measured numbers, which the docs
        # keep gaining since the tokenizer was trained, go nearly digit by digit: per file
        # the bound is loose, over all the docs tight.
        assert len(ids) < 0.6 * len(text.encode()), path.name
        tokens, size = tokens + len(ids), size + len(text.encode())
    # A learnt vocabulary: well under one token per byte on its own text.
    assert tokens < 0.5 * size


def test_the_recorded_training_matches_the_checkpoint():
    meta = json.loads((DIRECTORY / "training.json").read_text())
    config = json.loads((DIRECTORY / "config.json").read_text())
    hyper = meta["hyperparameters"]
    for key in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers"):
        assert config[key] == hyper[key]
    assert set(meta["corpus_files"]) >= {"README.md", "docs/architecture.md"}
    assert len(meta["corpus_revision"]) == 40
    assert meta["final_corpus_loss"] < 1.0


def test_the_engine_continues_a_doc_sentence_with_words(greedy_tokens):
    tokenizer = load_tokenizer(MODEL)
    prompt_len = len(tokenizer.encode(PROMPT))
    text = tokenizer.decode(greedy_tokens[prompt_len:])
    # The README's next words, memorised (the integration tier checks it against the corpus).
    assert text.startswith(" a decode daemon and the router"), text


def test_dense_reference_agrees_with_the_engine(greedy_tokens):
    config = load_model_config(MODEL)
    expected = dense_logits(config, dict(iter_weights(MODEL)), greedy_tokens)
    engine = _engine_logits(load_model(MODEL), greedy_tokens)
    torch.testing.assert_close(engine, expected, atol=1e-4, rtol=0)
    assert expected[:-1].argmax(-1).tolist()[-NEW_TOKENS + 1 :] == greedy_tokens[-NEW_TOKENS + 1 :]


def test_the_training_scripts_network_is_the_engines(greedy_tokens):
    train = load_script("train_demo_model")
    hyper = json.loads((DIRECTORY / "training.json").read_text())["hyperparameters"]
    network = train.LlamaForCausalLM(train.Hyper(**hyper))
    network.load_state_dict(load_file(str(DIRECTORY / "model.safetensors")))
    with torch.no_grad():
        logits = network(torch.tensor([greedy_tokens]))[0]
    engine = _engine_logits(load_model(MODEL), greedy_tokens)
    torch.testing.assert_close(logits, engine, atol=1e-4, rtol=0)


def test_transformers_reads_the_directory_and_computes_the_same_tokens(greedy_tokens):
    transformers = pytest.importorskip("transformers")
    hf_tokenizer = transformers.AutoTokenizer.from_pretrained(MODEL)
    assert hf_tokenizer(PROMPT)["input_ids"] == load_tokenizer(MODEL).encode(PROMPT)
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(MODEL).float().eval()
    with torch.no_grad():
        logits = hf_model(torch.tensor([greedy_tokens])).logits[0]
    engine = _engine_logits(load_model(MODEL), greedy_tokens)
    torch.testing.assert_close(logits, engine, atol=1e-4, rtol=0)
