"""Hugging Face checkpoints: config parsing, sharded safetensors, biases, tied embeddings,
tensor-parallel slices of biased projections, and the errors for what does not fit."""

from __future__ import annotations

import json
import threading
from pathlib import Path
from typing import Any

import pytest
import torch
from engine_helpers.dense_reference import SeqChunk, dense_logits, paged_step
from safetensors.torch import save_file

from kvtransfer.engine.config import ModelConfig
from kvtransfer.engine.model.builtin import builtin_model_config, builtin_weights
from kvtransfer.engine.model.llama import LlamaForCausalLM, num_parameters
from kvtransfer.engine.model.loader import (
    iter_weights,
    load_model,
    load_model_config,
    load_tokenizer,
    model_config_from_hf,
)
from kvtransfer.engine.model.tokenizer import byte_level_tokenizer_json
from kvtransfer.engine.parallel import ParallelRank

pytestmark = pytest.mark.unit

LLAMA_CONFIG: dict[str, Any] = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "vocab_size": 300,
    "hidden_size": 48,
    "intermediate_size": 96,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,  # q/k/v width 64 != hidden 48
    "hidden_act": "silu",
    "rope_theta": 500000.0,
    "rope_scaling": None,
    "rms_norm_eps": 1e-5,
    "max_position_embeddings": 512,
    "tie_word_embeddings": False,
    "attention_bias": True,  # HF Llama then biases o_proj too
    "bos_token_id": 1,
    "eos_token_id": 2,
    "torch_dtype": "bfloat16",
}
QWEN2_CONFIG: dict[str, Any] = {
    "architectures": ["Qwen2ForCausalLM"],
    "model_type": "qwen2",
    "vocab_size": 259,
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 3,
    "num_attention_heads": 4,
    "num_key_value_heads": 1,
    "hidden_act": "silu",
    "rope_theta": 1000000.0,
    "rms_norm_eps": 1e-6,
    "max_position_embeddings": 4096,
    "sliding_window": 4096,
    "use_sliding_window": False,
    "tie_word_embeddings": True,
    "bos_token_id": 256,
    "eos_token_id": [257, 258],
    "torch_dtype": "float32",
}


def _random_weights(config: ModelConfig, seed: int, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    hidden, inter = config.hidden_size, config.intermediate_size
    q = config.num_attention_heads * config.head_dim
    kv = config.num_key_value_heads * config.head_dim

    def rand(*shape: int, std: float = 0.2, mean: float = 0.0) -> torch.Tensor:
        return (torch.randn(shape, generator=gen) * std + mean).to(dtype)

    w = {"model.embed_tokens.weight": rand(config.vocab_size, hidden, std=1.0)}
    for i in range(config.num_hidden_layers):
        p = f"model.layers.{i}"
        w[f"{p}.input_layernorm.weight"] = rand(hidden, std=0.1, mean=1.0)
        w[f"{p}.post_attention_layernorm.weight"] = rand(hidden, std=0.1, mean=1.0)
        for name, rows, cols in (("q", q, hidden), ("k", kv, hidden), ("v", kv, hidden)):
            w[f"{p}.self_attn.{name}_proj.weight"] = rand(rows, cols)
            if config.attention_bias:
                w[f"{p}.self_attn.{name}_proj.bias"] = rand(rows)
        w[f"{p}.self_attn.o_proj.weight"] = rand(hidden, q)
        if config.attention_bias and config.architecture == "llama":
            w[f"{p}.self_attn.o_proj.bias"] = rand(hidden)
        w[f"{p}.mlp.gate_proj.weight"] = rand(inter, hidden)
        w[f"{p}.mlp.up_proj.weight"] = rand(inter, hidden)
        w[f"{p}.mlp.down_proj.weight"] = rand(hidden, inter)
    w["model.norm.weight"] = rand(hidden, std=0.1, mean=1.0)
    if not config.tie_word_embeddings:
        w["lm_head.weight"] = rand(config.vocab_size, hidden)
    return w


def _write_checkpoint(
    directory: Path, hf_config: dict[str, Any], weights: dict[str, torch.Tensor]
) -> Path:
    """config.json plus the tensors split over two safetensors shards, as HF saves them."""
    directory.mkdir()
    (directory / "config.json").write_text(json.dumps(hf_config))
    names = sorted(weights)
    half = len(names) // 2
    for index, part in enumerate((names[:half], names[half:]), start=1):
        shard = {name: weights[name] for name in part}
        save_file(shard, str(directory / f"model-0000{index}-of-00002.safetensors"))
    return directory


def _paged_logits(model: LlamaForCausalLM, tokens: list[int]) -> torch.Tensor:
    caches = [torch.zeros(model.kv_cache_shape(8, 4)) for _ in model.layer_names()]
    first = paged_step([SeqChunk(tokens[:7], 0, [6, 1, 4, 3])], 4)
    second = paged_step([SeqChunk(tokens, 7, [6, 1, 4, 3])], 4)
    out = []
    for step in (first, second):
        hidden = model(step.input_ids, step.positions, caches, step.attn_metadata)
        out.append(model.compute_logits(hidden))
    return torch.cat(out)


@pytest.mark.parametrize(
    ("hf_config", "dtype"), [(LLAMA_CONFIG, torch.bfloat16), (QWEN2_CONFIG, torch.float32)]
)
def test_checkpoint_directory_loads_and_matches_dense_reference(tmp_path, hf_config, dtype):
    config = model_config_from_hf(hf_config)
    weights = _random_weights(config, seed=3, dtype=dtype)
    if config.architecture == "qwen2":
        # Stale buffers of old transformers checkpoints are ignored.
        weights["model.layers.0.self_attn.rotary_emb.inv_freq"] = torch.ones(4)
    directory = _write_checkpoint(tmp_path / "ckpt", hf_config, weights)

    assert load_model_config(str(directory)) == config
    assert dict(iter_weights(str(directory))).keys() == weights.keys()
    model = load_model(str(directory))
    assert sum(p.numel() for p in model.parameters()) == num_parameters(config)
    tokens = [5, 17, 250, 3, 99, 0, 42, 7, 7, 128, 64]
    expected = dense_logits(config, weights, tokens)
    torch.testing.assert_close(_paged_logits(model, tokens), expected, atol=1e-4, rtol=0)


def test_parsed_configs_take_each_architectures_rules():
    llama = model_config_from_hf(LLAMA_CONFIG)
    assert (llama.architecture, llama.head_dim, llama.attention_bias) == ("llama", 16, True)
    assert (llama.rope_theta, llama.rms_norm_eps, llama.torch_dtype) == (500000.0, 1e-5, "bfloat16")
    qwen = model_config_from_hf(QWEN2_CONFIG)
    assert (qwen.architecture, qwen.head_dim, qwen.attention_bias) == ("qwen2", 8, True)
    assert (qwen.tie_word_embeddings, qwen.eos_token_id, qwen.bos_token_id) == (True, 257, 256)
    mistral = model_config_from_hf(
        {
            "model_type": "mistral",
            "vocab_size": 100,
            "hidden_size": 64,
            "intermediate_size": 128,
            "num_hidden_layers": 2,
            "num_attention_heads": 8,
            "max_position_embeddings": 32768,
            "sliding_window": 4096,
            "rope_scaling": {"rope_type": "default"},
        }
    )
    assert mistral == ModelConfig(
        architecture="mistral",
        vocab_size=100,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=8,
        num_key_value_heads=8,
        head_dim=8,
        rope_theta=10000.0,
        rms_norm_eps=1e-6,
        # Within the window, sliding-window attention is full attention.
        max_position_embeddings=4096,
        attention_bias=False,
    )


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        (
            {"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"},
            "unsupported model: architectures ['GPT2LMHeadModel'], model_type 'gpt2'; "
            "supported: LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM",
        ),
        (
            {"rope_scaling": {"rope_type": "llama3", "factor": 8.0}},
            "rope_scaling {'rope_type': 'llama3', 'factor': 8.0} is not supported "
            "(only unscaled RoPE is implemented)",
        ),
        ({"hidden_act": "gelu"}, "hidden_act 'gelu' is not supported (only 'silu')"),
        ({"mlp_bias": True}, "mlp_bias=True is not supported"),
    ],
)
def test_config_errors_name_the_problem(changes, message):
    with pytest.raises(ValueError) as info:
        model_config_from_hf({**LLAMA_CONFIG, **changes})
    assert str(info.value) == message


def test_missing_directory_and_files_are_file_not_found(tmp_path):
    missing = tmp_path / "nope"
    with pytest.raises(FileNotFoundError) as info:
        load_model_config(str(missing))
    assert str(info.value) == f"model directory not found: {missing}"
    with pytest.raises(FileNotFoundError) as info:
        load_model_config(str(tmp_path))
    assert str(info.value) == f"no config.json in model directory {tmp_path}"
    with pytest.raises(FileNotFoundError) as info:
        list(iter_weights(str(tmp_path)))
    assert str(info.value) == f"no *.safetensors files in model directory {tmp_path}"
    (tmp_path / "config.json").write_text(json.dumps(QWEN2_CONFIG))
    with pytest.raises(FileNotFoundError) as info:
        load_tokenizer(str(tmp_path))
    assert str(info.value) == f"tokenizer file not found: {tmp_path / 'tokenizer.json'}"


def test_tokenizer_of_a_directory_keeps_every_eos_id(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(QWEN2_CONFIG))
    (tmp_path / "tokenizer.json").write_text(byte_level_tokenizer_json())
    tokenizer = load_tokenizer(str(tmp_path))
    assert (tokenizer.eos_token_id, tokenizer.eos_token_ids) == (257, (257, 258))
    assert (tokenizer.bos_token_id, tokenizer.vocab_size) == (256, 259)
    assert tokenizer.encode("hi") == [104, 105]


def test_load_weights_reports_every_problem_at_once():
    config = builtin_model_config("tiny")
    weights = builtin_weights("tiny")
    del weights["model.norm.weight"]
    weights["model.layers.0.mlp.extra.weight"] = torch.zeros(1)
    weights["model.layers.4.mlp.up_proj.weight"] = torch.zeros(1)
    weights["model.embed_tokens.weight"] = torch.zeros(258, 64)
    with pytest.raises(ValueError) as info:
        LlamaForCausalLM(config).load_weights(weights.items())
    assert str(info.value) == (
        "checkpoint does not fit the model: missing tensors ['model.norm.weight']; "
        "unexpected tensors ['model.layers.0.mlp.extra.weight', "
        "'model.layers.4.mlp.up_proj.weight']; "
        "shape mismatches (got != expected) ['model.embed_tokens.weight: (258, 64) != (259, 64)']"
    )


def test_a_pipeline_stage_loads_only_its_part_of_a_full_checkpoint():
    config = builtin_model_config("tiny")
    weights = builtin_weights("tiny")
    middle = LlamaForCausalLM(config, ParallelRank(pp_rank=1, pp_size=4))
    middle.load_weights(weights.items())  # skips the other layers, embeddings, norm, lm_head
    torch.testing.assert_close(
        middle.layers[0].mlp.up_proj, weights["model.layers.1.mlp.up_proj.weight"]
    )
    weights["model.layers.3.self_attn.bogus.weight"] = torch.zeros(1)
    with pytest.raises(ValueError, match=r"unexpected tensors \['model.layers.3.self_attn.bogus"):
        middle.load_weights(weights.items())


class _ThreadAllReduce:
    """Sums a tensor over ``n`` threads in rank order, like an all-reduce over a TP group."""

    def __init__(self, n: int) -> None:
        self.barrier = threading.Barrier(n, timeout=30)
        self.parts: list[torch.Tensor | None] = [None] * n

    def for_rank(self, rank: int):
        def all_reduce(tensor: torch.Tensor) -> torch.Tensor:
            self.parts[rank] = tensor
            self.barrier.wait()
            total = sum(p for p in self.parts if p is not None)
            self.barrier.wait()  # nobody overwrites a part before everyone summed
            return total  # type: ignore[return-value]

        return all_reduce


@pytest.mark.parametrize("tp_size", [2, 4])
def test_biased_and_tied_checkpoint_shards_over_tensor_parallel_ranks(tmp_path, tp_size):
    config = model_config_from_hf(QWEN2_CONFIG)  # 1 KV head: replicated on every rank
    weights = _random_weights(config, seed=5, dtype=torch.float32)
    directory = str(_write_checkpoint(tmp_path / "ckpt", QWEN2_CONFIG, weights))
    reduce = _ThreadAllReduce(tp_size)
    tokens = [9, 8, 7, 200, 100, 3, 1, 2, 250, 77]
    results: list[torch.Tensor | BaseException | None] = [None] * tp_size

    def run(rank: int) -> None:
        try:
            rank_info = ParallelRank(tp_rank=rank, tp_size=tp_size)
            model = load_model(directory, rank_info, reduce.for_rank(rank))
            assert model.num_local_kv_heads == 1
            results[rank] = _paged_logits(model, tokens)
        except BaseException as exc:  # surfaced in the main thread below
            results[rank] = exc
            reduce.barrier.abort()

    threads = [threading.Thread(target=run, args=(r,)) for r in range(tp_size)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    expected = dense_logits(config, weights, tokens)
    for result in results:
        if isinstance(result, BaseException):
            raise result
        assert isinstance(result, torch.Tensor)
        torch.testing.assert_close(result, expected, atol=1e-4, rtol=0)
