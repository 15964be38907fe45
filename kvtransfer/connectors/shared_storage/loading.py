"""Load one request's KV from its producer files into a worker's paged caches.

Runs on a background thread of the worker half. It waits (bounded) until every file the
producer's TP x PP split writes exists, checks that each one matches this worker (block size,
dtype, split, enough tokens, the same prompt tokens), plans which file slice fills which local
heads of each layer, then copies with one index copy per layer and head run. Blocks wholly
before ``start_token`` (local prefix-cache hits, possibly shared with running requests) are
never written.
"""

from __future__ import annotations

import threading
import time
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import torch

from kvtransfer.connectors.shared_storage.metadata import LoadSpec
from kvtransfer.connectors.shared_storage.storage import (
    TOKEN_IDS_KEY,
    FileHeader,
    HeadRead,
    HeadSlice,
    StorageFormatError,
    dtype_name,
    expected_files,
    open_file,
    plan_reads,
    read_header,
    worker_file_name,
)

# How often a load waiting for producer files looks again.
POLL_S = 0.02


class LoadError(RuntimeError):
    """A load that cannot complete: files missing past the deadline, or not this request's."""


class LoadCancelled(Exception):
    """The request finished before its files appeared; nothing was written."""


def block_range(spec: LoadSpec, block_size: int) -> tuple[int, int]:
    """Indices ``[first, end)`` into the request's block table that a load writes."""
    return spec.start_token // block_size, -(-spec.end_token // block_size)


def load_request(
    spec: LoadSpec,
    caches: dict[str, torch.Tensor],
    wanted: dict[str, HeadSlice],
    timeout_s: float,
    cancel: threading.Event,
) -> int:
    """Fill ``spec``'s blocks of ``caches``' layers with the heads in ``wanted``; returns the
    bytes copied. Raises `LoadCancelled` if ``cancel`` is set while waiting for files."""
    first = next(iter(caches.values()))
    block_size = int(first.shape[3])
    first_block, end_block = block_range(spec, block_size)
    if end_block > len(spec.block_ids):
        raise LoadError(
            f"{spec.end_token} tokens need {end_block} blocks of {block_size}, the request "
            f"holds {len(spec.block_ids)}"
        )
    paths = expected_files(Path(spec.directory), spec.remote_pp_size, spec.remote_tp_size)
    _wait_for_files(paths, timeout_s, cancel)
    with ExitStack() as stack:
        handles = {path: stack.enter_context(open_file(path)) for path in paths}
        headers = {path: read_header(handle) for path, handle in handles.items()}
        for path, header in headers.items():
            _check_header(path, header, spec, block_size, dtype_name(first.dtype))
        saved = handles[paths[0]].get_tensor(TOKEN_IDS_KEY)[: spec.end_token].tolist()
        if saved != list(spec.token_ids):
            raise LoadError(
                f"{paths[0].parent} holds KV of different tokens than this request's first "
                f"{spec.end_token}"
            )
        plan = plan_reads(wanted, headers)
        return _copy(plan, handles, caches, spec.block_ids, first_block, end_block)


def _wait_for_files(paths: list[Path], timeout_s: float, cancel: threading.Event) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        missing = [path for path in paths if not path.is_file()]
        if not missing:
            return
        if cancel.is_set():
            raise LoadCancelled
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            names = ", ".join(path.name for path in missing)
            raise LoadError(
                f"producer file(s) {names} did not appear in {paths[0].parent} within "
                f"{timeout_s:g} s"
            )
        cancel.wait(min(POLL_S, remaining))


def _check_header(
    path: Path, header: FileHeader, spec: LoadSpec, block_size: int, dtype: str
) -> None:
    expected: dict[str, Any] = {
        "block_size": block_size,
        "dtype": dtype,
        "tp_size": spec.remote_tp_size,
        "pp_size": spec.remote_pp_size,
    }
    for name, value in expected.items():
        if getattr(header, name) != value:
            raise StorageFormatError(
                f"{path.name}: {name} is {getattr(header, name)!r}, expected {value!r}"
            )
    if path.name != worker_file_name(header.pp_rank, header.tp_rank):
        raise StorageFormatError(
            f"{path.name} claims to be pp_rank {header.pp_rank} tp_rank {header.tp_rank}"
        )
    if header.num_tokens < spec.end_token:
        raise StorageFormatError(
            f"{path.name} holds {header.num_tokens} tokens, {spec.end_token} are needed"
        )


def _copy(
    plan: dict[str, list[HeadRead]],
    handles: dict[Path, Any],
    caches: dict[str, torch.Tensor],
    block_ids: tuple[int, ...],
    first_block: int,
    end_block: int,
) -> int:
    device = next(iter(caches.values())).device
    index = torch.tensor(block_ids[first_block:end_block], dtype=torch.long, device=device)
    num_bytes = 0
    with torch.no_grad():
        for layer, reads in plan.items():
            cache = caches[layer]
            for read in reads:
                data = handles[read.path].get_slice(layer)[
                    first_block:end_block, :, read.file_start : read.file_end
                ]
                num_heads = read.file_end - read.file_start
                expected = (end_block - first_block, 2, num_heads, *cache.shape[3:])
                if tuple(data.shape) != expected or data.dtype != cache.dtype:
                    raise StorageFormatError(
                        f"{read.path.name}: layer {layer!r} slice has shape "
                        f"{tuple(data.shape)} {data.dtype}, expected {expected} {cache.dtype}"
                    )
                target = cache[:, :, read.local_start : read.local_end]
                target.index_copy_(0, index, data.to(device))
                num_bytes += data.numel() * data.element_size()
    if device.type == "cuda":
        # The step thread reports the load done once this returns: the copies must have landed.
        torch.cuda.current_stream(device).synchronize()
    return num_bytes
