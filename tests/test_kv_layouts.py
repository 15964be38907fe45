"""KV caches in other engines' axis orders: byte-exact conversion, head slices included.

Our engine stores a layer as ``B2HND``; vLLM's CPU backend as ``BH2ND`` (declared ``[blocks,
heads, block_size, 2 * head_dim]``, read as K's tokens then V's per head), its GPU backends as
``2BNHD`` / ``2BHND``. Payloads are always
``B2HND``, so every pair of orders converts through gather (server) and scatter (client).

What is checked, and how: every axis has its own size (server blocks, client blocks, K/V,
server heads, each client's heads, tokens, head dim, blocks per pull: no two equal within a
tensor or a payload), so a view that swaps or misreads two axes cannot line up by accident.
Caches are written and read as raw memory, never through `canonical_kv_view`: `_offset`
computes the flat offset of a (block, K/V, head, token, dim) element from the physical order
string alone (row-major over it), each source element holds `_code` of its coordinates (a
distinct integer, exact in float32), and after a transfer every element of the destination's
memory must hold the code of the source element that lands there, or the sentinel where the
pull writes nothing. The payload is checked the same way against ``B2HND``. The code under
test sees caches only as ``canonical_kv_view(memory, order)``.
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

# Every axis its own size: server blocks, client blocks, heads, tokens, head dim (and K/V 2).
BLOCKS, CLIENT_BLOCKS, HEADS, TOKENS, DIM = 9, 11, 6, 5, 7
ORDERS = ["B2HND", "BH2ND", "BHN2D", "2BNHD", "2BHND", "BNH2D"]
# (remote heads, local heads, local head count): whole blocks, a rank holding half the heads
# reading its half, and half the heads written into the middle of a wider cache.
HEAD_CASES = [
    (range(0, 6), range(0, 6), 6),
    (range(3, 6), range(0, 3), 3),
    (range(0, 3), range(4, 7), 8),
]
# Four blocks per pull (no axis of any payload or cache above has 4 elements).
REMOTE, LOCAL = [8, 0, 3, 5], [1, 10, 4, 2]
SENTINEL = -7.0


def _sizes(blocks: int, heads: int) -> dict[str, int]:
    return {"B": blocks, "2": 2, "H": heads, "N": TOKENS, "D": DIM}


def _offset(
    order: str, sizes: dict[str, int], block: int, kv: int, head: int, token: int, dim: int
) -> int:
    """The flat offset of an element of a dense tensor whose axes are ``order``, outermost
    first: row-major over the order string, computed here from nothing but the sizes."""
    coords = {"B": block, "2": kv, "H": head, "N": token, "D": dim}
    offset = 0
    for axis in order:
        assert 0 <= coords[axis] < sizes[axis]
        offset = offset * sizes[axis] + coords[axis]
    return offset


def _code(block: int, kv: int, head: int, token: int, dim: int) -> float:
    """A distinct value per element, one hex digit per coordinate (0xBKHND): exact in float32."""
    return float((((block * 16 + kv) * 16 + head) * 16 + token) * 16 + dim)


def _describe(value: float) -> str:
    if value == SENTINEL:
        return "sentinel"
    if not (value >= 0 and value.is_integer()):
        return repr(value)
    code = int(value)
    digits = [(code >> shift) & 15 for shift in (16, 12, 8, 4, 0)]
    return "block {} kv {} head {} token {} dim {}".format(*digits)


def _memory(order: str, blocks: int, heads: int, values: list[float] | None = None) -> torch.Tensor:
    """Dense float32 memory with the axes of ``order`` (``values`` flat, else the sentinel)."""
    sizes = _sizes(blocks, heads)
    shape = [sizes[axis] for axis in order]
    if values is None:
        return torch.full(shape, SENTINEL)
    return torch.tensor(values, dtype=torch.float32).view(shape)


def _filled(order: str, blocks: int, heads: int) -> torch.Tensor:
    """Memory in ``order`` whose every element holds `_code` of its own coordinates, written
    through `_offset` (not through any view)."""
    sizes = _sizes(blocks, heads)
    values = [SENTINEL] * (blocks * 2 * heads * TOKENS * DIM)
    for coords in itertools.product(
        range(blocks), range(2), range(heads), range(TOKENS), range(DIM)
    ):
        values[_offset(order, sizes, *coords)] = _code(*coords)
    assert SENTINEL not in values  # the offsets cover the memory exactly once
    return _memory(order, blocks, heads, values)


def _pulled(
    order: str, blocks: int, heads: int, remote, local, rh: range, lh: range
) -> list[float]:
    """What the memory of a client cache in ``order`` must hold, flat, after copying heads
    ``rh`` of blocks ``remote`` of a `_filled` server into heads ``lh`` of blocks ``local``."""
    sizes = _sizes(blocks, heads)
    values = [SENTINEL] * (blocks * 2 * heads * TOKENS * DIM)
    for (src, dst), kv, j, token, dim in itertools.product(
        zip(remote, local, strict=True), range(2), range(len(rh)), range(TOKENS), range(DIM)
    ):
        offset = _offset(order, sizes, dst, kv, lh.start + j, token, dim)
        values[offset] = _code(src, kv, rh.start + j, token, dim)
    return values


def _wire(remote, rh: range) -> list[float]:
    """The payload a server must send, flat: ``B2HND`` over the pulled blocks and heads."""
    sizes = {"B": len(remote), "2": 2, "H": len(rh), "N": TOKENS, "D": DIM}
    values = [SENTINEL] * (len(remote) * 2 * len(rh) * TOKENS * DIM)
    for (i, src), kv, j, token, dim in itertools.product(
        enumerate(remote), range(2), range(len(rh)), range(TOKENS), range(DIM)
    ):
        values[_offset("B2HND", sizes, i, kv, j, token, dim)] = _code(
            src, kv, rh.start + j, token, dim
        )
    return values


def _assert_memory(memory: torch.Tensor, expected: list[float]) -> None:
    """Every element of ``memory`` (raw, flat) is the expected one; names the first misses."""
    assert memory.is_contiguous()  # so flatten() is the memory in address order
    actual = memory.flatten().tolist()
    assert len(actual) == len(expected)
    wrong = [i for i, (a, e) in enumerate(zip(actual, expected, strict=True)) if a != e]
    if wrong:
        misses = "; ".join(
            f"offset {i}: {_describe(actual[i])}, want {_describe(expected[i])}" for i in wrong[:4]
        )
        pytest.fail(f"{len(wrong)} of {len(actual)} elements wrong: {misses}")


def test_the_oracle_matches_dense_memory_in_our_order():
    # _offset for B2HND is torch's own row-major offset (a check of the oracle, not the code).
    memory = _filled("B2HND", BLOCKS, HEADS)
    assert memory[8, 1, 5, 4, 6].item() == _code(8, 1, 5, 4, 6) == float(0x81546)
    assert memory[2, 0, 3, 1, 0].item() == _code(2, 0, 3, 1, 0)


@pytest.mark.parametrize(("server_order", "client_order"), list(itertools.product(ORDERS, ORDERS)))
@pytest.mark.parametrize(("rh", "lh", "local_heads"), HEAD_CASES)
def test_every_order_pair_converts_head_slices_byte_exactly(
    server_order, client_order, rh, lh, local_heads
):
    server_memory = _filled(server_order, BLOCKS, HEADS)
    original = server_memory.clone()
    client_memory = _memory(client_order, CLIENT_BLOCKS, local_heads)
    server = canonical_kv_view(server_memory, server_order)
    client = canonical_kv_view(client_memory, client_order)
    payload = torch.full(
        (payload_bytes(len(REMOTE), len(rh), TOKENS * DIM, 4) // 4,), SENTINEL
    ).view(torch.uint8)
    gather_into(
        payload,
        server,
        row_view(torch.tensor(REMOTE), HEADS, rh, TOKENS * DIM, server.is_contiguous()),
    )
    # The payload is B2HND whatever the server's order, and gathering leaves the server as is.
    _assert_memory(payload.view(torch.float32), _wire(REMOTE, rh))
    assert torch.equal(server_memory, original)
    scatter_from(
        payload,
        client,
        row_view(torch.tensor(LOCAL), local_heads, lh, TOKENS * DIM, client.is_contiguous()),
    )
    _assert_memory(
        client_memory, _pulled(client_order, CLIENT_BLOCKS, local_heads, REMOTE, LOCAL, rh, lh)
    )


@pytest.mark.parametrize("order", ORDERS)
def test_each_order_is_viewed_in_place_and_reports_itself(order):
    memory = _filled(order, BLOCKS, HEADS)
    view = canonical_kv_view(memory, order)
    assert view.shape == (BLOCKS, 2, HEADS, TOKENS, DIM)
    assert view.data_ptr() == memory.data_ptr()  # a view, not a copy
    assert view[7, 1, 2, 3, 4].item() == _code(7, 1, 2, 3, 4)
    assert kv_axis_order(view) == order
    assert KVLayout.of(view) == KVLayout(BLOCKS, HEADS, TOKENS, DIM, "float32", order)


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
    assert kv_axis_order(_memory("B2HND", BLOCKS, HEADS)) == KV_AXES
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
    rh, lh, local_heads = HEAD_CASES[1]
    with (
        KVTransferAgent(TransportConfig(timeout_s=30.0)) as server,
        KVTransferAgent(TransportConfig(timeout_s=30.0, inline_bytes=0)) as client,
    ):
        server_memory = _filled(server_order, BLOCKS, HEADS)
        server.register_kv_caches({"layer.0": canonical_kv_view(server_memory, server_order)})
        server.start_server()
        client_memory = _memory(client_order, CLIENT_BLOCKS, local_heads)
        client.register_kv_caches({"layer.0": canonical_kv_view(client_memory, client_order)})
        peer = client.connect(server.address, layouts=server.kv_layouts())
        assert server.kv_layouts()["layer.0"].order == server_order
        spec = PullSpec(
            "orders", ["layer.0"], REMOTE, LOCAL, (rh.start, rh.stop), (lh.start, lh.stop)
        )
        client.pull(peer, spec).result(30.0)
        _assert_memory(
            client_memory,
            _pulled(client_order, CLIENT_BLOCKS, local_heads, REMOTE, LOCAL, rh, lh),
        )


def test_connectors_view_the_engines_caches_in_its_declared_order():
    layout = KVCacheLayout(
        model="m", dtype="float32", block_size=TOKENS, num_blocks=BLOCKS, num_layers=1,
        num_kv_heads=HEADS, head_dim=DIM, kv_order="BH2ND",
    )  # fmt: skip
    memory = _filled("BH2ND", BLOCKS, HEADS)
    views = canonical_kv_caches({"a": memory}, layout)
    assert views["a"].shape == (BLOCKS, 2, HEADS, TOKENS, DIM)
    assert views["a"].data_ptr() == memory.data_ptr()
    assert views["a"][7, 1, 2, 3, 4].item() == _code(7, 1, 2, 3, 4)
    ours = memory.view(BLOCKS, 2, HEADS, TOKENS, DIM)
    assert canonical_kv_caches({"a": ours}, None)["a"].stride() == ours.stride()
    with pytest.raises(ValueError, match=r"KV cache 'b': a KV cache in order 'BH2ND' must have"):
        canonical_kv_caches({"b": torch.zeros(BLOCKS, HEADS, TOKENS, 2 * DIM)}, layout)
