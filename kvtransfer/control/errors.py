"""Typed control-plane errors; every message names the peer address and the cause.

They subclass the builtin a caller would naturally catch: `ValueError` for a peer that answered
but cannot be used, `ConnectionError` for one that could not be reached, `LookupError` for a
missing handshake.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvtransfer.control.compat import FieldDifference


class ControlPlaneError(Exception):
    """Base of every control-plane failure. ``address`` is the peer (``None`` for local errors),
    ``cause`` the underlying exception (also chained as ``__cause__`` by the raiser)."""

    def __init__(
        self, message: str, *, address: str | None = None, cause: BaseException | None = None
    ) -> None:
        super().__init__(message)
        self.address = address
        self.cause = cause


class HandshakeCompatibilityError(ControlPlaneError, ValueError):
    """The remote engine's `CompatibilityInfo` differs from ours; transfers would corrupt KV."""

    def __init__(
        self,
        differences: Sequence[FieldDifference],
        *,
        address: str,
        remote_engine_id: str,
    ) -> None:
        self.differences = tuple(differences)
        self.remote_engine_id = remote_engine_id
        details = "; ".join(str(diff) for diff in self.differences)
        super().__init__(
            f"engine {remote_engine_id!r} at {address} is incompatible with this engine: {details}",
            address=address,
        )


class EngineIdMismatchError(ControlPlaneError, ValueError):
    """The address is served by another engine than the one we meant to reach."""

    def __init__(
        self,
        *,
        expected: str,
        actual: str,
        address: str,
        cause: BaseException | None = None,
    ) -> None:
        self.expected = expected
        self.actual = actual
        super().__init__(
            f"expected engine {expected!r} at {address}, but engine {actual!r} answered",
            address=address,
            cause=cause,
        )


class PeerUnavailableError(ControlPlaneError, ConnectionError):
    """The peer could not be reached (or did not answer in time) after every retry."""

    def __init__(
        self,
        *,
        address: str,
        method: str,
        attempts: int,
        cause: BaseException | None,
        hint: str | None = None,
    ) -> None:
        self.method = method
        self.attempts = attempts
        message = f"{method} to {address} failed after {attempts} attempt(s): {_describe(cause)}"
        super().__init__(f"{message} ({hint})" if hint else message, address=address, cause=cause)


class HandshakeNotFoundError(ControlPlaneError, LookupError):
    """The engine has no payload for a requested (pp_rank, tp_rank), or has not published."""


class HandshakePayloadError(ControlPlaneError, ValueError):
    """The peer answered with something this client cannot use (malformed or inconsistent)."""


class RemoteCallError(ControlPlaneError):
    """The peer rejected the call with a status this client has no better type for.

    ``code`` is the `grpc.StatusCode`; INVALID_ARGUMENT also makes it a `ValueError` via
    `InvalidArgumentError`.
    """

    def __init__(
        self,
        message: str,
        *,
        address: str,
        code: object,
        cause: BaseException | None = None,
    ) -> None:
        super().__init__(message, address=address, cause=cause)
        self.code = code


class AdminAuthError(RemoteCallError):
    """The peer answered UNAUTHENTICATED: the admin token is missing or wrong. The message
    names the peer and which of the two it was."""


class InvalidArgumentError(RemoteCallError, ValueError):
    """The peer answered INVALID_ARGUMENT; the message carries its explanation."""


def _describe(cause: BaseException | None) -> str:
    if cause is None:
        return "no cause recorded"
    # grpc.aio.AioRpcError's str() is a multi-line dump; code + details is what people need.
    code = getattr(cause, "code", None)
    details = getattr(cause, "details", None)
    if callable(code) and callable(details):
        return f"{code().name}: {details()}"
    return f"{type(cause).__name__}: {cause}"
