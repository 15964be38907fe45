"""One request-size limit for the router and the daemons, so a large prompt gets one clear error.

The router refuses an HTTP body larger than ``max_request_bytes`` with a 413 naming the limit.
Whatever it accepts must then reach a daemon: the ``GenerateRequest`` built from a body is never
larger than the body (JSON text and token ids only shrink in protobuf) plus the fields the
router adds, the largest being the ``kv_transfer_params`` a prefill returned, whose block-id list
grows with the prompt. So the daemons' gRPC servers accept, and the router's channels send and
receive, messages of up to `grpc_message_limit` = the same ``max_request_bytes`` plus
`GRPC_HEADROOM_BYTES`. Both sides default to `DEFAULT_MAX_REQUEST_BYTES`; set the same
``--max-request-bytes`` on the router and every daemon when changing it.

No gRPC import here: `kvtransfer.router.config` and the daemons' settings read this cheaply.
"""

from __future__ import annotations

DEFAULT_MAX_REQUEST_BYTES = 8 * 2**20
# Protobuf framing, request id and sampling options take bytes; kv_transfer_params take up to
# ~8 bytes per held block ("123456, "): 1 MiB covers over 100,000 blocks, more than a prompt
# that fits one prefill pool needs.
GRPC_HEADROOM_BYTES = 2**20


def check_max_request_bytes(value: int) -> int:
    """Returns ``value`` if it is a usable limit, else raises ``ValueError`` naming it."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"max_request_bytes must be an integer >= 1, got {value!r}")
    return value


def grpc_message_limit(max_request_bytes: int) -> int:
    """The gRPC message size, in bytes, that a ``max_request_bytes`` request always fits."""
    return check_max_request_bytes(max_request_bytes) + GRPC_HEADROOM_BYTES


def grpc_message_options(max_request_bytes: int) -> list[tuple[str, int]]:
    """gRPC server or channel options for `grpc_message_limit`, sending and receiving."""
    limit = grpc_message_limit(max_request_bytes)
    return [
        ("grpc.max_receive_message_length", limit),
        ("grpc.max_send_message_length", limit),
    ]
