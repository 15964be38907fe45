"""Is the producer of a load still there? Telling dead from slow, in about a second.

UCX endpoints run without error handling (see `kvtransfer.transport.ucx`), so a pull from a
dead producer only ever times out. A consumer cannot wait the whole transfer timeout for that,
nor give up on a producer that is merely slow (busy, swapping, briefly stopped). The producer's
control port (``remote_host:remote_port``, its handshake and notify server) answers the
question cheaply, because accepting a TCP connection is the kernel's work, not the process's:

* connection refused, or no route: the producer process (or its host's network) is gone: dead
  at once;
* no answer within ``connect_timeout_s``, twice in a row: the host is unreachable (partition,
  powered off): dead;
* connected: the process is alive (maybe stopped or slow): keep waiting, within the transfer
  timeout. Every few probes a KeepAlive for the lease also asks whether the producer still
  holds it: a producer restarted on the same port answers "not held", and the load fails at
  once instead of waiting out its timeout; one that refuses the request's secret
  (PERMISSION_DENIED: the params' secret is not the one it lent the KV under) fails it too,
  typed as the refusal it is. Any other answer (no answer yet) keeps the load waiting: a lease
  its workers have not recorded yet is not a lease refused.
"""

from __future__ import annotations

import concurrent.futures
import errno
import socket
from collections.abc import Callable

import grpc

from kvtransfer.connectors.ucx.metadata import RemotePrefill
from kvtransfer.transport import AccessDenied

# Pause between probes while a load waits, and bound of one TCP connect.
PROBE_INTERVAL_S = 0.25
CONNECT_TIMEOUT_S = 0.5
# Consecutive connect timeouts that mean "unreachable".
TIMEOUT_STRIKES = 2
# Every this many probes, ask whether the lease is still held.
LEASE_CHECK_EVERY = 4

_DEFINITIVE = frozenset(
    {errno.ECONNREFUSED, errno.EHOSTUNREACH, errno.ENETUNREACH, errno.ECONNRESET}
)

# Starts "is this lease still held?" (see `Notifier.ask_held`); the future's bool is the answer.
AskHeld = Callable[[RemotePrefill], concurrent.futures.Future[bool]]


class ProducerUnreachable(ConnectionError):
    """The producer of a load is dead or cannot be reached; its KV will not come."""


class LeaseLostError(RuntimeError):
    """The producer no longer holds the request (its lease ran out, or it restarted)."""


def connect_probe(host: str, port: int, timeout_s: float = CONNECT_TIMEOUT_S) -> str | None:
    """None if ``host:port`` accepts a TCP connection, else why not; `TimeoutError` when the
    connect neither succeeded nor failed within ``timeout_s``."""
    try:
        with socket.create_connection((host, port), timeout=timeout_s):
            return None
    except TimeoutError:
        raise
    except OSError as exc:
        if exc.errno in _DEFINITIVE or isinstance(exc, socket.gaierror):
            return exc.strerror or type(exc).__name__
        raise


def ensure_reachable(remote: RemotePrefill) -> None:
    """Raise `ProducerUnreachable` within about a second if the producer's port cannot be
    reached, before a handshake would wait its whole timeout for it."""
    watch = ProducerWatch(remote)
    for _ in range(TIMEOUT_STRIKES):
        watch.check()
        if watch.strikes == 0:
            return


class ProducerWatch:
    """Probes one load's producer; `check` raises once it is known to be gone."""

    def __init__(self, remote: RemotePrefill, ask_held: AskHeld | None = None) -> None:
        self._remote = remote
        self._ask_held = ask_held
        self._strikes = 0
        self._probes = 0
        self._held: concurrent.futures.Future[bool] | None = None

    @property
    def strikes(self) -> int:
        """Connect timeouts in a row so far."""
        return self._strikes

    def check(self) -> None:
        """One probe; raises `ProducerUnreachable` or `LeaseLostError`, else returns."""
        remote = self._remote
        try:
            refused = connect_probe(remote.host, remote.port)
        except TimeoutError:
            self._strikes += 1
            if self._strikes >= TIMEOUT_STRIKES:
                raise ProducerUnreachable(
                    f"engine {remote.engine_id!r} at {remote.address} is unreachable: "
                    f"{self._strikes} connects timed out after {CONNECT_TIMEOUT_S} s"
                ) from None
            return
        except OSError:
            return  # an unexpected local error proves nothing about the producer
        if refused is not None:
            raise ProducerUnreachable(
                f"engine {remote.engine_id!r} at {remote.address} is gone: {refused}"
            )
        self._strikes = 0
        self._check_lease()

    def _check_lease(self) -> None:
        if self._ask_held is None:
            return
        held = self._held
        if held is not None and held.done():
            self._held = None
            remote = self._remote
            error = held.exception()
            if isinstance(error, grpc.RpcError) and (
                error.code() == grpc.StatusCode.PERMISSION_DENIED  # type: ignore[attr-defined]
            ):
                raise AccessDenied(
                    f"engine {remote.engine_id!r} refuses the secret of request "
                    f"{remote.request_id!r} (its KeepAlive answered PERMISSION_DENIED): the "
                    "params' secret is not the one it lent that KV under"
                )
            if error is None and not held.result():
                raise LeaseLostError(
                    f"engine {remote.engine_id!r} no longer holds request "
                    f"{remote.request_id!r} (its lease ran out, or it restarted)"
                )
        self._probes += 1
        if self._held is None and self._probes % LEASE_CHECK_EVERY == 0:
            self._held = self._ask_held(self._remote)
