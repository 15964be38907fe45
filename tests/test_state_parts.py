"""`StatePart`s: how vLLM's Mamba2 and Gated DeltaNet state pages split by heads, checked
against layouts worked out by hand, and the typed refusals for parts that cannot be."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from kvtransfer.connector.kv_groups import FULL_ATTENTION, RECURRENT_STATE, KVCacheGroup
from kvtransfer.connector.state_parts import (
    StatePart,
    check_parts,
    gdn_parts,
    mamba2_parts,
    part_views,
)
from kvtransfer.integrations import vllm_state

pytestmark = pytest.mark.unit


def test_mamba2_parts_in_vllms_default_layout():
    # TP 2 of 8 heads of 4, 1 group of 16 (replicated: one per rank), kernel 4: the conv state
    # is (3 positions, 4 * 4 + 2 * 16 channels), float32; SSM (4, 4, 16) float32.
    parts = mamba2_parts((3, 48), (4, 4, 16), 4, 4, dim_first=False, tp_size=2, total_groups=1)
    assert parts == (
        StatePart("conv.x", 0, 4, 8, 16, 3, 192),
        StatePart("conv.B", 64, 1, 1, 64, 3, 192),
        StatePart("conv.C", 128, 1, 1, 64, 3, 192),
        StatePart("ssm", 576, 4, 8, 256),
    )


def test_mamba2_parts_channels_first():
    parts = mamba2_parts((48, 3), (4, 4, 16), 2, 4, dim_first=True, tp_size=2, total_groups=2)
    assert parts == (
        StatePart("conv.x", 0, 4, 8, 24),
        StatePart("conv.B", 96, 1, 2, 96),
        StatePart("conv.C", 192, 1, 2, 96),
        StatePart("ssm", 288, 4, 8, 256),
    )


def test_gdn_parts():
    # 2 key heads of 8 and 4 value heads of 4 per rank (TP 2), kernel 4, bfloat16 conv.
    parts = gdn_parts((3, 48), (4, 4, 8), 2, 4, dim_first=False, tp_size=2)
    assert [(p.name, p.offset, p.heads, p.total_heads, p.head_bytes) for p in parts] == [
        ("conv.q", 0, 2, 4, 16),
        ("conv.k", 32, 2, 4, 16),
        ("conv.v", 64, 4, 8, 8),
        ("ssm", 288, 4, 8, 128),
    ]


def test_a_conv_state_that_does_not_fit_the_ssm_shape_is_refused():
    with pytest.raises(ValueError, match="does not hold x \\(4 heads of 4\\) then B and C"):
        mamba2_parts((3, 20), (4, 4, 16), 4, 4, dim_first=False, tp_size=1, total_groups=1)
    with pytest.raises(ValueError, match="does not hold q and k in heads of 8"):
        gdn_parts((3, 18), (1, 1, 8), 2, 4, dim_first=False, tp_size=1)


def test_part_views_address_the_page_bytes_they_describe():
    pages = torch.arange(4 * 40, dtype=torch.int32).to(torch.uint8).view(4, 2, 1, 1, 20)
    parts = (StatePart("a", 0, 2, 2, 4, 2, 10), StatePart("b", 8, 1, 1, 2, 2, 10))
    views = part_views("layer", pages, parts)
    a, b = views["layer#a"], views["layer#b"]
    assert a.shape == (4, 2, 2, 2, 2) and b.shape == (4, 2, 1, 2, 1)
    flat = pages.reshape(4, 40)
    # Head 1 of row 1 of block 3: bytes 10 + 4 ... 10 + 8; halves are the two "planes".
    assert a[3, :, 1, 1].reshape(-1).tolist() == flat[3, 14:18].tolist()
    assert b[2, :, 0, 1].reshape(-1).tolist() == flat[2, 18:20].tolist()
    assert a.data_ptr() == pages.data_ptr()


@pytest.mark.parametrize(
    ("parts", "message"),
    [
        ((StatePart("a", 0, 2, 2, 4), StatePart("a", 8, 1, 1, 2)), "names repeat"),
        ((StatePart("a", 0, 2, 2, 4), StatePart("b", 6, 1, 1, 2)), "'a' and 'b' overlap"),
        ((StatePart("a", 38, 1, 1, 4),), "ends at byte 42 of a 40-byte page"),
    ],
)
def test_parts_that_overlap_or_leave_the_page_are_refused(parts, message):
    with pytest.raises(ValueError, match=message):
        check_parts(parts, 40)


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        (dict(name="a#b"), "without '#'"),
        (dict(heads=0), "heads must be >= 1"),
        (dict(head_bytes=3), "head_bytes 3 even"),
        (dict(rows=2, row_stride=4), "rows 4 bytes apart overlap its 2 heads of 4 bytes"),
    ],
)
def test_a_malformed_part_is_refused(fields, message):
    values = dict(name="a", offset=0, heads=2, total_heads=2, head_bytes=4) | fields
    with pytest.raises(ValueError, match=message):
        StatePart(**values)


def test_parts_belong_to_an_opaque_state_group_only():
    part = StatePart("a", 0, 1, 1, 2)
    with pytest.raises(ValueError, match="got them for a full_attention group"):
        KVCacheGroup(FULL_ATTENTION, ("l",), state_parts=(part,))
    with pytest.raises(ValueError, match="not pages laid out per head"):
        KVCacheGroup(RECURRENT_STATE, ("l",), state_heads=2, state_parts=(part,))


def _spec(kind: str, **extra) -> SimpleNamespace:
    return SimpleNamespace(
        mamba_type=SimpleNamespace(name=kind),
        shapes=((3, 48), (4, 4, 16)),
        dtypes=(torch.float32, torch.float32),
        **extra,
    )


def _config(tp: int, **hf) -> SimpleNamespace:
    return SimpleNamespace(
        parallel_config=SimpleNamespace(tensor_parallel_size=tp),
        model_config=SimpleNamespace(hf_text_config=SimpleNamespace(**hf)),
    )


def test_the_adapter_splits_mamba2_and_gdn_pages_and_keeps_others_whole(monkeypatch):
    monkeypatch.setattr(vllm_state, "conv_state_dim_first", lambda: False)
    mamba = vllm_state.vllm_state_parts(_spec("MAMBA2"), _config(2, mamba_n_groups=1))
    assert [(p.name, p.total_heads) for p in mamba] == [
        ("conv.x", 8), ("conv.B", 1), ("conv.C", 1), ("ssm", 8)
    ]  # fmt: skip
    # Without the model's group count: the rank's groups times the TP size.
    assert vllm_state.vllm_state_parts(_spec("MAMBA2"), _config(2))[1].total_heads == 2
    assert vllm_state.vllm_state_parts(_spec("GDN_ATTN"), _config(1))[2].name == "conv.v"
    for kind in ("MAMBA1", "SHORT_CONV", "LINEAR"):
        assert vllm_state.vllm_state_parts(_spec(kind), _config(2)) == ()
    replicated = _spec("MAMBA2", tp_replicated=True)
    assert vllm_state.vllm_state_parts(replicated, _config(2)) == ()
    monkeypatch.setattr(vllm_state, "conv_state_dim_first", lambda: None)
    assert vllm_state.vllm_state_parts(_spec("MAMBA2"), _config(2)) == ()
