"""`CompatibilityInfo`: what two engines must agree on before KV blocks can move between them."""

from __future__ import annotations

import hashlib
import json
from typing import NamedTuple

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from kvtransfer.v1 import handshake_pb2

_NonBlank = Field(min_length=1)
_Positive = Field(gt=0, lt=2**32)  # the proto fields are uint32


class FieldDifference(NamedTuple):
    name: str
    local: object
    remote: object

    def __str__(self) -> str:
        return f"{self.name}: local={self.local!r} remote={self.remote!r}"


class CompatibilityInfo(BaseModel):
    """Model and KV-cache shape facts that must match on both ends of a transfer.

    `compat_hash` is what peers compare first; the fields themselves travel along so a mismatch
    can be explained field by field instead of as two opaque hashes.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    model: str = _NonBlank
    dtype: str = _NonBlank
    total_num_kv_heads: int = _Positive
    head_size: int = _Positive
    num_layers: int = _Positive
    kv_layout: str = Field(default="HND", min_length=1)
    block_size: int = _Positive
    wire_version: int = _Positive

    def compat_hash(self) -> str:
        """sha256 hex of a canonical JSON form: sorted keys, no whitespace, so it is the same
        in every process and Python version (unlike `hash()`)."""
        canonical = json.dumps(self.model_dump(), sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(canonical.encode()).hexdigest()

    def differences(self, remote: CompatibilityInfo) -> list[FieldDifference]:
        """Fields whose values differ, in declaration order; ``self`` is the local side."""
        return [
            FieldDifference(name, getattr(self, name), getattr(remote, name))
            for name in type(self).model_fields
            if getattr(self, name) != getattr(remote, name)
        ]

    def to_proto(self) -> handshake_pb2.CompatibilityInfo:
        return handshake_pb2.CompatibilityInfo(**self.model_dump())

    @classmethod
    def from_proto(cls, message: handshake_pb2.CompatibilityInfo) -> CompatibilityInfo:
        """Validate a peer's message; a missing or out-of-range field raises `ValueError`."""
        values = {name: getattr(message, name) for name in cls.model_fields}
        try:
            return cls.model_validate(values)
        except ValidationError as exc:
            raise ValueError(f"invalid CompatibilityInfo from peer: {exc}") from exc


API_VERSION = 1
"""Sent in every control-plane response. Additive changes keep it; a client refuses any other
value rather than misreading a reply whose meaning changed."""
