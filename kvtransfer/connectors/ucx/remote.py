"""`RemoteEngines`: the producer engines a consumer worker has handshaken with, cached.

The first load from a producer (keyed by engine id and handshake address) fetches every
worker's payload over `KVHandshake` (engine id and compatibility hash checked by the client),
plans this worker's pulls (`plan.plan_pulls`) and connects UCX endpoints to just the workers
the plan reads. Later loads reuse all of it. An entry is dropped when a pull from it fails, and
bypassed when a request names another handshake generation (the producer restarted); either way
the next load handshakes again. Concurrent loads from one producer share one handshake.
Runs on the loader threads, never on the step thread.
"""

from __future__ import annotations

import base64
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from kvtransfer.clients.control import RetryPolicy, fetch_handshake_sync
from kvtransfer.connector.metadata import PpTpRank
from kvtransfer.connectors.ucx.identity import WorkerIdentity
from kvtransfer.connectors.ucx.liveness import ensure_reachable
from kvtransfer.connectors.ucx.metadata import RemotePrefill, UcxHandshakeMetadata
from kvtransfer.connectors.ucx.plan import (
    LocalTopologies,
    PlannedPull,
    check_remote_engine,
    plan_pulls,
)
from kvtransfer.control.security import TLSFiles
from kvtransfer.timeline import BOOK, now_ns
from kvtransfer.transport import KVTransferAgent, PeerHandle

logger = logging.getLogger(__name__)

HANDSHAKE_ATTEMPTS = 2
_RETRY = RetryPolicy(max_attempts=HANDSHAKE_ATTEMPTS, initial_backoff_s=0.05, max_backoff_s=0.5)


class StaleGenerationError(RuntimeError):
    """The producer restarted since it returned the request's params: the blocks are gone."""


@dataclass
class RemoteEngine:
    engine_id: str
    address: str
    generation: int
    metadata: dict[PpTpRank, UcxHandshakeMetadata]
    plan: tuple[PlannedPull, ...]
    peers: dict[PpTpRank, PeerHandle] = field(default_factory=dict)


# A handshake was made: (latency in seconds); for stats.
HandshakeObserver = Callable[[float], None]


class RemoteEngines:
    def __init__(
        self,
        identity: WorkerIdentity,
        agent: KVTransferAgent,
        handshake_timeout_s: float,
        on_handshake: HandshakeObserver,
        *,
        tls: TLSFiles | None = None,
    ) -> None:
        self._identity = identity
        self._tls = tls
        self._agent = agent
        self._compat = identity.compat()
        self._timeout_s = handshake_timeout_s
        self._on_handshake = on_handshake
        self._topologies = LocalTopologies.of(identity)
        self._lock = threading.Lock()  # guards _engines, _key_locks and the topologies
        self._engines: dict[tuple[str, str], RemoteEngine] = {}
        self._key_locks: dict[tuple[str, str], threading.Lock] = {}

    def cached(self) -> list[RemoteEngine]:
        """The producers handshaken with and still trusted, in no particular order."""
        with self._lock:
            return list(self._engines.values())

    @property
    def wait_bound_s(self) -> float:
        """Longest a `get` waits (handshake attempts with back-off, then connects)."""
        return HANDSHAKE_ATTEMPTS * self._timeout_s + 1.0 + self._timeout_s

    def get(self, remote: RemotePrefill, request_id: str | None = None) -> RemoteEngine:
        """The handshaken, connected producer of ``remote``; handshakes on a miss (a
        ``kv.handshake`` span on ``request_id``'s timeline)."""
        key = (remote.engine_id, remote.address)
        cached = self._cached(key, remote.generation)
        if cached is not None:
            return cached
        with self._lock:
            key_lock = self._key_locks.setdefault(key, threading.Lock())
        if not key_lock.acquire(timeout=self.wait_bound_s):
            raise TimeoutError(
                f"waited {self.wait_bound_s:g} s for another handshake with engine "
                f"{remote.engine_id!r} at {remote.address}"
            )
        try:
            # Another load may have finished the handshake while this one waited.
            cached = self._cached(key, remote.generation)
            if cached is not None:
                return cached
            started = now_ns()
            engine = self._handshake(remote)
            if request_id is not None:
                BOOK.record(request_id, "kv.handshake", started, now_ns(), peer=remote.address)
            with self._lock:
                self._engines[key] = engine
            return engine
        finally:
            key_lock.release()

    def invalidate(self, engine: RemoteEngine) -> None:
        """Forget ``engine`` (a pull from it failed); the next load handshakes again."""
        key = (engine.engine_id, engine.address)
        with self._lock:
            if self._engines.get(key) is engine:
                del self._engines[key]
                self._topologies.unregister(engine.engine_id)

    def _cached(self, key: tuple[str, str], generation: int | None) -> RemoteEngine | None:
        with self._lock:
            engine = self._engines.get(key)
        if engine is None or generation is None or engine.generation == generation:
            return engine
        return None

    def _handshake(self, remote: RemotePrefill) -> RemoteEngine:
        ensure_reachable(remote)
        started = time.perf_counter()
        fetched = fetch_handshake_sync(
            remote.address,
            remote.engine_id,
            self._compat,
            UcxHandshakeMetadata,
            timeout_s=self._timeout_s,
            retry=_RETRY,
            tls=self._tls,
        )
        self._on_handshake(time.perf_counter() - started)
        if remote.generation is not None and fetched.generation != remote.generation:
            raise StaleGenerationError(
                f"engine {remote.engine_id!r} at {remote.address} restarted or re-registered "
                f"its KV cache (slept and woke up): it serves handshake generation "
                f"{fetched.generation}, the request's KV was produced by generation "
                f"{remote.generation}"
            )
        metadata = dict(fetched.metadata)
        check_remote_engine(remote, metadata)
        with self._lock:
            # A restarted producer keeps its engine id: drop what the old one registered.
            self._topologies.unregister(remote.engine_id)
            plan = plan_pulls(self._identity, self._topologies, remote.engine_id, metadata)
        engine = RemoteEngine(
            remote.engine_id, remote.address, fetched.generation, metadata, tuple(plan)
        )
        for rank in sorted({pull.remote_rank for pull in plan}):
            md = metadata[rank]
            engine.peers[rank] = self._agent.connect(
                md.agent_address_bytes(),
                layouts=md.layouts(),
                one_sided=md.data_plane in ("rma", "push"),
            )
        logger.debug(
            "handshake with engine %s at %s (generation %d): %d pull(s) per request from %s",
            remote.engine_id,
            remote.address,
            fetched.generation,
            len(plan),
            sorted(engine.peers),
        )
        return engine


def encode_agent_address(address: bytes) -> str:
    return base64.b64encode(address).decode("ascii")
