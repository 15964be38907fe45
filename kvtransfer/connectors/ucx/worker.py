"""The worker half of `UcxConnector`: this worker's transfer agent, its loads and releases.

Every worker owns one `KVTransferAgent` over its registered caches (drafter layers included); a
producer's agent serves pulls from a background thread, so blocks are read while the engine keeps
stepping, and only for leases the scheduler half granted (`LeaseGrants`): a release or expiry in
the step's metadata ends the grant before the request is reported ``finished_sending``, so no pull
reads blocks the engine is about to reuse. A consumer runs each `LoadSpec` as a `LoadJob` on a
small thread pool: the handshake, UCX connects, pulls and the producer's liveness probes never
run on the step thread, and finished or failed loads are reported exactly once
through `transfer_results`. No worker hook waits for a transfer: a load of an aborted request
is stopped without waiting and reported (failed, its blocks still borrowed until then) once its
loader stopped writing, at once if no pull had begun. Producer releases decided by the
scheduler half are reported as ``finished_sending`` in the step that carries them.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, replace

import torch

from kvtransfer.connector.base import TransferResults
from kvtransfer.connector.completions import CompletionQueue
from kvtransfer.connector.config import KVTransferConfig
from kvtransfer.connector.metadata import KVCacheLayout, KVConnectorStats, canonical_kv_caches
from kvtransfer.connector.serving import PROTOCOL_PREFIX
from kvtransfer.connector.watchdog import LOAD_HOOK, process_watchdog
from kvtransfer.connectors.ucx.config import UcxConfig
from kvtransfer.connectors.ucx.identity import WorkerIdentity
from kvtransfer.connectors.ucx.layer_ready import LayerReadiness, cuda_event
from kvtransfer.connectors.ucx.loaders import LoaderThreads
from kvtransfer.connectors.ucx.loads import LoadCancelled, LoadJob, LoadOutcome
from kvtransfer.connectors.ucx.metadata import (
    LoadSpec,
    RemotePrefill,
    UcxConnectorMetadata,
    UcxHandshakeMetadata,
    kernel_block_ids,
)
from kvtransfer.connectors.ucx.notify import Notifier
from kvtransfer.connectors.ucx.remote import RemoteEngine, RemoteEngines, encode_agent_address
from kvtransfer.transport import KVTransferAgent, LeaseGrants, TransportConfig

logger = logging.getLogger(__name__)

# Past its transfer timeout plus this, a load still running is reported by the watchdog (the
# load's own result wait gives up 5 s after the timeout: `loads._RESULT_GRACE_S`).
_LOAD_OVERDUE_GRACE_S = 10.0
# UCX's description of a protocol it picked, cut to this length in its counter's name.
_PROTOCOL_TEXT = 160


@dataclass(frozen=True)
class _Finished:
    spec: LoadSpec
    outcome: LoadOutcome | None = None
    error: BaseException | None = None
    cancelled: bool = False


class UcxWorker:
    def __init__(
        self, config: KVTransferConfig, ucx: UcxConfig, layout: KVCacheLayout | None
    ) -> None:
        self._config = config
        self._ucx = ucx
        self._layout = layout
        self._identity: WorkerIdentity | None = None
        self._agent: KVTransferAgent | None = None
        self._engines: RemoteEngines | None = None
        # The canonical views registered; kept while the engine sleeps (no agent then).
        self._caches: dict[str, torch.Tensor] | None = None
        self._asleep = False
        self._pool: LoaderThreads | None = None
        self._notifier = Notifier(timeout_s=ucx.handshake_timeout_s, tls=ucx.tls)
        # Loads not reported yet, by request id; the job is None for one that could not start.
        self._loads: dict[str, tuple[LoadSpec, LoadJob | None]] = {}
        # Loads of aborted requests, stopping on their loader threads: reported when they end.
        self._aborted: set[str] = set()
        # Queueing a result wakes the engine (`set_completion_callback`).
        self._results: CompletionQueue[_Finished] = CompletionQueue()
        self._released: list[str] = []
        self._grants = LeaseGrants()
        # Push data plane, on a consumer: its grants of its blocks to the producers writing them.
        self._push_grants: LeaseGrants | None = None
        if ucx.data_plane == "push" and config.is_kv_consumer:
            self._push_grants = LeaseGrants()
        # Leases granted this step while their KV is computed: served layer by layer.
        self._streaming: list[str] = []
        # Host caches until registered (a GPU's layers wait for their CUDA event).
        self._readiness = LayerReadiness(self._grants)
        self._load_errors: set[int] = set()
        self._failure_reasons: dict[str, str] = {}
        self._stats_lock = threading.Lock()
        self._stats: dict[str, float | list[float]] = {}
        self._pulls_served = 0
        self._naps_seen = (0, 0)
        self._protocols_seen: set[str] = set()
        self._bytes_served = 0
        self._bytes_per_block = 0
        self._closed = False

    # ------------------------------------------------------------------ set-up

    @property
    def agent(self) -> KVTransferAgent | None:
        return self._agent

    @property
    def identity(self) -> WorkerIdentity | None:
        return self._identity

    @property
    def remote_engines(self) -> list[RemoteEngine]:
        """Producers this worker has handshaken with (cached)."""
        return [] if self._engines is None else self._engines.cached()

    def load_job(self, req_id: str) -> LoadJob | None:
        """The load of ``req_id`` not reported yet, if it is running."""
        entry = self._loads.get(req_id)
        return None if entry is None else entry[1]

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        if self._caches is not None:
            raise RuntimeError("UcxConnector: register_kv_caches was already called")
        kv_caches = canonical_kv_caches(kv_caches, self._layout)
        identity = WorkerIdentity.from_caches(self._config.engine_id, self._layout, kv_caches)
        kv_caches = identity.transport_caches(kv_caches)
        self._attach(kv_caches, identity)
        self._caches, self._identity = kv_caches, identity
        self._bytes_per_block = identity.bytes_per_block
        if any(t.device.type == "cuda" for t in kv_caches.values()):
            self._readiness = LayerReadiness(self._grants, cuda_event)

    def _attach(self, kv_caches: dict[str, torch.Tensor], identity: WorkerIdentity) -> None:
        """A new transfer agent over ``kv_caches`` (registered, serving on a producer)."""
        agent = KVTransferAgent(
            TransportConfig(
                timeout_s=self._ucx.transfer_timeout_s,
                connect_timeout_s=self._ucx.handshake_timeout_s,
                net_devices=self._ucx.ucx_net_devices(),
                checksum=self._ucx.payload_checksum,
                # Pushes are one-sided writes: the rest of the RMA machinery, keys included.
                data_plane="rma" if self._ucx.data_plane == "push" else self._ucx.data_plane,
            )
        )
        try:
            agent.register_kv_caches(kv_caches)
            if self._config.is_kv_producer:
                agent.start_server(self._grants, pushes=self._ucx.data_plane == "push")
            elif self._push_grants is not None:
                agent.start_server(push_grants=self._push_grants)
        except BaseException:
            agent.close()
            raise
        self._agent = agent
        if self._config.is_kv_consumer:
            self._loaders()
        self._pulls_served = self._bytes_served = 0  # the new server counts from zero
        self._naps_seen = (0, 0)  # and the new loop
        self._engines = RemoteEngines(
            identity,
            agent,
            self._ucx.handshake_timeout_s,
            self._record_handshake,
            tls=self._ucx.tls,
        )

    def unregister_kv_caches(self) -> None:
        """The engine sleeps: every grant ends, the agent (its memory registrations, remote
        keys and server) is closed; loads still running are cancelled (reported failed).
        Idempotent."""
        if self._agent is None:
            return
        for _, job in list(self._loads.values()):
            if job is not None:
                job.cancel()
        self._grants.revoke(self._grants.lease_ids(), "has ended: the producer went to sleep")
        if self._push_grants is not None:
            self._push_grants.revoke(self._push_grants.lease_ids(), "has ended: the engine sleeps")
        agent, self._agent, self._engines = self._agent, None, None
        agent.close()
        self._asleep = True

    def restore_kv_caches(self) -> None:
        """The engine woke up: a new agent over the same tensors (new address, new keys), so
        the handshake metadata changes and the engine publishes it under a new generation.
        Idempotent; nothing to do before `register_kv_caches`."""
        if self._agent is not None or self._caches is None or self._identity is None:
            return
        self._attach(self._caches, self._identity)
        self._asleep = False

    def handshake_metadata(self) -> UcxHandshakeMetadata | None:
        if self._identity is None or self._agent is None:
            return None
        # Only a producer has KV to offer one-sided.
        offered = self._ucx.data_plane if self._config.is_kv_producer else "tagged"
        return self._identity.handshake(encode_agent_address(self._agent.address), offered)

    # ------------------------------------------------------------------ per step

    def start_load_kv(self, metadata: UcxConnectorMetadata) -> None:
        # The previous step ran every layer: whatever it did not report saved is complete.
        self._readiness.step_done(self._streaming)
        self._streaming = [g.req_id for g in metadata.grants if g.streaming]
        layers = tuple(self._agent.kv_caches) if self._agent is not None else ()
        kernel_blocks = 1 if self._identity is None else self._identity.kernel_blocks
        for grant in metadata.grants:
            self._grants.grant(
                grant.req_id,
                grant.secret_digest,
                kernel_block_ids(grant.block_ids, kernel_blocks),
                grant.prompt_digest,
                pending_layers=layers if grant.streaming else (),
            )
        # No new read of these blocks starts; they are reported sent (and freed) once the
        # gathers already reading them ended (`transfer_results`), which the step never waits
        # for.
        ended = [r.req_id for r in metadata.releases if not r.expired]
        if ended:
            self._grants.revoke_nowait(ended, "has ended (its consumer released it)")
        expired = [r.req_id for r in metadata.releases if r.expired]
        if expired:
            self._grants.revoke_nowait(
                expired,
                f"expired: no keep-alive from its consumer within the {self._ucx.lease_s:g} s "
                "lease",
            )
        for release in metadata.releases:
            self._released.append(release.req_id)
            self._add("num_leases_expired" if release.expired else "num_sends", 1)
            if self._ucx.data_plane != "tagged" and release.num_blocks:
                # One-sided reads are never seen here: count what the consumer says it read.
                self._add("bytes_sent", release.num_blocks * self._bytes_per_block)
        for spec in metadata.loads:
            self._start_load(spec)

    def _start_load(self, spec: LoadSpec) -> None:
        if self._closed or self._agent is None or self._engines is None:
            self._loads[spec.req_id] = (spec, None)
            state = (
                "its KV caches are unregistered (the engine sleeps)"
                if self._asleep
                else "it has no registered KV caches or is shut down"
            )
            error = RuntimeError(f"UcxConnector worker cannot load: {state}")
            self._results.put(_Finished(spec, error=error))
            return
        if self._identity is not None and self._identity.kernel_blocks > 1:
            spec = replace(spec, kernel_blocks=self._identity.kernel_blocks)
        job = LoadJob(
            spec,
            self._engines,
            self._agent,
            self._ucx.transfer_timeout_s,
            self._notifier.ask_held,
            groups=self._identity.groups if self._identity is not None else None,
            push_grants=self._push_grants,
        )
        self._loads[spec.req_id] = (spec, job)
        self._loaders().submit(lambda: self._run(job))

    def _loaders(self) -> LoaderThreads:
        """The loader threads, started with the caches (`_attach`), never in a step."""
        if self._pool is None:
            self._pool = LoaderThreads(self._ucx.max_concurrent_loads)
        return self._pool

    def _run(self, job: LoadJob) -> None:
        # A load bounds itself by its transfer timeout; one still running well past it is a bug
        # of ours holding a loader thread (and maybe the request): logged with its stack.
        overdue_s = self._ucx.transfer_timeout_s + _LOAD_OVERDUE_GRACE_S
        watch = process_watchdog().watch(LOAD_HOOK, overdue_s, f"request {job.spec.req_id}")
        try:
            with watch:
                finished = _Finished(job.spec, outcome=job.run())
        except LoadCancelled:
            finished = _Finished(job.spec, cancelled=True)
        except BaseException as exc:
            finished = _Finished(job.spec, error=exc)
        self._results.put(finished)

    def transfer_results(self, finished_req_ids: Iterable[str]) -> TransferResults:
        if self._loads or (self._agent is not None and self._agent.server is not None):
            # An idle engine steps in a tight loop; without a yield per step the loader, pull,
            # serving and UCX progress threads wait for the GIL for hundreds of milliseconds.
            time.sleep(0)
        sending = self._grants.drained(self._released)
        self._released = [r for r in self._released if r not in sending]
        recving: set[str] = set()
        failed: set[str] = set()
        for finished in self._results.drain():
            spec = finished.spec
            entry = self._loads.get(spec.req_id)
            if entry is None or entry[0] is not spec:
                continue  # cancelled and reported already
            del self._loads[spec.req_id]
            recving.add(spec.req_id)
            if spec.req_id in self._aborted:
                self._aborted.discard(spec.req_id)
                finished = _Finished(spec, cancelled=True)  # whatever it reached: aborted
            if finished.cancelled:
                # Reported failed (it delivered nothing) but without load errors: its request
                # is gone and its blocks may already hold another request's KV.
                failed.add(spec.req_id)
                self._add("num_loads_cancelled", 1)
            elif finished.error is not None:
                failed.add(spec.req_id)
                self._failure_reasons[spec.req_id] = load_failure_reason(
                    spec.remote, finished.error
                )
                self._load_errors.update(spec.local_block_ids)
                self._add("num_loads_failed", 1)
                logger.warning(
                    "loading KV of request %s from engine %s failed: %s: %s",
                    spec.req_id,
                    spec.remote.engine_id,
                    type(finished.error).__name__,
                    finished.error,
                )
            elif finished.outcome is not None:
                self._add("num_loads", 1)
                self._add("blocks_received", finished.outcome.num_blocks)
                self._add("bytes_received", finished.outcome.num_bytes)
                self._add("bytes_received_one_sided", finished.outcome.one_sided_bytes)
                if finished.outcome.pushed:
                    self._add("num_loads_pushed", 1)
                    self._add("bytes_received_pushed", finished.outcome.num_bytes)
                for kind, num_bytes in finished.outcome.bytes_by_kind:
                    self._add(f"bytes_received_{kind}", num_bytes)
                self._append("transfer_s", finished.outcome.elapsed_s)
        for req_id in finished_req_ids:
            entry = self._loads.get(req_id)
            if entry is None or req_id in self._aborted:
                continue
            job = entry[1]
            if job is not None and not job.stop_nowait():
                # Pulls may be writing: reported when its loader has stopped them.
                self._aborted.add(req_id)
                continue
            del self._loads[req_id]
            recving.add(req_id)
            failed.add(req_id)
            self._add("num_loads_cancelled", 1)
        return sending or None, recving or None, failed or None

    def block_ids_with_load_errors(self) -> set[int]:
        errors, self._load_errors = self._load_errors, set()
        return errors

    def save_kv_layer(self, layer_name: str) -> None:
        """This step's KV of ``layer_name`` is written: streaming leases serve it from now."""
        self._readiness.saved(self._streaming, layer_name)

    def set_completion_callback(self, callback: Callable[[], None]) -> bool:
        return self._results.set_callback(callback)

    def load_failure_reasons(self) -> dict[str, str]:
        reasons, self._failure_reasons = self._failure_reasons, {}
        return reasons

    # ------------------------------------------------------------------ stats

    def _record_handshake(self, elapsed_s: float) -> None:
        self._add("num_handshakes", 1)
        self._append("handshake_ms", elapsed_s * 1e3)

    def _add(self, key: str, value: float) -> None:
        with self._stats_lock:
            self._stats[key] = self._stats.get(key, 0) + value  # type: ignore[operator]

    def _append(self, key: str, value: float) -> None:
        with self._stats_lock:
            values = self._stats.setdefault(key, [])
            values.append(value)  # type: ignore[union-attr]

    def stats(self) -> KVConnectorStats | None:
        if self._agent is not None:
            # Spins the UCX loop's pacing prevented: UCX woke it for nothing, or could not be
            # armed (issue 34); its thread stayed within a small share of a core meanwhile.
            naps = self._agent.loop_naps
            for key, now, before in zip(
                ("ucx_idle_naps", "ucx_busy_naps"), naps, self._naps_seen, strict=True
            ):
                if now > before:
                    self._add(key, now - before)
            self._naps_seen = naps
            # What UCX picked for one-sided operations, once each: a counter of its own in
            # the admin status, named by UCX's description (issue 36: a GPU read emulated in
            # software must be visible, not only slow).
            for what, text in self._agent.picked_protocols.items():
                if what not in self._protocols_seen:
                    self._protocols_seen.add(what)
                    self._add(f"{PROTOCOL_PREFIX}{what}: {text[:_PROTOCOL_TEXT]}", 1)
        server = self._agent.server if self._agent is not None else None
        if server is not None:
            # What crossed the wire, whoever asked and whatever became of the pull after: a
            # consumer's bytes_received is never more than this, and equal when nothing was
            # cancelled or refused on its side.
            served, served_bytes = server.requests_served, server.bytes_served
            if served > self._pulls_served:
                self._add("pull_messages_served", served - self._pulls_served)
                if self._ucx.data_plane == "tagged":
                    self._add("bytes_sent", served_bytes - self._bytes_served)
                self._pulls_served, self._bytes_served = served, served_bytes
        with self._stats_lock:
            if not self._stats:
                return None
            stats, self._stats = self._stats, {}
        return KVConnectorStats(data=stats)

    # ------------------------------------------------------------------ lifecycle

    def shutdown(self) -> None:
        if self._closed:
            return
        self._closed = True
        for _, job in list(self._loads.values()):
            if job is not None:
                job.cancel()
        if self._agent is not None:
            # Closing the agent fails pulls still in flight, so loader threads end promptly.
            self._agent.close()
        if self._pool is not None:
            self._pool.close()
        self._readiness.close()
        self._notifier.close()


def load_failure_reason(remote: RemotePrefill, error: BaseException) -> str:
    """Why a load failed, for the request's error: the error's type and text, and the
    producer it read from where the text does not name it already (a reset connection says
    nothing of whose)."""
    reason = f"{_public_name(error)}: {error}"
    producer = f"engine {remote.engine_id!r} at {remote.address}"
    return reason if producer in reason else f"{reason} (producer {producer})"


def _public_name(error: BaseException) -> str:
    """The error's type as a client may look it up (private subclasses named by their base)."""
    return next(t.__name__ for t in type(error).__mro__ if not t.__name__.startswith("_"))
