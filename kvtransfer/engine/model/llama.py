"""`LlamaForCausalLM`: the Llama / Mistral / Qwen2 decoder over a paged KV cache, one TP x PP shard.

The math is Hugging Face's: pre-norm blocks of RMSNorm -> grouped-query attention with rotary
embeddings ("rotate_half" layout) -> residual add -> RMSNorm -> SwiGLU MLP -> residual add, then a
final RMSNorm and ``lm_head``. Qwen2 adds q/k/v biases; a Llama config with ``attention_bias``
biases o_proj too (as HF does), Qwen2 never does.

Sharding. Tensor parallel ranks split query heads evenly and KV heads by
`kvtransfer.connector.topology.kv_head_range` (one replicated head per rank once ranks
outnumber heads);
q/k/v and gate/up are column-parallel, o_proj and down_proj row-parallel with their partial
outputs summed by ``tp_all_reduce``. Embedding, final norm and ``lm_head`` are not split (every
rank computes full logits). Pipeline ranks own the layers of `pp_layer_range`; the first embeds,
the others resume from the previous stage's ``hidden_states``/``residual``.

Hybrid models (``config.layer_types``) mix sliding-window attention and Mamba2 mixers
(`kvtransfer.engine.model.mamba`, in place of attention) into the stack; each layer reads the
block table of its KV cache group, so the forward takes one `AttentionMetadata` per group and
builds one `PagedAttentionPlan` per attention group.

The residual stream travels as ``(hidden, residual)`` with the true activation being their sum,
so a stage boundary cuts between two adds; the sums are the same floating-point adds HF does.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from kvtransfer.connector.topology import kv_head_range
from kvtransfer.engine.config import MAMBA, SLIDING_ATTENTION, ModelConfig
from kvtransfer.engine.model.attention import PagedAttentionPlan, paged_attention
from kvtransfer.engine.model.forward_context import AttentionMetadata, LayerHooks, NoLayerHooks
from kvtransfer.engine.model.mamba import MAMBA_TENSORS, Mamba2Mixer, mamba_cache_shape
from kvtransfer.engine.outputs import IntermediateTensors
from kvtransfer.engine.parallel import ParallelRank, pp_layer_range

AllReduce = Callable[[torch.Tensor], torch.Tensor]

_NO_HOOKS = NoLayerHooks()
_SINGLE_RANK = ParallelRank()
# Checkpoints of older transformers versions store this buffer; it is recomputed, never loaded.
_IGNORED_SUFFIXES = (".self_attn.rotary_emb.inv_freq",)


def _identity(tensor: torch.Tensor) -> torch.Tensor:
    return tensor


def _empty(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> nn.Parameter:
    # Filled by load_weights; inference only, so no autograd bookkeeping.
    return nn.Parameter(torch.empty(shape, dtype=dtype, device=device), requires_grad=False)


def has_o_proj_bias(config: ModelConfig) -> bool:
    """HF Llama ties o_proj's bias to ``attention_bias``; Qwen2 biases only q/k/v."""
    return config.attention_bias and config.architecture != "qwen2"


def num_parameters(config: ModelConfig) -> int:
    """Parameters of the whole (unsharded) model; a tied ``lm_head`` is counted once."""
    hidden, inter = config.hidden_size, config.intermediate_size
    q_dim = config.num_attention_heads * config.head_dim
    kv_dim = config.num_key_value_heads * config.head_dim
    attn = hidden * (q_dim + 2 * kv_dim) + q_dim * hidden
    if config.attention_bias:
        attn += q_dim + 2 * kv_dim
    if has_o_proj_bias(config):
        attn += hidden
    mlp = 3 * hidden * inter + 2 * hidden
    inner, heads = config.mamba_inner_size, config.mamba_num_heads
    conv = config.mamba_conv_channels
    mamba = (inner + conv + heads) * hidden + conv * (config.mamba_conv_kernel + 1)
    mamba += 3 * heads + inner + hidden * inner
    layers = sum(
        mlp + (mamba if config.layer_type(i) == MAMBA else attn)
        for i in range(config.num_hidden_layers)
    )
    embed = config.vocab_size * hidden
    head = 0 if config.tie_word_embeddings else embed
    return layers + embed + hidden + head


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        self.eps = eps
        self.weight = _empty((size,), dtype, device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalise in float32 and scale in the model dtype, as HF does.
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)


class RotaryEmbedding(nn.Module):
    def __init__(self, head_dim: int, theta: float, device: torch.device) -> None:
        super().__init__()
        exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
        inv_freq = 1.0 / (theta**exponents)
        self.register_buffer("inv_freq", inv_freq.to(device), persistent=False)

    def forward(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """float32 ``cos``/``sin`` ``[num_tokens, head_dim]``, each half a copy of the other."""
        freqs = positions.float()[:, None] * self.inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos(), emb.sin()


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """``x`` ``[num_tokens, heads, head_dim]`` rotated by the per-token angles."""
    cos = cos[:, None, :].to(x.dtype)
    sin = sin[:, None, :].to(x.dtype)
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


@dataclass(frozen=True)
class _Target:
    """Where (a slice of) one checkpoint tensor goes: ``dim=None`` copies it whole."""

    param: torch.Tensor  # a parameter, or a view of one
    dim: int | None = None
    start: int = 0
    stop: int = 0


@dataclass(frozen=True)
class _Slot:
    full_shape: tuple[int, ...]
    targets: tuple[_Target, ...]


class LlamaAttention(nn.Module):
    def __init__(
        self,
        config: ModelConfig,
        q_heads: range,
        kv_heads: range,
        all_reduce: AllReduce,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        super().__init__()
        hidden, head_dim = config.hidden_size, config.head_dim
        self.q_heads, self.kv_heads = q_heads, kv_heads
        self.head_dim = head_dim
        self.scale = head_dim**-0.5
        self.all_reduce = all_reduce
        q_dim, kv_dim = len(q_heads) * head_dim, len(kv_heads) * head_dim
        self.q_proj = _empty((q_dim, hidden), dtype, device)
        self.k_proj = _empty((kv_dim, hidden), dtype, device)
        self.v_proj = _empty((kv_dim, hidden), dtype, device)
        self.o_proj = _empty((hidden, q_dim), dtype, device)
        bias = config.attention_bias
        self.q_bias = _empty((q_dim,), dtype, device) if bias else None
        self.k_bias = _empty((kv_dim,), dtype, device) if bias else None
        self.v_bias = _empty((kv_dim,), dtype, device) if bias else None
        self.o_bias = _empty((hidden,), dtype, device) if has_o_proj_bias(config) else None

    def slots(self, prefix: str, config: ModelConfig) -> dict[str, _Slot]:
        d, hidden = self.head_dim, config.hidden_size
        q_full = config.num_attention_heads * d
        kv_full = config.num_key_value_heads * d
        q_lo, q_hi = self.q_heads.start * d, self.q_heads.stop * d
        kv_lo, kv_hi = self.kv_heads.start * d, self.kv_heads.stop * d
        slots: dict[str, _Slot] = {}
        column_parallel = (
            ("q_proj", self.q_proj, self.q_bias, q_full, q_lo, q_hi),
            ("k_proj", self.k_proj, self.k_bias, kv_full, kv_lo, kv_hi),
            ("v_proj", self.v_proj, self.v_bias, kv_full, kv_lo, kv_hi),
        )
        for name, weight, bias, full, lo, hi in column_parallel:
            slots[f"{prefix}.{name}.weight"] = _Slot((full, hidden), (_Target(weight, 0, lo, hi),))
            if bias is not None:
                slots[f"{prefix}.{name}.bias"] = _Slot((full,), (_Target(bias, 0, lo, hi),))
        slots[f"{prefix}.o_proj.weight"] = _Slot(
            (hidden, q_full), (_Target(self.o_proj, 1, q_lo, q_hi),)
        )
        if self.o_bias is not None:
            slots[f"{prefix}.o_proj.bias"] = _Slot((hidden,), (_Target(self.o_bias),))
        return slots

    def forward(
        self,
        hidden: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv_cache: torch.Tensor,
        plan: PagedAttentionPlan,
    ) -> torch.Tensor:
        n, d = hidden.shape[0], self.head_dim
        q = F.linear(hidden, self.q_proj, self.q_bias).view(n, len(self.q_heads), d)
        k = F.linear(hidden, self.k_proj, self.k_bias).view(n, len(self.kv_heads), d)
        v = F.linear(hidden, self.v_proj, self.v_bias).view(n, len(self.kv_heads), d)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        out = paged_attention(q, k, v, kv_cache, plan, self.scale)
        out = self.all_reduce(F.linear(out.reshape(n, -1), self.o_proj))
        # Added after the reduction so that it counts once, not once per rank.
        return out if self.o_bias is None else out + self.o_bias


class LlamaMLP(nn.Module):
    def __init__(
        self,
        config: ModelConfig,
        rows: range,
        all_reduce: AllReduce,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        super().__init__()
        self.rows = rows
        self.all_reduce = all_reduce
        hidden = config.hidden_size
        self.gate_proj = _empty((len(rows), hidden), dtype, device)
        self.up_proj = _empty((len(rows), hidden), dtype, device)
        self.down_proj = _empty((hidden, len(rows)), dtype, device)

    def slots(self, prefix: str, config: ModelConfig) -> dict[str, _Slot]:
        column = (config.intermediate_size, config.hidden_size)
        lo, hi = self.rows.start, self.rows.stop
        return {
            f"{prefix}.gate_proj.weight": _Slot(column, (_Target(self.gate_proj, 0, lo, hi),)),
            f"{prefix}.up_proj.weight": _Slot(column, (_Target(self.up_proj, 0, lo, hi),)),
            f"{prefix}.down_proj.weight": _Slot(
                column[::-1], (_Target(self.down_proj, 1, lo, hi),)
            ),
        }

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gated = F.silu(F.linear(x, self.gate_proj)) * F.linear(x, self.up_proj)
        return self.all_reduce(F.linear(gated, self.down_proj))


class LlamaDecoderLayer(nn.Module):
    def __init__(
        self,
        config: ModelConfig,
        name: str,
        kv_group: int,
        attn: LlamaAttention | Mamba2Mixer,
        mlp: LlamaMLP,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        super().__init__()
        self.name = name
        self.kv_group = kv_group
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype, device)
        self.self_attn = attn
        self.post_attention_layernorm = RMSNorm(
            config.hidden_size, config.rms_norm_eps, dtype, device
        )
        self.mlp = mlp

    def forward(
        self,
        hidden: torch.Tensor,
        residual: torch.Tensor | None,
        rope: tuple[torch.Tensor, torch.Tensor],
        kv_cache: torch.Tensor,
        plan: PagedAttentionPlan | None,
        hooks: LayerHooks,
        attn_metadata: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        residual = hidden if residual is None else hidden + residual
        hidden = self.input_layernorm(residual)
        hooks.before_attention(self.name)
        if isinstance(self.self_attn, Mamba2Mixer):
            hidden = self.self_attn(hidden, kv_cache, attn_metadata)
        else:
            hidden = self.self_attn(hidden, rope[0], rope[1], kv_cache, plan)
        hooks.after_attention(self.name, kv_cache, attn_metadata)
        residual = hidden + residual
        hidden = self.mlp(self.post_attention_layernorm(residual))
        return hidden, residual


class LlamaForCausalLM(nn.Module):
    """One ``(tp_rank, pp_rank)`` shard of the decoder; see the module docstring.

    ``tp_all_reduce`` sums a row-parallel partial output over the TP group and returns the sum
    (wrap an in-place ``dist.all_reduce`` as ``lambda t: (dist.all_reduce(t, group=g), t)[1]``).
    ``None`` means identity, which is only correct when ``tp_size == 1``.
    """

    def __init__(
        self,
        config: ModelConfig,
        rank: ParallelRank = _SINGLE_RANK,
        tp_all_reduce: AllReduce | None = None,
        dtype: torch.dtype = torch.float32,
        device: str | torch.device = "cpu",
        layer_name_prefix: str = "model.layers",
    ) -> None:
        super().__init__()
        tp, tp_rank = rank.tp_size, rank.tp_rank
        if config.num_attention_heads % tp:
            raise ValueError(
                f"num_attention_heads ({config.num_attention_heads}) must be divisible by "
                f"tensor parallel size {tp}"
            )
        if config.intermediate_size % tp:
            raise ValueError(
                f"intermediate_size ({config.intermediate_size}) must be divisible by "
                f"tensor parallel size {tp}"
            )
        if config.head_dim % 2:
            raise ValueError(f"head_dim must be even for rotary embeddings, got {config.head_dim}")
        self.config = config
        self.rank = rank
        self.dtype = dtype
        self.device = torch.device(device)
        self.layer_name_prefix = layer_name_prefix
        self.layer_range = pp_layer_range(config.num_hidden_layers, rank.pp_size, rank.pp_rank)

        q_per_rank = config.num_attention_heads // tp
        q_heads = range(tp_rank * q_per_rank, (tp_rank + 1) * q_per_rank)
        kv_heads = kv_head_range(tp_rank, tp, config.num_key_value_heads)
        _check_head_grouping(config, q_heads, kv_heads)
        self.num_local_heads = len(q_heads)
        self.num_local_kv_heads = len(kv_heads)
        inter_per_rank = config.intermediate_size // tp
        mlp_rows = range(tp_rank * inter_per_rank, (tp_rank + 1) * inter_per_rank)
        reduce = tp_all_reduce if tp_all_reduce is not None and tp > 1 else _identity

        if MAMBA in config.layer_types and config.mamba_num_heads % tp:
            raise ValueError(
                f"mamba_num_heads ({config.mamba_num_heads}) must be divisible by tensor "
                f"parallel size {tp}"
            )
        mamba_per_rank = config.mamba_num_heads // tp
        mamba_heads = range(tp_rank * mamba_per_rank, (tp_rank + 1) * mamba_per_rank)
        self.num_local_mamba_heads = mamba_per_rank

        def mixer(i: int) -> tuple[str, LlamaAttention | Mamba2Mixer]:
            if config.layer_type(i) == MAMBA:
                return "mamba", Mamba2Mixer(config, mamba_heads, reduce, dtype, dev)
            return "self_attn", LlamaAttention(config, q_heads, kv_heads, reduce, dtype, dev)

        dev = self.device
        self.embed_tokens = (
            _empty((config.vocab_size, config.hidden_size), dtype, dev)
            if rank.is_first_pp_rank
            else None
        )
        self.rotary = RotaryEmbedding(config.head_dim, config.rope_theta, dev)
        start, end = self.layer_range
        layers = []
        for i in range(start, end):
            kind, module = mixer(i)
            layers.append(
                LlamaDecoderLayer(
                    config,
                    f"{layer_name_prefix}.{i}.{kind}",
                    config.kv_group_of_layer(i),
                    module,
                    LlamaMLP(config, mlp_rows, reduce, dtype, dev),
                    dtype,
                    dev,
                )
            )
        self.layers = nn.ModuleList(layers)
        self.norm: RMSNorm | None = None
        self.lm_head: nn.Parameter | None = None
        if rank.is_last_pp_rank:
            self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype, dev)
            if config.tie_word_embeddings and self.embed_tokens is not None:
                self.lm_head = self.embed_tokens
            else:
                self.lm_head = _empty((config.vocab_size, config.hidden_size), dtype, dev)
        self._slots = self._build_slots()

    # -- shapes and names ---------------------------------------------------------------------

    def layer_names(self) -> list[str]:
        """KV layer names of the owned layers, in order (one cache tensor each)."""
        return [layer.name for layer in self.layers]

    def kv_cache_shape(self, num_blocks: int, block_size: int) -> tuple[int, int, int, int, int]:
        """One layer's cache: ``(num_blocks, 2, num_local_kv_heads, block_size, head_dim)``."""
        if num_blocks < 1 or block_size < 1:
            raise ValueError(
                f"num_blocks and block_size must be >= 1, got {num_blocks}, {block_size}"
            )
        return (num_blocks, 2, self.num_local_kv_heads, block_size, self.config.head_dim)

    def layer_caches(
        self, num_blocks: int, block_size: int
    ) -> dict[str, tuple[tuple[int, ...], torch.dtype | None]]:
        """Each owned layer's cache shape and dtype (``None``: the model's KV dtype); a Mamba
        layer's is one state page per block, uint8."""
        attention = self.kv_cache_shape(num_blocks, block_size)
        state = mamba_cache_shape(self.config, self.num_local_mamba_heads, num_blocks)
        return {
            layer.name: (state, torch.uint8)
            if isinstance(layer.self_attn, Mamba2Mixer)
            else (attention, None)
            for layer in self.layers
        }

    # -- forward ------------------------------------------------------------------------------

    def forward(
        self,
        input_ids: torch.Tensor | None,
        positions: torch.Tensor,
        kv_caches: Sequence[torch.Tensor],
        attn_metadata: AttentionMetadata | Sequence[AttentionMetadata],
        hooks: LayerHooks = _NO_HOOKS,
        intermediate_tensors: IntermediateTensors | None = None,
    ) -> torch.Tensor | IntermediateTensors:
        """Run the owned layers over ``num_tokens`` flattened rows.

        ``attn_metadata`` is one per KV cache group (a single one for a one-group model).

        The last PP rank returns final-normed hidden states ``[num_tokens, hidden]``, the others
        `IntermediateTensors` with ``hidden_states`` and ``residual``.
        """
        if len(kv_caches) != len(self.layers):
            raise ValueError(
                f"got {len(kv_caches)} KV caches for {len(self.layers)} layers "
                f"{self.layer_range[0]}..{self.layer_range[1] - 1}"
            )
        residual: torch.Tensor | None
        if self.embed_tokens is not None:
            if input_ids is None:
                raise ValueError("the first pipeline rank needs input_ids")
            hidden = F.embedding(input_ids.to(self.device), self.embed_tokens)
            residual = None
        else:
            if intermediate_tensors is None:
                raise ValueError(
                    f"pipeline rank {self.rank.pp_rank} needs intermediate_tensors from the "
                    "previous stage"
                )
            hidden = intermediate_tensors["hidden_states"]  # type: ignore[assignment]
            residual = intermediate_tensors["residual"]  # type: ignore[assignment]
        num_tokens = hidden.shape[0]
        if tuple(positions.shape) != (num_tokens,):
            raise ValueError(
                f"positions has shape {tuple(positions.shape)}, expected ({num_tokens},)"
            )
        metadata = self._group_metadata(attn_metadata)
        kinds = self.config.kv_group_kinds
        plans = [
            None
            if kinds[group] == MAMBA
            else PagedAttentionPlan.build(md, num_tokens, self.device, self._group_window(group))
            for group, md in enumerate(metadata)
        ]
        rope = self.rotary(positions.to(self.device))
        for layer, kv_cache in zip(self.layers, kv_caches, strict=True):
            group = layer.kv_group
            hidden, residual = layer(
                hidden, residual, rope, kv_cache, plans[group], hooks, metadata[group]
            )
        if residual is None:  # pp_layer_range gives every stage >= 1 layer
            raise RuntimeError("no layer ran on this pipeline stage")
        if self.norm is None:
            return IntermediateTensors({"hidden_states": hidden, "residual": residual})
        return self.norm(hidden + residual)

    def _group_metadata(
        self, attn_metadata: AttentionMetadata | Sequence[AttentionMetadata]
    ) -> tuple[AttentionMetadata, ...]:
        metadata = (
            (attn_metadata,)
            if isinstance(attn_metadata, AttentionMetadata)
            else tuple(attn_metadata)
        )
        if len(metadata) != self.config.num_kv_groups:
            raise ValueError(
                f"got attention metadata for {len(metadata)} KV cache groups, the model has "
                f"{self.config.num_kv_groups}"
            )
        return metadata

    def _group_window(self, group: int) -> int | None:
        if self.config.kv_group_kinds[group] == SLIDING_ATTENTION:
            return self.config.sliding_window
        return None

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """float32 logits over the full vocabulary ``[n, vocab_size]`` (last PP rank only)."""
        if self.lm_head is None:
            raise ValueError(
                f"compute_logits needs the last pipeline rank; this is pp_rank "
                f"{self.rank.pp_rank} of {self.rank.pp_size}"
            )
        return F.linear(hidden_states.to(self.dtype), self.lm_head).float()

    # -- weights ------------------------------------------------------------------------------

    def _build_slots(self) -> dict[str, _Slot]:
        """Every HF tensor this shard loads, with its full shape and where its slice goes."""
        cfg = self.config
        vocab_shape = (cfg.vocab_size, cfg.hidden_size)
        slots: dict[str, _Slot] = {}
        embed_targets = [p for p in (self.embed_tokens,) if p is not None]
        if cfg.tie_word_embeddings and self.lm_head is not None:
            if self.lm_head is not self.embed_tokens:
                embed_targets.append(self.lm_head)
        elif self.lm_head is not None:
            slots["lm_head.weight"] = _Slot(vocab_shape, (_Target(self.lm_head),))
        if embed_targets:
            slots["model.embed_tokens.weight"] = _Slot(
                vocab_shape, tuple(_Target(p) for p in embed_targets)
            )
        if self.norm is not None:
            slots["model.norm.weight"] = _Slot((cfg.hidden_size,), (_Target(self.norm.weight),))
        for i, layer in zip(range(*self.layer_range), self.layers, strict=True):
            prefix = f"model.layers.{i}"
            norm_shape = (cfg.hidden_size,)
            slots[f"{prefix}.input_layernorm.weight"] = _Slot(
                norm_shape, (_Target(layer.input_layernorm.weight),)
            )
            slots[f"{prefix}.post_attention_layernorm.weight"] = _Slot(
                norm_shape, (_Target(layer.post_attention_layernorm.weight),)
            )
            if isinstance(layer.self_attn, Mamba2Mixer):
                slots.update(_mamba_slots(layer.self_attn, f"{prefix}.mamba"))
            else:
                slots.update(layer.self_attn.slots(f"{prefix}.self_attn", cfg))
            slots.update(layer.mlp.slots(f"{prefix}.mlp", cfg))
        return slots

    def _belongs_elsewhere(self, name: str) -> bool:
        """A tensor of the full model that another shard loads (or nobody needs)."""
        if name.endswith(_IGNORED_SUFFIXES):
            return True
        if name in ("model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"):
            # A tied checkpoint may still carry lm_head.weight; the embedding is what counts.
            return True
        parts = name.split(".", 3)
        if len(parts) == 4 and parts[:2] == ["model", "layers"] and parts[2].isdigit():
            index = int(parts[2])
            if index < self.config.num_hidden_layers and not (
                self.layer_range[0] <= index < self.layer_range[1]
            ):
                return parts[3] in _layer_tensor_names(self.config, index)
        return False

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy this shard's slices of HF-named tensors in; raise ``ValueError`` listing every
        missing, unexpected or wrongly shaped tensor once all of them have been seen."""
        loaded: set[str] = set()
        unexpected: list[str] = []
        mismatched: dict[str, str] = {}
        with torch.no_grad():
            for name, tensor in weights:
                slot = self._slots.get(name)
                if slot is None:
                    if not self._belongs_elsewhere(name):
                        unexpected.append(name)
                    continue
                if tuple(tensor.shape) != slot.full_shape:
                    mismatched[name] = f"{name}: {tuple(tensor.shape)} != {slot.full_shape}"
                    continue
                for target in slot.targets:
                    part = tensor
                    if target.dim is not None:
                        part = tensor.narrow(target.dim, target.start, target.stop - target.start)
                    target.param.copy_(part)
                loaded.add(name)
        problems = []
        missing = sorted(set(self._slots) - loaded - set(mismatched))
        if missing:
            problems.append(f"missing tensors {missing}")
        if unexpected:
            problems.append(f"unexpected tensors {sorted(unexpected)}")
        if mismatched:
            problems.append(f"shape mismatches (got != expected) {sorted(mismatched.values())}")
        if problems:
            raise ValueError("checkpoint does not fit the model: " + "; ".join(problems))


def _check_head_grouping(config: ModelConfig, q_heads: range, kv_heads: range) -> None:
    """Local query head ``j`` must read local KV head ``j // (local q / local kv)``, i.e. the
    global grouping ``q // (heads / kv_heads)`` survives the split."""
    group = config.num_attention_heads // config.num_key_value_heads
    local_group = len(q_heads) // len(kv_heads)
    if (
        local_group < 1
        or len(q_heads) % len(kv_heads)
        or any(q // group != kv_heads[j // local_group] for j, q in enumerate(q_heads))
    ):
        raise ValueError(
            f"query heads {list(q_heads)} do not line up with KV heads {list(kv_heads)} "
            f"(group size {group})"
        )


def _mamba_slots(mixer: Mamba2Mixer, prefix: str) -> dict[str, _Slot]:
    shapes = mixer.full_shapes()
    return {
        f"{prefix}.{name}": _Slot(
            shapes[name], tuple(_Target(view, dim, start, stop) for view, dim, start, stop in parts)
        )
        for name, parts in mixer.checkpoint_slices().items()
    }


def _layer_tensor_names(config: ModelConfig, layer: int) -> frozenset[str]:
    """Layer ``layer``'s checkpoint tensors, named after ``model.layers.<layer>.``."""
    names = {
        "input_layernorm.weight",
        "post_attention_layernorm.weight",
        "mlp.gate_proj.weight",
        "mlp.up_proj.weight",
        "mlp.down_proj.weight",
    }
    if config.layer_type(layer) == MAMBA:
        names |= {f"mamba.{name}" for name in MAMBA_TENSORS}
        return frozenset(names)
    names |= {f"self_attn.{proj}.weight" for proj in ("q_proj", "k_proj", "v_proj", "o_proj")}
    if config.attention_bias:
        names |= {f"self_attn.{proj}.bias" for proj in ("q_proj", "k_proj", "v_proj")}
    if has_o_proj_bias(config):
        names.add("self_attn.o_proj.bias")
    return frozenset(names)
