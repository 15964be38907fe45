"""`Mamba2Mixer`: a Mamba2 layer (state-space duality form, one B/C group per head) whose running
state lives in the paged block pool, one block per request, as vLLM keeps Mamba state.

Per token ``t`` of a sequence, with ``x``, ``B``, ``C`` from a causal depthwise convolution
(kernel ``K``) over the input projection and ``dt = softplus(dt_raw + dt_bias)`` per head::

    h_t = exp(dt_t * A) * h_{t-1} + dt_t * x_t (outer) B_t        A = -exp(A_log), per head
    y_t = h_t . C_t + D * x_t

then ``y * silu(z)`` is RMS-normed per head and projected out. The state a request carries from
one step to the next is the convolution's last ``K - 1`` inputs and ``h``: both live in the
request's block of the layer's cache, as float32, laid out per head so that a tensor-parallel
split of the state is a split of the page's head axis, as for attention KV: the cache is
``[num_blocks, 2, heads, 1, unit_bytes]`` uint8, where ``[b, 0, h]`` holds head ``h``'s
convolution window (its x, B and C channels, ``K - 1`` rows) and ``[b, 1, h]`` its SSM state
(``head_dim x state_size``), each padded to ``unit_bytes``. A sequence whose chunk starts at
position 0 starts from a zero state, whatever its block held.

Tensor parallel ranks split the heads (x, z, dt, B and C follow their head); ``out_proj`` is
row-parallel. The scan is a loop over tokens: exact, not fast.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from kvtransfer.engine.config import ModelConfig
from kvtransfer.engine.model.forward_context import AttentionMetadata

AllReduce = Callable[[torch.Tensor], torch.Tensor]
_STATE_DTYPE = torch.float32
# A mixer's checkpoint tensors, named after ``model.layers.<i>.mamba.``.
MAMBA_TENSORS = (
    "in_proj.weight",
    "conv1d.weight",
    "conv1d.bias",
    "dt_bias",
    "A_log",
    "D",
    "norm.weight",
    "out_proj.weight",
)


def mamba_unit_bytes(config: ModelConfig) -> int:
    """Bytes of one head's half page: its convolution window or its SSM state, the larger."""
    k, p, n = config.mamba_conv_kernel, config.mamba_head_dim, config.mamba_state_size
    element = torch.empty((), dtype=_STATE_DTYPE).element_size()
    return max((k - 1) * (p + 2 * n), p * n) * element


def mamba_state_bytes(config: ModelConfig, num_heads: int) -> int:
    """Bytes of one request's state page in one layer holding ``num_heads`` heads."""
    return 2 * num_heads * mamba_unit_bytes(config)


def mamba_cache_shape(config: ModelConfig, num_heads: int, num_blocks: int) -> tuple[int, ...]:
    return (num_blocks, 2, num_heads, 1, mamba_unit_bytes(config))


class Mamba2Mixer(nn.Module):
    def __init__(
        self,
        config: ModelConfig,
        heads: range,
        all_reduce: AllReduce,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        super().__init__()
        self.config = config
        self.heads = heads
        self.all_reduce = all_reduce
        h, p, n, k = (
            len(heads),
            config.mamba_head_dim,
            config.mamba_state_size,
            config.mamba_conv_kernel,
        )
        self.num_heads, self.head_dim, self.state_size, self.kernel = h, p, n, k
        self.inner = h * p
        self.conv_channels = self.inner + 2 * h * n
        self.eps = config.rms_norm_eps
        hidden = config.hidden_size

        def param(*shape: int) -> nn.Parameter:
            return nn.Parameter(torch.empty(shape, dtype=dtype, device=device), requires_grad=False)

        # Rows: z, then x, B, C (the convolution's channels), then dt.
        self.in_proj = param(self.inner + self.conv_channels + h, hidden)
        self.conv_weight = param(self.conv_channels, k)
        self.conv_bias = param(self.conv_channels)
        self.dt_bias = param(h)
        self.A_log = param(h)
        self.D = param(h)
        self.norm_weight = param(self.inner)
        self.out_proj = param(hidden, self.inner)

    def checkpoint_slices(self) -> dict[str, list[tuple[torch.Tensor, int, int, int]]]:
        """Per checkpoint tensor (suffix after ``mamba.``): ``(destination view, dim, start,
        stop)`` of this rank's slices of it."""
        cfg, heads = self.config, self.heads
        p, n, h = cfg.mamba_head_dim, cfg.mamba_state_size, len(heads)
        inner_full = cfg.mamba_inner_size
        bc_full = cfg.mamba_num_heads * n
        lo, hi = heads.start, heads.stop
        x_rows = (lo * p, hi * p)
        b_rows = (inner_full + lo * n, inner_full + hi * n)
        c_rows = (inner_full + bc_full + lo * n, inner_full + bc_full + hi * n)
        conv_full = cfg.mamba_conv_channels
        inner, conv = self.inner, self.conv_channels

        def conv_parts(dest: torch.Tensor, offset: int) -> list[tuple[torch.Tensor, int, int, int]]:
            """x, B and C rows of a tensor whose rows start with the conv channels at
            ``offset`` (``dest``: this rank's x, B, C rows back to back)."""
            return [
                (dest[: self.inner], 0, offset + x_rows[0], offset + x_rows[1]),
                (dest[self.inner : self.inner + h * n], 0, offset + b_rows[0], offset + b_rows[1]),
                (dest[self.inner + h * n :], 0, offset + c_rows[0], offset + c_rows[1]),
            ]

        in_proj = [
            (self.in_proj[:inner], 0, lo * p, hi * p),
            *conv_parts(self.in_proj[inner : inner + conv], inner_full),
            (
                self.in_proj[inner + conv :],
                0,
                inner_full + conv_full + lo,
                inner_full + conv_full + hi,
            ),
        ]
        return {
            "in_proj.weight": in_proj,
            "conv1d.weight": conv_parts(self.conv_weight, 0),
            "conv1d.bias": conv_parts(self.conv_bias, 0),
            "dt_bias": [(self.dt_bias, 0, lo, hi)],
            "A_log": [(self.A_log, 0, lo, hi)],
            "D": [(self.D, 0, lo, hi)],
            "norm.weight": [(self.norm_weight, 0, lo * p, hi * p)],
            "out_proj.weight": [(self.out_proj, 1, lo * p, hi * p)],
        }

    def full_shapes(self) -> dict[str, tuple[int, ...]]:
        cfg = self.config
        inner, conv, h = cfg.mamba_inner_size, cfg.mamba_conv_channels, cfg.mamba_num_heads
        return {
            "in_proj.weight": (inner + conv + h, cfg.hidden_size),
            "conv1d.weight": (conv, cfg.mamba_conv_kernel),
            "conv1d.bias": (conv,),
            "dt_bias": (h,),
            "A_log": (h,),
            "D": (h,),
            "norm.weight": (inner,),
            "out_proj.weight": (cfg.hidden_size, inner),
        }

    # -- state --------------------------------------------------------------------------------

    def _state_views(self, cache: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Per head, the conv window ``[heads, K - 1, head_dim + 2 * state]`` (x, B, C) and SSM
        state ``[heads, head_dim, state]`` stored in ``block`` (views into the cache)."""
        h, p, n, k = self.num_heads, self.head_dim, self.state_size, self.kernel
        page = cache[block, :, :, 0].view(_STATE_DTYPE)  # [2, heads, unit floats]
        conv = page[0, :, : (k - 1) * (p + 2 * n)].view(h, k - 1, p + 2 * n)
        ssm = page[1, :, : p * n].view(h, p, n)
        return conv, ssm

    def _window(self, per_head: torch.Tensor) -> torch.Tensor:
        """``[heads, K - 1, x|B|C]`` as the convolution's ``[K - 1, channels]``: every head's
        x channels, then every head's B, then every head's C."""
        p, n = self.head_dim, self.state_size
        x, b, c = per_head.split((p, n, n), dim=-1)
        return torch.cat([part.transpose(0, 1).flatten(1) for part in (x, b, c)], dim=1)

    def _per_head(self, window: torch.Tensor) -> torch.Tensor:
        """The inverse of `_window`."""
        h, p, n = self.num_heads, self.head_dim, self.state_size
        rows = window.shape[0]
        x, b, c = window.split((h * p, h * n, h * n), dim=1)
        parts = [x.view(rows, h, p), b.view(rows, h, n), c.view(rows, h, n)]
        return torch.cat(parts, dim=-1).transpose(0, 1)

    # -- forward ------------------------------------------------------------------------------

    def forward(
        self, hidden: torch.Tensor, cache: torch.Tensor, md: AttentionMetadata
    ) -> torch.Tensor:
        """``hidden`` ``[num_tokens, hidden]`` of the batch's sequences (``md``: their rows,
        context lengths and, in ``block_tables[:, 0]``, each one's state block)."""
        num_tokens = hidden.shape[0]
        proj = F.linear(hidden, self.in_proj).to(_STATE_DTYPE)
        z, xbc, dt = proj.split((self.inner, self.conv_channels, self.num_heads), dim=-1)
        dt = F.softplus(dt + self.dt_bias.to(_STATE_DTYPE))
        decay_rate = -torch.exp(self.A_log.to(_STATE_DTYPE))
        weight = self.conv_weight.to(_STATE_DTYPE)
        bias = self.conv_bias.to(_STATE_DTYPE)
        skip = self.D.to(_STATE_DTYPE)
        y = torch.zeros(num_tokens, self.inner, dtype=_STATE_DTYPE, device=hidden.device)
        starts = md.query_start_loc.to("cpu").tolist()
        seq_lens = md.seq_lens.to("cpu").tolist()
        blocks = md.block_tables[:, 0].to("cpu").tolist()
        for i in range(md.num_seqs):
            a, b = starts[i], starts[i + 1]
            if a == b:
                continue
            conv_state, ssm_state = self._state_views(cache, blocks[i])
            if seq_lens[i] == b - a:  # a chunk from position 0: a fresh state
                conv_state.zero_()
                ssm_state.zero_()
            window = torch.cat((self._window(conv_state), xbc[a:b]))  # [K - 1 + L, channels]
            length = b - a
            conv = bias + sum(window[j : j + length] * weight[:, j] for j in range(self.kernel))
            conv_state.copy_(self._per_head(window[-(self.kernel - 1) :]))
            x, bmat, cmat = F.silu(conv).split(
                (self.inner, self.num_heads * self.state_size, self.num_heads * self.state_size),
                dim=-1,
            )
            x = x.view(length, self.num_heads, self.head_dim)
            bmat = bmat.view(length, self.num_heads, self.state_size)
            cmat = cmat.view(length, self.num_heads, self.state_size)
            decay = torch.exp(dt[a:b] * decay_rate)  # [L, heads]
            state = ssm_state.clone()
            for t in range(length):
                inject = (dt[a + t][:, None] * x[t])[:, :, None] * bmat[t][:, None, :]
                state = decay[t][:, None, None] * state + inject
                out = (state * cmat[t][:, None, :]).sum(-1) + skip[:, None] * x[t]
                y[a + t] = out.reshape(-1)
            ssm_state.copy_(state)
        gated = (y * F.silu(z)).view(num_tokens, self.num_heads, self.head_dim)
        gated = gated * torch.rsqrt(gated.pow(2).mean(-1, keepdim=True) + self.eps)
        gated = gated.reshape(num_tokens, self.inner).to(hidden.dtype) * self.norm_weight
        return self.all_reduce(F.linear(gated, self.out_proj))
