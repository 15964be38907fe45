"""`KVTransferAgent`: one per worker process, serving and pulling KV blocks over UCX.

It owns one `UcxLoop` (UCX context, worker and the event-driven progress thread), the
registered KV caches, an optional `KVServer` and a `PullClient`. Creating an agent initialises
UCX; importing this module does not.

    agent = KVTransferAgent()
    agent.register_kv_caches(kv_caches)
    agent.start_server()                   # prefill side
    publish(agent.address, agent.kv_layouts())
    peer = agent.connect(address)          # decode side
    handle = agent.pull(peer, PullSpec(...))
    handle.result()
    agent.close()
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Mapping
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass, replace
from types import MappingProxyType, TracebackType
from typing import TypeVar

import torch

from kvtransfer.timeline import BOOK
from kvtransfer.transport.access import LeaseAccess, LeaseGrants
from kvtransfer.transport.buffers import BufferPool
from kvtransfer.transport.client import PeerHandle, PullClient, PullHandle, lease_fields
from kvtransfer.transport.errors import (
    ErrorCode,
    PeerUnreachable,
    RemoteTransferError,
    TransferTimeoutError,
    TransportClosed,
    TransportError,
)
from kvtransfer.transport.lease_table import LeaseTable
from kvtransfer.transport.locality import WorkerAddresses
from kvtransfer.transport.messages import (
    PushAskMessage,
    decode_address,
    encode_address,
    peer_name,
)
from kvtransfer.transport.pusher import Pusher
from kvtransfer.transport.rma import (
    ReadControl,
    ReadCounters,
    RmaExporter,
    RmaKeys,
    RmaPeer,
    RmaReader,
)
from kvtransfer.transport.rma_layout import LayerMemory
from kvtransfer.transport.server import KVServer
from kvtransfer.transport.spec import KVLayout, PullSpec, check_kv_cache, plan_pull
from kvtransfer.transport.ucp_rma import picked_protocols
from kvtransfer.transport.ucx import UcxLoop

logger = logging.getLogger(__name__)

T = TypeVar("T")


DATA_PLANES = ("rma", "tagged")
# A pull waiting for another pull's keys request checks its deadline, cancel and probe this often.
_KEYS_LOCK_POLL_S = 0.05
# A push asks again this soon (doubling to the second) while its grant is not recorded yet.
_GRANT_RETRY_S = (0.002, 0.1)


def _positive(name: str, value: object, *, integer: bool = True) -> None:
    kinds: tuple[type, ...] = (int,) if integer else (int, float)
    if isinstance(value, bool) or not isinstance(value, kinds):
        raise ValueError(f"{name} must be {'an int' if integer else 'a number'}, got {value!r}")
    if value <= 0:
        raise ValueError(f"{name} must be > 0, got {value}")


@dataclass(frozen=True)
class TransportConfig:
    """Tuning of one agent. Times are seconds, sizes bytes."""

    # A pull fails with TransferTimeoutError after this long (dead peers are found this way).
    timeout_s: float = 30.0
    # A served response not taken by the client within this long resets its connection.
    send_timeout_s: float = 30.0
    connect_timeout_s: float = 10.0
    # Upper bound of one response message; larger pulls are split into several.
    chunk_bytes: int = 32 << 20
    # Messages of one pull in flight at once (overlaps gather, wire and scatter).
    max_inflight_chunks: int = 2
    # A pull of one message of at most this size is gathered and sent on the server's UCX
    # thread and scattered on the client's: no thread hand-off on either side (on a 2-vCPU VM
    # each cost ~0.1-0.3 ms). Larger ones go through the handler and pull threads, so that
    # their gather, wire and scatter overlap and the UCX threads keep progressing other pulls.
    inline_bytes: int = 2 << 20
    # Bounds the request size for tiny blocks (8 bytes per block id).
    max_blocks_per_message: int = 65536
    pull_threads: int = 4
    server_threads: int = 1
    # Idle message buffers kept for reuse.
    buffer_pool_bytes: int = 256 << 20
    # Served payloads carry their xxh3-64, checked by the puller before anything is written.
    # Off by default: on a 2-vCPU VM it cost 11-34% of pull throughput (transfer benchmark).
    checksum: bool = False
    # UCX network devices KV traffic may use ("eth0", "mlx5_0:1,eth0"): UCX listens, advertises
    # and dials only there. None leaves it to UCX (UCX_NET_DEVICES, else every interface).
    net_devices: str | None = None
    # Shared memory with peers on this host and in this network namespace; False: always the
    # network (see `locality`), and no CUDA IPC handles published.
    shared_memory: bool = True
    # GPU caches publish CUDA IPC handles to peers on this host, which copy a whole pull or
    # push with a few kernels (see `cuda_ipc`); False: UCX's cuda_ipc, one operation per run.
    cuda_ipc: bool = True
    # "rma": a server also hands its UCX remote keys to peers that present a valid lease, and
    # pulls from peers that offer them read one-sided (see `rma`); "tagged": every read is a
    # request the server checks and answers (see `server`).
    data_plane: str = "rma"
    # RMA mode: how long a reader waits for its lease to appear in the producer's lease table.
    grant_wait_s: float = 5.0

    def __post_init__(self) -> None:
        for name in ("timeout_s", "send_timeout_s", "connect_timeout_s"):
            _positive(name, getattr(self, name), integer=False)
        for name in (
            "chunk_bytes",
            "max_inflight_chunks",
            "max_blocks_per_message",
            "pull_threads",
            "server_threads",
        ):
            _positive(name, getattr(self, name))
        for name in ("buffer_pool_bytes", "inline_bytes"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int):
                raise ValueError(f"{name} must be an int, got {value!r}")
            if value < 0:
                raise ValueError(f"{name} must be >= 0, got {value}")
        if self.net_devices is not None and (
            not isinstance(self.net_devices, str) or not self.net_devices.strip()
        ):
            raise ValueError(
                f"net_devices must be a non-empty str or None, got {self.net_devices!r}"
            )
        for name in ("shared_memory", "cuda_ipc"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be a bool, got {getattr(self, name)!r}")
        if self.data_plane not in DATA_PLANES:
            raise ValueError(
                f"data_plane must be one of {list(DATA_PLANES)}, got {self.data_plane!r}"
            )
        _positive("grant_wait_s", self.grant_wait_s, integer=False)


class KVTransferAgent:
    """Pull-based KV block transfer between worker processes (see the module docstring)."""

    def __init__(self, config: TransportConfig | None = None) -> None:
        self.config = config if config is not None else TransportConfig()
        self._lock = threading.Lock()
        self._closed = False
        self._caches: Mapping[str, torch.Tensor] = MappingProxyType({})
        # Per registered layer, computed once: its layout, and where it is in memory.
        self._layouts: Mapping[str, KVLayout] = MappingProxyType({})
        self._memory: Mapping[str, LayerMemory] = MappingProxyType({})
        self._peers: dict[bytes, PeerHandle] = {}
        self._loop = UcxLoop(
            net_devices=self.config.net_devices, shared_memory=self.config.shared_memory
        )
        self._address = encode_address(self._loop.address)
        self._pool = BufferPool(self.config.buffer_pool_bytes)
        self._server: KVServer | None = None
        # Push data plane: the producer's writes of what consumers ask (`start_server`).
        self._pusher: Pusher | None = None
        self._exporter: RmaExporter | None = None
        self._table: LeaseTable | None = None
        # Pushes into this agent's blocks (`start_server`'s ``push_grants``): its caches mapped
        # for remote writes, and the table of its push leases.
        self._push_exporter: RmaExporter | None = None
        self._push_table: LeaseTable | None = None
        # Per consumer address: its write keys (pushes from this agent).
        self._push_peers: dict[bytes, RmaPeer | None] = {}
        self._reader = RmaReader(self._loop.worker_handle, self._loop.nudge)
        # Per peer address: its keys (one-sided reads), or None once it refused to hand them.
        self._rma_peers: dict[bytes, RmaPeer | None] = {}
        self._rma_locks: dict[bytes, threading.Lock] = {}
        self._client = PullClient(
            self._loop,
            self._pool,
            chunk_bytes=self.config.chunk_bytes,
            max_inflight_chunks=self.config.max_inflight_chunks,
            max_blocks_per_message=self.config.max_blocks_per_message,
            threads=self.config.pull_threads,
            inline_bytes=self.config.inline_bytes,
        )

    @property
    def address(self) -> bytes:
        """This agent's address, to publish in the handshake; `connect` takes it."""
        return self._address

    @property
    def server(self) -> KVServer | None:
        return self._server

    # -- registration -------------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: Mapping[str, torch.Tensor]) -> None:
        """Add (or replace) layers that pulls read from and write into.

        Each tensor is ``[num_blocks, 2, num_kv_heads, block_size, head_dim]``, contiguous, and
        all live on one device (host or CUDA; UCX sees device memory through
        ``__cuda_array_interface__``).
        """
        self._check_open()
        if not isinstance(kv_caches, Mapping) or not kv_caches:
            raise ValueError("kv_caches must be a non-empty mapping of layer name to tensor")
        for name, tensor in kv_caches.items():
            check_kv_cache(name, tensor)
        with self._lock:
            if self._exporter is not None or self._push_exporter is not None:
                # Peers hold keys to the memory mapped at start_server: new layers would be
                # unreadable to them, and replaced ones read from the old addresses.
                raise ValueError(
                    "KV caches must be registered before start_server in RMA mode "
                    "(data_plane 'rma'): the served memory is mapped once"
                )
            merged = {**self._caches, **kv_caches}
            devices = sorted({str(t.device) for t in merged.values()})
            if len(devices) > 1:
                raise ValueError(f"KV caches must share one device, got {devices}")
            # Readers take the mappings without the lock: swap in new immutable ones.
            self._caches = MappingProxyType(merged)
            self._layouts = MappingProxyType({n: KVLayout.of(t) for n, t in merged.items()})
            self._memory = MappingProxyType({n: LayerMemory.of(n, t) for n, t in merged.items()})

    @property
    def kv_caches(self) -> Mapping[str, torch.Tensor]:
        return self._caches

    def kv_layouts(self) -> dict[str, KVLayout]:
        """Layout of every registered layer, for peers to validate pulls locally."""
        return dict(self._layouts)

    # -- serving ------------------------------------------------------------------------------

    def start_server(
        self,
        grants: LeaseGrants | None = None,
        push_grants: LeaseGrants | None = None,
        *,
        pushes: bool = False,
    ) -> None:
        """Answer pull requests from the registered caches on a background thread; idempotent.

        With ``grants`` only pulls presenting a granted lease are served (what an engine does);
        without, any peer may read any block (tests and benchmarks on a trusted host).

        ``push_grants``: this agent also takes pushes. Its caches are mapped a second time,
        for remote writes, and a producer presenting one of these grants (`LeaseGrants.
        grant_push`) gets those write keys and writes the granted blocks itself (`push`);
        `LeaseGrants.landed` says when its writes completed. What the write keys allow is
        in docs/data-plane.md.

        ``pushes`` (with ``grants``): this agent also writes, into a consumer's blocks, the
        leased KV that consumer asks for (`ask_push`), each layer once computed (`Pusher`).
        """
        self._check_open()
        if pushes and grants is None:
            raise ValueError("pushes are served for granted leases only: pass grants")
        if push_grants is not None and grants is None:
            # An agent taking pushes serves no unauthenticated reads of its caches: with no
            # read grants every read is refused (an empty set of leases, not none at all).
            grants = LeaseGrants(self.config.grant_wait_s)
        with self._lock:
            if self._server is None:
                push_keys = None
                if push_grants is not None:
                    self._push_table = LeaseTable(tuple(self._caches))
                    self._push_exporter = RmaExporter(
                        self._loop.context_handle,
                        self._caches,
                        self._push_table,
                        writable=True,
                        cuda_ipc=self.config.shared_memory and self.config.cuda_ipc,
                    )
                    push_keys = self._push_exporter.encoded
                    push_grants.publish_to(self._push_table)
                rma_keys = None
                if self.config.data_plane == "rma":
                    self._table = LeaseTable(tuple(self._caches)) if grants is not None else None
                    self._exporter = RmaExporter(
                        self._loop.context_handle,
                        self._caches,
                        self._table,
                        cuda_ipc=self.config.shared_memory and self.config.cuda_ipc,
                    )
                    rma_keys = self._exporter.encoded
                    if grants is not None and self._table is not None:
                        grants.publish_to(self._table)
                self._server = KVServer(
                    self._loop,
                    self._pool,
                    lambda: self._caches,
                    send_timeout_s=self.config.send_timeout_s,
                    threads=self.config.server_threads,
                    grants=grants,
                    checksum=self.config.checksum,
                    inline_bytes=self.config.inline_bytes,
                    rma_keys=rma_keys,
                    push_grants=push_grants,
                    push_keys=push_keys,
                    push_asks=self._start_pusher(grants) if pushes else None,
                )
            server = self._server
        server.start()

    def _start_pusher(self, grants: LeaseGrants | None) -> Callable[[PushAskMessage], bool]:
        if grants is None:  # never: start_server checked
            raise ValueError("pushes need grants")
        self._pusher = Pusher(self, grants, self.config.timeout_s)
        return self._pusher.submit

    # -- pulling ------------------------------------------------------------------------------

    def connect(
        self,
        peer_address: bytes,
        *,
        layouts: Mapping[str, KVLayout] | None = None,
        one_sided: bool = False,
    ) -> PeerHandle:
        """A handle to the agent at ``peer_address``, cached per address. ``one_sided``: the
        peer offers RMA keys (in RMA mode pulls from it read one-sided).

        `InvalidPeerAddress` if the bytes are not an agent address, `PeerUnreachable` if UCX
        cannot create an endpoint to it. A dead peer is only noticed when a pull times out.
        """
        self._check_open()
        ucx_address = decode_address(peer_address)
        key = bytes(peer_address)
        with self._lock:
            peer = self._peers.get(key)
        if (
            peer is not None
            and (layouts is None or peer.layouts == layouts)
            and peer.one_sided == one_sided
        ):
            return peer
        created = self._loop.call(lambda: self._loop.endpoint(ucx_address))
        # Creating an endpoint from a worker address does not talk to the peer (UCX connects
        # lazily): a wait here is this process's own UCX thread not getting the CPU, so it is
        # bounded by the transfer timeout, not the peer's connect timeout, and never reported
        # as an unreachable peer.
        wait_s = max(self.config.connect_timeout_s, self.config.timeout_s)
        try:
            created.result(wait_s)
        except FutureTimeout:
            if created.done():
                raise
            raise TransferTimeoutError(
                f"the UCX progress thread of this process did not create the endpoint to "
                f"{peer_name(ucx_address)} within {wait_s} s (starved of CPU?)"
            ) from None
        except TransportError:
            raise
        except Exception as exc:
            raise PeerUnreachable(
                f"cannot connect to {peer_name(ucx_address)}: {type(exc).__name__}: {exc}"
            ) from exc
        peer = PeerHandle(
            key,
            ucx_address,
            None if layouts is None else MappingProxyType(dict(layouts)),
            one_sided,
        )
        with self._lock:
            self._peers[key] = peer
        return peer

    def disconnect(self, peer: PeerHandle) -> None:
        """Forget ``peer`` and close its endpoint, cancelling receives still posted to it."""
        with self._lock:
            self._peers.pop(peer.address, None)
        if not self._closed:
            self._loop.call(lambda: self._loop.reset_endpoint(peer.ucx_address)).result()

    def pull(
        self,
        peer: PeerHandle,
        spec: PullSpec,
        *,
        timeout_s: float | None = None,
        on_wait: Callable[[], None] | None = None,
        should_stop: Callable[[], bool] | None = None,
    ) -> PullHandle:
        """Start copying ``spec`` from ``peer`` into the local caches.

        Tagged: returns at once. One-sided (RMA mode, a peer that offers keys): runs on the
        calling thread and returns a completed handle; ``on_wait`` runs every ~0.25 s while it
        waits (a liveness probe: what it raises fails the pull), ``should_stop`` is polled as a
        cancel (the handle does not exist yet to cancel). The first one-sided pull from
        a peer asks it for its keys, presenting ``spec.lease``.

        Raises `ValueError` now for anything checkable locally (unknown layers, block or head
        ranges, and with the peer's layouts known, dtype/block size/head_dim mismatches).
        """
        self._check_open()
        if not isinstance(peer, PeerHandle):
            raise ValueError(f"peer must be a PeerHandle from connect(), got {peer!r}")
        if not isinstance(spec, PullSpec):
            raise ValueError(f"spec must be a PullSpec, got {type(spec).__name__}")
        control = self._control(timeout_s, on_wait, should_stop)
        caches = self._caches
        plans = plan_pull(spec, caches, peer.layouts, self._layouts)
        if peer.one_sided and self.config.data_plane == "rma" and spec.num_blocks:
            try:
                rma = self._rma_peer(peer, spec, control)
            except TransportError as exc:
                # Like any refusal or failure of the transfer: through the handle.
                return PullHandle.failed(spec.request_id, peer, exc)
            if rma is not None:
                return self._client.read_one_sided(
                    peer, rma, self._reader, spec, plans, self._memory, control
                )
        return self._client.submit(peer, spec, plans, caches, control.timeout_s)

    def _rma_peer(self, peer: PeerHandle, spec: PullSpec, control: ReadControl) -> RmaPeer | None:
        """``peer``'s keys, fetched once (presenting this pull's lease); None: tagged only."""

        def fetch() -> bytes | None:
            try:
                with BOOK.span(spec.request_id, "kv.keys", peer=peer.name):
                    return self._client.fetch_keys(peer, spec.lease, control)
            except RemoteTransferError as exc:
                if exc.code != ErrorCode.NOT_SERVING:
                    raise
                logger.info("%s serves tagged reads only: %s", peer.name, exc)
                return None

        return self._keyed_peer(peer, spec.request_id, control, self._rma_peers, "pull", fetch)

    def _keyed_peer(
        self,
        peer: PeerHandle,
        request_id: str,
        control: ReadControl,
        cache: dict[bytes, RmaPeer | None],
        verb: str,
        fetch: Callable[[], bytes | None],
    ) -> RmaPeer | None:
        """``peer``'s keys from ``cache``, else fetched once by ``fetch()`` (None: the peer
        hands none) while other pulls or pushes to it wait within their own ``control``."""
        key = peer.ucx_address
        if key in cache:
            return cache[key]
        with self._lock:
            lock = self._rma_locks.setdefault(key, threading.Lock())
        while not lock.acquire(timeout=_KEYS_LOCK_POLL_S):
            control.check(f"{verb} {request_id!r} (waiting for {peer.name}'s keys)")
        try:
            if key in cache:
                return cache[key]
            encoded = fetch()
            if encoded is None:
                cache[key] = None
                return None
            try:
                keys = RmaKeys.decode(encoded)
            except ValueError as exc:
                raise RemoteTransferError(
                    f"{verb} {request_id!r}: {peer.name} sent unusable keys: {exc}",
                    code=ErrorCode.BAD_REQUEST,
                ) from exc
            same_host = WorkerAddresses.unpack(key).locality == self._loop.locality
            rma = RmaPeer(keys, same_host)
            self._loop.on_close(key, rma.release)
            cache[key] = rma
            return rma
        finally:
            lock.release()

    # -- pushing ------------------------------------------------------------------------------

    def push(
        self,
        peer: PeerHandle,
        spec: PullSpec,
        *,
        timeout_s: float | None = None,
        on_wait: Callable[[], None] | None = None,
        should_stop: Callable[[], bool] | None = None,
    ) -> PullHandle:
        """Write ``spec``'s local blocks into ``peer``'s (a consumer that granted this push:
        ``spec.lease`` is its push lease, ``spec.remote_block_ids`` its blocks at the lease's
        positions), one-sided, on the calling thread; returns a completed handle. One
        `begin_push`, one `PushSession.write`, one `PushSession.finish`. `ValueError` now for
        what is checkable locally, as `pull`."""
        self._check_open()
        if not isinstance(peer, PeerHandle):
            raise ValueError(f"peer must be a PeerHandle from connect(), got {peer!r}")
        if not isinstance(spec, PullSpec) or spec.lease is None:
            raise ValueError("spec must be a PullSpec presenting the consumer's push lease")
        plan_pull(spec, self._caches, peer.layouts, self._layouts)
        try:
            session = self.begin_push(
                peer,
                spec.lease,
                request_id=spec.request_id,
                timeout_s=timeout_s,
                on_wait=on_wait,
                should_stop=should_stop,
            )
        except TransportError as exc:
            return PullHandle.failed(spec.request_id, peer, exc)
        handle = session.write(spec, timeout_s=timeout_s)
        try:
            session.finish()
        except TransportError as exc:
            if handle.exception() is None:
                return PullHandle.failed(spec.request_id, peer, exc)
            logger.warning(
                "push %r: telling %s it stopped failed: %s", spec.request_id, peer.name, exc
            )
        return handle

    def begin_push(
        self,
        peer: PeerHandle,
        lease: LeaseAccess,
        *,
        request_id: str | None = None,
        timeout_s: float | None = None,
        on_wait: Callable[[], None] | None = None,
        should_stop: Callable[[], bool] | None = None,
    ) -> PushSession:
        """Begin writing push lease ``lease`` of ``peer`` (the consumer): its write keys,
        fetched once per consumer presenting the lease, then the begin notice, which the
        consumer answers once it counts this writer (from then on it keeps the lease's blocks
        out of use, even if it gives the lease up, until this producer says its writes
        stopped or landed). A lease not yet granted there is waited for within ``timeout_s``.
        Raises `TransportError` (typed: refused, unreachable, timed out).

        The session's `write` calls then each check the lease row, write, wait for the
        flush and check the row again: a producer writes each layer as it computes it and
        pays the begin round trip once per request. `finish` tells the consumer what landed."""
        self._check_open()
        if not isinstance(peer, PeerHandle):
            raise ValueError(f"peer must be a PeerHandle from connect(), got {peer!r}")
        if not isinstance(lease, LeaseAccess):
            raise ValueError(f"lease must be a LeaseAccess, got {lease!r}")
        name = lease.lease_id if request_id is None else request_id
        control = self._control(timeout_s, on_wait, should_stop)
        rma = self._push_peer(peer, lease, name, control)
        self._until_granted(
            control, name, lambda: self._client.notify_push(peer, lease, "begin", (), control)
        )
        return PushSession(self, peer, lease, rma, on_wait, should_stop)

    def _write(
        self,
        session: PushSession,
        spec: PullSpec,
        timeout_s: float | None,
    ) -> PullHandle:
        """One `PushSession.write`: the writes of ``spec`` and the row checks around them."""
        self._check_open()
        if spec.lease is None or spec.lease.lease_id != session.lease.lease_id:
            raise ValueError("a session's writes present its own push lease")
        control = self._control(timeout_s, session.on_wait, session.should_stop)
        plans = plan_pull(spec, self._caches, session.peer.layouts, self._layouts)
        handle = self._client.read_one_sided(
            session.peer, session.rma, self._reader, spec, plans, self._memory, control, write=True
        )
        if handle.exception() is None:
            session.written.update(plan.name for plan in plans)
        return handle

    def _end_push(self, session: PushSession, landed: bool) -> None:
        """Tell the consumer the session's writes landed (the layers written) or stopped,
        without waiting for its answer: the consumer is the one who waits for it (until a
        stop arrives it keeps the blocks out of use)."""
        layers = tuple(sorted(session.written)) if landed else ()
        failed = session.failed
        reason = "" if failed is None else f"{type(failed).__name__}: {failed}"
        self._client.notify_push(
            session.peer, session.lease, "landed" if landed else "stopped", layers, None, reason
        )

    def ask_push(
        self,
        peer: PeerHandle,
        *,
        request_id: str,
        lease: LeaseAccess,
        push_lease: LeaseAccess,
        layer_names: tuple[str, ...],
        block_ids: tuple[int, ...],
        dest_block_ids: tuple[int, ...],
        heads: range | None = None,
        dest_heads: range | None = None,
        timeout_s: float | None = None,
        on_wait: Callable[[], None] | None = None,
        should_stop: Callable[[], bool] | None = None,
    ) -> None:
        """Ask producer ``peer`` (serving with ``pushes``) to write ``layer_names`` of its
        blocks ``block_ids`` (heads ``heads``), presenting ``lease``, its lease of them, into
        this agent's ``dest_block_ids`` (heads ``dest_heads``), which ``push_lease`` grants
        it (`LeaseGrants.grant_push` of this agent's push grants). Returns once the producer
        queued the ask; `LeaseGrants.landed` says when the writes landed. `RemoteTransferError`
        if refused (``LEASE_NOT_GRANTED``: not recorded there yet), `ValueError` now for what
        is checkable here."""
        self._check_open()
        if not isinstance(peer, PeerHandle):
            raise ValueError(f"peer must be a PeerHandle from connect(), got {peer!r}")
        check = PullSpec(
            request_id=request_id,
            layer_names=layer_names,
            remote_block_ids=block_ids,
            local_block_ids=dest_block_ids,
            remote_heads=heads,
            local_heads=dest_heads,
            lease=lease,
        )
        plan_pull(check, self._caches, peer.layouts, self._layouts)
        control = self._control(timeout_s, on_wait, should_stop)
        layouts = {name: layout.as_dict() for name, layout in self._layouts.items()}
        address = self._address

        def message(reply_tag: int, reply_address: bytes) -> bytes:
            return PushAskMessage(
                reply_tag,
                reply_address,
                request_id,
                lease_fields(lease),
                lease_fields(push_lease),
                address,
                layouts,
                layer_names,
                block_ids,
                dest_block_ids,
                None if heads is None else (heads.start, heads.stop),
                None if dest_heads is None else (dest_heads.start, dest_heads.stop),
            ).encode()

        self._client.ask(peer, message, control, "push ask")

    def _control(
        self,
        timeout_s: float | None,
        on_wait: Callable[[], None] | None,
        should_stop: Callable[[], bool] | None,
    ) -> ReadControl:
        """The bounds of one operation: its deadline (``timeout_s``, else the agent's, checked
        now), its liveness probe and its cancel flag."""
        timeout = self.config.timeout_s if timeout_s is None else timeout_s
        _positive("timeout_s", timeout, integer=False)
        return ReadControl(
            cancelled=should_stop or (lambda: False),
            deadline=time.monotonic() + timeout,
            timeout_s=timeout,
            on_wait=on_wait,
            grant_wait_s=self.config.grant_wait_s,
        )

    def _until_granted(self, control: ReadControl, request_id: str, ask: Callable[[], T]) -> T:
        """``ask()``, asked again while the consumer answers LEASE_NOT_GRANTED (its workers
        record a grant once a step), within ``control``."""
        delay = _GRANT_RETRY_S[0]
        while True:
            try:
                return ask()
            except RemoteTransferError as exc:
                if exc.code != ErrorCode.LEASE_NOT_GRANTED or time.monotonic() + delay >= (
                    control.deadline
                ):
                    raise
            control.check(f"push {request_id!r} (waiting for the consumer's grant)")
            time.sleep(delay)
            delay = min(delay * 2, _GRANT_RETRY_S[1])

    def _push_peer(
        self, peer: PeerHandle, lease: LeaseAccess, request_id: str, control: ReadControl
    ) -> RmaPeer:
        """``peer``'s write keys, fetched once (presenting this push's lease)."""

        def fetch() -> bytes:
            with BOOK.span(request_id, "kv.push_keys", peer=peer.name):
                return self._until_granted(
                    control,
                    request_id,
                    lambda: self._client.fetch_keys(peer, lease, control, push=True),
                )

        rma = self._keyed_peer(peer, request_id, control, self._push_peers, "push", fetch)
        if rma is None:  # never: a refused fetch raises
            raise RemoteTransferError(f"{peer.name} handed no write keys", code=ErrorCode.INTERNAL)
        return rma

    @property
    def picked_protocols(self) -> dict[str, str]:
        """What UCX said it picked for this process's one-sided reads and writes, per
        operation and memory type (`ucp_rma.picked_protocols`; logged once each)."""
        return picked_protocols()

    @property
    def push_asks_pending(self) -> int:
        """Serving pushes: the asks queued or being written now."""
        return 0 if self._pusher is None else self._pusher.pending

    @property
    def push_table(self) -> LeaseTable | None:
        """Taking pushes: the table this agent publishes its push leases in."""
        return self._push_table

    @property
    def loop_naps(self) -> tuple[int, int]:
        """The UCX loop's naps so far: (after empty wake-ups, while UCX could not be armed);
        each is a spin its pacing prevented (see `ucx._EMPTY_WAKES_BEFORE_NAP`)."""
        return self._loop.idle_naps, self._loop.busy_naps

    @property
    def one_sided_counters(self) -> ReadCounters:
        """What this agent's one-sided reads moved so far, by path (a copy)."""
        return replace(self._reader.counters)

    @property
    def lease_table(self) -> LeaseTable | None:
        """RMA mode with leases: the table this agent publishes its held leases in."""
        return self._table

    # -- lifecycle ----------------------------------------------------------------------------

    def close(self) -> None:
        """Cancel pulls, stop serving, then stop the UCX progress thread; idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        if self._pusher is not None:
            self._pusher.close()
        self._client.close()
        if self._server is not None:
            self._server.stop()
        for exporter in (self._exporter, self._push_exporter):
            if exporter is not None:
                # Before the context goes with the loop: UCX wants regions unmapped first.
                exporter.close()
        self._loop.close()
        self._peers.clear()

    @property
    def closed(self) -> bool:
        return self._closed

    def __enter__(self) -> KVTransferAgent:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def _check_open(self) -> None:
        if self._closed:
            raise TransportClosed("the transfer agent is closed")


class PushSession:
    """One producer's writes of one push lease, begun once (`KVTransferAgent.begin_push`):
    any number of `write` calls (a layer each, as the producer computes them), then one
    `finish`. As a context manager it finishes on exit, as stopped if the block raised.
    A session never finished leaves the consumer holding the lease's blocks until it learns
    this producer is gone (`LeaseGrants.abandon_writes`)."""

    def __init__(
        self,
        agent: KVTransferAgent,
        peer: PeerHandle,
        lease: LeaseAccess,
        rma: RmaPeer,
        on_wait: Callable[[], None] | None,
        should_stop: Callable[[], bool] | None,
    ) -> None:
        self._agent = agent
        self.peer, self.lease, self.rma = peer, lease, rma
        self.on_wait, self.should_stop = on_wait, should_stop
        # Layers whose writes completed (flushed, the lease held before and after).
        self.written: set[str] = set()
        self.failed: BaseException | None = None
        self.finished = False

    def write(self, spec: PullSpec, *, timeout_s: float | None = None) -> PullHandle:
        """Write ``spec``'s local blocks into the consumer's (``spec.lease`` is the session's);
        a completed handle. After a failed write the session only finishes, as stopped."""
        if self.finished:
            raise ValueError(f"push session of lease {self.lease.lease_id!r} is finished")
        if self.failed is not None:
            return PullHandle.failed(spec.request_id, self.peer, self.failed)
        handle = self._agent._write(self, spec, timeout_s)
        self.failed = handle.exception()
        return handle

    def finish(self) -> None:
        """Tell the consumer what landed (every layer written, if no write failed) or that the
        writes stopped; idempotent. `TransportError` if the notice could not be sent."""
        if self.finished:
            return
        self.finished = True
        self._agent._end_push(self, landed=self.failed is None)

    def __enter__(self) -> PushSession:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if exc is not None and self.failed is None:
            self.failed = exc
        try:
            self.finish()
        except TransportError as error:
            logger.warning("push of lease %r: ending it failed: %s", self.lease.lease_id, error)
