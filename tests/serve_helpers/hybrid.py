"""The hybrid model the P/D tests serve, and what a transfer of its KV moves."""

from __future__ import annotations

from kvtransfer.engine.model.builtin import builtin_model_config
from kvtransfer.engine.model.mamba import mamba_state_bytes
from serve_helpers.daemons import BLOCK_SIZE

MODEL = "builtin:tiny-hybrid"
CONFIG = builtin_model_config(MODEL.removeprefix("builtin:"))
# One block of one layer: K and V of every KV head, float32.
LAYER_BLOCK_BYTES = 2 * CONFIG.num_key_value_heads * BLOCK_SIZE * CONFIG.head_dim * 4
LAYERS_PER_GROUP = CONFIG.num_hidden_layers // 2


def prompt_tokens(prompt: str) -> int:
    return len(prompt.encode())  # the built-in tokenizer: one token per byte


def window_tail_blocks(num_tokens: int) -> int:
    """Blocks of the sliding-window group that move: those holding positions >= num_tokens -
    window (the decode's next query, at num_tokens, sees one position fewer; the engine keeps
    one more for a consumer that recomputes the last prompt token)."""
    first_seen = max(0, num_tokens - CONFIG.sliding_window)
    return -(-num_tokens // BLOCK_SIZE) - first_seen // BLOCK_SIZE


MAMBA_MODEL = "builtin:tiny-mamba"
_MAMBA = builtin_model_config(MAMBA_MODEL.removeprefix("builtin:"))
# One layer's state (conv window and SSM state, every head), float32.
MAMBA_STATE_BYTES = mamba_state_bytes(_MAMBA, _MAMBA.mamba_num_heads)
