"""Same-host one-sided copies of GPU memory with CUDA IPC: the GPU's own copy engines and
kernels instead of one UCX operation per run.

UCX moves a one-sided read or write of CUDA memory between processes of one host over its
``cuda_ipc`` transport, one operation per contiguous run. Each costs tens of microseconds
whatever its size (one H200, 2026-11-28: 0.35 ms for one 1 MiB block of 8 layers, 1 s for
2048 blocks of 64 KiB), so a pull of scattered blocks ran three orders below the GPU's
bandwidth. Here the producer publishes, beside its UCX keys, a CUDA IPC handle of each cache
storage (`CudaIpcHandle`, torch's own export); a consumer on the same host maps them once
(`open_region`) and moves a whole pull in a few gather/scatter kernels (`copy_runs`): rows of
the runs' common size, one ``index_select`` and one ``index_copy_`` per pair of local and
remote storages, on a stream of its own, synchronised before the read returns.

Trust: a CUDA IPC handle maps the whole allocation read-write, as UCX's ``cuda_ipc`` key for
the same memory does (it carries the same handle). The handle is only sent to a peer that
presented a valid lease, and only used by a peer that proved it shares the host and PID
namespace (`direct_read`'s probe); ``TransportConfig(shared_memory=False)`` turns the path off.
The fields of a peer's handle are checked before torch sees them: torch writes to the
reference-counter file it names when the mapping is released.
"""

from __future__ import annotations

import base64
import functools
import logging
import math
import re
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

logger = logging.getLogger(__name__)

# torch's reference-counter files hold this many int64 counters (CUDA_IPC_REF_COUNTER_FILE_SIZE).
_REF_COUNTERS = 10000
_MAX_HANDLE_BYTES = 4096
# Above this many rows (runs cut to their common size) a copy's index would cost more memory
# than the copy is worth: such a pull goes through UCX instead.
MAX_ROWS = 1 << 22


class CudaIpcUnavailable(Exception):
    """This process cannot map the peer's GPU memory (use UCX instead)."""


@dataclass(frozen=True)
class CudaIpcHandle:
    """One exported cache storage: what torch's ``UntypedStorage._share_cuda_`` returns, with
    the device named by UUID (device indices differ between processes)."""

    device_uuid: str
    handle: bytes
    size: int
    offset: int
    ref_counter: bytes
    ref_counter_offset: int
    event: bytes
    event_sync: bool

    @classmethod
    def export(cls, tensor: torch.Tensor) -> CudaIpcHandle | None:
        """The handle of ``tensor``'s storage (None where torch cannot share it)."""
        try:
            device, handle, size, offset, counter, counter_offset, event, sync = (
                tensor.untyped_storage()._share_cuda_()
            )
            uuid = str(torch.cuda.get_device_properties(device).uuid)
        except Exception as exc:
            logger.warning("CUDA IPC export unavailable (UCX serves GPU reads): %s", exc)
            return None
        return cls(
            uuid, bytes(handle), int(size), int(offset), bytes(counter), int(counter_offset),
            bytes(event or b""), bool(sync),
        )  # fmt: skip

    def as_list(self) -> list[object]:
        return [
            self.device_uuid,
            base64.b64encode(self.handle).decode(),
            self.size,
            self.offset,
            base64.b64encode(self.ref_counter).decode(),
            self.ref_counter_offset,
            base64.b64encode(self.event).decode(),
            self.event_sync,
        ]

    @classmethod
    def from_list(cls, item: Sequence[object]) -> CudaIpcHandle:
        """`ValueError` naming what is wrong with a peer's handle."""
        uuid, handle, size, offset, counter, counter_offset, event, sync = item
        value = cls(
            str(uuid),
            base64.b64decode(str(handle), validate=True),
            int(size),  # type: ignore[call-overload]
            int(offset),  # type: ignore[call-overload]
            base64.b64decode(str(counter), validate=True),
            int(counter_offset),  # type: ignore[call-overload]
            base64.b64decode(str(event), validate=True),
            bool(sync),
        )
        if not 0 < len(value.handle) <= _MAX_HANDLE_BYTES or len(value.event) > _MAX_HANDLE_BYTES:
            raise ValueError("CUDA IPC handle of a bad size")
        if value.size <= 0 or value.offset < 0:
            raise ValueError("CUDA IPC region of a bad size or offset")
        if not 0 <= value.ref_counter_offset < _REF_COUNTERS:
            raise ValueError(f"reference counter offset {value.ref_counter_offset} out of range")
        return value


def check_counter_file(handle: CudaIpcHandle, pid: int) -> None:
    """The reference-counter file must be one torch made in the producer's process (torch
    names them ``/torch_<pid>_<random>_<n>``): a peer may not name another file to write."""
    name = handle.ref_counter.decode("ascii", "replace")
    if not re.fullmatch(rf"/torch_{pid}_[0-9_]+", name):
        raise CudaIpcUnavailable(f"reference-counter file {name!r} is not the producer's")


@functools.cache
def _devices_by_uuid() -> dict[str, int]:
    return {
        str(torch.cuda.get_device_properties(i).uuid): i for i in range(torch.cuda.device_count())
    }


def open_region(handle: CudaIpcHandle, pid: int) -> torch.Tensor:
    """The peer's storage as a ``uint8`` tensor in this process (`CudaIpcUnavailable`)."""
    check_counter_file(handle, pid)
    if not torch.cuda.is_available():
        raise CudaIpcUnavailable("this process has no CUDA device")
    device = _devices_by_uuid().get(handle.device_uuid)
    if device is None:
        raise CudaIpcUnavailable(f"no local device has UUID {handle.device_uuid}")
    try:
        storage = torch.UntypedStorage._new_shared_cuda(
            device,
            handle.handle,
            handle.size,
            handle.offset,
            handle.ref_counter,
            handle.ref_counter_offset,
            handle.event,
            handle.event_sync,
        )
    except Exception as exc:
        raise CudaIpcUnavailable(f"opening the peer's CUDA IPC handle failed: {exc}") from exc
    return torch.empty(0, dtype=torch.uint8, device=f"cuda:{device}").set_(
        storage, 0, (handle.size,), (1,)
    )


class _DeviceBytes:
    """``__cuda_array_interface__`` of bytes this process owns (a registered cache)."""

    def __init__(self, address: int, nbytes: int) -> None:
        self.__cuda_array_interface__ = {
            "data": (address, False),
            "shape": (nbytes,),
            "typestr": "|u1",
            "strides": None,
            "version": 3,
        }


def local_bytes(address: int, nbytes: int, cuda: bool) -> torch.Tensor:
    """A ``uint8`` view of this process's own memory at ``address`` (no copy, not owning)."""
    if cuda:
        return torch.as_tensor(_DeviceBytes(address, nbytes), device="cuda")
    import ctypes

    array = (ctypes.c_uint8 * nbytes).from_address(address)
    return torch.frombuffer(array, dtype=torch.uint8)


@dataclass(frozen=True)
class Span:
    """Memory a copy addresses: ``tensor``'s bytes begin at ``address``."""

    address: int
    tensor: torch.Tensor


def _word(row: int, *addresses: int) -> torch.dtype:
    """The widest integer type that divides the row and aligns every base."""
    for size, dtype in ((8, torch.int64), (4, torch.int32), (2, torch.int16)):
        if row % size == 0 and all(a % size == 0 for a in addresses):
            return dtype
    return torch.uint8


def _expand(starts: np.ndarray, counts: np.ndarray) -> np.ndarray:
    """Row indices ``starts[i] .. starts[i] + counts[i]``, concatenated."""
    total = int(counts.sum())
    before = np.cumsum(counts) - counts
    return np.repeat(starts - before, counts) + np.arange(total, dtype=np.int64)


class RowViews:
    """Spans seen as rows of one size, kept across copies (the spans of a peer and of the
    local caches do not change)."""

    def __init__(self) -> None:
        self._views: dict[tuple, torch.Tensor] = {}

    def of(self, span: Span, row: int, word: torch.dtype) -> torch.Tensor:
        # By memory, not by tensor object: equal keys are the same bytes.
        tensor = span.tensor
        key = (tensor.device, tensor.data_ptr(), tensor.numel(), row, word)
        view = self._views.get(key)
        if view is None:
            if len(self._views) >= 1024:
                self._views.clear()
            usable = span.tensor.numel() // row * row
            width = row // torch.empty(0, dtype=word).element_size()
            view = span.tensor[:usable].view(word).view(-1, width)
            self._views[key] = view
        return view


def copy_runs(
    local: np.ndarray,
    remote: np.ndarray,
    lengths: np.ndarray,
    remote_regions: np.ndarray,
    local_spans: Sequence[Span],
    remote_spans: Sequence[Span],
    *,
    write: bool = False,
    views: RowViews | None = None,
) -> int:
    """Copy ``lengths[i]`` bytes from ``remote[i]`` (in ``remote_spans[remote_regions[i]]``)
    to ``local[i]`` (in the local span holding it), or the other way with ``write``. Returns
    the number of gather/scatter pairs launched; the caller synchronises.

    Runs are cut into rows of their greatest common size (a block's slice of a layer, for a
    KV pull), so one indexed copy per pair of spans moves them all; the row indices of every
    pair reach the device in one copy. Everything is checked before anything is launched: a
    refused copy has moved nothing."""
    if not len(lengths):
        return 0
    views = views or RowViews()
    bases = np.array([s.address for s in local_spans], dtype=np.int64)
    order = np.argsort(bases)
    which = order[np.searchsorted(bases[order], local, side="right") - 1]
    local_off = local - bases[which]
    remote_base = np.array([s.address for s in remote_spans], dtype=np.int64)[remote_regions]
    remote_off = remote - remote_base
    row = math.gcd(
        int(np.gcd.reduce(lengths)), int(np.gcd.reduce(local_off)), int(np.gcd.reduce(remote_off))
    )
    if int(lengths.sum()) // row > MAX_ROWS:
        raise CudaIpcUnavailable(f"runs of {row}-byte rows are too fine for an indexed copy")
    # Runs grouped by (local span, remote region), each group's rows contiguous.
    pairs = which * len(remote_spans) + remote_regions
    by_pair = np.argsort(pairs, kind="stable")
    counts = lengths[by_pair] // row
    local_idx = _expand(local_off[by_pair] // row, counts)
    remote_idx = _expand(remote_off[by_pair] // row, counts)
    row_pairs = np.repeat(pairs[by_pair], counts)
    groups, starts = np.unique(row_pairs, return_index=True)
    local_max = np.maximum.reduceat(local_idx, starts)
    remote_max = np.maximum.reduceat(remote_idx, starts)
    copies = []
    for k, pair in enumerate(groups.tolist()):
        mine, theirs = divmod(pair, len(remote_spans))
        mine_span, their_span = local_spans[mine], remote_spans[theirs]
        word = _word(row, mine_span.tensor.data_ptr(), their_span.tensor.data_ptr())
        mine_rows = views.of(mine_span, row, word)
        their_rows = views.of(their_span, row, word)
        if local_max[k] >= len(mine_rows) or remote_max[k] >= len(their_rows):
            raise ValueError("a run lies outside its memory region")
        copies.append((mine_rows, their_rows))
    devices = {t.device for pair in copies for t in pair}
    total = len(local_idx)
    if len(devices) == 1:
        both = torch.from_numpy(np.concatenate((local_idx, remote_idx))).to(devices.pop())
        local_dev, remote_dev = both[:total], both[total:]
    else:  # spans on several devices: each copy takes its indices where it runs
        local_dev, remote_dev = torch.from_numpy(local_idx), torch.from_numpy(remote_idx)
    ends = [*starts.tolist()[1:], total]
    for (mine_rows, their_rows), start, end in zip(copies, starts.tolist(), ends, strict=True):
        mine_at, theirs_at = local_dev[start:end], remote_dev[start:end]
        src, src_at, dst, dst_at = (
            (mine_rows, mine_at, their_rows, theirs_at)
            if write
            else (their_rows, theirs_at, mine_rows, mine_at)
        )
        gathered = src.index_select(0, src_at.to(src.device))
        dst.index_copy_(0, dst_at.to(dst.device), gathered.to(dst.device))
    return len(copies)
