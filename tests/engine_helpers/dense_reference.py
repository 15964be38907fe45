"""A dense, unpaged, single-process Llama/Mistral/Qwen2 forward written straight from the
Hugging Face math, plus the paged inputs that feed the same token sequences to the engine model.

`dense_logits` shares no code with ``kvtransfer.engine.model``: its own RMSNorm, RoPE and causal
attention, in float64 by default, so it can serve as ground truth for the paged implementation.
Hybrid models too: sliding-window layers mask what lies ``sliding_window`` positions back or
more, and Mamba2 layers run in their quadratic ("attention-like") form, the whole sequence at
once, where the engine scans token by token from a state it keeps in the block pool.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from kvtransfer.engine.config import ModelConfig
from kvtransfer.engine.model.forward_context import AttentionMetadata


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return weight * (x / torch.sqrt((x * x).mean(dim=-1, keepdim=True) + eps))


def _rope(x: torch.Tensor, theta: float) -> torch.Tensor:
    """x: [heads, n, d]; rotate pair (i, i + d/2) of position p by p / theta^(2i/d)."""
    _, n, d = x.shape
    half = d // 2
    inv_freq = torch.tensor([theta ** (-2 * i / d) for i in range(half)], dtype=x.dtype)
    angles = torch.arange(n, dtype=x.dtype)[:, None] * inv_freq[None, :]  # [n, half]
    cos, sin = angles.cos(), angles.sin()
    first, second = x[..., :half], x[..., half:]
    return torch.cat((first * cos - second * sin, second * cos + first * sin), dim=-1)


def _linear(
    w: dict[str, torch.Tensor], name: str, x: torch.Tensor, with_bias: bool = True
) -> torch.Tensor:
    out = x @ w[f"{name}.weight"].T
    bias = w.get(f"{name}.bias")
    return out + bias if with_bias and bias is not None else out


def dense_logits(
    config: ModelConfig,
    weights: dict[str, torch.Tensor],
    token_ids: Sequence[int],
    dtype: torch.dtype = torch.float64,
) -> torch.Tensor:
    """float32 logits ``[len(token_ids), vocab_size]``: row ``t`` predicts token ``t + 1``."""
    w = {name: tensor.detach().to("cpu", dtype) for name, tensor in weights.items()}
    n = len(token_ids)
    heads, kv_heads, d = config.num_attention_heads, config.num_key_value_heads, config.head_dim
    group = heads // kv_heads
    eps = config.rms_norm_eps
    causal = torch.ones(n, n, dtype=torch.bool).tril()
    window = config.sliding_window or n
    sliding = causal & ~torch.ones(n, n, dtype=torch.bool).tril(-window)

    x = w["model.embed_tokens.weight"][torch.tensor(list(token_ids), dtype=torch.long)]
    for layer in range(config.num_hidden_layers):
        p = f"model.layers.{layer}"
        h = _rms_norm(x, w[f"{p}.input_layernorm.weight"], eps)
        kind = config.layer_types[layer] if config.layer_types else "full_attention"
        if kind == "mamba":
            x = x + _mamba_quadratic(config, w, f"{p}.mamba", h)
            x = _mlp(w, p, x, eps)
            continue
        mask = sliding if kind == "sliding_attention" else causal
        q = _linear(w, f"{p}.self_attn.q_proj", h).view(n, heads, d).transpose(0, 1)
        k = _linear(w, f"{p}.self_attn.k_proj", h).view(n, kv_heads, d).transpose(0, 1)
        v = _linear(w, f"{p}.self_attn.v_proj", h).view(n, kv_heads, d).transpose(0, 1)
        q, k = _rope(q, config.rope_theta), _rope(k, config.rope_theta)
        head_outputs = []
        for head in range(heads):
            kv = head // group
            scores = (q[head] @ k[kv].T) / math.sqrt(d)
            scores = scores.masked_fill(~mask, float("-inf"))
            head_outputs.append(torch.softmax(scores, dim=-1) @ v[kv])
        attn = torch.cat(head_outputs, dim=-1)  # [n, heads * d], head-major like HF
        x = x + _linear(w, f"{p}.self_attn.o_proj", attn)
        x = _mlp(w, p, x, eps)
    x = _rms_norm(x, w["model.norm.weight"], eps)
    head = w["model.embed_tokens.weight"] if config.tie_word_embeddings else w["lm_head.weight"]
    return (x @ head.T).float()


def _mlp(w: dict[str, torch.Tensor], p: str, x: torch.Tensor, eps: float) -> torch.Tensor:
    h = _rms_norm(x, w[f"{p}.post_attention_layernorm.weight"], eps)
    gate = _linear(w, f"{p}.mlp.gate_proj", h)
    up = _linear(w, f"{p}.mlp.up_proj", h)
    return x + _linear(w, f"{p}.mlp.down_proj", gate * torch.sigmoid(gate) * up)


def _mamba_quadratic(
    config: ModelConfig, w: dict[str, torch.Tensor], p: str, h: torch.Tensor
) -> torch.Tensor:
    """A Mamba2 mixer over the whole sequence: y_t = sum over s <= t of
    (C_t . B_s) exp(sum_{s<r<=t} dt_r A) dt_s x_s, plus D x_t."""
    n = h.shape[0]
    heads, dim, state = config.mamba_num_heads, config.mamba_head_dim, config.mamba_state_size
    inner, channels = heads * dim, heads * (dim + 2 * state)
    z, xbc, dt = (h @ w[f"{p}.in_proj.weight"].T).split((inner, channels, heads), dim=-1)
    kernel = w[f"{p}.conv1d.weight"]  # [channels, K]
    padded = torch.cat((torch.zeros(kernel.shape[1] - 1, channels, dtype=h.dtype), xbc))
    conv = w[f"{p}.conv1d.bias"] + torch.stack(
        [(padded[t : t + kernel.shape[1]] * kernel.T).sum(0) for t in range(n)]
    )
    xbc = conv * torch.sigmoid(conv)
    x, b, c = xbc.split((inner, heads * state, heads * state), dim=-1)
    x = x.view(n, heads, dim)
    b, c = b.view(n, heads, state), c.view(n, heads, state)
    dt = torch.nn.functional.softplus(dt + w[f"{p}.dt_bias"])  # [n, heads]
    total = torch.cumsum(dt * -torch.exp(w[f"{p}.A_log"]), dim=0)  # [n, heads]
    lower = torch.ones(n, n, dtype=torch.bool).tril()[:, :, None]
    decay = torch.exp((total[:, None, :] - total[None, :, :]).masked_fill(~lower, -math.inf))
    weights = torch.einsum("thn,shn->tsh", c, b) * decay * dt[None, :, :]
    y = torch.einsum("tsh,shp->thp", weights, x) + w[f"{p}.D"][None, :, None] * x
    gated = y.reshape(n, inner) * (z * torch.sigmoid(z))
    gated = gated.view(n, heads, dim)
    gated = gated / torch.sqrt((gated * gated).mean(-1, keepdim=True) + config.rms_norm_eps)
    gated = gated.reshape(n, inner) * w[f"{p}.norm.weight"]
    return gated @ w[f"{p}.out_proj.weight"].T


@dataclass(frozen=True)
class SeqChunk:
    """One sequence in a paged step: ``token_ids`` is its whole context after the step, of which
    the first ``num_computed`` already have KV in the cache; ``block_ids`` is its block table."""

    token_ids: Sequence[int]
    num_computed: int
    block_ids: Sequence[int]


@dataclass(frozen=True)
class PagedStep:
    input_ids: torch.Tensor
    positions: torch.Tensor
    attn_metadata: AttentionMetadata
    # (sequence index, position) of every row, in row order.
    rows: tuple[tuple[int, int], ...]


def paged_step(
    chunks: Sequence[SeqChunk], block_size: int, device: str | torch.device = "cpu"
) -> PagedStep:
    """The flattened inputs that compute ``token_ids[num_computed:]`` of every chunk."""
    input_ids: list[int] = []
    positions: list[int] = []
    slots: list[int] = []
    starts = [0]
    rows: list[tuple[int, int]] = []
    width = max(len(c.block_ids) for c in chunks)
    tables = []
    for index, chunk in enumerate(chunks):
        if len(chunk.block_ids) * block_size < len(chunk.token_ids):
            raise ValueError(f"chunk {index} has too few blocks for {len(chunk.token_ids)} tokens")
        for pos in range(chunk.num_computed, len(chunk.token_ids)):
            input_ids.append(chunk.token_ids[pos])
            positions.append(pos)
            slots.append(chunk.block_ids[pos // block_size] * block_size + pos % block_size)
            rows.append((index, pos))
        starts.append(len(input_ids))
        tables.append(list(chunk.block_ids) + [0] * (width - len(chunk.block_ids)))

    def tensor(values: list[int] | list[list[int]]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.int64, device=device)

    metadata = AttentionMetadata(
        slot_mapping=tensor(slots),
        query_start_loc=tensor(starts),
        seq_lens=tensor([len(c.token_ids) for c in chunks]),
        block_tables=tensor(tables),
        block_size=block_size,
    )
    return PagedStep(tensor(input_ids), tensor(positions), metadata, tuple(rows))
