"""Where `SharedStorageConnector` keeps KV on disk, and the file format.

Layout: ``<shared_storage_path>/<engine_id>/<request_id>/pp<p>_tp<t>.safetensors``, one file per
producer worker. A file holds, per layer the worker owns (drafter layers included), the tensor
``[num_blocks, 2, num_local_kv_heads, block_size, head_dim]`` of the blocks covering the saved
prompt tokens, in token order, plus the saved token ids under ``__token_ids__``. Its safetensors
metadata (`FileHeader`) names the global KV heads each layer's tensor holds, so a reader with a
different TP/PP split can pick the slices it needs by layer name and head range.

Writers write to a temporary name and ``os.replace`` it, so a reader sees a whole file or none.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import threading
import urllib.parse
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from kvtransfer.connector.config import KVTransferConfig

FORMAT = "kvtransfer.shared_storage.v1"
TOKEN_IDS_KEY = "__token_ids__"
DEFAULT_LOAD_TIMEOUT_S = 10.0
_EXTRA_KEYS = ("shared_storage_path", "load_timeout_s", "delete_after_load")
# Longest id kept readable on disk; longer ones are hashed (file systems cap names at 255).
_MAX_COMPONENT = 128


class StorageFormatError(ValueError):
    """A file that is not a whole, well-formed file of this connector."""


@dataclass(frozen=True)
class SharedStorageConfig:
    """The connector's own keys of ``kv_connector_extra_config``, checked."""

    root: Path
    load_timeout_s: float = DEFAULT_LOAD_TIMEOUT_S
    delete_after_load: bool = False

    @classmethod
    def from_transfer_config(cls, config: KVTransferConfig) -> SharedStorageConfig:
        extra = config.kv_connector_extra_config
        unknown = sorted(set(extra) - set(_EXTRA_KEYS))
        if unknown:
            raise ValueError(
                f"SharedStorageConnector: unknown kv_connector_extra_config key(s) {unknown}; "
                f"known keys are {list(_EXTRA_KEYS)}"
            )
        return cls(
            root=_storage_root(extra.get("shared_storage_path")),
            load_timeout_s=_load_timeout(extra.get("load_timeout_s", DEFAULT_LOAD_TIMEOUT_S)),
            delete_after_load=_delete_after_load(extra.get("delete_after_load", False)),
        )

    def request_dir(self, engine_id: str, request_id: str) -> Path:
        """The directory of one produced request; ids cannot escape ``root``."""
        return self.root / path_component(engine_id) / path_component(request_id)


def _storage_root(raw: Any) -> Path:
    key = "kv_connector_extra_config.shared_storage_path"
    if raw is None:
        raise ValueError(f"SharedStorageConnector needs {key}: the directory shared by all engines")
    if not isinstance(raw, str) or not raw.strip():
        raise ValueError(f"{key} must be a non-empty string, got {raw!r}")
    path = Path(raw).expanduser()
    # A relative path depends on each process's working directory; accept it only when it
    # already names a directory, so a typo cannot silently create a private one.
    if not path.is_absolute() and not path.is_dir():
        raise ValueError(f"{key} {raw!r} is relative and no such directory exists")
    path = path.resolve()
    if path.exists() and not path.is_dir():
        raise ValueError(f"{key} {raw!r} exists but is not a directory")
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ValueError(f"{key} {raw!r} cannot be created: {exc}") from exc
    return path


def _load_timeout(raw: Any) -> float:
    if (
        isinstance(raw, bool)
        or not isinstance(raw, int | float)
        or not math.isfinite(raw)
        or raw <= 0
    ):
        raise ValueError(
            f"kv_connector_extra_config.load_timeout_s must be a positive number of seconds, "
            f"got {raw!r}"
        )
    return float(raw)


def _delete_after_load(raw: Any) -> bool:
    if not isinstance(raw, bool):
        raise ValueError(f"kv_connector_extra_config.delete_after_load must be a bool, got {raw!r}")
    return raw


def path_component(name: str) -> str:
    """``name`` as one safe path component: never ``.``/``..``, never a separator, and two
    different names never map to the same component."""
    # quote leaves only [A-Za-z0-9_.~-] and %XX; escaping "." too rules out "." and "..".
    quoted = urllib.parse.quote(name, safe="").replace(".", "%2E")
    if quoted and len(quoted) <= _MAX_COMPONENT:
        return quoted
    # "%h" never appears in quote's output, so hashed names cannot collide with quoted ones.
    return "%h" + hashlib.sha256(name.encode()).hexdigest()


def worker_file_name(pp_rank: int, tp_rank: int) -> str:
    return f"pp{pp_rank}_tp{tp_rank}.safetensors"


def expected_files(directory: Path, pp_size: int, tp_size: int) -> list[Path]:
    """Every file a producer with this TP x PP split writes for one request."""
    return [directory / worker_file_name(p, t) for p in range(pp_size) for t in range(tp_size)]


@dataclass(frozen=True)
class HeadSlice:
    """The global KV heads ``[start, end)`` of ``total`` that one layer tensor holds."""

    start: int
    end: int
    total: int

    def __post_init__(self) -> None:
        if not 0 <= self.start < self.end <= self.total:
            raise StorageFormatError(
                f"invalid head slice [{self.start},{self.end}) of {self.total} heads"
            )


@dataclass(frozen=True)
class FileHeader:
    """What one producer worker's file says about itself (its safetensors metadata)."""

    engine_id: str
    request_id: str
    num_tokens: int
    block_size: int
    dtype: str
    pp_rank: int
    tp_rank: int
    pp_size: int
    tp_size: int
    layers: dict[str, HeadSlice]

    def to_metadata(self) -> dict[str, str]:
        fields = {
            "format": FORMAT,
            "engine_id": self.engine_id,
            "request_id": self.request_id,
            "dtype": self.dtype,
            "layers": json.dumps({n: [s.start, s.end, s.total] for n, s in self.layers.items()}),
        }
        for name in ("num_tokens", "block_size", "pp_rank", "tp_rank", "pp_size", "tp_size"):
            fields[name] = str(getattr(self, name))
        return fields

    @classmethod
    def from_metadata(cls, metadata: dict[str, str] | None) -> FileHeader:
        if not metadata or metadata.get("format") != FORMAT:
            found = None if not metadata else metadata.get("format")
            raise StorageFormatError(f"not a {FORMAT} file (format {found!r})")
        try:
            numbers = {
                name: int(metadata[name])
                for name in ("num_tokens", "block_size", "pp_rank", "tp_rank", "pp_size", "tp_size")
            }
            layers = {
                name: HeadSlice(int(start), int(end), int(total))
                for name, (start, end, total) in json.loads(metadata["layers"]).items()
            }
            return cls(
                engine_id=metadata["engine_id"],
                request_id=metadata["request_id"],
                dtype=metadata["dtype"],
                layers=layers,
                **numbers,
            )
        except (AttributeError, KeyError, TypeError, ValueError) as exc:
            raise StorageFormatError(f"malformed {FORMAT} metadata: {exc!r}") from exc


@dataclass(frozen=True)
class HeadRead:
    """Copy heads ``[file_start, file_end)`` of one layer tensor of ``path`` into the local
    heads ``[local_start, local_start + file_end - file_start)``."""

    path: Path
    file_start: int
    file_end: int
    local_start: int

    @property
    def local_end(self) -> int:
        return self.local_start + self.file_end - self.file_start


def plan_reads(
    wanted: dict[str, HeadSlice], available: dict[Path, FileHeader]
) -> dict[str, list[HeadRead]]:
    """For each wanted layer, the file slices that cover its heads exactly once.

    Raises `StorageFormatError` when no file holds a layer or some of its heads, or when the
    producer split a layer into a different number of heads than the reader (replicated heads
    under TP > num_kv_heads cannot be told apart from distinct ones).
    """
    plan: dict[str, list[HeadRead]] = {}
    for layer, want in wanted.items():
        sources = sorted(
            (
                (header.layers[layer], path)
                for path, header in available.items()
                if layer in header.layers
            ),
            key=lambda source: (source[0].start, str(source[1])),
        )
        if not sources:
            raise StorageFormatError(f"no producer file holds layer {layer!r}")
        reads: list[HeadRead] = []
        cursor = want.start
        for have, path in sources:
            if have.total != want.total:
                raise StorageFormatError(
                    f"layer {layer!r}: the producer split it into {have.total} KV heads, this "
                    f"worker into {want.total} (TP layouts that replicate heads only match "
                    "the same TP size)"
                )
            if cursor == want.end or have.start > cursor:
                break
            if have.end <= cursor:
                continue
            end = min(have.end, want.end)
            reads.append(HeadRead(path, cursor - have.start, end - have.start, cursor - want.start))
            cursor = end
        if cursor < want.end:
            raise StorageFormatError(
                f"no producer file holds KV heads [{cursor},{want.end}) of layer {layer!r}"
            )
        plan[layer] = reads
    return plan


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def write_worker_file(
    path: Path, header: FileHeader, tensors: dict[str, torch.Tensor], token_ids: torch.Tensor
) -> int:
    """Write one worker's slice atomically; returns the bytes of KV written."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
    try:
        save_file({**tensors, TOKEN_IDS_KEY: token_ids}, tmp, metadata=header.to_metadata())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    return sum(t.numel() * t.element_size() for t in tensors.values())


def read_header(handle: Any) -> FileHeader:
    """The header of an open ``safe_open`` handle, checked against the tensors it lists."""
    header = FileHeader.from_metadata(handle.metadata())
    keys = set(handle.keys())
    missing = sorted(set(header.layers) - keys)
    if missing or TOKEN_IDS_KEY not in keys:
        raise StorageFormatError(f"file lacks tensors {missing or [TOKEN_IDS_KEY]}")
    return header


def open_file(path: Path) -> Any:
    """``safe_open`` on CPU; any failure to parse becomes `StorageFormatError`."""
    try:
        return safe_open(str(path), framework="pt", device="cpu")
    except Exception as exc:  # safetensors raises its own error types for broken files
        raise StorageFormatError(f"cannot read {path.name}: {exc}") from exc
