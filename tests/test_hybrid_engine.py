"""Our engine's hybrid models in one process: sliding-window layers equal transformers' logits,
Mamba2 layers carrying their state in the block pool equal the dense reference's quadratic form,
HF configs name their layer kinds, and the block pool gives back what a window passed and holds
one block of state per request."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from engine_helpers.dense_reference import SeqChunk, dense_logits, paged_step

from kvtransfer.engine.config import NULL_BLOCK_ID, ModelConfig
from kvtransfer.engine.model.builtin import (
    builtin_model_config,
    builtin_weights,
    write_builtin_model,
)
from kvtransfer.engine.model.loader import load_model, model_config_from_hf
from kvtransfer.engine.sampling_params import SamplingParams
from kvtransfer.engine.scheduler.block_manager import BlockManager
from kvtransfer.engine.scheduler.request import Request

pytestmark = pytest.mark.unit

BLOCK = 4


def _logits(model, tokens: list[int], full: list[int], window: list[int]) -> torch.Tensor:
    caches = [torch.zeros(model.kv_cache_shape(64, BLOCK)) for _ in model.layer_names()]
    out = []
    for start, end in ((0, 33), (33, 50), (50, len(tokens))):
        steps = [paged_step([SeqChunk(tokens[:end], start, t)], BLOCK) for t in (full, window)]
        hidden = model(
            steps[0].input_ids, steps[0].positions, caches, [s.attn_metadata for s in steps]
        )
        out.append(model.compute_logits(hidden))
    return torch.cat(out)


def test_tiny_hybrid_logits_equal_transformers(tmp_path):
    transformers = pytest.importorskip("transformers")
    directory = write_builtin_model(tmp_path / "hybrid", "tiny-hybrid")
    hf = transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32)
    assert hf.config.layer_types == ["sliding_attention", "full_attention"] * 2
    tokens = list(range(40, 110))
    with torch.no_grad():
        expected = hf(torch.tensor([tokens])).logits[0]
        model = load_model(str(directory))
        # Each group its own blocks, chunked across the window's edge.
        ours = _logits(model, tokens, list(range(1, 19)), list(range(40, 58)))
    torch.testing.assert_close(ours, expected, atol=1e-4, rtol=0)
    # The control: the same weights with full attention everywhere differ past the window.
    dense = ModelConfig(**{**model.config.__dict__, "layer_types": (), "sliding_window": None})
    assert not torch.allclose(
        _dense_logits(dense, directory, tokens), expected[-1:], atol=1e-3, rtol=0
    )


def _dense_logits(config: ModelConfig, directory, tokens: list[int]) -> torch.Tensor:
    from kvtransfer.engine.model.llama import LlamaForCausalLM
    from kvtransfer.engine.model.loader import iter_weights

    model = LlamaForCausalLM(config)
    model.load_weights(iter_weights(str(directory)))
    caches = [torch.zeros(model.kv_cache_shape(32, BLOCK)) for _ in model.layer_names()]
    step = paged_step([SeqChunk(tokens, 0, list(range(1, 19)))], BLOCK)
    with torch.no_grad():
        hidden = model(step.input_ids, step.positions, caches, step.attn_metadata)
        return model.compute_logits(hidden)[-1:]


def test_hf_configs_name_their_layer_kinds():
    base = {
        "architectures": ["Qwen2ForCausalLM"],
        "vocab_size": 300,
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": 4,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "sliding_window": 16,
        "max_position_embeddings": 512,
    }
    assert model_config_from_hf(base).layer_types == ()  # use_sliding_window off
    mixed = model_config_from_hf({**base, "use_sliding_window": True, "max_window_layers": 2})
    assert mixed.layer_types == ("full_attention",) * 2 + ("sliding_attention",) * 2
    assert (mixed.sliding_window, mixed.is_hybrid, mixed.num_kv_groups) == (16, True, 2)
    every = model_config_from_hf({**base, "use_sliding_window": True, "max_window_layers": 0})
    assert (every.layer_types, every.max_position_embeddings) == ((), 16)
    with pytest.raises(ValueError, match="4 layers"):
        model_config_from_hf({**base, "use_sliding_window": True, "layer_types": ["x"]})


def _request(rid: str, num_tokens: int) -> Request:
    return Request(rid, list(range(num_tokens)), SamplingParams(max_tokens=4), seed=0)


def test_the_pool_gives_back_what_a_window_passed_and_rewinds():
    bm = BlockManager(16, BLOCK, extra_groups=(6,))
    assert (bm.capacity, bm.num_free_blocks) == (15, 15)
    request = _request("a", 14)
    bm.allocate_slots(request, 14)
    full, window = bm.get_group_block_ids("a")
    assert len(full) == len(window) == 4 and NULL_BLOCK_ID not in full + window
    assert bm.num_free_blocks == 7
    # The query at 14 sees 9..14; one position more (8) is kept: blocks 0 and 1 go back.
    assert bm.release_out_of_window("a", 14) == 2
    assert bm.get_group_block_ids("a")[1][:2] == [NULL_BLOCK_ID] * 2
    assert bm.num_free_blocks == 9
    assert bm.take_untold_blocks("a")[1][:2] == (NULL_BLOCK_ID,) * 2
    # A recompute from 0 needs every window entry back.
    assert bm.rewind("a", 0) == 0
    assert NULL_BLOCK_ID not in bm.get_group_block_ids("a")[1]
    assert bm.num_free_blocks == 7
    bm.free("a")
    bm.check_no_leaks()
    # Both groups count against the pool: 8 tokens take 2 blocks in each.
    assert bm.blocks_needed(8) == 4


def _paged_hybrid_logits(name: str, tokens: list[int], drop_state: bool = False) -> torch.Tensor:
    """``tokens`` in three chunks through the paged model, each group its own blocks (a Mamba
    group: one state block); ``drop_state`` zeroes the state pages between chunks."""
    model = load_model(f"builtin:{name}")
    specs = model.layer_caches(64, BLOCK).values()
    caches = [torch.zeros(shape, dtype=dtype or torch.float32) for shape, dtype in specs]
    tables = (list(range(1, 19)), [60] if name == "tiny-mamba" else list(range(40, 58)))
    out = []
    with torch.no_grad():
        for start, end in ((0, 33), (33, 50), (50, len(tokens))):
            if drop_state:
                for cache in caches:
                    if cache.dtype == torch.uint8:
                        cache.zero_()
            full = paged_step([SeqChunk(tokens[:end], start, tables[0])], BLOCK)
            other = full.attn_metadata
            if name == "tiny-mamba":
                other = replace(other, block_tables=torch.tensor([tables[1]]))
            else:
                other = paged_step([SeqChunk(tokens[:end], start, tables[1])], BLOCK).attn_metadata
            hidden = model(full.input_ids, full.positions, caches, [full.attn_metadata, other])
            out.append(model.compute_logits(hidden))
    return torch.cat(out)


@pytest.mark.parametrize("name", ["tiny-mamba", "tiny-hybrid"])
def test_hybrid_presets_equal_the_dense_reference_across_chunks(name):
    """The Mamba2 state carried in its block from chunk to chunk (and the sliding window's
    mask) give the dense reference's logits, which compute Mamba2 in its quadratic form."""
    tokens = list(range(40, 110))
    expected = dense_logits(builtin_model_config(name), builtin_weights(name), tokens)
    torch.testing.assert_close(_paged_hybrid_logits(name, tokens), expected, atol=1e-4, rtol=0)
    if name == "tiny-mamba":
        # The control: a state lost between chunks changes what follows.
        lost = _paged_hybrid_logits(name, tokens, drop_state=True)
        assert not torch.allclose(lost[33:], expected[33:], atol=1e-2, rtol=0)


def test_a_state_group_holds_one_block_and_rewinds_only_to_zero():
    bm = BlockManager(16, BLOCK, extra_groups=(None,))
    request = _request("m", 30)
    bm.allocate_slots(request, 30)
    full, state = bm.get_group_block_ids("m")
    assert (len(full), len(state)) == (8, 1)
    request.num_computed_tokens = 30
    bm.allocate_slots(request, 8)
    assert [len(t) for t in bm.get_group_block_ids("m")] == [10, 1]
    assert bm.release_out_of_window("m", 38) == 0
    assert bm.num_blocks_holding("m", 0, 38) == 11
    assert bm.rewind("m", 16) == 0  # a state cannot go back to position 16: from nothing
    bm.free("m")
    bm.check_no_leaks()
    assert bm.blocks_needed(8) == 3


def test_mamba_configs_are_checked():
    base = builtin_model_config("tiny-mamba")
    with pytest.raises(ValueError, match="mamba layers need mamba_num_heads"):
        ModelConfig(**{**base.__dict__, "mamba_state_size": 0})
    with pytest.raises(ValueError, match="no full_attention layer"):
        ModelConfig(**{**base.__dict__, "layer_types": ("mamba",) * 4})
    assert base.kv_group_kinds == ("full_attention", "mamba")
    assert [base.kv_group_of_layer(i) for i in range(4)] == [1, 0, 1, 0]


def test_a_prefix_hit_needs_every_window_tail_cached():
    """A hit ends where group 0 and every window group can serve it: the window's blocks from
    there must be cached (published while held, so a window's release keeps them cached)."""
    bm = BlockManager(32, BLOCK, extra_groups=(6,))
    assert bm.enable_prefix_caching
    first = _request("a", 30)
    bm.allocate_slots(first, 30)
    first.num_computed_tokens = 30
    bm.cache_full_blocks(first, 30)
    window = bm.get_group_block_ids("a")[1]
    assert bm.release_out_of_window("a", 30) == 6  # blocks 0-5 lie before position 24
    bm.free("a")
    second = Request("b", list(range(30)) + [99] * 10, SamplingParams(max_tokens=4), seed=0)
    hits, num_local = bm.get_computed_blocks(second)
    # 7 full blocks (28 tokens); the query at 28 sees 23.., so blocks 5 and 6 of the window.
    assert num_local == 28
    assert hits[1] == [NULL_BLOCK_ID] * 5 + window[5:7]
    bm.allocate_slots(second, 12, hits)
    tables = bm.get_group_block_ids("b")
    assert tables[0][:7] == hits[0] and tables[1][:7] == hits[1]
    assert [len(t) for t in tables] == [10, 10]
    bm.free("b")
    bm.check_no_leaks()
    # Without block 6 of the window, the hit stops a block earlier (at 24 it sees 19..).
    bm.evict_blocks([window[6]])
    hits, num_local = bm.get_computed_blocks(second)
    assert num_local == 24 and hits[1] == [NULL_BLOCK_ID] * 4 + window[4:6]
    # A recurrent state is kept for the latest position only: no prefix caching with one.
    assert not BlockManager(32, BLOCK, extra_groups=(6, None)).enable_prefix_caching


def test_a_rewind_past_a_released_window_block_restarts_from_zero():
    """A recompute from position 36 would read window positions 30..35 without rewriting those
    before 36; block 7 (28..31) went back to the pool, so nothing before 36 is usable: the
    request restarts at 0 with every window entry a real block again."""
    bm = BlockManager(32, BLOCK, extra_groups=(6,))
    request = _request("r", 40)
    bm.allocate_slots(request, 40)
    assert bm.release_out_of_window("r", 40) == 8  # blocks 0-7 lie before 34
    free = bm.num_free_blocks
    assert bm.rewind("r", 40) == 40  # its window (34..39) is all there
    assert bm.num_free_blocks == free
    assert bm.rewind("r", 36) == 0
    assert NULL_BLOCK_ID not in bm.get_group_block_ids("r")[1]
    assert bm.num_free_blocks == free - 8
    bm.free("r")
    bm.check_no_leaks()
