"""Tensor- and pipeline-parallel shards, run as real gloo processes, equal the unsharded model.

One spawn of four processes runs three layouts in turn: TP=4; TP=2 twice (ranks 0-1 and 2-3);
and TP=2 x PP=2 (ranks 0-1 the first stage, 2-3 the second, activations sent rank r -> r+2).
Each rank saves its logits and KV caches; the test compares them with one in-process model.
"""

from __future__ import annotations

import random
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from engine_helpers.dense_reference import SeqChunk, paged_step

from kvtransfer.connector.topology import kv_head_range
from kvtransfer.engine.model.builtin import builtin_model_config, builtin_weights
from kvtransfer.engine.model.llama import LlamaForCausalLM
from kvtransfer.engine.outputs import IntermediateTensors
from kvtransfer.engine.parallel import ParallelRank

pytestmark = pytest.mark.integration

BLOCK = 4
NUM_BLOCKS = 16
WORLD = 4
CONFIG = builtin_model_config("tiny")


def _steps() -> list[list[SeqChunk]]:
    """A prefill step, then a step mixing a chunked prefill, a decode and a new prefill."""
    rng = random.Random(11)
    a, b, c = ([rng.randrange(256) for _ in range(n)] for n in (10, 7, 9))
    blocks = list(range(NUM_BLOCKS))
    rng.shuffle(blocks)
    ta, tb, tc = blocks[0:3], blocks[3:5], blocks[5:8]
    return [
        [SeqChunk(a[:6], 0, ta), SeqChunk(b[:6], 0, tb)],
        [SeqChunk(a, 6, ta), SeqChunk(b, 6, tb), SeqChunk(c, 0, tc)],
    ]


def _build(rank: ParallelRank, group: dist.ProcessGroup | None) -> LlamaForCausalLM:
    def all_reduce(tensor: torch.Tensor) -> torch.Tensor:
        dist.all_reduce(tensor, group=group)
        return tensor

    model = LlamaForCausalLM(CONFIG, rank, all_reduce if group is not None else None)
    model.load_weights(builtin_weights("tiny").items())
    return model


def _caches(model: LlamaForCausalLM) -> list[torch.Tensor]:
    return [torch.zeros(model.kv_cache_shape(NUM_BLOCKS, BLOCK)) for _ in model.layer_names()]


def _run_tp(model: LlamaForCausalLM) -> dict[str, object]:
    caches = _caches(model)
    logits = []
    for chunks in _steps():
        step = paged_step(chunks, BLOCK)
        hidden = model(step.input_ids, step.positions, caches, step.attn_metadata)
        logits.append(model.compute_logits(hidden))
    return {"logits": logits, "caches": caches}


def _run_tp2_pp2(model: LlamaForCausalLM, peer: int) -> dict[str, object]:
    caches = _caches(model)
    logits = []
    for chunks in _steps():
        step = paged_step(chunks, BLOCK)
        shape = (step.input_ids.shape[0], CONFIG.hidden_size)
        if model.rank.is_first_pp_rank:
            out = model(step.input_ids, step.positions, caches, step.attn_metadata)
            assert isinstance(out, IntermediateTensors)
            for name in ("hidden_states", "residual"):
                dist.send(out[name].contiguous(), dst=peer)
        else:
            received = IntermediateTensors({})
            for name in ("hidden_states", "residual"):
                received[name] = torch.empty(shape)
                dist.recv(received[name], src=peer)
            hidden = model(
                None, step.positions, caches, step.attn_metadata, intermediate_tensors=received
            )
            logits.append(model.compute_logits(hidden))
    return {"logits": logits, "caches": caches}


def _worker(rank: int, init_file: str, out_dir: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"file://{init_file}",
        rank=rank,
        world_size=WORLD,
        timeout=timedelta(seconds=120),
    )
    # Every rank creates every group, in the same order.
    pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    pair = pairs[rank // 2]
    results = {
        "tp4": _run_tp(_build(ParallelRank(tp_rank=rank, tp_size=4), dist.group.WORLD)),
        "tp2": _run_tp(_build(ParallelRank(tp_rank=rank % 2, tp_size=2), pair)),
    }
    staged = ParallelRank(tp_rank=rank % 2, tp_size=2, pp_rank=rank // 2, pp_size=2)
    results["tp2pp2"] = _run_tp2_pp2(_build(staged, pair), peer=(rank + 2) % WORLD)
    torch.save(results, Path(out_dir) / f"rank{rank}.pt")
    dist.destroy_process_group()


def _reference() -> dict[str, object]:
    return _run_tp(_build(ParallelRank(), None))


def test_tp_and_pp_shards_in_gloo_processes_equal_the_unsharded_model(tmp_path):
    mp.spawn(_worker, args=(str(tmp_path / "init"), str(tmp_path)), nprocs=WORLD, join=True)
    results = [torch.load(tmp_path / f"rank{r}.pt") for r in range(WORLD)]
    ref = _reference()
    heads = CONFIG.num_key_value_heads

    def check(logits: list[torch.Tensor]) -> None:
        for mine, theirs in zip(logits, ref["logits"], strict=True):  # type: ignore[call-overload]
            torch.testing.assert_close(mine, theirs, atol=1e-5, rtol=0)

    def check_caches(caches: list[torch.Tensor], layers: range, tp_rank: int, tp: int) -> None:
        owned = kv_head_range(tp_rank, tp, heads)
        full = ref["caches"]
        assert len(caches) == len(layers)
        for cache, layer in zip(caches, layers, strict=True):
            expected = full[layer][:, :, owned.start : owned.stop]  # type: ignore[index]
            torch.testing.assert_close(cache, expected, atol=1e-5, rtol=0)

    for rank, result in enumerate(results):
        for layout, tp in (("tp4", 4), ("tp2", 2)):
            check(result[layout]["logits"])
            check_caches(result[layout]["caches"], range(4), rank % tp, tp)
        staged = result["tp2pp2"]
        check_caches(staged["caches"], range(0, 2) if rank < 2 else range(2, 4), rank % 2, 2)
        if rank >= 2:
            check(staged["logits"])
        else:
            assert staged["logits"] == []
