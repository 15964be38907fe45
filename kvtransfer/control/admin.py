"""What `KVAdmin` reports and acts on: the `AdminBackend` protocol and its records.

The server owns the gRPC side (and the log level); an engine only implements `AdminBackend`.
Backend methods are called from a worker thread of the server, never from the engine's step
loop, so they must be thread-safe and quick (take a lock, copy, return).
"""

from __future__ import annotations

import enum
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Protocol, TypeVar, runtime_checkable

from kvtransfer.v1 import admin_pb2

_E = TypeVar("_E", bound=enum.IntEnum)


class HandshakeState(enum.IntEnum):
    UNSPECIFIED = admin_pb2.HANDSHAKE_STATE_UNSPECIFIED  # also: a value this client predates
    PENDING = admin_pb2.HANDSHAKE_STATE_PENDING
    READY = admin_pb2.HANDSHAKE_STATE_READY
    FAILED = admin_pb2.HANDSHAKE_STATE_FAILED


class TransferDirection(enum.IntEnum):
    UNSPECIFIED = admin_pb2.TRANSFER_DIRECTION_UNSPECIFIED
    SEND = admin_pb2.TRANSFER_DIRECTION_SEND
    RECV = admin_pb2.TRANSFER_DIRECTION_RECV


@dataclass(frozen=True)
class EngineStatus:
    role: str
    engine_id: str
    model: str
    tp_size: int
    pp_size: int
    num_free_blocks: int
    num_used_blocks: int
    uptime_s: float
    counters: Mapping[str, int] = field(default_factory=dict)
    num_running_requests: int = 0
    num_waiting_requests: int = 0
    # `placement.Placement`: where it computes ("" and () when unknown).
    host_id: str = ""
    cpus: tuple[int, ...] = ()


@dataclass(frozen=True)
class PeerInfo:
    engine_id: str
    address: str
    state: HandshakeState
    generation: int = 0
    last_handshake_latency_ms: float = 0.0


@dataclass(frozen=True)
class TransferInfo:
    request_id: str
    peer_engine_id: str
    direction: TransferDirection
    num_blocks: int
    num_bytes: int
    age_s: float


@runtime_checkable
class AdminBackend(Protocol):
    def status(self) -> EngineStatus: ...

    def peers(self) -> Sequence[PeerInfo]: ...

    def transfers(self) -> Sequence[TransferInfo]: ...

    def abort(self, request_id: str) -> bool:
        """Abort ``request_id``'s transfers; ``False`` when no such request is known."""
        ...

    def drain(self) -> int:
        """Stop accepting new transfers; returns how many are still in flight."""
        ...


class BasicAdminBackend:
    """An in-memory `AdminBackend` for the demo and tests; engines feed it as things happen."""

    def __init__(
        self,
        *,
        role: str,
        engine_id: str,
        model: str,
        tp_size: int = 1,
        pp_size: int = 1,
        num_blocks: int = 0,
    ) -> None:
        self._lock = threading.Lock()
        self._started = time.monotonic()
        self._identity = (role, engine_id, model, tp_size, pp_size)
        self._num_blocks = num_blocks
        self._num_used_blocks = 0
        self._counters: dict[str, int] = {}
        self._peers: dict[str, PeerInfo] = {}
        # request id -> (record with age 0, monotonic start)
        self._transfers: dict[str, tuple[TransferInfo, float]] = {}
        self._draining = False

    @property
    def draining(self) -> bool:
        return self._draining

    def count(self, name: str, increment: int = 1) -> None:
        with self._lock:
            self._counters[name] = self._counters.get(name, 0) + increment

    def set_num_used_blocks(self, num_used_blocks: int) -> None:
        if not 0 <= num_used_blocks <= self._num_blocks:
            raise ValueError(f"num_used_blocks must be in [0, {self._num_blocks}]")
        with self._lock:
            self._num_used_blocks = num_used_blocks

    def record_peer(self, peer: PeerInfo) -> None:
        with self._lock:
            self._peers[peer.engine_id] = peer

    def start_transfer(
        self,
        request_id: str,
        peer_engine_id: str,
        direction: TransferDirection,
        num_blocks: int,
        num_bytes: int,
    ) -> None:
        with self._lock:
            if self._draining:
                raise RuntimeError(f"draining: not starting a transfer for {request_id!r}")
            info = TransferInfo(request_id, peer_engine_id, direction, num_blocks, num_bytes, 0.0)
            self._transfers[request_id] = (info, time.monotonic())

    def finish_transfer(self, request_id: str) -> None:
        with self._lock:
            self._transfers.pop(request_id, None)

    def status(self) -> EngineStatus:
        role, engine_id, model, tp_size, pp_size = self._identity
        with self._lock:
            return EngineStatus(
                role=role,
                engine_id=engine_id,
                model=model,
                tp_size=tp_size,
                pp_size=pp_size,
                num_free_blocks=self._num_blocks - self._num_used_blocks,
                num_used_blocks=self._num_used_blocks,
                uptime_s=time.monotonic() - self._started,
                counters=dict(self._counters),
            )

    def peers(self) -> list[PeerInfo]:
        with self._lock:
            return list(self._peers.values())

    def transfers(self) -> list[TransferInfo]:
        now = time.monotonic()
        with self._lock:
            return [replace(info, age_s=now - start) for info, start in self._transfers.values()]

    def abort(self, request_id: str) -> bool:
        with self._lock:
            found = self._transfers.pop(request_id, None) is not None
            if found:
                self._counters["aborted_requests"] = self._counters.get("aborted_requests", 0) + 1
            return found

    def drain(self) -> int:
        with self._lock:
            self._draining = True
            return len(self._transfers)


# ------------------------------------------------------------------ proto conversion


def status_to_proto(status: EngineStatus, api_version: int) -> admin_pb2.GetStatusResponse:
    return admin_pb2.GetStatusResponse(
        api_version=api_version,
        role=status.role,
        engine_id=status.engine_id,
        model=status.model,
        tp_size=status.tp_size,
        pp_size=status.pp_size,
        num_free_blocks=status.num_free_blocks,
        num_used_blocks=status.num_used_blocks,
        uptime_s=status.uptime_s,
        counters=dict(status.counters),
        num_running_requests=status.num_running_requests,
        num_waiting_requests=status.num_waiting_requests,
        host_id=status.host_id,
        cpus=list(status.cpus),
    )


def status_from_proto(message: admin_pb2.GetStatusResponse) -> EngineStatus:
    return EngineStatus(
        role=message.role,
        engine_id=message.engine_id,
        model=message.model,
        tp_size=message.tp_size,
        pp_size=message.pp_size,
        num_free_blocks=message.num_free_blocks,
        num_used_blocks=message.num_used_blocks,
        uptime_s=message.uptime_s,
        counters=dict(message.counters),
        num_running_requests=message.num_running_requests,
        num_waiting_requests=message.num_waiting_requests,
        host_id=message.host_id,
        cpus=tuple(message.cpus),
    )


def peer_to_proto(peer: PeerInfo) -> admin_pb2.PeerInfo:
    return admin_pb2.PeerInfo(
        engine_id=peer.engine_id,
        address=peer.address,
        state=int(peer.state),
        generation=peer.generation,
        last_handshake_latency_ms=peer.last_handshake_latency_ms,
    )


def peer_from_proto(message: admin_pb2.PeerInfo) -> PeerInfo:
    return PeerInfo(
        engine_id=message.engine_id,
        address=message.address,
        state=_lenient(HandshakeState, message.state),
        generation=message.generation,
        last_handshake_latency_ms=message.last_handshake_latency_ms,
    )


def transfer_to_proto(transfer: TransferInfo) -> admin_pb2.TransferInfo:
    return admin_pb2.TransferInfo(
        request_id=transfer.request_id,
        peer_engine_id=transfer.peer_engine_id,
        direction=int(transfer.direction),
        num_blocks=transfer.num_blocks,
        num_bytes=transfer.num_bytes,
        age_s=transfer.age_s,
    )


def transfer_from_proto(message: admin_pb2.TransferInfo) -> TransferInfo:
    return TransferInfo(
        request_id=message.request_id,
        peer_engine_id=message.peer_engine_id,
        direction=_lenient(TransferDirection, message.direction),
        num_blocks=message.num_blocks,
        num_bytes=message.num_bytes,
        age_s=message.age_s,
    )


def _lenient(enum_cls: type[_E], value: int) -> _E:
    # A newer server may send values this client does not know; show them as UNSPECIFIED.
    try:
        return enum_cls(value)
    except ValueError:
        return enum_cls(0)
