"""Build producer/consumer/colocated engines on the tiny built-in model and run P/D flows."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from kvtransfer.connector.config import KVTransferConfig
from kvtransfer.engine.config import EngineConfig, SpeculativeConfig
from kvtransfer.engine.engine_core import EngineCore
from kvtransfer.engine.llm import LLM, RequestOutput
from kvtransfer.engine.sampling_params import SamplingParams

BLOCK_SIZE = 8
NUM_TOKENS = 6
PROMPTS = [
    list(range(40, 45)),  # shorter than a block
    [(7 * i) % 200 + 3 for i in range(17)],
    [(13 * i) % 250 + 1 for i in range(40)],  # exactly five blocks
    [(5 * i + 11) % 240 + 2 for i in range(70)],  # many blocks
]
DECODE = SamplingParams(max_tokens=NUM_TOKENS, ignore_eos=True)
PREFILL = SamplingParams(max_tokens=1, ignore_eos=True)
DRAFT = SpeculativeConfig(method="draft", num_speculative_tokens=3)


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


def engine_config(kv: KVTransferConfig | None = None, **overrides: Any) -> EngineConfig:
    fields: dict[str, Any] = {
        "model": "builtin",
        "block_size": BLOCK_SIZE,
        "num_kv_blocks": 64,
        "kv_transfer_config": kv,
    }
    fields.update(overrides)
    return EngineConfig(**fields)


def colocated(prompts: Sequence[list[int]], **overrides: Any) -> list[list[int]]:
    """Greedy tokens of a plain engine: what every disaggregated run must reproduce."""
    with LLM(engine_config(**overrides)) as llm:
        outputs = llm.generate(list(prompts), DECODE)
        llm.engine.drain()
        llm.engine.check_no_leaks()
    return [o.token_ids for o in outputs]


def prefill(llm: LLM, prompts: Sequence[list[int]]) -> list[RequestOutput]:
    """Run ``prompts`` on a producer for one token each and wait until their KV is saved."""
    outputs = llm.generate(list(prompts), PREFILL, [{"do_remote_decode": True}] * len(prompts))
    llm.engine.drain()
    llm.engine.check_no_leaks()
    return outputs


def decode(
    llm: LLM, prompts: Sequence[list[int]], params: Sequence[dict[str, Any] | None]
) -> list[RequestOutput]:
    outputs = llm.generate(list(prompts), DECODE, list(params))
    llm.engine.drain()
    llm.engine.check_no_leaks()
    return outputs


def worker_caches(core: EngineCore) -> dict[str, torch.Tensor]:
    """Every KV layer of a single-process engine's worker, drafter layers included."""
    runner = core.executor._worker.runner
    caches = dict(zip(runner.model.layer_names(), runner.kv_caches, strict=True))
    drafter = getattr(runner.proposer, "drafter", None)
    if drafter is not None:
        caches.update(zip(drafter.layer_names(), runner.proposer.kv_caches, strict=True))
    return caches


def read_file(path: Path) -> tuple[dict[str, str], dict[str, torch.Tensor]]:
    """A producer file's metadata and tensors."""
    with safe_open(str(path), framework="pt", device="cpu") as handle:
        return handle.metadata(), {key: handle.get_tensor(key) for key in handle.keys()}  # noqa: SIM118
