"""Build a tiny Llama checkpoint and tokenizer offline, for the real-vLLM CI stage.

    python vllm_stage/make_tiny_llama.py OUT_DIR

hidden 256, 4 layers, 4 heads, 2 KV heads (head_dim 64), vocab 1024, float32, seeded. The
initializer range is 0.2 (HF's 0.02 makes greedy output repeat one token, and equality checks
need varied tokens). The tokenizer is a byte-level BPE trained on a fixed text.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

VOCAB = 1024
CORPUS = [
    "Disaggregated serving splits prefill and decode across engines.",
    "The KV cache moves from the prefill engine to the decode engine over UCX.",
    "Every request reads only its own blocks, and blocks are freed when it ends.",
    "The quick brown fox jumps over the lazy dog, again and again, in many languages.",
] * 50


def save_tokenizer(out: Path) -> None:
    """The byte-level BPE tokenizer every tiny stage model uses, saved into ``out``."""
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = Tokenizer(models.BPE(unk_token=None))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB - 2,
        special_tokens=["<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tokenizer.train_from_iterator(CORPUS, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, bos_token="<s>", eos_token="</s>")
    fast.save_pretrained(out)


def build(out: Path) -> None:
    save_tokenizer(out)
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=2048,
        initializer_range=0.2,
        bos_token_id=0,
        eos_token_id=1,
        torch_dtype="float32",
    )
    LlamaForCausalLM(config).save_pretrained(out, safe_serialization=True)


if __name__ == "__main__":
    build(Path(sys.argv[1]))
