"""Thin wrapper over ucxx's core (non-async) API: one UCX worker and the thread that drives it.

`UcxLoop` owns a UCX context and worker in blocking progress mode and runs its own progress
thread: progress the worker, finish completed requests, then `arm` the worker and sleep in
``poll`` on its epoll descriptor plus a wake-up pipe. When UCX cannot be armed (work its
descriptor will not announce) the thread spins briefly, then naps a millisecond per pass; when
it keeps being woken for nothing (a descriptor that stays readable), it naps the same way on
the wake-up pipe alone (`_Pacer`): it never holds a core, which a peer pinned to the same core
needs. That thread is the only one
that touches UCX objects; other threads hand it closures through `UcxLoop.call`. This gives
completion callbacks without polling (ucxx's built-in progress thread would leave request
completion to be polled from Python) and makes every UCX call single-threaded.

Traps this module works around (see the UCX facts notes of the project):

* endpoints are created **without** error handling, otherwise UCX will not use shared memory
  between processes; as a consequence a dead peer is reported only where a TCP lane to it
  resets, and is otherwise detected by timeouts;
* ``close_blocking`` on an endpoint whose peer died hangs forever, so endpoints are only ever
  closed with the non-blocking ``close`` followed by ``cancel_inflight_requests``, which cancels
  that endpoint's posted receives (sends to a dead peer cannot be cancelled and are kept, with
  their buffers, until the worker is destroyed);
* without error handling, a failure UCX meets inside its ``cma`` transport (``process_vm_readv``
  on a peer that died while UCX copied a rendezvous message from it) aborts the whole process;
  so ``cma`` is left out of the transports and messages between processes of one host are
  sent eagerly through the ``sysv``/``posix`` segments (`transport_options`): the tagged data
  plane on one host pays for it (numbers in ``docs/data-plane.md``), same-host one-sided reads
  never needed cma (`direct_read` does them, with its own error handling);
* UCX's TCP transport connects with a blocking ``connect()`` inside endpoint creation by
  default: creating an endpoint to a partitioned host (no answer to its SYN) held this loop's
  thread, and every transfer of the process with it, for over a minute. Connections are made
  non-blocking (``TCP_CONN_NB``, `transport_options`): an endpoint is created at once, a
  request on it waits for the connection within its own deadline and liveness probe;
* ``import ucxx`` writes UCX variables into ``os.environ``, so it happens only when a loop is
  created, never at module import.

Transport selection. The context is confined to ``net_devices`` (the interface carrying KV
traffic, see `netdev`) through ucxx's config dict, so UCX listens on, advertises and dials that
interface only. Addresses handed around (``address``, the ``address`` of `endpoint`) are packed
`WorkerAddresses`: a peer in the same `Locality` (host and network namespace) is dialled at its
full UCX address (shared memory where UCX finds it usable, plus the network device), any other
peer at its network-only address, so shared memory is never tried where its wake-ups cannot
arrive. ``shared_memory=False`` makes every peer remote.

The ``libucx-cu12`` wheel is built without verbs/rdmacm: between hosts this runs over TCP, not
InfiniBand/RoCE, unless a system UCX with those transports is used.
"""

from __future__ import annotations

import contextlib
import heapq
import itertools
import logging
import os
import select
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping, MutableMapping
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, TypeVar

import torch

from kvtransfer.threads import enter_own_thread
from kvtransfer.transport.errors import PeerUnreachable, TransportClosed
from kvtransfer.transport.locality import Locality, WorkerAddresses
from kvtransfer.transport.messages import peer_name
from kvtransfer.transport.ucp_query import net_only_address

logger = logging.getLogger(__name__)

T = TypeVar("T")
Completion = Callable[[BaseException | None], None]
MessageHandler = Callable[[Any, BaseException | None], None]

# Upper bound on one sleep of the loop: deadlines are rechecked at least this often.
_MAX_SLEEP_S = 1.0
# How long shutdown keeps progressing so that closes and cancellations are processed.
_SHUTDOWN_DRAIN_S = 0.2
# Progress calls per pass before the loop serves its queue, probes and deadlines again.
_MAX_PROGRESS_PER_PASS = 64
# The loop sleeps in ``poll`` on UCX's event descriptor and its wake-up pipe, and runs a pass
# whenever either is readable. A pass that finds nothing to do (no queued call, no completion,
# UCX progressed nothing) after a wake-up is an *empty* wake-up. A descriptor that stays
# readable although UCX has nothing for us, or a worker that can never be armed, would turn
# that into a spin at 100% of a core: vLLM pins a whole worker process, our threads included,
# to its OpenMP core, and such a spin in a producer kept the TP rank 0 of its consumer, pinned
# to the same core, from running until vLLM's executor killed the engine (issues 27 and 34).
# So after `_EMPTY_WAKES_BEFORE_NAP` empty wake-ups in a row, or `_BUSY_SPIN_S` of UCX unable
# to arm, each pass naps `_NAP_MS` on the wake-up pipe alone (a queued call still ends the nap;
# UCX's descriptor cannot): the thread's share of a core while nothing moves is bounded by one
# pass's cost per `_NAP_MS`, whatever UCX reports.
_EMPTY_WAKES_BEFORE_NAP = 4
_BUSY_SPIN_S = 200e-6
_NAP_MS = 1.0
# UCX saying it progressed something for this long while none of our requests completed and
# no call came counts as nothing done (a transport that claims work forever).
_UNSEEN_PROGRESS_S = 2.0
# A loop napping this long without a break is logged (once per spell).
_BUSY_WARN_S = 5.0


@dataclass(eq=False)
class _Tracked:
    request: Any
    keepalive: tuple[Any, ...]
    on_done: Completion | None
    on_timeout: Callable[[], None] | None = None
    done: bool = False


@dataclass(order=True)
class _Deadline:
    at: float
    seq: int
    tracked: _Tracked = field(compare=False)


# Every transport but cma, which aborts the process when a peer dies mid-copy (see the module
# docstring).
_WITHOUT_CMA = "^cma"
# UCX_TLS names that include cma (``sm``/``shm`` are UCX's aliases for the shared-memory set).
_CMA_INCLUDED_BY = frozenset({"all", "cma", "sm", "shm"})


def transport_options(net_devices: str | None, environ: Mapping[str, str]) -> dict[str, str]:
    """The UCX context options of a loop: confined to ``net_devices``, without ``cma``, with
    every message between processes of one host sent eagerly, and TCP connections made
    without blocking (see the module docstring; ``UCX_TCP_CONN_NB`` overrides it).

    Without cma, UCX would send a large message to a same-host peer as a rendezvous, partly
    over the TCP lane that RMA needs (a test saw a pull hang after an endpoint reset there);
    eager fragments through the shared-memory segments leave a sender's death nothing to break
    but that message (what they cost the tagged data plane: ``docs/data-plane.md``). An
    operator's own ``UCX_TLS`` is respected (UCX reads it; an option here would override it),
    with a warning if it lets ``cma`` in; so is a ``UCX_RNDV_THRESH`` that names
    ``intra``/``inter`` itself.
    """
    options = {} if net_devices is None else {"NET_DEVICES": net_devices}
    chosen = environ.get("UCX_TLS")
    if chosen is None:
        options["TLS"] = _WITHOUT_CMA
    elif _lets_cma_in(chosen):
        logger.warning(
            "UCX_TLS=%s lets UCX use cma: a peer that dies while UCX copies a message from it "
            "aborts this process; add ^cma (or list the transports without cma)",
            chosen,
        )
    if "UCX_TCP_CONN_NB" not in environ:
        options["TCP_CONN_NB"] = "y"
    threshold = environ.get("UCX_RNDV_THRESH", "auto")
    if ":" not in threshold:
        options["RNDV_THRESH"] = f"intra:inf,inter:{threshold}"
    return options


def _lets_cma_in(tls: str) -> bool:
    names = tls.strip()
    if names.startswith("^"):
        return "cma" not in {name.strip() for name in names[1:].split(",")}
    listed = {name.strip() for name in names.split(",")}
    return bool(listed & _CMA_INCLUDED_BY)


# UCX turns cuda_ipc GET zero-copy off on GPUs without active NVLink (UCX PR 7566): a
# one-sided read of another process's GPU memory then takes an emulated path (measured on one
# H200: 1 MiB in 1.59 ms, 0.66 GB/s; with it on, 0.35 ms, and ucx_perftest's own gets from
# 0.35 to 1.6 TB/s). NIXL turns it on as well (PR 2208). Only "on" enables it without NVLink.
CUDA_GET_ZCOPY_VAR = "UCX_CUDA_IPC_ENABLE_GET_ZCOPY"
_cuda_get_logged = False


def cuda_get_zcopy(environ: MutableMapping[str, str]) -> tuple[str, bool]:
    """Turn UCX's cuda_ipc GET zero-copy on in ``environ`` (what UCX reads when a context is
    created) unless the operator set it; ``(value, whether it is ours)``. An environment
    variable, not a context option: on a host without CUDA, UCX knows no cuda_ipc option and
    would refuse the context, while an unused variable is ignored."""
    chosen = environ.get(CUDA_GET_ZCOPY_VAR)
    if chosen is not None:
        return chosen, False
    environ[CUDA_GET_ZCOPY_VAR] = "on"
    return "on", True


def _ucx_modules() -> tuple[Any, Any, Any]:
    # ucxx warns once per context about variables it set itself; it is noise for us.
    os.environ.setdefault("UCX_WARN_UNUSED_ENV_VARS", "n")
    global _cuda_get_logged
    value, ours = cuda_get_zcopy(os.environ)
    if not _cuda_get_logged:
        _cuda_get_logged = True
        logger.info(
            "UCX cuda_ipc GET zero-copy (one-sided reads of GPU memory): %s=%s (%s)",
            CUDA_GET_ZCOPY_VAR,
            value,
            "kvtransfer's default; set it to override" if ours else "set by the operator",
        )
    import numpy
    import ucxx._lib.libucxx as libucxx
    from ucxx._lib.arr import Array

    return libucxx, Array, numpy


class _Pacer:
    """Decides when the loop naps instead of polling (see `_EMPTY_WAKES_BEFORE_NAP`)."""

    def __init__(self, name: str) -> None:
        self._name = name
        self._empty_wakes = 0
        self._woke = False
        self._busy_since: float | None = None
        self._unseen_since: float | None = None
        self._napping_since: float | None = None
        self._warned = False

    def pass_done(self, ours: int, progressed: bool) -> None:
        """A pass ran ``ours`` calls, completions and expiries; UCX said it ``progressed``."""
        now = time.monotonic()
        if ours:
            self._unseen_since = None
        elif progressed and self._unseen_since is None:
            self._unseen_since = now
        unseen = self._unseen_since is not None and now - self._unseen_since >= _UNSEEN_PROGRESS_S
        if ours or (progressed and not unseen):
            self._empty_wakes = 0
            self._busy_since = None
            self._rested()
        elif self._woke:
            self._empty_wakes += 1

    def woke(self, by_event: bool) -> None:
        """The poll returned: because a descriptor was readable (else its timeout ran out)."""
        self._woke = by_event
        if not by_event:
            self._empty_wakes = 0
            self._rested()

    def should_nap(self) -> bool:
        """UCX is armed: nap rather than poll when its descriptor keeps waking us for nothing."""
        self._busy_since = None
        if self._empty_wakes < _EMPTY_WAKES_BEFORE_NAP:
            return False
        self._napping()
        return True

    def busy(self) -> bool:
        """UCX could not be armed: whether to nap (past `_BUSY_SPIN_S` of it) or spin on."""
        now = time.monotonic()
        if self._busy_since is None:
            self._busy_since = now
        if now - self._busy_since < _BUSY_SPIN_S:
            return False
        self._napping()
        return True

    def _napping(self) -> None:
        now = time.monotonic()
        if self._napping_since is None:
            self._napping_since = now
        if not self._warned and now - self._napping_since >= _BUSY_WARN_S:
            self._warned = True
            logger.warning(
                "UCX loop %s: UCX has kept waking it for nothing, or had unannounced work, for "
                "%.0f s (a descriptor that stays readable, pending sends to a peer that does "
                "not progress?); polling it every %g ms",
                self._name,
                now - self._napping_since,
                _NAP_MS,
            )

    def _rested(self) -> None:
        self._napping_since = None
        self._warned = False


class UcxLoop:
    """A UCX worker plus its progress thread. Methods marked *loop thread* must run on it."""

    def __init__(
        self,
        *,
        name: str = "kvtransfer-ucx",
        net_devices: str | None = None,
        shared_memory: bool = True,
    ) -> None:
        self._ucx, self._array, self._np = _ucx_modules()
        ucx = self._ucx
        options = transport_options(net_devices, os.environ)
        # RMA: one-sided reads of registered KV (see `rma`), on the same worker and endpoints.
        self._context = ucx.UCXContext(
            options, feature_flags=(ucx.Feature.TAG, ucx.Feature.WAKEUP, ucx.Feature.RMA)
        )
        self._worker = ucx.UCXWorker(self._context)
        self.context_handle: int = self._context.handle
        self.worker_handle: int = self._worker.handle
        self._worker.init_blocking_progress_mode()
        self._epoll_fd = self._worker.epoll_file_descriptor
        self.net_devices: str = str(self._context.config.get("NET_DEVICES", "all"))
        self.locality = Locality.current() if shared_memory else Locality.unique()
        addresses = WorkerAddresses(
            self.locality, bytes(self._worker.address), net_only_address(self._worker.handle)
        )
        # Packed `WorkerAddresses`: what peers dial and what requests name as reply address.
        self.address: bytes = addresses.pack()
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        # poll, not select: descriptors of a process with many files (vLLM raises its limit)
        # reach past select's 1024.
        self._poller = select.poll()
        self._poller.register(self._epoll_fd, select.POLLIN)
        self._poller.register(self._wake_r, select.POLLIN)
        self._wake_poller = select.poll()
        self._wake_poller.register(self._wake_r, select.POLLIN)
        os.set_blocking(self._wake_w, False)
        self._lock = threading.Lock()
        self._calls: deque[tuple[Callable[[], Any], Future[Any]]] = deque()
        self._closing = False
        self._tracked: list[_Tracked] = []
        self._deadlines: list[_Deadline] = []
        self._deadline_seq = itertools.count()
        self._endpoints: dict[bytes, Any] = {}
        # Raw ``ucp_ep_h`` of each live endpoint, for threads that call UCX directly (`rma`):
        # written on the loop thread only, removed before the endpoint closes.
        self._handles: dict[bytes, int] = {}
        # Run before an endpoint to the address closes, every time (remote keys go first).
        self._close_hooks: dict[bytes, list[Callable[[], None]]] = {}
        self._listeners: dict[int, MessageHandler] = {}
        self.name = name
        # Naps taken while UCX could not be armed, and after empty wake-ups (see
        # `_EMPTY_WAKES_BEFORE_NAP`); for tests and stats.
        self.busy_naps = 0
        self.idle_naps = 0
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    # -- any thread ---------------------------------------------------------------------------

    def call(self, fn: Callable[[], T]) -> Future[T]:
        """Run ``fn`` on the loop thread; its result or exception arrives in the future."""
        future: Future[T] = Future()
        with self._lock:
            if self._closing:
                raise TransportClosed("the UCX loop is closed")
            self._calls.append((fn, future))
            # Under the lock: close() cannot close (and the OS reuse) the pipe in between.
            self._wake()
        return future

    def is_cancellation(self, error: BaseException) -> bool:
        """Whether a completion error means the request was cancelled (endpoint reset)."""
        return isinstance(error, self._ucx.UCXCanceledError)

    def nudge(self) -> None:
        """Wake the loop thread: another thread progressed the worker and may have taken the
        events it sleeps on."""
        with self._lock:
            if not self._closing:
                self._wake()

    def in_loop_thread(self) -> bool:
        return threading.current_thread() is self._thread

    @property
    def running(self) -> bool:
        return self._thread.is_alive()

    def close(self, timeout_s: float = 10.0) -> None:
        """Stop the thread after closing every endpoint; idempotent."""
        with self._lock:
            self._closing = True
            self._wake()
        if not self.in_loop_thread():
            self._thread.join(timeout_s)
            if self._thread.is_alive():
                raise RuntimeError(f"UCX progress thread did not stop within {timeout_s} s")
        with self._lock:
            if self._wake_w >= 0:
                os.close(self._wake_w)
                os.close(self._wake_r)
                self._wake_w = self._wake_r = -1
        # Destroy the worker before the buffers its cancelled requests pointed at.
        self._endpoints.clear()
        self._worker = None
        self._context = None
        self._tracked.clear()
        self._deadlines.clear()

    def as_buffer(self, data: torch.Tensor | bytes | Any) -> Any:
        """A ucxx ``Array`` over a byte tensor (host or CUDA), bytes, or a numpy array."""
        if isinstance(data, torch.Tensor):
            if data.dtype != torch.uint8 or not data.is_contiguous():
                raise ValueError("UCX buffers must be contiguous uint8 tensors")
            if data.is_cuda:
                # UCX's CUDA transports work in the calling thread's current CUDA context; UCX
                # detects device memory from __cuda_array_interface__.
                torch.cuda.set_device(data.device)
                return self._array(data)
            return self._array(data.numpy())
        if isinstance(data, bytes | bytearray):
            return self._array(self._np.frombuffer(data, dtype=self._np.uint8))
        return self._array(data)

    def new_host_buffer(self, nbytes: int) -> Any:
        return self._np.zeros(nbytes, dtype=self._np.uint8)

    # -- loop thread --------------------------------------------------------------------------

    def endpoint(self, address: bytes) -> Any:
        """The cached endpoint to the worker at packed ``address`` (loop thread).

        `InvalidPeerAddress` if it is not a packed `WorkerAddresses`, `PeerUnreachable` if UCX
        finds no transport to it.
        """
        endpoint = self._endpoints.get(address)
        if endpoint is None:
            peer = WorkerAddresses.unpack(address)
            local = peer.locality == self.locality
            ucx = self._ucx
            try:
                endpoint = ucx.UCXEndpoint.create_from_worker_address(
                    self._worker,
                    ucx.UCXAddress.create_from_buffer(peer.for_peer_at(self.locality)),
                    False,
                )
            except ucx.UCXError as exc:
                raise PeerUnreachable(
                    f"no UCX transport reaches {peer_name(address)} "
                    f"({'same host and network namespace' if local else 'over the network'}) "
                    f"from network devices {self.net_devices}: {type(exc).__name__}: {exc}"
                ) from exc
            logger.debug(
                "endpoint to %s: %s",
                peer_name(address),
                "shared memory or network (same host and network namespace)"
                if local
                else "network only",
            )
            self._endpoints[address] = endpoint
            self._handles[address] = endpoint.handle
        return endpoint

    def on_close(self, address: bytes, hook: Callable[[], None]) -> None:
        """Run ``hook`` (on the loop thread) before any endpoint to ``address`` closes; any
        thread."""
        with self._lock:
            self._close_hooks.setdefault(address, []).append(hook)

    def endpoint_handle(self, address: bytes) -> int | None:
        """The raw ``ucp_ep_h`` of the live endpoint to ``address``, if any; any thread. Valid
        until the `on_close` hooks for ``address`` have run."""
        return self._handles.get(address)

    def reset_endpoint(self, address: bytes) -> bool:
        """Close the endpoint to ``address`` and cancel its posted receives (loop thread).

        The next `endpoint` call creates a fresh one. Returns whether one existed.
        """
        endpoint = self._endpoints.pop(address, None)
        if endpoint is None:
            return False
        self._run_before_close(address)
        endpoint.close()
        # Cancels only requests of closed endpoints: live endpoints' requests are unaffected.
        self._worker.cancel_inflight_requests()
        return True

    def send(
        self,
        address: bytes,
        data: Any,
        tag: int,
        on_done: Completion | None = None,
        *,
        keepalive: tuple[Any, ...] = (),
        timeout_s: float | None = None,
        on_timeout: Callable[[], None] | None = None,
    ) -> None:
        """Send ``data`` to ``address`` under ``tag`` (loop thread)."""
        buffer = self.as_buffer(data)
        request = self.endpoint(address).tag_send(buffer, self._ucx.UCXXTag(tag))
        self._track(request, (data, buffer, *keepalive), on_done, timeout_s, on_timeout)

    def recv(
        self,
        address: bytes,
        data: Any,
        tag: int,
        on_done: Completion | None = None,
        *,
        keepalive: tuple[Any, ...] = (),
        timeout_s: float | None = None,
        on_timeout: Callable[[], None] | None = None,
    ) -> None:
        """Post a receive of ``tag`` into ``data`` on the endpoint to ``address`` (loop thread).

        Tag matching is worker-wide; posting it on the endpoint lets `reset_endpoint` cancel it.
        ``on_timeout`` runs (loop thread) if it has not completed within ``timeout_s``; it stays
        posted (`reset_endpoint` cancels it).
        """
        buffer = self.as_buffer(data)
        request = self.endpoint(address).tag_recv(
            buffer, self._ucx.UCXXTag(tag), self._ucx.UCXXTagMaskFull
        )
        self._track(request, (data, buffer, *keepalive), on_done, timeout_s, on_timeout)

    def listen(self, tag: int, handler: MessageHandler) -> None:
        """Deliver every message sent to ``tag`` from any peer to ``handler`` (loop thread).

        Messages are probed, then received into a host buffer of their exact size, so requests
        of any length need no pre-posted buffer.
        """
        self._listeners[tag] = handler

    def unlisten(self, tag: int) -> None:
        self._listeners.pop(tag, None)

    # -- internals ----------------------------------------------------------------------------

    def _wake(self) -> None:
        # A full pipe already guarantees a wake-up; a closed one means we are shut down.
        with contextlib.suppress(BlockingIOError, OSError):
            os.write(self._wake_w, b"\0")

    def _track(
        self,
        request: Any,
        keepalive: tuple[Any, ...],
        on_done: Completion | None,
        timeout_s: float | None,
        on_timeout: Callable[[], None] | None,
    ) -> None:
        tracked = _Tracked(request, keepalive, on_done, on_timeout)
        self._tracked.append(tracked)
        if timeout_s is not None:
            heapq.heappush(
                self._deadlines,
                _Deadline(time.monotonic() + timeout_s, next(self._deadline_seq), tracked),
            )

    def _run(self) -> None:
        enter_own_thread(self.name)
        pacer = _Pacer(self.name)
        try:
            while True:
                ran = self._run_calls()
                with self._lock:
                    if self._closing and not self._calls:
                        break
                progressed, ours = self._progress()
                if self._calls:
                    continue
                pacer.pass_done(ran + ours, progressed)
                if self._worker.arm():
                    if pacer.should_nap():
                        self._nap()
                        self.idle_naps += 1
                        # A descriptor that went quiet lets the loop sleep for real again.
                        pacer.woke(bool(self._poller.poll(0)))
                        continue
                    pacer.woke(bool(self._poller.poll(self._sleep_s() * 1e3)))
                    self._drain_wake()
                elif pacer.busy():
                    self._nap()
                    self.busy_naps += 1
        except Exception:
            logger.exception("UCX progress thread crashed")
        finally:
            self._shutdown()

    def _nap(self) -> None:
        """Sleep `_NAP_MS` (less if a deadline is nearer) unless a call is queued; UCX's
        descriptor is not watched, so one that stays readable cannot end the nap."""
        self._wake_poller.poll(min(_NAP_MS, self._sleep_s() * 1e3))
        self._drain_wake()

    def _progress(self) -> tuple[bool, int]:
        """Progress UCX, probe listeners, complete and expire requests: (whether UCX said it
        progressed anything, how many of our requests completed or expired)."""
        progressed = False
        for _ in range(_MAX_PROGRESS_PER_PASS):
            if not self._worker.progress_once():
                break
            progressed = True
        if self._listeners:
            self._probe()
        return progressed, self._complete() + self._expire()

    def _run_calls(self) -> int:
        """Run the queued calls; how many ran."""
        ran = 0
        while True:
            with self._lock:
                if not self._calls:
                    return ran
                fn, future = self._calls.popleft()
            if not future.set_running_or_notify_cancel():
                continue
            ran += 1
            try:
                result = fn()
            except BaseException as exc:
                future.set_exception(exc)
            else:
                future.set_result(result)

    def _probe(self) -> None:
        ucx = self._ucx
        for tag, handler in list(self._listeners.items()):
            while True:
                probe = self._worker.tag_probe(ucx.UCXXTag(tag), ucx.UCXXTagMaskFull, True)
                if not probe.matched:
                    break
                buffer = self.new_host_buffer(probe.length)
                array = self._array(buffer)
                request = self._worker.tag_recv_with_handle(array, probe)
                self._track(
                    request,
                    (buffer, array),
                    lambda exc, buffer=buffer, handler=handler: handler(buffer, exc),
                    None,
                    None,
                )

    def _complete(self) -> int:
        if not self._tracked:
            return 0
        pending = []
        finished = []
        for tracked in self._tracked:
            (finished if tracked.request.completed else pending).append(tracked)
        if not finished:
            return 0
        self._tracked = pending
        for tracked in finished:
            tracked.done = True
            error: BaseException | None = None
            try:
                tracked.request.check_error()
            except Exception as exc:
                error = exc
            self._notify(tracked, error)
        return len(finished)

    def _notify(self, tracked: _Tracked, error: BaseException | None) -> None:
        callback, tracked.on_done = tracked.on_done, None
        if callback is None:
            return
        try:
            callback(error)
        except Exception:
            logger.exception("UCX completion callback failed")

    def _expire(self) -> int:
        now = time.monotonic()
        expired = 0
        while self._deadlines and self._deadlines[0].at <= now:
            tracked = heapq.heappop(self._deadlines).tracked
            if tracked.done or tracked.on_timeout is None:
                continue
            on_timeout, tracked.on_timeout = tracked.on_timeout, None
            expired += 1
            try:
                on_timeout()
            except Exception:
                logger.exception("UCX timeout callback failed")
        return expired

    def _sleep_s(self) -> float:
        while self._deadlines and self._deadlines[0].tracked.done:
            heapq.heappop(self._deadlines)
        if not self._deadlines:
            return _MAX_SLEEP_S
        return min(_MAX_SLEEP_S, max(0.0, self._deadlines[0].at - time.monotonic()))

    def _drain_wake(self) -> None:
        try:
            while os.read(self._wake_r, 4096):
                pass
        except BlockingIOError:
            pass

    def _run_before_close(self, address: bytes) -> None:
        self._handles.pop(address, None)
        with self._lock:
            hooks = list(self._close_hooks.get(address, ()))
        for hook in hooks:
            try:
                hook()
            except Exception:
                logger.exception("hook before closing an endpoint failed")

    def _shutdown(self) -> None:
        self._listeners.clear()
        try:
            for address, endpoint in self._endpoints.items():
                self._run_before_close(address)
                endpoint.close()
            self._worker.cancel_inflight_requests()
            stop = time.monotonic() + _SHUTDOWN_DRAIN_S
            # Closes need progress too: an endpoint left closing keeps its worker, and with it
            # the worker's listening sockets, alive after the loop is gone.
            endpoints = list(self._endpoints.values())
            while (self._tracked or any(e.alive for e in endpoints)) and time.monotonic() < stop:
                self._progress()
                time.sleep(0.001)
        except Exception:
            logger.exception("error while shutting down the UCX worker")
        closed = TransportClosed("the UCX loop is closed")
        for tracked in self._tracked:
            self._notify(tracked, closed)
        with self._lock:
            self._closing = True
            calls = list(self._calls)
            self._calls.clear()
        for _, future in calls:
            if future.set_running_or_notify_cancel():
                future.set_exception(closed)
