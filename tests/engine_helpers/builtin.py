"""Engines on the tiny built-in model, as every P/D engine test builds them: the prompts,
sampling parameters, an `EngineConfig` builder, the colocated reference, and a worker's caches.

The connector-specific pieces (its `KVTransferConfig`, how a prefill ends) stay with the
connector's helpers: `ucx_helpers.engines`, `shared_storage_helpers.engines`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

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
REMOTE_DECODE = {"do_remote_decode": True}


def engine_config(kv: KVTransferConfig | None = None, **overrides: Any) -> EngineConfig:
    fields: dict[str, Any] = {
        "model": "builtin",
        "block_size": BLOCK_SIZE,
        "num_kv_blocks": 64,
        "kv_transfer_config": kv,
    }
    fields.update(overrides)
    return EngineConfig(**fields)


def finish(*cores: EngineCore) -> None:
    """Run each engine dry and check it leaks no block or request."""
    for core in cores:
        core.drain()
        core.check_no_leaks()


def colocated(prompts: Sequence[list[int]], **overrides: Any) -> list[RequestOutput]:
    """A plain engine's greedy outputs: what every disaggregated run must reproduce."""
    with LLM(engine_config(**overrides)) as llm:
        outputs = llm.generate(list(prompts), DECODE)
        finish(llm.engine)
    return outputs


def colocated_tokens(prompts: Sequence[list[int]], **overrides: Any) -> list[list[int]]:
    """The token ids of `colocated`."""
    return [output.token_ids for output in colocated(prompts, **overrides)]


def worker_caches(core: EngineCore) -> dict[str, torch.Tensor]:
    """Every KV layer of a single-process engine's worker, drafter layers included."""
    runner = core.executor._worker.runner
    caches = dict(zip(runner.model.layer_names(), runner.kv_caches, strict=True))
    drafter = getattr(runner.proposer, "drafter", None)
    if drafter is not None:
        caches.update(zip(drafter.layer_names(), runner.proposer.kv_caches, strict=True))
    return caches
