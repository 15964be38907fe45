"""The model: a Llama-family decoder over a paged KV cache, its checkpoints and its tokenizer.

`llama` (the network, TP/PP-sharded) calls `attention` (paged attention in plain torch);
`loader` resolves ``"builtin[:preset]"`` or a Hugging Face directory into a `ModelConfig`,
weights and a `Tokenizer`, using `builtin` (generated checkpoints) and `tokenizer`. Importing
this package imports torch.
"""

from __future__ import annotations

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
    model_config_from_hf,
)
from kvtransfer.engine.model.tokenizer import Tokenizer

__all__ = [
    "LlamaForCausalLM",
    "Tokenizer",
    "builtin_model_config",
    "builtin_preset_names",
    "builtin_weights",
    "init_model_dir",
    "iter_weights",
    "load_model",
    "load_model_config",
    "load_tokenizer",
    "model_config_from_hf",
    "num_parameters",
    "write_builtin_model",
]
