"""`cuda_ipc` in isolation, on host tensors (the copy is device-agnostic; opening a peer's
handle needs a GPU and runs in the GPU checks): the indexed copy of runs, byte for byte
against a run-by-run copy, and the checks of a peer's handle."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvtransfer.transport.cuda_ipc import (
    MAX_ROWS,
    CudaIpcHandle,
    CudaIpcUnavailable,
    Span,
    check_counter_file,
    copy_runs,
    local_bytes,
)
from kvtransfer.transport.rma import RegionKey, RmaKeys
from kvtransfer.transport.rma_layout import LayerMemory

pytestmark = pytest.mark.unit

BLOCK = 4096


def _spans(count: int, nbytes: int, seed: int, base: int) -> list[Span]:
    generator = torch.Generator().manual_seed(seed)
    return [
        Span(base + i * (1 << 32), torch.randint(0, 256, (nbytes,), generator=generator).byte())
        for i in range(count)
    ]


def _runs(local: list[Span], remote: list[Span], seed: int):
    """Scattered runs of 1-3 blocks, some at a quarter-block head offset, over all spans."""
    rng = np.random.default_rng(seed)
    nbytes = local[0].tensor.numel()
    rows = []
    local_used: set[tuple[int, int]] = set()
    remote_used: set[tuple[int, int]] = set()
    for _ in range(40):
        blocks = int(rng.integers(1, 4))
        shift = int(rng.choice([0, BLOCK // 4]))
        length = blocks * BLOCK - shift
        li, ri = int(rng.integers(len(local))), int(rng.integers(len(remote)))
        lo = int(rng.integers(0, nbytes // BLOCK - 3)) * BLOCK + shift
        ro = int(rng.integers(0, nbytes // BLOCK - 3)) * BLOCK + shift
        lkeys = {(li, lo // BLOCK + k) for k in range(blocks)}
        rkeys = {(ri, ro // BLOCK + k) for k in range(blocks)}
        if lkeys & local_used or rkeys & remote_used:
            continue  # runs never overlap on either side (distinct blocks)
        local_used |= lkeys
        remote_used |= rkeys
        rows.append((local[li].address + lo, remote[ri].address + ro, length, ri))
    return tuple(np.array(column, dtype=np.int64) for column in zip(*rows, strict=True))


def _expected(local, remote, runs, write):
    want_local = [s.tensor.clone() for s in local]
    want_remote = [s.tensor.clone() for s in remote]
    for lo, ro, length, region in zip(*runs, strict=True):
        li = next(i for i, s in enumerate(local) if 0 <= lo - s.address < s.tensor.numel())
        lo, ro = lo - local[li].address, ro - remote[region].address
        if write:
            want_remote[region][ro : ro + length] = local[li].tensor[lo : lo + length]
        else:
            want_local[li][lo : lo + length] = remote[region].tensor[ro : ro + length]
    return want_local, want_remote


@pytest.mark.parametrize("write", [False, True])
def test_copy_runs_moves_exactly_the_runs_bytes_each_way(write):
    local = _spans(2, 64 * BLOCK, 1, 1 << 40)
    remote = _spans(3, 64 * BLOCK, 2, 1 << 44)
    runs = _runs(local, remote, 3)
    want_local, want_remote = _expected(local, remote, runs, write)
    before = [s.tensor.clone() for s in (remote if write else local)]
    launched = copy_runs(*runs, local, remote, write=write)
    assert all(torch.equal(a.tensor, b) for a, b in zip(local, want_local, strict=True))
    assert all(torch.equal(a.tensor, b) for a, b in zip(remote, want_remote, strict=True))
    written = remote if write else local
    assert any(not torch.equal(a, b.tensor) for a, b in zip(before, written, strict=True))
    owners = [next(i for i, s in enumerate(local) if 0 <= lo - s.address < s.tensor.numel())
              for lo in runs[0]]  # fmt: skip
    assert launched == len(set(zip(owners, runs[3].tolist(), strict=True)))


def test_copy_runs_refuses_rows_too_fine_and_moves_nothing():
    local = _spans(1, MAX_ROWS + 2, 4, 1 << 40)
    remote = _spans(1, MAX_ROWS + 2, 5, 1 << 44)
    before = local[0].tensor.clone()
    one = np.array([1], dtype=np.int64)
    runs = (one * local[0].address + 1, one * remote[0].address, one * (MAX_ROWS + 1), one * 0)
    with pytest.raises(CudaIpcUnavailable, match="too fine"):
        copy_runs(*runs, local, remote)
    assert torch.equal(local[0].tensor, before)


def test_copy_runs_refuses_a_run_outside_its_region_before_copying_any():
    local = _spans(1, 8 * BLOCK, 6, 1 << 40)
    remote = _spans(2, 8 * BLOCK, 7, 1 << 44)
    before = local[0].tensor.clone()
    runs = (
        np.array([local[0].address, local[0].address + BLOCK], dtype=np.int64),
        np.array([remote[0].address, remote[1].address + 8 * BLOCK], dtype=np.int64),
        np.array([BLOCK, BLOCK], dtype=np.int64),
        np.array([0, 1], dtype=np.int64),
    )
    with pytest.raises(ValueError, match="outside its memory region"):
        copy_runs(*runs, local, remote)
    assert torch.equal(local[0].tensor, before)


def test_local_bytes_views_this_process_memory_without_copying():
    tensor = torch.arange(64, dtype=torch.uint8)
    view = local_bytes(tensor.data_ptr() + 8, 16, cuda=False)
    assert view.tolist() == list(range(8, 24))
    view[0] = 255
    assert int(tensor[8]) == 255


def _handle(**changes) -> CudaIpcHandle:
    fields = dict(
        device_uuid="GPU-1234",
        handle=b"\x01" * 64,
        size=1 << 20,
        offset=512,
        ref_counter=b"/torch_4242_17_3",
        ref_counter_offset=5,
        event=b"\x02" * 64,
        event_sync=True,
    )
    return CudaIpcHandle(**{**fields, **changes})


def test_a_handle_round_trips_through_the_keys_answer():
    layer = LayerMemory("l0", 0, 1 << 30, (4, 2, 1, 16, 8), (512, 256, 256, 16, 2), "float16", 1)
    regions = (
        RegionKey(1 << 30, 2048, "cuda", b"rkey", _handle()),
        RegionKey(1 << 32, 64, "host", b"t"),
    )
    keys = RmaKeys(
        regions,
        {"l0": layer},
        None,
        RmaKeys.decode(_keys_without_ipc()).identity,
    )
    decoded = RmaKeys.decode(keys.encode())
    assert decoded.regions[0].ipc == _handle()
    assert decoded.regions[1].ipc is None


def _keys_without_ipc() -> bytes:
    return b'{"regions":[],"layers":[],"table":null,"identity":[4242,4096,"AAAA"]}'


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"ref_counter_offset": 10000}, "reference counter offset 10000 out of range"),
        ({"ref_counter_offset": -1}, "reference counter offset -1 out of range"),
        ({"handle": b""}, "CUDA IPC handle of a bad size"),
        ({"handle": b"x" * 5000}, "CUDA IPC handle of a bad size"),
        ({"size": 0}, "CUDA IPC region of a bad size or offset"),
        ({"offset": -4}, "CUDA IPC region of a bad size or offset"),
    ],
)
def test_a_peers_bad_handle_is_refused_by_name(change, message):
    with pytest.raises(ValueError, match=message):
        CudaIpcHandle.from_list(_handle(**change).as_list())


@pytest.mark.parametrize(
    "name", [b"/dev/shm/victim", b"/torch_999_1_2", b"/torch_4242_1_2/../x", b"torch_4242_1"]
)
def test_a_counter_file_not_the_producers_is_refused(name):
    with pytest.raises(CudaIpcUnavailable, match="is not the producer's"):
        check_counter_file(_handle(ref_counter=name), 4242)


def test_the_producers_own_counter_file_is_accepted():
    check_counter_file(_handle(), 4242)
