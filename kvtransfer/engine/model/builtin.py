"""Built-in models: deterministic random-weight Llama checkpoints that need no download.

Every preset uses the byte vocabulary of `tokenizer` (ids 0..255 = bytes, ``<bos>`` 256,
``<eos>`` 257, ``<pad>`` 258). Weights come from a CPU ``torch.Generator`` with a fixed seed per
preset, so every process (and every TP/PP worker) builds identical tensors. They are scaled so a
forward pass stays well conditioned: unit-RMS embeddings, input projections ``1/sqrt(fan_in)``,
output projections shrinking with depth, unit norms, and an ``lm_head`` whose logits have a
spread of a few units, so greedy choices are far from ties. The ``lm_head`` rows of printable
ASCII are larger than the rest, so the tiny model babbles printable text and rarely picks
``<eos>`` (stop on a token of your choice with ``stop_token_ids``).

``tiny-hybrid`` is a Qwen2 (q/k/v biases) whose layers alternate sliding-window attention
(window 24 tokens) and full attention: a hybrid KV cache of two groups, small enough for every
TP/PP pairing of ``tiny``.

``tiny-mamba`` is a Llama whose layers 0 and 2 are Mamba2 mixers (4 heads of 8, state 16,
convolution kernel 4) beside full attention in layers 1 and 3: a recurrent-state group beside the
full-attention one.

``tiny-draft`` is ``tiny`` truncated to its first two layers (same embeddings, final norm and
``lm_head``); because ``tiny``'s later layers contribute little, its greedy proposals often match.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any

import torch

from kvtransfer.engine.config import FULL_ATTENTION, MAMBA, SLIDING_ATTENTION, ModelConfig
from kvtransfer.engine.model.tokenizer import (
    BOS_TOKEN_ID,
    BYTE_VOCAB_SIZE,
    EOS_TOKEN_ID,
    PAD_TOKEN_ID,
    byte_level_tokenizer_json,
)

_HF_ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
}


@dataclass(frozen=True)
class _Preset:
    config: ModelConfig
    seed: int
    # Scale of layer i's o_proj/down_proj output is out_scale * layer_decay**i.
    out_scale: float = 0.5
    layer_decay: float = 1.0
    logit_std: float = 3.0
    # A preset that is a truncation of another reuses that one's tensors.
    truncates: str | None = None


def _byte_config(architecture: str = "llama", **fields: Any) -> ModelConfig:
    return ModelConfig(
        architecture=architecture,
        vocab_size=BYTE_VOCAB_SIZE,
        bos_token_id=BOS_TOKEN_ID,
        eos_token_id=EOS_TOKEN_ID,
        rope_theta=10000.0,
        rms_norm_eps=1e-5,
        max_position_embeddings=2048,
        tie_word_embeddings=False,
        torch_dtype="float32",
        **fields,
    )


_TINY_SHAPE = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
}
_PRESETS: dict[str, _Preset] = {
    # 4 layers, 4 query heads, 2 KV heads: splits over TP 1/2/4 and PP 1/2/4.
    # Layer outputs decay with depth so that tiny-draft (layers 0-1) agrees with it often.
    "tiny": _Preset(
        _byte_config(num_hidden_layers=4, **_TINY_SHAPE),
        seed=1234,
        out_scale=1.0,
        layer_decay=0.6,
    ),
    "tiny-draft": _Preset(
        _byte_config(num_hidden_layers=2, **_TINY_SHAPE), seed=1234, truncates="tiny"
    ),
    # ~104M parameters, nearly all in the layers (the byte vocabulary is tiny).
    "small": _Preset(
        _byte_config(
            num_hidden_layers=12,
            hidden_size=768,
            intermediate_size=3072,
            num_attention_heads=12,
            num_key_value_heads=4,
            head_dim=64,
        ),
        seed=4321,
        out_scale=0.2,
    ),
    # Sliding-window layers 0 and 2 beside full layers 1 and 3: each PP 2 stage holds one of each.
    "tiny-hybrid": _Preset(
        _byte_config(
            architecture="qwen2",
            num_hidden_layers=4,
            attention_bias=True,
            sliding_window=24,
            layer_types=(SLIDING_ATTENTION, FULL_ATTENTION) * 2,
            **_TINY_SHAPE,
        ),
        seed=2468,
        out_scale=1.0,
        layer_decay=0.8,
    ),
    # Mamba2 layers 0 and 2 beside full attention 1 and 3: each PP 2 stage holds one of each.
    "tiny-mamba": _Preset(
        _byte_config(
            num_hidden_layers=4,
            layer_types=(MAMBA, FULL_ATTENTION) * 2,
            mamba_num_heads=4,
            mamba_head_dim=8,
            mamba_state_size=16,
            mamba_conv_kernel=4,
            **_TINY_SHAPE,
        ),
        seed=1357,
        out_scale=1.0,
        layer_decay=0.8,
    ),
}


def builtin_preset_names() -> tuple[str, ...]:
    return tuple(_PRESETS)


def _preset(name: str) -> _Preset:
    preset = _PRESETS.get(name)
    if preset is None:
        raise ValueError(
            f"unknown built-in model preset {name!r}; known presets: {', '.join(_PRESETS)}"
        )
    return preset


def builtin_model_config(preset: str) -> ModelConfig:
    return _preset(preset).config


def builtin_weights(preset: str) -> dict[str, torch.Tensor]:
    """HF-named float32 CPU tensors of ``preset``; identical on every call and in every process.

    Generated once per process and cached: treat the tensors as read-only.
    """
    _preset(preset)
    return dict(_cached_weights(preset))


@lru_cache(maxsize=4)
def _cached_weights(name: str) -> dict[str, torch.Tensor]:
    preset = _PRESETS[name]
    if preset.truncates is not None:
        source = _cached_weights(preset.truncates)
        layers = preset.config.num_hidden_layers
        return {
            key: tensor
            for key, tensor in source.items()
            if not key.startswith("model.layers.") or int(key.split(".")[2]) < layers
        }
    return _generate(preset)


def _printable_rows(vocab_size: int) -> torch.Tensor:
    """1 for printable ASCII, tab and newline; 0 for every other id."""
    rows = torch.zeros(vocab_size)
    rows[ord(" ") : ord("~") + 1] = 1.0
    rows[ord("\n")] = rows[ord("\t")] = 1.0
    return rows


def _generate(preset: _Preset) -> dict[str, torch.Tensor]:
    cfg = preset.config
    gen = torch.Generator(device="cpu").manual_seed(preset.seed)

    def normal(*shape: int, std: float) -> torch.Tensor:
        return torch.randn(shape, generator=gen, dtype=torch.float32) * std

    hidden, inter = cfg.hidden_size, cfg.intermediate_size
    in_std = hidden**-0.5
    weights = {"model.embed_tokens.weight": normal(cfg.vocab_size, hidden, std=1.0)}
    for i in range(cfg.num_hidden_layers):
        p = f"model.layers.{i}"
        out = preset.out_scale * preset.layer_decay**i
        weights[f"{p}.input_layernorm.weight"] = torch.ones(hidden)
        if cfg.layer_type(i) == MAMBA:
            weights.update(_mamba_weights(cfg, f"{p}.mamba", out, gen))
        else:
            weights.update(_attention_weights(cfg, p, out, normal))
        weights[f"{p}.post_attention_layernorm.weight"] = torch.ones(hidden)
        weights[f"{p}.mlp.gate_proj.weight"] = normal(inter, hidden, std=in_std)
        weights[f"{p}.mlp.up_proj.weight"] = normal(inter, hidden, std=in_std)
        weights[f"{p}.mlp.down_proj.weight"] = normal(hidden, inter, std=out * inter**-0.5)
    weights["model.norm.weight"] = torch.ones(hidden)
    # Non-printable and special ids get a third of the spread: possible, but rarely greedy.
    row_scale = 1 / 3 + (2 / 3) * _printable_rows(cfg.vocab_size)
    lm_head = normal(cfg.vocab_size, hidden, std=preset.logit_std * in_std)
    weights["lm_head.weight"] = lm_head * row_scale[:, None]
    return weights


def _attention_weights(
    cfg: ModelConfig, p: str, out: float, normal: Callable[..., torch.Tensor]
) -> dict[str, torch.Tensor]:
    hidden = cfg.hidden_size
    q_dim = cfg.num_attention_heads * cfg.head_dim
    kv_dim = cfg.num_key_value_heads * cfg.head_dim
    in_std = hidden**-0.5
    weights = {}
    weights[f"{p}.self_attn.q_proj.weight"] = normal(q_dim, hidden, std=in_std)
    weights[f"{p}.self_attn.k_proj.weight"] = normal(kv_dim, hidden, std=in_std)
    weights[f"{p}.self_attn.v_proj.weight"] = normal(kv_dim, hidden, std=in_std)
    weights[f"{p}.self_attn.o_proj.weight"] = normal(hidden, q_dim, std=out * q_dim**-0.5)
    if cfg.attention_bias:
        for name, size in (("q_proj", q_dim), ("k_proj", kv_dim), ("v_proj", kv_dim)):
            weights[f"{p}.self_attn.{name}.bias"] = normal(size, std=0.1)
    return weights


def _mamba_weights(
    cfg: ModelConfig, prefix: str, out_scale: float, gen: torch.Generator
) -> dict[str, torch.Tensor]:
    """A Mamba2 mixer's tensors, initialised as Mamba2 does: dt in [0.01, 0.1], A in [1, 16]."""
    heads, inner, conv = cfg.mamba_num_heads, cfg.mamba_inner_size, cfg.mamba_conv_channels

    def uniform(low: float, high: float, size: int) -> torch.Tensor:
        return low + (high - low) * torch.rand(size, generator=gen)

    def normal(*shape: int, std: float) -> torch.Tensor:
        return torch.randn(shape, generator=gen) * std

    dt = torch.exp(uniform(math.log(0.01), math.log(0.1), heads))
    return {
        f"{prefix}.in_proj.weight": normal(
            inner + conv + heads, cfg.hidden_size, std=cfg.hidden_size**-0.5
        ),
        f"{prefix}.conv1d.weight": normal(conv, cfg.mamba_conv_kernel, std=0.5),
        f"{prefix}.conv1d.bias": normal(conv, std=0.1),
        # softplus(dt_bias) = dt
        f"{prefix}.dt_bias": dt + torch.log(-torch.expm1(-dt)),
        f"{prefix}.A_log": torch.log(uniform(1.0, 16.0, heads)),
        f"{prefix}.D": torch.ones(heads),
        f"{prefix}.norm.weight": torch.ones(inner),
        f"{prefix}.out_proj.weight": normal(cfg.hidden_size, inner, std=out_scale * inner**-0.5),
    }


def hf_config_dict(config: ModelConfig) -> dict[str, Any]:
    """``config`` as the ``config.json`` transformers writes for the same architecture."""
    return {
        "architectures": [_HF_ARCHITECTURES[config.architecture]],
        "model_type": config.architecture,
        "vocab_size": config.vocab_size,
        "hidden_size": config.hidden_size,
        "intermediate_size": config.intermediate_size,
        "num_hidden_layers": config.num_hidden_layers,
        "num_attention_heads": config.num_attention_heads,
        "num_key_value_heads": config.num_key_value_heads,
        "head_dim": config.head_dim,
        "hidden_act": "silu",
        "rope_theta": config.rope_theta,
        "rope_scaling": None,
        "rms_norm_eps": config.rms_norm_eps,
        "max_position_embeddings": config.max_position_embeddings,
        "tie_word_embeddings": config.tie_word_embeddings,
        "attention_bias": config.attention_bias,
        "mlp_bias": False,
        "bos_token_id": config.bos_token_id,
        "eos_token_id": config.eos_token_id,
        "torch_dtype": config.torch_dtype,
        **_sliding_window_fields(config),
    }


def _sliding_window_fields(config: ModelConfig) -> dict[str, Any]:
    """Qwen2's keys for a hybrid model: explicit ``layer_types`` win over
    ``max_window_layers``, which is set so that it alone would make every layer full."""
    if not config.layer_types:
        return {}
    if MAMBA in config.layer_types:
        # Not a transformers architecture: kvtransfer's own keys, which its loader reads.
        return {
            "layer_types": list(config.layer_types),
            "mamba_num_heads": config.mamba_num_heads,
            "mamba_head_dim": config.mamba_head_dim,
            "mamba_state_size": config.mamba_state_size,
            "mamba_conv_kernel": config.mamba_conv_kernel,
        }
    return {
        "use_sliding_window": True,
        "sliding_window": config.sliding_window,
        "max_window_layers": config.num_hidden_layers,
        "layer_types": list(config.layer_types),
    }


def write_builtin_model(directory: Path, preset: str = "tiny") -> Path:
    """Write ``preset`` as a Hugging Face model directory (created if missing); return it.

    Files: ``config.json``, ``model.safetensors``, ``tokenizer.json`` (loadable with
    ``tokenizers.Tokenizer.from_file``), ``generation_config.json`` and ``tokenizer_config.json``
    (special tokens and the built-in chat template, so Hugging Face's tokenizer renders chats
    as the daemons do).
    """
    from safetensors.torch import save_file

    from kvtransfer.engine.model.chat_template import (
        BUILTIN_CHAT_TEMPLATE,
        BUILTIN_SPECIAL_TOKENS,
    )

    config = builtin_model_config(preset)
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    hf_config = {**hf_config_dict(config), "kvtransfer_preset": preset}
    (directory / "config.json").write_text(json.dumps(hf_config, indent=2) + "\n")
    generation = {
        "bos_token_id": BOS_TOKEN_ID,
        "eos_token_id": EOS_TOKEN_ID,
        "pad_token_id": PAD_TOKEN_ID,
    }
    (directory / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")
    (directory / "tokenizer.json").write_text(byte_level_tokenizer_json())
    tokenizer_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        **BUILTIN_SPECIAL_TOKENS,
        "chat_template": BUILTIN_CHAT_TEMPLATE,
    }
    (directory / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=2) + "\n")
    tensors = {name: t.contiguous() for name, t in builtin_weights(preset).items()}
    save_file(tensors, str(directory / "model.safetensors"), metadata={"format": "pt"})
    return directory


def init_model_dir(directory: str | Path, preset: str) -> Path:
    """`write_builtin_model` into a new or empty directory (never over existing files)."""
    path = Path(directory)
    _preset(preset)
    if path.exists() and not path.is_dir():
        raise ValueError(f"{path} exists and is not a directory")
    if path.is_dir() and any(path.iterdir()):
        raise ValueError(f"refusing to write a model into non-empty directory {path}")
    return write_builtin_model(path, preset)
