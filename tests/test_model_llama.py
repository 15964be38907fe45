"""The paged model against the dense reference: mixed batches, hooks, pipeline stages, errors."""

from __future__ import annotations

import random

import pytest
import torch
from engine_helpers.dense_reference import SeqChunk, dense_logits, paged_step

from kvtransfer.engine.model.builtin import builtin_model_config, builtin_weights
from kvtransfer.engine.model.forward_context import AttentionMetadata
from kvtransfer.engine.model.llama import LlamaForCausalLM
from kvtransfer.engine.outputs import IntermediateTensors
from kvtransfer.engine.parallel import ParallelRank

pytestmark = pytest.mark.unit

BLOCK = 4
NUM_BLOCKS = 24
CONFIG = builtin_model_config("tiny")
WEIGHTS = builtin_weights("tiny")


def _model(rank: ParallelRank | None = None, **kwargs: object) -> LlamaForCausalLM:
    model = LlamaForCausalLM(CONFIG, rank or ParallelRank(), **kwargs)  # type: ignore[arg-type]
    model.load_weights(WEIGHTS.items())
    return model


def _caches(model: LlamaForCausalLM) -> list[torch.Tensor]:
    return [torch.zeros(model.kv_cache_shape(NUM_BLOCKS, BLOCK)) for _ in model.layer_names()]


def _tokens(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(CONFIG.vocab_size) for _ in range(n)]


def _logits(model: LlamaForCausalLM, caches: list[torch.Tensor], chunks: list[SeqChunk]):
    step = paged_step(chunks, BLOCK)
    hidden = model(step.input_ids, step.positions, caches, step.attn_metadata)
    return model.compute_logits(hidden), step.rows


def _two_steps() -> tuple[list[SeqChunk], list[SeqChunk]]:
    """Step 1 starts three sequences; step 2 mixes a fresh full prefill, the second chunk of a
    chunked prefill, a decode and a 4-token speculative verification, on shuffled blocks."""
    blocks = list(range(NUM_BLOCKS))
    random.Random(7).shuffle(blocks)
    chunked, decode, verify, fresh = (_tokens(s, n) for s, n in ((1, 13), (2, 10), (3, 9), (4, 11)))
    tables = [blocks[0:4], blocks[4:7], blocks[7:10], blocks[10:13]]
    step1 = [
        SeqChunk(chunked[:7], 0, tables[0]),
        SeqChunk(decode[:9], 0, tables[1]),
        SeqChunk(verify[:5], 0, tables[2]),
    ]
    step2 = [
        SeqChunk(fresh, 0, tables[3]),
        SeqChunk(chunked, 7, tables[0]),
        SeqChunk(decode, 9, tables[1]),
        SeqChunk(verify, 5, tables[2]),
    ]
    return step1, step2


def _expected(chunks: list[SeqChunk], rows: tuple[tuple[int, int], ...]) -> torch.Tensor:
    dense = [dense_logits(CONFIG, WEIGHTS, c.token_ids) for c in chunks]
    return torch.stack([dense[seq][pos] for seq, pos in rows])


def test_mixed_batch_on_shuffled_blocks_matches_dense_reference():
    model = _model()
    caches = _caches(model)
    step1, step2 = _two_steps()
    logits1, rows1 = _logits(model, caches, step1)
    logits2, rows2 = _logits(model, caches, step2)
    assert logits1.dtype == torch.float32
    assert logits2.shape == (11 + 6 + 1 + 4, CONFIG.vocab_size)
    torch.testing.assert_close(logits1, _expected(step1, rows1), atol=1e-4, rtol=0)
    torch.testing.assert_close(logits2, _expected(step2, rows2), atol=1e-4, rtol=0)


@pytest.mark.parametrize("pp_size", [2, 4])
def test_pipeline_stages_in_sequence_equal_the_whole_model(pp_size):
    whole = _model()
    whole_caches = _caches(whole)
    stages = [_model(ParallelRank(pp_rank=r, pp_size=pp_size)) for r in range(pp_size)]
    stage_caches = [_caches(stage) for stage in stages]
    assert [stage.layer_range for stage in stages] == [
        (r * 4 // pp_size, (r + 1) * 4 // pp_size) for r in range(pp_size)
    ]
    for chunks in _two_steps():
        expected, _ = _logits(whole, whole_caches, chunks)
        step = paged_step(chunks, BLOCK)
        out: torch.Tensor | IntermediateTensors | None = None
        for stage, caches in zip(stages, stage_caches, strict=True):
            out = stage(
                step.input_ids if stage.rank.is_first_pp_rank else None,
                step.positions,
                caches,
                step.attn_metadata,
                intermediate_tensors=out if isinstance(out, IntermediateTensors) else None,
            )
            if not stage.rank.is_last_pp_rank:
                assert isinstance(out, IntermediateTensors)
                assert sorted(out) == ["hidden_states", "residual"]
                assert out["hidden_states"].shape == (len(step.rows), CONFIG.hidden_size)
        assert isinstance(out, torch.Tensor)
        torch.testing.assert_close(stages[-1].compute_logits(out), expected, atol=1e-6, rtol=0)
    # Each stage's caches are the whole model's caches of its layers.
    flat = [cache for caches in stage_caches for cache in caches]
    for mine, theirs in zip(flat, whole_caches, strict=True):
        torch.testing.assert_close(mine, theirs, atol=1e-6, rtol=0)


class _RecordingHooks:
    def __init__(self, caches: list[torch.Tensor]) -> None:
        self.calls: list[tuple[str, str]] = []
        self.caches = caches

    def before_attention(self, layer_name: str) -> None:
        self.calls.append(("before", layer_name))

    def after_attention(
        self, layer_name: str, kv_cache: torch.Tensor, attn_metadata: AttentionMetadata
    ) -> None:
        index = int(layer_name.split(".")[2]) - 2  # pp rank 1 of 2 owns layers 2 and 3
        assert kv_cache is self.caches[index]
        slots = attn_metadata.slot_mapping
        # This step's K/V is already in the cache when the hook runs.
        assert kv_cache[slots // BLOCK, 0, :, slots % BLOCK].ne(0).all()
        self.calls.append(("after", layer_name))


def test_hooks_wrap_every_owned_layer_in_order_with_its_cache():
    model = _model(ParallelRank(pp_rank=1, pp_size=2), layer_name_prefix="draft.layers")
    caches = _caches(model)
    hooks = _RecordingHooks(caches)
    step = paged_step([SeqChunk(_tokens(0, 5), 0, [3, 1])], BLOCK)
    hidden = torch.randn(5, CONFIG.hidden_size)
    model(
        None,
        step.positions,
        caches,
        step.attn_metadata,
        hooks=hooks,
        intermediate_tensors=IntermediateTensors({"hidden_states": hidden, "residual": hidden}),
    )
    assert model.layer_names() == ["draft.layers.2.self_attn", "draft.layers.3.self_attn"]
    assert hooks.calls == [
        ("before", "draft.layers.2.self_attn"),
        ("after", "draft.layers.2.self_attn"),
        ("before", "draft.layers.3.self_attn"),
        ("after", "draft.layers.3.self_attn"),
    ]


class _LoadingHooks:
    """Plays a connector that fills each layer's prefix blocks in ``before_attention``."""

    def __init__(self, source: list[torch.Tensor], target: list[torch.Tensor], blocks: list[int]):
        self.source, self.target, self.blocks = source, target, blocks

    def before_attention(self, layer_name: str) -> None:
        index = int(layer_name.split(".")[2])
        self.target[index][self.blocks] = self.source[index][self.blocks]

    def after_attention(self, layer_name: str, kv_cache: torch.Tensor, attn_metadata) -> None:
        pass


def test_kv_loaded_by_before_attention_is_attended_to():
    model = _model()
    tokens = _tokens(5, 12)
    prefilled = _caches(model)
    _logits(model, prefilled, [SeqChunk(tokens[:8], 0, [5, 2])])
    empty = _caches(model)
    step = paged_step([SeqChunk(tokens, 8, [5, 2, 9])], BLOCK)
    hidden = model(
        step.input_ids,
        step.positions,
        empty,
        step.attn_metadata,
        hooks=_LoadingHooks(prefilled, empty, [5, 2]),
    )
    expected = dense_logits(CONFIG, WEIGHTS, tokens)[8:]
    torch.testing.assert_close(model.compute_logits(hidden), expected, atol=1e-4, rtol=0)


def test_bfloat16_model_stays_close_to_the_reference():
    model = _model(dtype=torch.bfloat16)
    tokens = _tokens(9, 10)
    caches = [c.to(torch.bfloat16) for c in _caches(model)]
    logits, _ = _logits(model, caches, [SeqChunk(tokens, 0, [0, 1, 2])])
    expected = dense_logits(CONFIG, WEIGHTS, tokens)
    assert logits.dtype == torch.float32
    assert (logits - expected).abs().max() < 0.5
    assert (logits.argmax(-1) == expected.argmax(-1)).float().mean() >= 0.8


def test_shapes_and_names_of_a_tensor_parallel_shard():
    model = LlamaForCausalLM(CONFIG, ParallelRank(tp_rank=3, tp_size=4, pp_rank=0, pp_size=2))
    assert model.layer_range == (0, 2)
    assert model.num_local_kv_heads == 1
    assert model.kv_cache_shape(10, 16) == (10, 2, 1, 16, 16)
    assert model.layer_names() == ["model.layers.0.self_attn", "model.layers.1.self_attn"]
    with pytest.raises(ValueError, match="compute_logits needs the last pipeline rank"):
        model.compute_logits(torch.zeros(1, CONFIG.hidden_size))
    with pytest.raises(ValueError, match="num_blocks and block_size must be >= 1, got 0, 16"):
        model.kv_cache_shape(0, 16)


def test_rejects_splits_the_config_cannot_take():
    from dataclasses import replace

    with pytest.raises(
        ValueError,
        match=r"num_attention_heads \(6\) must be divisible by tensor parallel size 4",
    ):
        LlamaForCausalLM(
            replace(CONFIG, num_attention_heads=6, num_key_value_heads=2),
            ParallelRank(tp_size=4),
        )
    with pytest.raises(
        ValueError, match=r"intermediate_size \(130\) must be divisible by tensor parallel size 4"
    ):
        LlamaForCausalLM(replace(CONFIG, intermediate_size=130), ParallelRank(tp_size=4))
    with pytest.raises(ValueError, match=r"tp_size \(4\) must divide total_num_kv_heads \(3\)"):
        LlamaForCausalLM(
            replace(CONFIG, num_attention_heads=12, num_key_value_heads=3),
            ParallelRank(tp_size=4),
        )
    with pytest.raises(ValueError, match="cannot split 4 layers over 8 pipeline stages"):
        LlamaForCausalLM(CONFIG, ParallelRank(pp_size=8))


def test_forward_rejects_inputs_that_do_not_fit():
    first = _model(ParallelRank(pp_size=2))
    second = _model(ParallelRank(pp_rank=1, pp_size=2))
    step = paged_step([SeqChunk([1, 2, 3], 0, [0])], BLOCK)
    args = (step.positions, _caches(first), step.attn_metadata)
    with pytest.raises(ValueError, match="the first pipeline rank needs input_ids"):
        first(None, *args)
    with pytest.raises(ValueError, match="pipeline rank 1 needs intermediate_tensors"):
        second(None, *args)
    with pytest.raises(ValueError, match=r"got 1 KV caches for 2 layers 0\.\.1"):
        first(step.input_ids, step.positions, args[1][:1], step.attn_metadata)
    with pytest.raises(ValueError, match=r"positions has shape \(2,\), expected \(3,\)"):
        first(step.input_ids, step.positions[:2], args[1], step.attn_metadata)
