"""Small stand-ins for the engine's request and batch objects, for testing one connector alone."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch


@dataclass
class ContractRequest:
    """Satisfies `kvtransfer.KVRequest`: what scheduler-side hooks may read."""

    request_id: str
    prompt_token_ids: Sequence[int]
    kv_transfer_params: Mapping[str, Any] | None = None
    output_token_ids: list[int] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)


@dataclass
class ContractSchedulerOutput:
    """The fields of a step's batch description that connectors read."""

    num_scheduled_tokens: dict[str, int] = field(default_factory=dict)
    finished_req_ids: set[str] = field(default_factory=set)

    @property
    def total_num_scheduled_tokens(self) -> int:
        return sum(self.num_scheduled_tokens.values())


def make_request(
    request_id: str = "req-0",
    num_prompt_tokens: int = 20,
    kv_transfer_params: Mapping[str, Any] | None = None,
) -> ContractRequest:
    return ContractRequest(
        request_id=request_id,
        prompt_token_ids=list(range(1, num_prompt_tokens + 1)),
        kv_transfer_params=kv_transfer_params,
    )


def make_kv_caches(
    num_layers: int = 2,
    num_blocks: int = 8,
    num_kv_heads: int = 2,
    block_size: int = 16,
    head_dim: int = 8,
    dtype: torch.dtype = torch.float32,
    prefix: str = "model.layers",
) -> dict[str, torch.Tensor]:
    """Paged KV tensors in the engine's layout ``[num_blocks, 2, heads, block_size, head_dim]``,
    filled with distinct values so a misplaced byte shows."""
    shape = (num_blocks, 2, num_kv_heads, block_size, head_dim)
    numel = num_blocks * 2 * num_kv_heads * block_size * head_dim
    return {
        f"{prefix}.{layer}.self_attn": (torch.arange(numel, dtype=torch.float64) + layer * numel)
        .to(dtype)
        .reshape(shape)
        for layer in range(num_layers)
    }
