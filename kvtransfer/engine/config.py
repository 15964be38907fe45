"""Engine configuration: what model, how it is split across workers, and how KV is paged."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from kvtransfer.connector.config import KVTransferConfig

DType = Literal["auto", "float32", "bfloat16", "float16"]
FULL_ATTENTION = "full_attention"
SLIDING_ATTENTION = "sliding_attention"
MAMBA = "mamba"
# Also the order of the KV cache groups a hybrid model's layers make.
LAYER_TYPES = (FULL_ATTENTION, SLIDING_ATTENTION, MAMBA)
# A hybrid model's pool reserves this block: the entry of a block a sliding window passed.
NULL_BLOCK_ID = 0


@dataclass(frozen=True)
class ModelConfig:
    """Architecture hyperparameters of a Llama-family decoder (the fields of HF ``config.json``).

    ``architecture`` is ``"llama"``, ``"mistral"`` or ``"qwen2"``; they differ only in defaults
    (Qwen2 has q/k/v biases). ``head_dim`` defaults to ``hidden_size // num_attention_heads``.

    ``layer_types`` (HF's names, one per layer; empty = every layer full attention) makes a
    hybrid model: its ``"sliding_attention"`` layers see only the last ``sliding_window``
    tokens (the token itself included, as transformers' sliding mask), and keep their KV in a
    KV cache group of their own whose blocks behind the window go back to the pool. Its
    ``"mamba"`` layers are Mamba2 mixers (``mamba_*`` fields; one B/C group per head, so TP
    splits them by head) whose running state (conv window and SSM state) is one block per
    request in a recurrent-state group.
    """

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-6
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    bos_token_id: int | None = None
    eos_token_id: int | None = None
    torch_dtype: str = "float32"
    sliding_window: int | None = None
    layer_types: tuple[str, ...] = ()
    mamba_num_heads: int = 0
    mamba_head_dim: int = 0
    mamba_state_size: int = 0
    mamba_conv_kernel: int = 4

    def __post_init__(self) -> None:
        for name in (
            "vocab_size",
            "hidden_size",
            "intermediate_size",
            "num_hidden_layers",
            "num_attention_heads",
            "num_key_value_heads",
            "head_dim",
        ):
            if getattr(self, name) < 1:
                raise ValueError(f"model config: {name} must be >= 1, got {getattr(self, name)}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"model config: num_attention_heads ({self.num_attention_heads}) must be a "
                f"multiple of num_key_value_heads ({self.num_key_value_heads})"
            )
        if self.layer_types:
            unknown = sorted(set(self.layer_types) - set(LAYER_TYPES))
            if unknown:
                raise ValueError(
                    f"model config: layer_types {unknown} unsupported (known: {list(LAYER_TYPES)})"
                )
            if len(self.layer_types) != self.num_hidden_layers:
                raise ValueError(
                    f"model config: {len(self.layer_types)} layer_types for "
                    f"{self.num_hidden_layers} layers"
                )
            if FULL_ATTENTION not in self.layer_types:
                raise ValueError(
                    "model config: no full_attention layer (a model of sliding layers only is "
                    "one full attention group with max_position_embeddings capped at the "
                    "window; one of Mamba layers only is not supported)"
                )
            mamba = ("mamba_num_heads", "mamba_head_dim", "mamba_state_size")
            if MAMBA in self.layer_types and (
                any(getattr(self, name) < 1 for name in mamba) or self.mamba_conv_kernel < 2
            ):
                raise ValueError(
                    "model config: mamba layers need mamba_num_heads, mamba_head_dim and "
                    "mamba_state_size >= 1 and mamba_conv_kernel >= 2, got "
                    f"{[getattr(self, n) for n in (*mamba, 'mamba_conv_kernel')]}"
                )
            if SLIDING_ATTENTION in self.layer_types and (
                self.sliding_window is None or self.sliding_window < 1
            ):
                raise ValueError(
                    "model config: sliding_attention layers need sliding_window >= 1, got "
                    f"{self.sliding_window!r}"
                )

    def layer_window(self, layer: int) -> int | None:
        """The sliding window of layer ``layer`` (``None``: full attention)."""
        if self.layer_types and self.layer_types[layer] == SLIDING_ATTENTION:
            return self.sliding_window
        return None

    def layer_type(self, layer: int) -> str:
        return self.layer_types[layer] if self.layer_types else FULL_ATTENTION

    @property
    def kv_group_kinds(self) -> tuple[str, ...]:
        """The layer types of its KV cache groups, in group order (full attention first)."""
        return tuple(
            kind for kind in LAYER_TYPES if kind in (self.layer_types or (FULL_ATTENTION,))
        )

    def kv_group_of_layer(self, layer: int) -> int:
        """The KV cache group layer ``layer`` keeps its KV (or state) in."""
        return self.kv_group_kinds.index(self.layer_type(layer))

    @property
    def num_kv_groups(self) -> int:
        return len(self.kv_group_kinds)

    @property
    def mamba_inner_size(self) -> int:
        return self.mamba_num_heads * self.mamba_head_dim

    @property
    def mamba_conv_channels(self) -> int:
        """x, B and C: what the causal convolution runs over (one B/C group per head)."""
        return self.mamba_inner_size + 2 * self.mamba_num_heads * self.mamba_state_size

    @property
    def is_hybrid(self) -> bool:
        """Whether its layers make more than one KV cache group."""
        return len(set(self.layer_types)) > 1


@dataclass(frozen=True)
class SpeculativeConfig:
    """``method="draft"``: a smaller model sharing the tokenizer proposes tokens and keeps its own
    KV layers (``draft.layers.N.self_attn``) in the target's block tables. ``method="ngram"``:
    tokens are proposed by matching the last n-gram against the request's history (no KV).

    ``defer_kv_finalize``: the connector's step order of vLLM 0.33's Model Runner V2 with a
    speculator: its results (finished transfers, load errors, stats) are collected right after
    the target's forward, then the drafter runs, then the step is finalized (``wait_for_save``,
    metadata cleared). False: vLLM 0.32's order, everything after the drafter (seed 000)."""

    method: Literal["draft", "ngram"]
    num_speculative_tokens: int = 3
    draft_model: str = "builtin:tiny-draft"
    prompt_lookup_min: int = 2
    prompt_lookup_max: int = 4
    defer_kv_finalize: bool = False

    def __post_init__(self) -> None:
        if self.method not in ("draft", "ngram"):
            raise ValueError(f"speculative method must be 'draft' or 'ngram', got {self.method!r}")
        if self.num_speculative_tokens < 1:
            raise ValueError(
                f"num_speculative_tokens must be >= 1, got {self.num_speculative_tokens}"
            )
        if not 1 <= self.prompt_lookup_min <= self.prompt_lookup_max:
            raise ValueError(
                "need 1 <= prompt_lookup_min <= prompt_lookup_max, got "
                f"{self.prompt_lookup_min}, {self.prompt_lookup_max}"
            )


@dataclass(frozen=True)
class EngineConfig:
    """Everything an engine (scheduler + workers) is built from; picklable, sent to workers.

    ``model`` is ``"builtin"`` (= ``"builtin:tiny"``), ``"builtin:<preset>"`` or a directory in
    Hugging Face format. ``num_kv_blocks`` ``None`` sizes the pool from ``kv_cache_bytes``.
    """

    model: str = "builtin"
    dtype: DType = "auto"
    device: Literal["cpu", "cuda"] = "cpu"
    block_size: int = 16
    num_kv_blocks: int | None = None
    kv_cache_bytes: int = 256 * 1024 * 1024
    max_num_seqs: int = 32
    max_num_batched_tokens: int = 512
    max_model_len: int | None = None
    enable_prefix_caching: bool = True
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    speculative: SpeculativeConfig | None = None
    kv_transfer_config: KVTransferConfig | None = None
    seed: int = 0
    extra: dict[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        positive = ("block_size", "max_num_seqs", "max_num_batched_tokens", "kv_cache_bytes")
        for name in positive:
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 1:
            raise ValueError(f"num_kv_blocks must be >= 1, got {self.num_kv_blocks}")
        for name in ("tensor_parallel_size", "pipeline_parallel_size"):
            if getattr(self, name) not in (1, 2, 4):
                raise ValueError(f"{name} must be 1, 2 or 4, got {getattr(self, name)}")

    @property
    def world_size(self) -> int:
        return self.tensor_parallel_size * self.pipeline_parallel_size
