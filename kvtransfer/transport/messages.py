"""The data plane's wire format: agent addresses, UCX tags, pull requests and responses.

Every message starts with a small fixed-size little-endian prefix whose first fields (magic,
protocol version, kind or status, and for requests the reply tag and reply address) keep their
place in every protocol version, so a server can always answer "unsupported version" to a
client it does not understand. Variable metadata is JSON; block ids are packed int64. No pickle:
a peer's bytes are never executed.

A pull exchange is three tagged messages:

* request (client -> server) on `REQUEST_TAG`: what to read and where to answer;
* response header (server -> client) on ``reply_tag``: status, payload size, the payload's
  checksum (xxh3-64, zero when the server does not checksum), error text;
* response payload (server -> client) on ``reply_tag | 1``: the gathered KV bytes, or zero bytes
  on error so the client's posted receive always completes.

Reply tags come from a per-agent counter, so a tag is never reused and a late answer to a
cancelled or timed-out pull can only land in that pull's private receive buffer.
"""

from __future__ import annotations

import base64
import binascii
import json
import struct
import sys
import zlib
from array import array
from collections.abc import Sequence
from dataclasses import dataclass

from kvtransfer.transport.errors import ErrorCode, InvalidPeerAddress, TransportError

PROTOCOL_VERSION = 2
# The address envelope has its own version: it did not change when the messages did.
ADDRESS_VERSION = 1

# Requests use the top tag bit; reply tags never do (see `reply_tags`).
REQUEST_TAG = (1 << 63) | 0x4B5654
MAX_REPLY_SEQUENCE = (1 << 62) - 1
# Room for a status line plus a long error text; longer texts are cut.
RESPONSE_HEADER_BYTES = 4096
# Payload segments (one per layer) start on this boundary so each can be viewed as its dtype.
SEGMENT_ALIGNMENT = 16

KIND_PULL = 1
# RMA mode: ask for the remote keys and memory layout of the server's KV (one-sided reads;
# with "push": its write keys, presenting a push lease).
KIND_KEYS = 2
# Push: a producer tells the consumer it begins writing a push lease's blocks, or that its
# writes ended (landed: flushed; or stopped).
KIND_PUSH = 3
PUSH_PHASES = ("begin", "landed", "stopped")
# A stopped notice's reason is cut to this many characters.
MAX_STOP_REASON = 1000
# Push data plane: a consumer asks the producer holding a request's KV to write some of its
# layers into the consumer's blocks (presenting the request's lease and a push lease of its own).
KIND_PUSH_ASK = 4
# Bounds of a push ask: blocks on either side, layers named.
MAX_ASK_BLOCKS = 1 << 20
MAX_ASK_LAYERS = 4096

_ADDRESS_MAGIC = b"KVTA"
_REQUEST_MAGIC = b"KVTQ"
_RESPONSE_MAGIC = b"KVTR"

# magic, version, reserved, UCX address length, crc32 of the UCX address
_ADDRESS = struct.Struct("<4sHHII")
# Stable across versions: magic, version, kind, reply tag, reply address length.
_REQUEST_STABLE = struct.Struct("<4sHHQI")
# Version 1: payload bytes, JSON length, number of block ids.
_REQUEST_V1 = struct.Struct("<QII")
# Stable across versions: magic, version, status.
_RESPONSE_STABLE = struct.Struct("<4sHH")
# Version 2: payload bytes, payload checksum, flags, error message length.
_RESPONSE_V2 = struct.Struct("<QQII")
# Response flag: the checksum field holds the payload's xxh3-64.
FLAG_CHECKSUM = 1


class WireFormatError(TransportError, ValueError):
    """A message could not be decoded; ``code`` is the status to answer with."""

    def __init__(self, message: str, *, code: ErrorCode = ErrorCode.BAD_REQUEST) -> None:
        super().__init__(message)
        self.code = code


# -- addresses ----------------------------------------------------------------------------


def encode_address(ucx_address: bytes) -> bytes:
    """Wrap a UCX worker address so that garbage can be told apart before UCX parses it.

    UCX aborts the whole process on some malformed addresses, so a checksum guards it.
    """
    return (
        _ADDRESS.pack(_ADDRESS_MAGIC, ADDRESS_VERSION, 0, len(ucx_address), zlib.crc32(ucx_address))
        + ucx_address
    )


def decode_address(address: bytes) -> bytes:
    """The UCX worker address inside an `encode_address` envelope; `InvalidPeerAddress` if none."""
    if not isinstance(address, bytes | bytearray | memoryview):
        raise InvalidPeerAddress(f"peer address must be bytes, got {type(address).__name__}")
    data = bytes(address)
    if len(data) < _ADDRESS.size:
        raise InvalidPeerAddress(
            f"peer address is {len(data)} bytes, shorter than the {_ADDRESS.size}-byte header"
        )
    magic, version, _, length, crc = _ADDRESS.unpack_from(data)
    if magic != _ADDRESS_MAGIC:
        raise InvalidPeerAddress(f"peer address has magic {magic!r}, expected {_ADDRESS_MAGIC!r}")
    if version != ADDRESS_VERSION:
        raise InvalidPeerAddress(
            f"peer address has protocol version {version}, this agent speaks {ADDRESS_VERSION}"
        )
    ucx_address = data[_ADDRESS.size :]
    if len(ucx_address) != length:
        raise InvalidPeerAddress(
            f"peer address declares {length} UCX address bytes but carries {len(ucx_address)}"
        )
    if zlib.crc32(ucx_address) != crc:
        raise InvalidPeerAddress("peer address checksum mismatch (corrupted address)")
    return ucx_address


def peer_name(ucx_address: bytes) -> str:
    """Short stable id of a peer for messages and logs."""
    return f"peer-{zlib.crc32(ucx_address):08x}"


# -- tags ---------------------------------------------------------------------------------


def reply_tags(sequence: int) -> tuple[int, int]:
    """(header tag, payload tag) of the exchange numbered ``sequence``."""
    if not 0 <= sequence <= MAX_REPLY_SEQUENCE:
        raise ValueError(f"reply sequence {sequence} out of range [0, {MAX_REPLY_SEQUENCE}]")
    return sequence << 1, (sequence << 1) | 1


def payload_tag(header_tag: int) -> int:
    return header_tag | 1


# -- payload layout -----------------------------------------------------------------------


def segment_offsets(sizes: Sequence[int]) -> tuple[list[int], int]:
    """Start offset of each payload segment and the total payload size, segments aligned."""
    offsets = []
    cursor = 0
    for size in sizes:
        cursor = -(-cursor // SEGMENT_ALIGNMENT) * SEGMENT_ALIGNMENT
        offsets.append(cursor)
        cursor += size
    return offsets, cursor


def pack_block_ids(block_ids: Sequence[int]) -> bytes:
    packed = array("q", block_ids)
    if sys.byteorder != "little":
        packed.byteswap()
    return packed.tobytes()


def unpack_block_ids(data: bytes) -> array:
    if len(data) % 8:
        raise WireFormatError(f"block id bytes ({len(data)}) are not a multiple of 8")
    ids = array("q")
    ids.frombytes(data)
    if sys.byteorder != "little":
        ids.byteswap()
    return ids


# -- request ------------------------------------------------------------------------------


@dataclass(frozen=True)
class LayerRequest:
    """One layer to read and the layout the client expects it to have."""

    name: str
    dtype: str
    block_size: int
    head_dim: int


@dataclass(frozen=True)
class RequestEnvelope:
    """The version-stable part of a request: enough to answer it, whatever its version."""

    version: int
    kind: int
    reply_tag: int
    reply_address: bytes
    body_offset: int


@dataclass(frozen=True)
class PullRequestMessage:
    """Read ``block_ids`` of ``layers`` (heads ``remote_heads``, all if None) in one payload,
    presenting ``lease`` (lease id, secret, prompt digest, position of the first block in the
    lease) to a server that serves leased KV only."""

    request_id: str
    reply_tag: int
    reply_address: bytes
    layers: tuple[LayerRequest, ...]
    remote_heads: tuple[int, int] | None
    num_heads: int
    block_ids: bytes
    payload_bytes: int
    lease: tuple[str, str, str, int] | None = None

    @property
    def num_blocks(self) -> int:
        return len(self.block_ids) // 8

    def encode(self) -> bytes:
        fields: dict[str, object] = {
            "request_id": self.request_id,
            "layers": [[x.name, x.dtype, x.block_size, x.head_dim] for x in self.layers],
            "heads": None if self.remote_heads is None else list(self.remote_heads),
            "num_heads": self.num_heads,
        }
        if self.lease is not None:
            fields["lease"] = list(self.lease)
        return _encode_request(
            KIND_PULL,
            self.reply_tag,
            self.reply_address,
            fields,
            payload_bytes=self.payload_bytes,
            block_ids=self.block_ids,
        )

    @classmethod
    def decode(cls, data: bytes | bytearray | memoryview) -> PullRequestMessage:
        """Decode a request; `WireFormatError` (with the status to answer) if it is invalid."""
        envelope, payload_bytes, body, block_ids = _decode_request(data, KIND_PULL)
        return cls(
            request_id=_field(body, "request_id", str),
            reply_tag=envelope.reply_tag,
            reply_address=envelope.reply_address,
            layers=_decode_layers(body),
            remote_heads=_decode_heads(body),
            num_heads=_field(body, "num_heads", int),
            block_ids=block_ids,
            payload_bytes=payload_bytes,
            lease=_decode_lease(body),
        )


@dataclass(frozen=True)
class KeysRequestMessage:
    """Ask for the server's `RmaKeys`, presenting ``lease`` (as a pull does) to a server that
    serves leased KV only; the answer's payload is the encoded keys. ``push``: its write keys,
    presenting a push lease (a grant of this server's blocks to the asking producer)."""

    reply_tag: int
    reply_address: bytes
    lease: tuple[str, str, str, int] | None = None
    push: bool = False

    def encode(self) -> bytes:
        fields: dict[str, object] = {}
        if self.lease is not None:
            fields["lease"] = list(self.lease)
        if self.push:
            fields["push"] = True
        return _encode_request(KIND_KEYS, self.reply_tag, self.reply_address, fields)

    @classmethod
    def decode(cls, data: bytes | bytearray | memoryview) -> KeysRequestMessage:
        envelope, _, body, _ = _decode_request(data, KIND_KEYS)
        push = body.get("push", False)
        if not isinstance(push, bool):
            raise WireFormatError(f"request field 'push' must be a bool, got {push!r}")
        return cls(envelope.reply_tag, envelope.reply_address, _decode_lease(body), push)


@dataclass(frozen=True)
class PushNoticeMessage:
    """A producer's notice about its writes of a push lease (``phase``: "begin" before the
    first write, "landed" once ``layers`` were written and flushed, "stopped" when it gave up,
    and why: ``reason``), presenting the lease; answered with a bare header."""

    reply_tag: int
    reply_address: bytes
    lease: tuple[str, str, str, int]
    phase: str
    layers: tuple[str, ...] = ()
    reason: str = ""

    def encode(self) -> bytes:
        fields = {
            "lease": list(self.lease),
            "phase": self.phase,
            "layers": list(self.layers),
            "reason": self.reason[:MAX_STOP_REASON],
        }
        return _encode_request(KIND_PUSH, self.reply_tag, self.reply_address, fields)

    @classmethod
    def decode(cls, data: bytes | bytearray | memoryview) -> PushNoticeMessage:
        envelope, _, body, _ = _decode_request(data, KIND_PUSH)
        lease = _decode_lease(body)
        if lease is None:
            raise WireFormatError("a push notice must present its lease")
        phase = _field(body, "phase", str)
        if phase not in PUSH_PHASES:
            raise WireFormatError(f"push notice phase must be one of {list(PUSH_PHASES)}")
        layers = _field(body, "layers", list)
        if not all(isinstance(name, str) and name for name in layers):
            raise WireFormatError("push notice layers must be non-empty strings")
        reason = body.get("reason", "")
        if not isinstance(reason, str):
            raise WireFormatError("push notice reason must be a string")
        return cls(
            envelope.reply_tag,
            envelope.reply_address,
            lease,
            phase,
            tuple(layers),
            reason[:MAX_STOP_REASON],
        )


@dataclass(frozen=True)
class PushAskMessage:
    """A consumer asks the producer to write ``layers`` of the blocks ``block_ids`` (the
    producer's, presenting ``lease``, the request's lease there) into ``dest_block_ids`` of the
    agent at ``consumer`` (its encoded address; ``layouts``: its caches, every layer),
    presenting ``push_lease`` (the consumer's grant of those blocks) in its writes. Heads: the
    producer's ``heads`` into the consumer's ``dest_heads`` (None: all). Answered with a bare
    header once the ask is queued; the writes' end is told by push notices."""

    reply_tag: int
    reply_address: bytes
    request_id: str
    lease: tuple[str, str, str, int]
    push_lease: tuple[str, str, str, int]
    consumer: bytes
    layouts: dict[str, dict[str, int | str]]
    layers: tuple[str, ...]
    block_ids: tuple[int, ...]
    dest_block_ids: tuple[int, ...]
    heads: tuple[int, int] | None = None
    dest_heads: tuple[int, int] | None = None

    def encode(self) -> bytes:
        fields = {
            "request_id": self.request_id,
            "lease": list(self.lease),
            "push_lease": list(self.push_lease),
            "consumer": base64.b64encode(self.consumer).decode(),
            "layouts": self.layouts,
            "layers": list(self.layers),
            "dest_block_ids": list(self.dest_block_ids),
            "heads": None if self.heads is None else list(self.heads),
            "dest_heads": None if self.dest_heads is None else list(self.dest_heads),
        }
        return _encode_request(
            KIND_PUSH_ASK,
            self.reply_tag,
            self.reply_address,
            fields,
            block_ids=pack_block_ids(self.block_ids),
        )

    @classmethod
    def decode(cls, data: bytes | bytearray | memoryview) -> PushAskMessage:
        envelope, _, body, packed = _decode_request(data, KIND_PUSH_ASK)
        lease = _decode_lease(body)
        push_lease = _decode_lease({"lease": body.get("push_lease")})
        if lease is None or push_lease is None:
            raise WireFormatError("a push ask must present the request's lease and a push lease")
        try:
            consumer = base64.b64decode(_field(body, "consumer", str), validate=True)
        except (binascii.Error, ValueError) as exc:
            raise WireFormatError(f"push ask consumer address is not base64: {exc}") from exc
        layouts = _field(body, "layouts", dict)
        if not 0 < len(layouts) <= MAX_ASK_LAYERS or not all(
            isinstance(name, str) and name and isinstance(layout, dict)
            for name, layout in layouts.items()
        ):
            raise WireFormatError(
                f"push ask layouts must map 1 to {MAX_ASK_LAYERS} layer names to layouts"
            )
        layers = _field(body, "layers", list)
        if not layers or not all(isinstance(name, str) and name in layouts for name in layers):
            raise WireFormatError("push ask layers must name layers of its layouts")
        if len(set(layers)) != len(layers):
            raise WireFormatError("push ask layers repeat a layer")
        block_ids = tuple(unpack_block_ids(packed))
        dest = _field(body, "dest_block_ids", list)
        if not 0 < len(dest) <= MAX_ASK_BLOCKS or not all(
            isinstance(b, int) and not isinstance(b, bool) and b >= 0 for b in dest
        ):
            raise WireFormatError(
                f"push ask dest_block_ids must be 1 to {MAX_ASK_BLOCKS} block ids >= 0"
            )
        return cls(
            envelope.reply_tag,
            envelope.reply_address,
            _field(body, "request_id", str),
            lease,
            push_lease,
            consumer,
            layouts,
            tuple(layers),
            block_ids,
            tuple(dest),
            _decode_heads(body),
            _decode_heads({"heads": body.get("dest_heads")}),
        )


def _encode_request(
    kind: int,
    reply_tag: int,
    reply_address: bytes,
    fields: dict[str, object],
    *,
    payload_bytes: int = 0,
    block_ids: bytes = b"",
) -> bytes:
    body = json.dumps(fields, separators=(",", ":")).encode()
    return b"".join(
        (
            _REQUEST_STABLE.pack(
                _REQUEST_MAGIC, PROTOCOL_VERSION, kind, reply_tag, len(reply_address)
            ),
            reply_address,
            _REQUEST_V1.pack(payload_bytes, len(body), len(block_ids) // 8),
            body,
            block_ids,
        )
    )


def _decode_request(
    data: bytes | bytearray | memoryview, kind: int
) -> tuple[RequestEnvelope, int, dict, bytes]:
    """(envelope, payload bytes, JSON body, packed block ids) of a request of ``kind``;
    `WireFormatError` (with the status to answer) if it is not a valid one."""
    envelope = peek_request(data)
    if envelope.version != PROTOCOL_VERSION:
        raise WireFormatError(
            f"request uses protocol version {envelope.version}, server speaks {PROTOCOL_VERSION}",
            code=ErrorCode.UNSUPPORTED_VERSION,
        )
    if envelope.kind != kind:
        raise WireFormatError(f"unknown request kind {envelope.kind}")
    view = memoryview(data)
    offset = envelope.body_offset
    if len(view) < offset + _REQUEST_V1.size:
        raise WireFormatError(f"request truncated: {len(view)} bytes")
    payload_bytes, json_len, num_blocks = _REQUEST_V1.unpack_from(view, offset)
    offset += _REQUEST_V1.size
    expected = offset + json_len + 8 * num_blocks
    if len(view) != expected:
        raise WireFormatError(f"request is {len(view)} bytes, its header declares {expected}")
    try:
        body = json.loads(bytes(view[offset : offset + json_len]))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise WireFormatError(f"request metadata is not valid JSON: {exc}") from exc
    if not isinstance(body, dict):
        raise WireFormatError("request metadata must be a JSON object")
    return envelope, payload_bytes, body, bytes(view[offset + json_len :])


def peek_request(data: bytes | bytearray | memoryview) -> RequestEnvelope:
    """The stable prefix of a request; `WireFormatError` if it is not one (cannot be answered)."""
    view = memoryview(data)
    if len(view) < _REQUEST_STABLE.size:
        raise WireFormatError(f"request truncated: {len(view)} bytes")
    magic, version, kind, reply_tag, address_len = _REQUEST_STABLE.unpack_from(view)
    if magic != _REQUEST_MAGIC:
        raise WireFormatError(f"request has magic {bytes(magic)!r}, expected {_REQUEST_MAGIC!r}")
    end = _REQUEST_STABLE.size + address_len
    if len(view) < end or address_len == 0:
        raise WireFormatError(f"request reply address truncated: {len(view)} bytes")
    if reply_tag & (1 << 63):
        raise WireFormatError(f"reply tag {reply_tag:#x} collides with the request tag space")
    return RequestEnvelope(
        version=version,
        kind=kind,
        reply_tag=reply_tag,
        reply_address=bytes(view[_REQUEST_STABLE.size : end]),
        body_offset=end,
    )


def _field(body: object, key: str, kind: type) -> object:
    if not isinstance(body, dict) or key not in body:
        raise WireFormatError(f"request metadata lacks {key!r}")
    value = body[key]
    if isinstance(value, bool) or not isinstance(value, kind):
        raise WireFormatError(f"request field {key!r} must be {kind.__name__}, got {value!r}")
    return value


def _decode_layers(body: dict) -> tuple[LayerRequest, ...]:
    raw = _field(body, "layers", list)
    layers = []
    for item in raw:
        if (
            not isinstance(item, list)
            or len(item) != 4
            or not isinstance(item[0], str)
            or not isinstance(item[1], str)
            or any(isinstance(v, bool) or not isinstance(v, int) for v in item[2:])
        ):
            raise WireFormatError(f"bad layer entry {item!r}: want [name, dtype, block, head_dim]")
        layers.append(LayerRequest(*item))
    if not layers:
        raise WireFormatError("request names no layers")
    return tuple(layers)


def _decode_heads(body: dict) -> tuple[int, int] | None:
    if not isinstance(body, dict) or body.get("heads") is None:
        return None
    heads = body["heads"]
    if (
        not isinstance(heads, list)
        or len(heads) != 2
        or any(isinstance(v, bool) or not isinstance(v, int) for v in heads)
    ):
        raise WireFormatError(f"bad head range {heads!r}: want [start, stop]")
    return heads[0], heads[1]


def _decode_lease(body: dict) -> tuple[str, str, str, int] | None:
    lease = body.get("lease")
    if lease is None:
        return None
    if (
        not isinstance(lease, list)
        or len(lease) != 4
        or not all(isinstance(v, str) and v for v in lease[:2])
        or not isinstance(lease[2], str)
        or isinstance(lease[3], bool)
        or not isinstance(lease[3], int)
        or lease[3] < 0
    ):
        raise WireFormatError(
            "bad lease: want [lease id, secret, prompt digest, first block position]"
        )
    return lease[0], lease[1], lease[2], lease[3]


# -- response -----------------------------------------------------------------------------


@dataclass(frozen=True)
class PullResponseHeader:
    """Status of one exchange; ``payload_bytes`` is what the payload message carries."""

    status: ErrorCode
    payload_bytes: int = 0
    message: str = ""
    checksum: int | None = None

    def encode(self) -> bytes:
        room = RESPONSE_HEADER_BYTES - _RESPONSE_STABLE.size - _RESPONSE_V2.size
        text = self.message.encode()
        if len(text) > room:
            text = text[: room - 3].decode(errors="ignore").encode() + b"..."
        return (
            _RESPONSE_STABLE.pack(_RESPONSE_MAGIC, PROTOCOL_VERSION, int(self.status))
            + _RESPONSE_V2.pack(
                self.payload_bytes,
                self.checksum or 0,
                0 if self.checksum is None else FLAG_CHECKSUM,
                len(text),
            )
            + text
        )

    @classmethod
    def decode(cls, data: bytes | bytearray | memoryview) -> PullResponseHeader:
        view = memoryview(data)
        if len(view) < _RESPONSE_STABLE.size + _RESPONSE_V2.size:
            raise WireFormatError(f"response header truncated: {len(view)} bytes")
        magic, version, status = _RESPONSE_STABLE.unpack_from(view)
        if magic != _RESPONSE_MAGIC:
            raise WireFormatError(
                f"response has magic {bytes(magic)!r}, expected {_RESPONSE_MAGIC!r}"
            )
        if version != PROTOCOL_VERSION:
            raise WireFormatError(
                f"response uses protocol version {version}, client speaks {PROTOCOL_VERSION}",
                code=ErrorCode.UNSUPPORTED_VERSION,
            )
        payload_bytes, checksum, flags, text_len = _RESPONSE_V2.unpack_from(
            view, _RESPONSE_STABLE.size
        )
        start = _RESPONSE_STABLE.size + _RESPONSE_V2.size
        if len(view) < start + text_len:
            raise WireFormatError("response header message truncated")
        try:
            code = ErrorCode(status)
        except ValueError:
            code = ErrorCode.INTERNAL
        text = bytes(view[start : start + text_len]).decode(errors="replace")
        return cls(
            status=code,
            payload_bytes=payload_bytes,
            message=text,
            checksum=checksum if flags & FLAG_CHECKSUM else None,
        )
