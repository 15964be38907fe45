"""KV caches in other engines' axis orders: byte-exact conversion, head slices included.

Our engine stores a layer as ``B2HND``; vLLM's CPU backend as ``BH2ND`` (declared ``[blocks,
heads, block_size, 2 * head_dim]``, read as K's tokens then V's per head), its GPU backends as
``2BNHD`` / ``2BHND``. Payloads are always
``B2HND``, so every pair of orders converts through gather (server) and scatter (client).
"""

from __future__ import annotations

import itertools

import pytest
import torch

from kvtransfer.connector.metadata import KVCacheLayout, canonical_kv_caches
from kvtransfer.transport import (
    KV_AXES,
    KVLayout,
    KVTransferAgent,
    PullSpec,
    TransportConfig,
    canonical_kv_view,
)
from kvtransfer.transport.buffers import gather_into, payload_bytes, row_view, scatter_from
from kvtransfer.transport.spec import check_kv_cache, kv_axis_order

pytestmark = pytest.mark.integration

BLOCKS, HEADS, TOKENS, DIM = 6, 4, 4, 8
ORDERS = ["B2HND", "BH2ND", "BHN2D", "2BNHD", "2BHND", "BNH2D"]
# (remote heads, local heads, local head count): whole blocks, a TP 2 -> 1 read of half the
# heads, and a half written into the middle of a wider cache.
HEAD_CASES = [
    (range(0, 4), range(0, 4), 4),
    (range(2, 4), range(0, 2), 2),
    (range(0, 2), range(1, 3), 4),
]


def _allocate(order: str, heads: int, fill: torch.Tensor | None = None) -> torch.Tensor:
    """A dense tensor in ``order`` and its B2HND view (filled from ``fill``, a B2HND tensor)."""
    sizes = {"B": BLOCKS, "2": 2, "H": heads, "N": TOKENS, "D": DIM}
    memory = torch.full([sizes[a] for a in order], -7.0)
    view = canonical_kv_view(memory, order)
    if fill is not None:
        view.copy_(fill)
    return view


def _seeded(heads: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(5)
    return torch.randn(BLOCKS, 2, heads, TOKENS, DIM, generator=generator)


def _expected(local_heads: int, source: torch.Tensor, remote, local, rh, lh) -> torch.Tensor:
    expected = torch.full((BLOCKS, 2, local_heads, TOKENS, DIM), -7.0)
    expected[local, :, lh.start : lh.stop] = source[remote][:, :, rh.start : rh.stop]
    return expected


@pytest.mark.parametrize(("server_order", "client_order"), list(itertools.product(ORDERS, ORDERS)))
@pytest.mark.parametrize(("rh", "lh", "local_heads"), HEAD_CASES)
def test_every_order_pair_converts_head_slices_byte_exactly(
    server_order, client_order, rh, lh, local_heads
):
    source = _seeded(HEADS)
    server = _allocate(server_order, HEADS, source)
    client = _allocate(client_order, local_heads)
    remote, local = [5, 0, 3], [1, 4, 2]
    payload = torch.empty(payload_bytes(3, len(rh), TOKENS * DIM, 4), dtype=torch.uint8)
    gather_into(
        payload,
        server,
        row_view(torch.tensor(remote), HEADS, rh, TOKENS * DIM, server.is_contiguous()),
    )
    # The payload is B2HND whatever the server's order.
    wire = payload.view(torch.float32).view(3, 2, len(rh), TOKENS, DIM)
    assert torch.equal(wire, source[remote][:, :, rh.start : rh.stop])
    scatter_from(
        payload,
        client,
        row_view(torch.tensor(local), local_heads, lh, TOKENS * DIM, client.is_contiguous()),
    )
    assert torch.equal(client, _expected(local_heads, source, remote, local, rh, lh))


def test_vllm_cpu_cache_viewed_as_its_attention_reads_it():
    # vLLM CPU declares [num_blocks, kv_heads, block_size, 2 * head_size] and its attention
    # views it as [num_blocks, kv_heads, 2 * block_size, head_size]: K's tokens, then V's.
    memory = torch.arange(BLOCKS * HEADS * TOKENS * 2 * DIM, dtype=torch.float32)
    memory = memory.view(BLOCKS, HEADS, TOKENS, 2 * DIM)
    keys, values = memory.view(BLOCKS, HEADS, 2 * TOKENS, DIM).chunk(2, dim=2)
    view = canonical_kv_view(memory.view(BLOCKS, HEADS, 2, TOKENS, DIM), "BH2ND")
    assert view.shape == (BLOCKS, 2, HEADS, TOKENS, DIM)
    assert view.data_ptr() == memory.data_ptr()  # a view, not a copy
    assert torch.equal(view[:, 0], keys)
    assert torch.equal(view[:, 1], values)
    assert kv_axis_order(view) == "BH2ND"
    assert KVLayout.of(view) == KVLayout(BLOCKS, HEADS, TOKENS, DIM, "float32", "BH2ND")
    assert kv_axis_order(_allocate("B2HND", HEADS)) == KV_AXES
    assert check_kv_cache("x", view) is view


@pytest.mark.parametrize(
    ("order", "shape", "match"),
    [
        ("B2HN", (2, 2, 2, 2), r"order must name the axes 'B2HND' .* got 'B2HN'"),
        ("BB2HN", (2, 2, 2, 2, 2), r"got 'BB2HN'"),
        (None, (2, 2, 2, 2, 2), r"got None"),
        ("B2HND", (2, 3, 2, 2, 2), r"must have 5 axes with 2 at position 1, got shape \(2, 3,"),
        ("BH2ND", (2, 2, 2, 3), r"must have 5 axes with 2 at position 2, got shape \(2, 2, 2, 3\)"),
    ],
)
def test_bad_orders_and_shapes_are_refused(order, shape, match):
    with pytest.raises(ValueError, match=match):
        canonical_kv_view(torch.zeros(shape), order)


def test_strided_caches_with_gaps_are_accepted_and_overlapping_ones_refused():
    keys = torch.zeros(BLOCKS, 1, HEADS, TOKENS, DIM)
    values = torch.zeros(BLOCKS, 1, HEADS, TOKENS, DIM)
    # K and V rows with a gap after (as a layer of vLLM's block-outermost layouts has).
    padded = torch.cat([keys, values, values], dim=1)[:, :2]
    assert check_kv_cache("x", padded) is padded
    # One plane seen twice: K and V would share memory.
    shared = keys.expand(BLOCKS, 2, HEADS, TOKENS, DIM)
    with pytest.raises(ValueError, match=r"KV cache 'x' has elements that share memory"):
        check_kv_cache("x", shared)


def test_layout_order_travels_and_defaults_for_older_peers():
    layout = KVLayout(BLOCKS, HEADS, TOKENS, DIM, "bfloat16", "2BNHD")
    assert KVLayout.from_dict(layout.as_dict()) == layout
    older = {k: v for k, v in layout.as_dict().items() if k != "order"}
    assert KVLayout.from_dict(older).order == KV_AXES
    with pytest.raises(ValueError, match=r"order must name the axes"):
        KVLayout.from_dict({**layout.as_dict(), "order": "XYZ"})


@pytest.mark.parametrize(
    ("server_order", "client_order"), [("BH2ND", "B2HND"), ("B2HND", "2BNHD"), ("2BHND", "BH2ND")]
)
def test_a_real_pull_between_orders_over_ucx(server_order, client_order):
    source = _seeded(HEADS)
    with (
        KVTransferAgent(TransportConfig(timeout_s=30.0)) as server,
        KVTransferAgent(TransportConfig(timeout_s=30.0, inline_bytes=0)) as client,
    ):
        server.register_kv_caches({"layer.0": _allocate(server_order, HEADS, source)})
        server.start_server()
        local = _allocate(client_order, 2)
        client.register_kv_caches({"layer.0": local})
        peer = client.connect(server.address, layouts=server.kv_layouts())
        assert server.kv_layouts()["layer.0"].order == server_order
        spec = PullSpec("orders", ["layer.0"], [5, 0], [1, 4], (2, 4), (0, 2))
        client.pull(peer, spec).result(30.0)
        assert torch.equal(local, _expected(2, source, [5, 0], [1, 4], range(2, 4), range(0, 2)))


def test_connectors_view_the_engines_caches_in_its_declared_order():
    layout = KVCacheLayout(
        model="m", dtype="float32", block_size=TOKENS, num_blocks=BLOCKS, num_layers=1,
        num_kv_heads=HEADS, head_dim=DIM, kv_order="BH2ND",
    )  # fmt: skip
    memory = torch.zeros(BLOCKS, HEADS, 2, TOKENS, DIM)
    views = canonical_kv_caches({"a": memory}, layout)
    assert views["a"].shape == (BLOCKS, 2, HEADS, TOKENS, DIM)
    assert views["a"].data_ptr() == memory.data_ptr()
    ours = memory.view(BLOCKS, 2, HEADS, TOKENS, DIM)
    assert canonical_kv_caches({"a": ours}, None)["a"].stride() == ours.stride()
    with pytest.raises(ValueError, match=r"KV cache 'b': a KV cache in order 'BH2ND' must have"):
        canonical_kv_caches({"b": torch.zeros(BLOCKS, HEADS, TOKENS, 2 * DIM)}, layout)
