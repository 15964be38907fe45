from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class CompatibilityInfo(_message.Message):
    __slots__ = ("model", "dtype", "total_num_kv_heads", "head_size", "num_layers", "kv_layout", "block_size", "wire_version")
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
    def __init__(self, model: _Optional[str] = ..., dtype: _Optional[str] = ..., total_num_kv_heads: _Optional[int] = ..., head_size: _Optional[int] = ..., num_layers: _Optional[int] = ..., kv_layout: _Optional[str] = ..., block_size: _Optional[int] = ..., wire_version: _Optional[int] = ...) -> None: ...

class WorkerRank(_message.Message):
    __slots__ = ("pp_rank", "tp_rank")
    PP_RANK_FIELD_NUMBER: _ClassVar[int]
    TP_RANK_FIELD_NUMBER: _ClassVar[int]
    pp_rank: int
    tp_rank: int
    def __init__(self, pp_rank: _Optional[int] = ..., tp_rank: _Optional[int] = ...) -> None: ...

class GetHandshakeRequest(_message.Message):
    __slots__ = ("expected_engine_id", "client_compat_hash", "all_ranks", "ranks")
    EXPECTED_ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
    CLIENT_COMPAT_HASH_FIELD_NUMBER: _ClassVar[int]
    ALL_RANKS_FIELD_NUMBER: _ClassVar[int]
    RANKS_FIELD_NUMBER: _ClassVar[int]
    expected_engine_id: str
    client_compat_hash: str
    all_ranks: bool
    ranks: _containers.RepeatedCompositeFieldContainer[WorkerRank]
    def __init__(self, expected_engine_id: _Optional[str] = ..., client_compat_hash: _Optional[str] = ..., all_ranks: _Optional[bool] = ..., ranks: _Optional[_Iterable[_Union[WorkerRank, _Mapping]]] = ...) -> None: ...

class HandshakePayload(_message.Message):
    __slots__ = ("compat_hash", "engine_id", "compat", "generation", "pp_rank", "tp_rank", "metadata")
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
    def __init__(self, compat_hash: _Optional[str] = ..., engine_id: _Optional[str] = ..., compat: _Optional[_Union[CompatibilityInfo, _Mapping]] = ..., generation: _Optional[int] = ..., pp_rank: _Optional[int] = ..., tp_rank: _Optional[int] = ..., metadata: _Optional[bytes] = ...) -> None: ...

class GetHandshakeResponse(_message.Message):
    __slots__ = ("api_version", "payloads")
    API_VERSION_FIELD_NUMBER: _ClassVar[int]
    PAYLOADS_FIELD_NUMBER: _ClassVar[int]
    api_version: int
    payloads: _containers.RepeatedCompositeFieldContainer[HandshakePayload]
    def __init__(self, api_version: _Optional[int] = ..., payloads: _Optional[_Iterable[_Union[HandshakePayload, _Mapping]]] = ...) -> None: ...
