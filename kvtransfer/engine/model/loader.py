"""Where a model comes from: ``"builtin"``, ``"builtin:<preset>"`` or a Hugging Face directory
(``config.json``, ``*.safetensors``, ``tokenizer.json``).

Only what the engine computes exactly is accepted: Llama, Mistral and Qwen2 with SiLU MLPs and
unscaled RoPE. A sliding window on every layer is honoured by capping
``max_position_embeddings`` at the window, inside which full attention is the same function; a
model whose ``layer_types`` mix sliding and full attention layers (Qwen2's ``layer_types``, or
``use_sliding_window`` with ``max_window_layers``) is a hybrid model with a sliding-window KV
cache group.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from kvtransfer.engine.config import FULL_ATTENTION, SLIDING_ATTENTION, ModelConfig
from kvtransfer.engine.model.builtin import builtin_model_config, builtin_weights
from kvtransfer.engine.model.llama import AllReduce, LlamaForCausalLM
from kvtransfer.engine.model.tokenizer import Tokenizer
from kvtransfer.engine.parallel import ParallelRank

BUILTIN = "builtin"
DEFAULT_PRESET = "tiny"
_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
}
# transformers' own per-architecture defaults for keys a config.json may leave out.
_MAX_POSITIONS = {"llama": 2048, "mistral": 4096 * 32, "qwen2": 32768}
_SINGLE_RANK = ParallelRank()


def _builtin_preset(model: str) -> str | None:
    """The preset named by ``model``, or ``None`` when it is a directory."""
    if model == BUILTIN:
        return DEFAULT_PRESET
    if model.startswith(BUILTIN + ":"):
        return model[len(BUILTIN) + 1 :]
    return None


def _architecture(config: dict[str, Any]) -> str:
    architectures = config.get("architectures") or []
    for name in architectures:
        if name in _ARCHITECTURES:
            return _ARCHITECTURES[name]
    model_type = config.get("model_type")
    if model_type in _ARCHITECTURES.values():
        return str(model_type)
    raise ValueError(
        f"unsupported model: architectures {architectures!r}, model_type {model_type!r}; "
        f"supported: {', '.join(_ARCHITECTURES)}"
    )


def _rope_theta(config: dict[str, Any]) -> float:
    # transformers >= 5 nests RoPE settings in rope_parameters; older configs use rope_scaling.
    for key in ("rope_scaling", "rope_parameters"):
        value = config.get(key)
        if value is None:
            continue
        kind = value.get("rope_type", value.get("type")) if isinstance(value, dict) else value
        if kind != "default":
            raise ValueError(
                f"{key} {value!r} is not supported (only unscaled RoPE is implemented)"
            )
    parameters = config.get("rope_parameters") or {}
    return float(parameters.get("rope_theta", config.get("rope_theta", 10000.0)))


def _first_id(value: Any) -> int | None:
    if isinstance(value, list):
        return int(value[0]) if value else None
    return None if value is None else int(value)


def model_config_from_hf(config: dict[str, Any]) -> ModelConfig:
    """A `ModelConfig` from the contents of a Hugging Face ``config.json``."""
    arch = _architecture(config)
    act = config.get("hidden_act", "silu")
    if act != "silu":
        raise ValueError(f"hidden_act {act!r} is not supported (only 'silu')")
    if config.get("mlp_bias"):
        raise ValueError("mlp_bias=True is not supported")
    heads = int(config["num_attention_heads"])
    hidden = int(config["hidden_size"])
    max_positions = int(config.get("max_position_embeddings") or _MAX_POSITIONS[arch])
    layer_types = _layer_types(config, arch)
    window = config.get("sliding_window")
    if layer_types and len(set(layer_types)) == 1 and FULL_ATTENTION in layer_types:
        layer_types = ()
    elif layer_types and FULL_ATTENTION not in layer_types:
        if window is None:
            raise ValueError("config.json has sliding_attention layers but no sliding_window")
        layer_types = ()
        max_positions = min(max_positions, int(window))
    if arch == "qwen2":
        attention_bias = True
    elif arch == "mistral":
        attention_bias = False
    else:
        attention_bias = bool(config.get("attention_bias", False))
    return ModelConfig(
        architecture=arch,
        vocab_size=int(config["vocab_size"]),
        hidden_size=hidden,
        intermediate_size=int(config["intermediate_size"]),
        num_hidden_layers=int(config["num_hidden_layers"]),
        num_attention_heads=heads,
        num_key_value_heads=int(config.get("num_key_value_heads") or heads),
        head_dim=int(config.get("head_dim") or hidden // heads),
        rope_theta=_rope_theta(config),
        rms_norm_eps=float(config.get("rms_norm_eps", 1e-6)),
        max_position_embeddings=max_positions,
        tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
        attention_bias=attention_bias,
        bos_token_id=_first_id(config.get("bos_token_id")),
        eos_token_id=_first_id(config.get("eos_token_id")),
        torch_dtype=str(config.get("torch_dtype") or config.get("dtype") or "float32"),
        sliding_window=int(window) if SLIDING_ATTENTION in layer_types else None,
        layer_types=layer_types,
        **{
            key: int(config[key])
            for key in (
                "mamba_num_heads",
                "mamba_head_dim",
                "mamba_state_size",
                "mamba_conv_kernel",
            )
            if key in config
        },
    )


def _layer_types(config: dict[str, Any], arch: str) -> tuple[str, ...]:
    """Each layer's attention as transformers builds it (empty: no sliding window anywhere)."""
    num_layers = int(config["num_hidden_layers"])
    window = config.get("sliding_window")
    if arch == "mistral":
        return (SLIDING_ATTENTION,) * num_layers if window is not None else ()
    if arch == "qwen2" and not config.get("use_sliding_window"):
        return ()
    listed = config.get("layer_types")
    if listed is not None:
        if len(listed) != num_layers:
            raise ValueError(f"config.json lists {len(listed)} layer_types for {num_layers} layers")
        return tuple(str(kind) for kind in listed)
    if arch != "qwen2" or window is None:
        return ()
    first_sliding = int(config.get("max_window_layers", num_layers))
    return tuple(
        SLIDING_ATTENTION if i >= first_sliding else FULL_ATTENTION for i in range(num_layers)
    )


def _model_dir(model: str) -> Path:
    path = Path(model)
    if not path.is_dir():
        raise FileNotFoundError(f"model directory not found: {path}")
    return path


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        raise FileNotFoundError(f"no {path.name} in model directory {path.parent}")
    return json.loads(path.read_text())


def load_model_config(model: str) -> ModelConfig:
    preset = _builtin_preset(model)
    if preset is not None:
        return builtin_model_config(preset)
    return model_config_from_hf(_read_json(_model_dir(model) / "config.json"))


def iter_weights(model: str) -> Iterator[tuple[str, torch.Tensor]]:
    """``(hf_name, tensor)`` for every tensor of the model, shard files in name order."""
    preset = _builtin_preset(model)
    if preset is not None:
        yield from builtin_weights(preset).items()
        return
    from safetensors import safe_open

    directory = _model_dir(model)
    files = sorted(directory.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors files in model directory {directory}")
    for file in files:
        with safe_open(str(file), framework="pt") as shard:
            for name in shard.keys():  # noqa: SIM118 - safe_open is not a Mapping
                yield name, shard.get_tensor(name)


def load_tokenizer(model: str) -> Tokenizer:
    """The model's tokenizer; special ids from ``generation_config.json``, else ``config.json``."""
    if _builtin_preset(model) is not None:
        load_model_config(model)  # an unknown preset fails here, not at first use
        return Tokenizer.byte_level()
    directory = _model_dir(model)
    config = _read_json(directory / "config.json")
    generation_path = directory / "generation_config.json"
    generation = _read_json(generation_path) if generation_path.is_file() else {}

    def special(key: str) -> Any:
        value = generation.get(key)
        return config.get(key) if value is None else value

    eos = special("eos_token_id")
    eos_ids = [int(i) for i in eos] if isinstance(eos, list) else [] if eos is None else [int(eos)]
    return Tokenizer.from_file(
        directory / "tokenizer.json",
        eos_token_ids=eos_ids,
        bos_token_id=_first_id(special("bos_token_id")),
        pad_token_id=_first_id(special("pad_token_id")),
    )


def load_model(
    model: str,
    rank: ParallelRank = _SINGLE_RANK,
    tp_all_reduce: AllReduce | None = None,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    layer_name_prefix: str = "model.layers",
) -> LlamaForCausalLM:
    """Build ``rank``'s shard of ``model`` and load its weights."""
    llm = LlamaForCausalLM(
        load_model_config(model), rank, tp_all_reduce, dtype, device, layer_name_prefix
    )
    llm.load_weights(iter_weights(model))
    return llm
