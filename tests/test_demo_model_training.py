"""How the demo model came to be: its training script (a few steps of a miniature, never the real
run), its tokenizer retrained from the recorded revision's docs, and the demo's prompts continued
by the engine exactly as those docs go on."""

from __future__ import annotations

import json

import pytest
from script_modules import load_script

from kvtransfer.cli.demo import DEFAULT_PROMPTS
from kvtransfer.engine.config import EngineConfig
from kvtransfer.engine.llm import LLM
from kvtransfer.engine.model.loader import load_model, load_model_config, load_tokenizer
from kvtransfer.engine.sampling_params import SamplingParams
from kvtransfer.models import demo_model_dir

pytestmark = pytest.mark.integration

DIRECTORY = demo_model_dir()
META = json.loads((DIRECTORY / "training.json").read_text())


@pytest.fixture(scope="module")
def train():
    return load_script("train_demo_model")


@pytest.fixture(scope="module")
def corpus(train) -> str:
    """The prose the model was trained on, as shipped beside it (checked against its hash)."""
    texts = train.load_corpus(DIRECTORY)
    assert sorted(texts) == sorted(META["corpus_files"])
    return "".join(texts[name] for name in sorted(texts))


def test_the_tokenizer_retrains_to_the_shipped_one(train):
    shipped = train.load_corpus(DIRECTORY)
    texts = [shipped[name] for name in sorted(shipped)]  # the order the script trained in
    tokenizer = train.train_tokenizer(texts, META["hyperparameters"]["vocab_size"])
    shipped = json.loads((DIRECTORY / "tokenizer.json").read_text())
    assert json.loads(tokenizer.to_str()) == shipped


def test_the_demo_prompts_continue_as_the_docs_do(corpus):
    with LLM(EngineConfig(model=str(DIRECTORY))) as llm:
        outputs = llm.generate(list(DEFAULT_PROMPTS), SamplingParams(max_tokens=24))
    for prompt, output in zip(DEFAULT_PROMPTS, outputs, strict=True):
        assert len(output.token_ids) == 24
        assert prompt + output.text in corpus, (prompt, output.text)


def test_the_script_trains_and_writes_a_loadable_directory(train, tmp_path):
    out = tmp_path / "mini"
    argv = ["--out", str(out), "--steps", "2", "--vocab-size", "300", "--hidden-size", "32"]
    argv += ["--intermediate-size", "64", "--num-attention-heads", "2"]
    argv += ["--num-key-value-heads", "1", "--seq-len", "16", "--batch-size", "2"]
    assert train.main(argv) == 0
    config = load_model_config(str(out))
    assert (config.vocab_size, config.hidden_size, config.head_dim) == (300, 32, 16)
    assert load_tokenizer(str(out)).vocab_size == 300
    assert sum(p.numel() for p in load_model(str(out)).parameters()) > 0
    meta = json.loads((out / "training.json").read_text())
    assert [point["step"] for point in meta["loss_curve"]] == [0, 1]
