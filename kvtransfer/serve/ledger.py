"""`ServingLedger`: what a daemon remembers about the requests it served, for KVAdmin.

Cumulative counters, the producers a decode daemon pulled from (with how the last pull went),
and the prefill requests whose KV waits for a consumer. Written by gRPC handlers as requests
finish, read by admin calls: every method takes the lock.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, replace
from typing import Any

from kvtransfer.connector.kv_groups import num_listed_blocks
from kvtransfer.control.admin import HandshakeState, PeerInfo
from kvtransfer.engine.scheduler.request import EngineCoreOutput

COUNTERS = (
    "requests_started",
    "requests_finished",
    "requests_failed",
    "requests_aborted",
    "requests_rejected",
    "kv_blocks_sent",
    "kv_bytes_sent",
    "kv_blocks_received",
    "kv_bytes_received",
    "kv_tokens_received",
    "kv_tokens_recomputed",
    "kv_leases_expired",
    "kv_releases",
    "handshakes",
)


@dataclass(frozen=True)
class HeldKV:
    """A finished prefill request whose blocks stay for a decode engine."""

    request_id: str
    num_blocks: int
    num_bytes: int
    since: float


class ServingLedger:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counters = dict.fromkeys(COUNTERS, 0)
        self._peers: dict[str, PeerInfo] = {}
        self._held: dict[str, HeldKV] = {}

    def count(self, name: str, increment: int = 1) -> None:
        with self._lock:
            self._counters[name] = self._counters.get(name, 0) + increment

    def set_counter(self, name: str, value: int) -> None:
        with self._lock:
            self._counters[name] = value

    def counters(self) -> dict[str, int]:
        with self._lock:
            return dict(self._counters)

    # ------------------------------------------------------------------ requests

    def request_finished(self, output: EngineCoreOutput, bytes_per_block: int) -> None:
        """Count a request's end and what its KV transfers did."""
        reason = output.finish_reason or "error"
        stats = output.kv_stats
        with self._lock:
            key = {"error": "requests_failed", "abort": "requests_aborted"}.get(
                reason, "requests_finished"
            )
            self._counters[key] += 1
            if stats is not None:
                self._counters["kv_blocks_received"] += stats.num_loaded_blocks
                self._counters["kv_bytes_received"] += stats.num_loaded_blocks * bytes_per_block
                self._counters["kv_tokens_received"] += stats.num_loaded_tokens
                self._counters["kv_tokens_recomputed"] += stats.num_recomputed_tokens

    def hold(self, request_id: str, params: dict[str, Any], bytes_per_block: int) -> None:
        """A prefill request finished and keeps ``remote_block_ids`` for a consumer."""
        num_blocks = num_listed_blocks(params.get("remote_block_ids"))
        if not num_blocks:
            return
        with self._lock:
            self._held[request_id] = HeldKV(
                request_id, num_blocks, num_blocks * bytes_per_block, time.monotonic()
            )

    def held(self) -> list[HeldKV]:
        with self._lock:
            return list(self._held.values())

    def forget_held(self, request_ids: set[str]) -> None:
        with self._lock:
            for request_id in request_ids:
                self._held.pop(request_id, None)

    # ------------------------------------------------------------------ peers

    def record_load(self, params: dict[str, Any] | None, output: EngineCoreOutput) -> None:
        """A decode request that named a producer ended: remember how its load went."""
        if not params or not params.get("do_remote_prefill"):
            return
        engine_id = str(params.get("remote_engine_id", ""))
        if not engine_id:
            return
        stats = output.kv_stats
        if stats is not None and stats.num_loaded_blocks:
            state = HandshakeState.READY
        elif (stats is not None and stats.num_recomputed_tokens) or output.finish_reason == "error":
            state = HandshakeState.FAILED
        else:
            state = HandshakeState.PENDING
        address = f"{params.get('remote_host', '?')}:{params.get('remote_port', '?')}"
        generation = params.get("remote_generation")
        with self._lock:
            previous = self._peers.get(engine_id)
            if previous is not None and state is HandshakeState.PENDING:
                state = previous.state
            self._peers[engine_id] = replace(
                previous or PeerInfo(engine_id, address, state),
                address=address,
                state=state,
                generation=generation if isinstance(generation, int) else 0,
            )

    def set_handshake_latency(self, latency_ms: float) -> None:
        """The connector reports handshake latency per engine, not per peer: apply it to all."""
        with self._lock:
            for engine_id, peer in self._peers.items():
                self._peers[engine_id] = replace(peer, last_handshake_latency_ms=latency_ms)

    def peers(self) -> list[PeerInfo]:
        with self._lock:
            return sorted(self._peers.values(), key=lambda p: p.engine_id)
