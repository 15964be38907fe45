"""The pieces of RMA mode that need no UCX: the runs a read copies, the lease table, the keys.

Runs are checked by executing them: every run is copied with ``memmove`` between two tensors of
this process (the addresses are real), and the result must equal what torch indexing says the
pull means, for every pair of axis orders, head slice and block pattern; the number of runs is
checked where the layouts make it exact.
"""

from __future__ import annotations

import ctypes

import pytest
import torch

from kvtransfer.transport import canonical_kv_view
from kvtransfer.transport.lease_table import (
    WINDOW,
    LeaseTable,
    blocks_tag,
    find_row,
    lease_slot,
    lease_token,
    prompt_tag,
)
from kvtransfer.transport.rma import Identity, RegionKey, RmaKeys, TableRef
from kvtransfer.transport.rma_layout import LayerMemory, concat_runs, layer_runs

pytestmark = pytest.mark.unit

# Every axis its own size, so a swapped axis cannot pass.
BLOCKS, HEADS, TOKENS, DIM = 12, 4, 5, 3


def _cache(order: str, fill: float | None = None) -> torch.Tensor:
    shape = {"B": BLOCKS, "2": 2, "H": HEADS, "N": TOKENS, "D": DIM}
    physical = torch.empty([shape[axis] for axis in order], dtype=torch.float32)
    view = canonical_kv_view(physical, order)
    if fill is None:
        view.copy_(torch.arange(view.numel(), dtype=torch.float32).reshape(view.shape))
    else:
        view.fill_(fill)
    return view


def _execute(runs) -> None:
    for local, remote, length in zip(runs.local, runs.remote, runs.lengths, strict=True):
        ctypes.memmove(int(local), int(remote), int(length))


ORDERS = ["B2HND", "BH2ND", "2BHND", "B2NHD", "BNH2D"]
HEAD_CASES = [
    (range(0, 4), range(0, 4)),
    (range(2, 4), range(0, 2)),
    (range(1, 2), range(3, 4)),
]


@pytest.mark.parametrize("remote_order", ORDERS)
@pytest.mark.parametrize("local_order", ORDERS)
@pytest.mark.parametrize("heads", HEAD_CASES, ids=["all", "half", "one"])
def test_runs_copy_exactly_the_requested_elements(remote_order, local_order, heads):
    remote_heads, local_heads = heads
    remote = _cache(remote_order)
    local = _cache(local_order, fill=-1.0)
    remote_ids, local_ids = [7, 8, 9, 0, 11], [1, 2, 3, 10, 4]
    runs = layer_runs(
        LayerMemory.of("l", local),
        LayerMemory.of("l", remote),
        local_ids,
        remote_ids,
        local_heads,
        remote_heads,
    )
    _execute(runs)
    expected = _cache(local_order, fill=-1.0)
    expected[local_ids, :, local_heads.start : local_heads.stop] = remote[
        remote_ids, :, remote_heads.start : remote_heads.stop
    ]
    assert torch.equal(local, expected)
    assert runs.total_bytes == len(local_ids) * 2 * len(local_heads) * TOKENS * DIM * 4


def test_run_counts_follow_the_layout():
    remote, local = _cache("B2HND"), _cache("B2HND", fill=0.0)
    mem_l, mem_r = LayerMemory.of("l", local), LayerMemory.of("l", remote)
    everything = range(HEADS)
    # Consecutive on both sides: one run; a gap on one side: two.
    assert len(layer_runs(mem_l, mem_r, [0, 1, 2], [5, 6, 7], everything, everything)) == 1
    assert len(layer_runs(mem_l, mem_r, [0, 1, 3], [5, 6, 7], everything, everything)) == 2
    # A head slice is one run per (block, K/V).
    half = range(0, 2)
    assert len(layer_runs(mem_l, mem_r, [0, 1], [5, 6], half, half)) == 4
    # Token-major heads (B2NHD): one run per (block, K/V, token) for a slice.
    token_major = LayerMemory.of("l", _cache("B2NHD"))
    runs = layer_runs(LayerMemory.of("l", _cache("B2NHD", 0.0)), token_major, [0], [5], half, half)
    assert len(runs) == 2 * TOKENS


def test_adjacent_layers_merge_into_one_run():
    buffer = torch.arange(3 * BLOCKS * 2 * HEADS * TOKENS * DIM, dtype=torch.float32)
    layers = buffer.view(3, BLOCKS, 2, HEADS, TOKENS, DIM)
    target = torch.zeros_like(layers)
    everything = range(HEADS)
    parts = [
        layer_runs(
            LayerMemory.of(f"l{i}", target[i]),
            LayerMemory.of(f"l{i}", layers[i]),
            range(BLOCKS),
            range(BLOCKS),
            everything,
            everything,
        )
        for i in range(3)
    ]
    merged = concat_runs(parts)
    assert len(merged) == 1
    _execute(merged)
    assert torch.equal(target, layers)


def test_mismatched_geometry_is_refused():
    a = LayerMemory.of("l", _cache("B2HND"))
    b = LayerMemory.of("l", torch.zeros(BLOCKS, 2, HEADS, TOKENS + 1, DIM))
    with pytest.raises(ValueError, match=r"does not match remote float32 \(6, 3\)"):
        layer_runs(a, b, [0], [0], range(HEADS), range(HEADS))
    with pytest.raises(ValueError, match="differ in size"):
        layer_runs(a, a, [0], [0], range(2), range(3))


# ------------------------------------------------------------------------------ lease table


def test_the_lease_row_appears_changes_and_goes():
    table = LeaseTable(["l0", "l1", "l2"], slots=64)
    digest = b"d" * 32
    assert table.publish("r1", digest, "prompt", {"l1", "l2"}, [3, 4])
    token = lease_token("r1", digest)
    start = lease_slot("r1", 64) * 4
    window = table.words.numpy()[start : start + WINDOW * 4]
    assert find_row(window, token) == (1, prompt_tag("prompt"), blocks_tag([3, 4]))
    table.update("r1", {"l2"})
    assert find_row(window, token)[0] == 2
    table.update("r1", {"l0"})  # out of order: nothing counts past the first pending layer
    assert find_row(window, token)[0] == 0
    table.withdraw("r1")
    assert find_row(window, token) is None
    assert len(table) == 0
    assert prompt_tag("") == 0 and blocks_tag([3, 4]) != blocks_tag([4, 3])


def test_a_full_window_is_counted_not_overwritten():
    table = LeaseTable(["l0"], slots=1)
    ids = [f"r{i}" for i in range(WINDOW)]
    assert all(table.publish(i, b"x" * 32, "", set(), [1]) for i in ids)
    assert not table.publish("one-too-many", b"x" * 32, "", set(), [1])
    assert table.full == 1
    for lease_id in ids:
        window = table.words.numpy()[: WINDOW * 4]
        assert find_row(window, lease_token(lease_id, b"x" * 32)) is not None


# ------------------------------------------------------------------------------------ keys


def _keys() -> RmaKeys:
    layer = LayerMemory("l", 0, 4096, (2, 2, 1, 1, 1), (16, 8, 4, 4, 4), "float32")
    return RmaKeys(
        (RegionKey(4096, 64, "host", b"\x01\x02"),),
        {"l": layer},
        TableRef(0, 4096, 8, ("l",)),
        Identity(123, 8192, b"n" * 16),
    )


def test_keys_round_trip():
    keys = _keys()
    assert RmaKeys.decode(keys.encode()) == keys


@pytest.mark.parametrize(
    ("mutate", "message"),
    [
        (lambda body: body.pop("regions"), "unreadable RMA keys: KeyError"),
        (lambda body: body["layers"][0].update(region=3), "names region 3 of 1"),
        (lambda body: body["layers"][0].update(address=8192), "lies outside its region"),
        (
            lambda body: body["layers"][0].update(shape=[2, 3, 1, 1, 1]),
            "is not \\[B, 2, H, N, D\\]",
        ),
        (lambda body: body["regions"][0].__setitem__(3, "%%%"), "unreadable RMA keys"),
        (lambda body: body.update(table=[5, 0, 8, []]), "lease table names region 5"),
    ],
)
def test_malformed_keys_are_refused(mutate, message):
    import json

    body = json.loads(_keys().encode())
    mutate(body)
    with pytest.raises(ValueError, match=message):
        RmaKeys.decode(json.dumps(body).encode())
