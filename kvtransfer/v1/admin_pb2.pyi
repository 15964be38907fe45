from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class HandshakeState(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    HANDSHAKE_STATE_UNSPECIFIED: _ClassVar[HandshakeState]
    HANDSHAKE_STATE_PENDING: _ClassVar[HandshakeState]
    HANDSHAKE_STATE_READY: _ClassVar[HandshakeState]
    HANDSHAKE_STATE_FAILED: _ClassVar[HandshakeState]

class TransferDirection(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    TRANSFER_DIRECTION_UNSPECIFIED: _ClassVar[TransferDirection]
    TRANSFER_DIRECTION_SEND: _ClassVar[TransferDirection]
    TRANSFER_DIRECTION_RECV: _ClassVar[TransferDirection]
HANDSHAKE_STATE_UNSPECIFIED: HandshakeState
HANDSHAKE_STATE_PENDING: HandshakeState
HANDSHAKE_STATE_READY: HandshakeState
HANDSHAKE_STATE_FAILED: HandshakeState
TRANSFER_DIRECTION_UNSPECIFIED: TransferDirection
TRANSFER_DIRECTION_SEND: TransferDirection
TRANSFER_DIRECTION_RECV: TransferDirection

class GetStatusRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class GetStatusResponse(_message.Message):
    __slots__ = ("api_version", "role", "engine_id", "model", "tp_size", "pp_size", "num_free_blocks", "num_used_blocks", "uptime_s", "counters", "num_running_requests", "num_waiting_requests", "host_id", "cpus")
    class CountersEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    API_VERSION_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    TP_SIZE_FIELD_NUMBER: _ClassVar[int]
    PP_SIZE_FIELD_NUMBER: _ClassVar[int]
    NUM_FREE_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_USED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    UPTIME_S_FIELD_NUMBER: _ClassVar[int]
    COUNTERS_FIELD_NUMBER: _ClassVar[int]
    NUM_RUNNING_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    NUM_WAITING_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    HOST_ID_FIELD_NUMBER: _ClassVar[int]
    CPUS_FIELD_NUMBER: _ClassVar[int]
    api_version: int
    role: str
    engine_id: str
    model: str
    tp_size: int
    pp_size: int
    num_free_blocks: int
    num_used_blocks: int
    uptime_s: float
    counters: _containers.ScalarMap[str, int]
    num_running_requests: int
    num_waiting_requests: int
    host_id: str
    cpus: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, api_version: _Optional[int] = ..., role: _Optional[str] = ..., engine_id: _Optional[str] = ..., model: _Optional[str] = ..., tp_size: _Optional[int] = ..., pp_size: _Optional[int] = ..., num_free_blocks: _Optional[int] = ..., num_used_blocks: _Optional[int] = ..., uptime_s: _Optional[float] = ..., counters: _Optional[_Mapping[str, int]] = ..., num_running_requests: _Optional[int] = ..., num_waiting_requests: _Optional[int] = ..., host_id: _Optional[str] = ..., cpus: _Optional[_Iterable[int]] = ...) -> None: ...

class PeerInfo(_message.Message):
    __slots__ = ("engine_id", "address", "state", "generation", "last_handshake_latency_ms")
    ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    LAST_HANDSHAKE_LATENCY_MS_FIELD_NUMBER: _ClassVar[int]
    engine_id: str
    address: str
    state: HandshakeState
    generation: int
    last_handshake_latency_ms: float
    def __init__(self, engine_id: _Optional[str] = ..., address: _Optional[str] = ..., state: _Optional[_Union[HandshakeState, str]] = ..., generation: _Optional[int] = ..., last_handshake_latency_ms: _Optional[float] = ...) -> None: ...

class ListPeersRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ListPeersResponse(_message.Message):
    __slots__ = ("api_version", "peers")
    API_VERSION_FIELD_NUMBER: _ClassVar[int]
    PEERS_FIELD_NUMBER: _ClassVar[int]
    api_version: int
    peers: _containers.RepeatedCompositeFieldContainer[PeerInfo]
    def __init__(self, api_version: _Optional[int] = ..., peers: _Optional[_Iterable[_Union[PeerInfo, _Mapping]]] = ...) -> None: ...

class TransferInfo(_message.Message):
    __slots__ = ("request_id", "peer_engine_id", "direction", "num_blocks", "num_bytes", "age_s")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PEER_ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
    DIRECTION_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_BYTES_FIELD_NUMBER: _ClassVar[int]
    AGE_S_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    peer_engine_id: str
    direction: TransferDirection
    num_blocks: int
    num_bytes: int
    age_s: float
    def __init__(self, request_id: _Optional[str] = ..., peer_engine_id: _Optional[str] = ..., direction: _Optional[_Union[TransferDirection, str]] = ..., num_blocks: _Optional[int] = ..., num_bytes: _Optional[int] = ..., age_s: _Optional[float] = ...) -> None: ...

class ListTransfersRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ListTransfersResponse(_message.Message):
    __slots__ = ("api_version", "transfers")
    API_VERSION_FIELD_NUMBER: _ClassVar[int]
    TRANSFERS_FIELD_NUMBER: _ClassVar[int]
    api_version: int
    transfers: _containers.RepeatedCompositeFieldContainer[TransferInfo]
    def __init__(self, api_version: _Optional[int] = ..., transfers: _Optional[_Iterable[_Union[TransferInfo, _Mapping]]] = ...) -> None: ...

class AbortRequestRequest(_message.Message):
    __slots__ = ("request_id",)
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    def __init__(self, request_id: _Optional[str] = ...) -> None: ...

class AbortRequestResponse(_message.Message):
    __slots__ = ("api_version", "found")
    API_VERSION_FIELD_NUMBER: _ClassVar[int]
    FOUND_FIELD_NUMBER: _ClassVar[int]
    api_version: int
    found: bool
    def __init__(self, api_version: _Optional[int] = ..., found: _Optional[bool] = ...) -> None: ...

class DrainRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class DrainResponse(_message.Message):
    __slots__ = ("api_version", "num_in_flight_transfers")
    API_VERSION_FIELD_NUMBER: _ClassVar[int]
    NUM_IN_FLIGHT_TRANSFERS_FIELD_NUMBER: _ClassVar[int]
    api_version: int
    num_in_flight_transfers: int
    def __init__(self, api_version: _Optional[int] = ..., num_in_flight_transfers: _Optional[int] = ...) -> None: ...

class SetLogLevelRequest(_message.Message):
    __slots__ = ("level", "logger")
    LEVEL_FIELD_NUMBER: _ClassVar[int]
    LOGGER_FIELD_NUMBER: _ClassVar[int]
    level: str
    logger: str
    def __init__(self, level: _Optional[str] = ..., logger: _Optional[str] = ...) -> None: ...

class SetLogLevelResponse(_message.Message):
    __slots__ = ("api_version", "previous_level")
    API_VERSION_FIELD_NUMBER: _ClassVar[int]
    PREVIOUS_LEVEL_FIELD_NUMBER: _ClassVar[int]
    api_version: int
    previous_level: str
    def __init__(self, api_version: _Optional[int] = ..., previous_level: _Optional[str] = ...) -> None: ...
