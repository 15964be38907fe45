from collections.abc import Iterable as _Iterable
from collections.abc import Mapping as _Mapping
from typing import ClassVar as _ClassVar

from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from google.protobuf.internal import containers as _containers

DESCRIPTOR: _descriptor.FileDescriptor

class CompatibilityInfo(_message.Message):
    __slots__ = (
        "block_size",
        "dtype",
        "head_size",
        "kv_layout",
        "model",
        "num_layers",
        "total_num_kv_heads",
        "wire_version",
    )
    MODEL_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    TOTAL_NUM_KV_HEADS_FIELD_NUMBER: _ClassVar[int]
    HEAD_SIZE_FIELD_NUMBER: _ClassVar[int]
    NUM_LAYERS_FIELD_NUMBER: _ClassVar[int]
    KV_LAYOUT_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    WIRE_VERSION_FIELD_NUMBER: _ClassVar[int]
    model: str
    dtype: str
    total_num_kv_heads: int
    head_size: int
    num_layers: int
    kv_layout: str
    block_size: int
    wire_version: int
    def __init__(
        self,
        model: str | None = ...,
        dtype: str | None = ...,
        total_num_kv_heads: int | None = ...,
        head_size: int | None = ...,
        num_layers: int | None = ...,
        kv_layout: str | None = ...,
        block_size: int | None = ...,
        wire_version: int | None = ...,
    ) -> None: ...

class WorkerRank(_message.Message):
    __slots__ = ("pp_rank", "tp_rank")
    PP_RANK_FIELD_NUMBER: _ClassVar[int]
    TP_RANK_FIELD_NUMBER: _ClassVar[int]
    pp_rank: int
    tp_rank: int
    def __init__(self, pp_rank: int | None = ..., tp_rank: int | None = ...) -> None: ...

class GetHandshakeRequest(_message.Message):
    __slots__ = ("all_ranks", "client_compat_hash", "expected_engine_id", "ranks")
    EXPECTED_ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
    CLIENT_COMPAT_HASH_FIELD_NUMBER: _ClassVar[int]
    ALL_RANKS_FIELD_NUMBER: _ClassVar[int]
    RANKS_FIELD_NUMBER: _ClassVar[int]
    expected_engine_id: str
    client_compat_hash: str
    all_ranks: bool
    ranks: _containers.RepeatedCompositeFieldContainer[WorkerRank]
    def __init__(
        self,
        expected_engine_id: str | None = ...,
        client_compat_hash: str | None = ...,
        all_ranks: bool | None = ...,
        ranks: _Iterable[WorkerRank | _Mapping] | None = ...,
    ) -> None: ...

class HandshakePayload(_message.Message):
    __slots__ = (
        "compat",
        "compat_hash",
        "engine_id",
        "generation",
        "metadata",
        "pp_rank",
        "tp_rank",
    )
    COMPAT_HASH_FIELD_NUMBER: _ClassVar[int]
    ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
    COMPAT_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    PP_RANK_FIELD_NUMBER: _ClassVar[int]
    TP_RANK_FIELD_NUMBER: _ClassVar[int]
    METADATA_FIELD_NUMBER: _ClassVar[int]
    compat_hash: str
    engine_id: str
    compat: CompatibilityInfo
    generation: int
    pp_rank: int
    tp_rank: int
    metadata: bytes
    def __init__(
        self,
        compat_hash: str | None = ...,
        engine_id: str | None = ...,
        compat: CompatibilityInfo | _Mapping | None = ...,
        generation: int | None = ...,
        pp_rank: int | None = ...,
        tp_rank: int | None = ...,
        metadata: bytes | None = ...,
    ) -> None: ...

class GetHandshakeResponse(_message.Message):
    __slots__ = ("api_version", "payloads")
    API_VERSION_FIELD_NUMBER: _ClassVar[int]
    PAYLOADS_FIELD_NUMBER: _ClassVar[int]
    api_version: int
    payloads: _containers.RepeatedCompositeFieldContainer[HandshakePayload]
    def __init__(
        self,
        api_version: int | None = ...,
        payloads: _Iterable[HandshakePayload | _Mapping] | None = ...,
    ) -> None: ...
