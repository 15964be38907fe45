"""`SharedStorageConnector` engines on the tiny built-in model (the rest: `engine_helpers.builtin`)
and the producer's files."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from engine_helpers.builtin import DECODE, PREFILL, REMOTE_DECODE, finish
from safetensors import safe_open

from kvtransfer.connector.config import KVTransferConfig
from kvtransfer.engine.llm import LLM, RequestOutput


def kv_config(
    root: Path, role: str, engine_id: str, policy: str = "fail", **extra: Any
) -> KVTransferConfig:
    return KVTransferConfig(
        kv_connector="SharedStorageConnector",
        kv_role=role,
        engine_id=engine_id,
        kv_load_failure_policy=policy,
        kv_connector_extra_config={"shared_storage_path": str(root), **extra},
    )


def prefill(llm: LLM, prompts: Sequence[list[int]]) -> list[RequestOutput]:
    """Run ``prompts`` on a producer for one token each and wait until their KV is saved."""
    outputs = llm.generate(list(prompts), PREFILL, [REMOTE_DECODE] * len(prompts))
    finish(llm.engine)
    return outputs


def decode(
    llm: LLM, prompts: Sequence[list[int]], params: Sequence[dict[str, Any] | None]
) -> list[RequestOutput]:
    outputs = llm.generate(list(prompts), DECODE, list(params))
    finish(llm.engine)
    return outputs


def read_file(path: Path) -> tuple[dict[str, str], dict[str, torch.Tensor]]:
    """A producer file's metadata and tensors."""
    with safe_open(str(path), framework="pt", device="cpu") as handle:
        return handle.metadata(), {key: handle.get_tensor(key) for key in handle.keys()}  # noqa: SIM118
