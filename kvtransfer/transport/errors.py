"""Typed data-plane errors.

Each subclasses the builtin a caller would naturally catch as well as `TransportError`:
`TimeoutError` for a transfer that ran out of time, `ConnectionError` for a peer that cannot be
reached, `ValueError` for an address that is not one. `RemoteTransferError` carries the
server's `ErrorCode` so callers can tell a bad request (a bug) from a server-side failure.
"""

from __future__ import annotations

import enum


class ErrorCode(enum.IntEnum):
    """Status of a pull response on the wire; ``OK`` is the only success value."""

    OK = 0
    BAD_REQUEST = 1
    UNSUPPORTED_VERSION = 2
    UNKNOWN_LAYER = 3
    BLOCK_OUT_OF_RANGE = 4
    HEAD_RANGE = 5
    LAYOUT_MISMATCH = 6
    NOT_SERVING = 7
    INTERNAL = 8
    ACCESS_DENIED = 9
    CORRUPT_PAYLOAD = 10
    # The lease is not (yet) recorded on the serving worker: its grant may still be on the way
    # (the scheduler lends, the workers record it at their next step), unlike ACCESS_DENIED.
    LEASE_NOT_GRANTED = 11


class TransportError(Exception):
    """Base of every data-plane failure."""


class TransferTimeoutError(TransportError, TimeoutError):
    """A pull did not complete within its timeout (the peer may be dead or overloaded).

    Nothing is written to the local KV cache after this is raised.
    """


class RemoteTransferError(TransportError):
    """The server refused a pull; ``code`` says why and the message names the problem."""

    def __init__(self, message: str, *, code: ErrorCode) -> None:
        super().__init__(message)
        self.code = code


class PeerUnreachable(TransportError, ConnectionError):
    """A peer could not be connected to, or its connection failed or was reset."""


class EndpointReset(PeerUnreachable):
    """Another pull to the same peer failed and reset the connection this one was using: the
    peer may be fine (a read that timed out on a connection a partition broke resets it for
    every read in flight). A new connection is made by the next pull."""


class InvalidPeerAddress(PeerUnreachable, ValueError):
    """The bytes given as a peer address are not a kvtransfer agent address."""


class CorruptPayloadError(TransportError):
    """A payload's checksum did not match what the server computed: it was not used."""


class TransferCancelled(TransportError):
    """The pull was cancelled by `PullHandle.cancel` before it completed."""


class TransportClosed(TransportError, RuntimeError):
    """The agent was closed; it can neither start nor finish transfers."""
