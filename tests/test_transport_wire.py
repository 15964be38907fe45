"""Data-plane pieces that need no UCX: wire format, pull specs, gather/scatter, buffer pool."""

from __future__ import annotations

import json
import struct
import subprocess
import sys
import zlib

import pytest
import torch

from kvtransfer.connector.topology import EngineTransferInfo, TransferTopology
from kvtransfer.transport import (
    ErrorCode,
    InvalidPeerAddress,
    KVLayout,
    PullSpec,
    TransportConfig,
)
from kvtransfer.transport.buffers import BufferPool, gather_into, row_view, scatter_from
from kvtransfer.transport.messages import (
    KIND_PUSH_ASK,
    PROTOCOL_VERSION,
    REQUEST_TAG,
    RESPONSE_HEADER_BYTES,
    LayerRequest,
    PullRequestMessage,
    PullResponseHeader,
    PushAskMessage,
    WireFormatError,
    _decode_request,
    _encode_request,
    decode_address,
    encode_address,
    pack_block_ids,
    peek_request,
    reply_tags,
    segment_offsets,
    unpack_block_ids,
)
from kvtransfer.transport.spec import check_kv_cache, plan_pull

pytestmark = pytest.mark.integration

UCX_ADDRESS = bytes(range(200)) + b"\xff" * 17


def _request(**overrides: object) -> PullRequestMessage:
    fields: dict[str, object] = {
        "request_id": "req-1",
        "reply_tag": 42,
        "reply_address": UCX_ADDRESS,
        "layers": (LayerRequest("model.layers.0.self_attn", "float32", 16, 8),),
        "remote_heads": (2, 4),
        "num_heads": 2,
        "block_ids": pack_block_ids([3, 0, 63]),
        "payload_bytes": 3 * 2 * 2 * 16 * 8 * 4,
    }
    fields.update(overrides)
    return PullRequestMessage(**fields)  # type: ignore[arg-type]


# -- addresses --------------------------------------------------------------------------------


def test_address_envelope_round_trips():
    assert decode_address(encode_address(UCX_ADDRESS)) == UCX_ADDRESS


@pytest.mark.parametrize(
    ("address", "match"),
    [
        (b"", r"peer address is 0 bytes, shorter than the 16-byte header"),
        (b"\x00" * 40, r"peer address has magic b'\\x00\\x00\\x00\\x00', expected b'KVTA'"),
        (encode_address(UCX_ADDRESS)[:-1], r"declares 217 UCX address bytes but carries 216"),
        (encode_address(UCX_ADDRESS)[:-1] + b"\x00", r"checksum mismatch"),
        (
            b"KVTA" + struct.pack("<HHII", 99, 0, 1, zlib.crc32(b"x")) + b"x",
            r"protocol version 99, this agent speaks 1",
        ),
        ("not bytes", r"peer address must be bytes, got str"),
    ],
)
def test_garbage_addresses_are_refused_before_ucx_sees_them(address, match):
    with pytest.raises(InvalidPeerAddress, match=match):
        decode_address(address)


def test_invalid_address_is_a_value_error_and_connection_error():
    assert issubclass(InvalidPeerAddress, ValueError)
    assert issubclass(InvalidPeerAddress, ConnectionError)


# -- tags and layout --------------------------------------------------------------------------


def test_reply_tags_pair_up_and_never_touch_the_request_tag_bit():
    assert reply_tags(0) == (0, 1)
    assert reply_tags(5) == (10, 11)
    header, payload = reply_tags((1 << 62) - 1)
    assert not header & REQUEST_TAG & (1 << 63)
    assert not payload & (1 << 63)
    with pytest.raises(ValueError, match=r"reply sequence 4611686018427387904 out of range"):
        reply_tags(1 << 62)


def test_segments_are_aligned_to_16_bytes():
    assert segment_offsets([10, 32, 1, 0, 5]) == ([0, 16, 48, 64, 64], 69)
    assert segment_offsets([]) == ([], 0)


def test_block_ids_pack_little_endian_int64():
    data = pack_block_ids([1, 2**40, 0])
    assert data == struct.pack("<qqq", 1, 2**40, 0)
    assert list(unpack_block_ids(data)) == [1, 2**40, 0]
    with pytest.raises(WireFormatError, match=r"block id bytes \(7\) are not a multiple of 8"):
        unpack_block_ids(b"\x00" * 7)


# -- requests ---------------------------------------------------------------------------------


def test_request_round_trips():
    message = _request()
    decoded = PullRequestMessage.decode(message.encode())
    assert decoded == message
    assert decoded.num_blocks == 3


def test_request_without_head_range_round_trips():
    message = _request(remote_heads=None, num_heads=4)
    assert PullRequestMessage.decode(message.encode()) == message


def test_request_prefix_is_stable_and_names_the_version():
    data = _request().encode()
    magic, version, kind, reply_tag, address_len = struct.unpack_from("<4sHHQI", data)
    assert (magic, version, kind, reply_tag, address_len) == (b"KVTQ", 2, 1, 42, 217)
    envelope = peek_request(data)
    assert envelope.reply_address == UCX_ADDRESS
    assert envelope.reply_tag == 42


def test_newer_version_is_answerable_but_refused():
    data = bytearray(_request().encode())
    struct.pack_into("<H", data, 4, PROTOCOL_VERSION + 1)
    assert peek_request(data).reply_tag == 42
    with pytest.raises(WireFormatError, match=r"protocol version 3, server speaks 2") as info:
        PullRequestMessage.decode(data)
    assert info.value.code is ErrorCode.UNSUPPORTED_VERSION


@pytest.mark.parametrize(
    ("mutate", "match"),
    [
        (lambda d: d[:10], r"request truncated: 10 bytes"),
        (lambda d: b"XXXX" + d[4:], r"request has magic b'XXXX', expected b'KVTQ'"),
        (lambda d: d + b"\x00", r"request is 383 bytes, its header declares 382"),
        (lambda d: d[:-8], r"request is 374 bytes, its header declares 382"),
    ],
)
def test_malformed_requests_are_rejected(mutate, match):
    data = _request().encode()
    assert len(data) == 382
    with pytest.raises(WireFormatError, match=match):
        PullRequestMessage.decode(mutate(data))


def test_request_with_bad_metadata_is_a_bad_request():
    good = _request().encode()
    envelope = peek_request(good)
    body = json.dumps({"request_id": "r", "layers": [["x", "float32", 16]], "num_heads": 1})
    data = good[: envelope.body_offset] + struct.pack("<QII", 0, len(body), 0) + body.encode()
    with pytest.raises(WireFormatError, match=r"bad layer entry \['x', 'float32', 16\]") as info:
        PullRequestMessage.decode(data)
    assert info.value.code is ErrorCode.BAD_REQUEST


def test_reply_tag_in_request_space_is_refused():
    data = _request(reply_tag=1 << 63).encode()
    with pytest.raises(WireFormatError, match=r"collides with the request tag space"):
        peek_request(data)


# -- responses --------------------------------------------------------------------------------


def test_response_header_round_trips_inside_a_larger_buffer():
    header = PullResponseHeader(ErrorCode.UNKNOWN_LAYER, 0, "unknown layer(s) 'x'")
    buffer = bytearray(RESPONSE_HEADER_BYTES)
    encoded = header.encode()
    buffer[: len(encoded)] = encoded
    assert PullResponseHeader.decode(buffer) == header


def test_long_error_text_is_cut_to_fit_the_header_buffer():
    header = PullResponseHeader(ErrorCode.INTERNAL, 0, "é" * 5000)
    encoded = header.encode()
    assert len(encoded) <= RESPONSE_HEADER_BYTES
    decoded = PullResponseHeader.decode(encoded)
    assert decoded.message.endswith("...")
    assert decoded.message.startswith("éé")


def test_unknown_status_decodes_as_internal():
    encoded = bytearray(PullResponseHeader(ErrorCode.OK, 8).encode())
    struct.pack_into("<H", encoded, 6, 999)
    assert PullResponseHeader.decode(encoded).status is ErrorCode.INTERNAL


def test_response_with_other_version_is_refused():
    encoded = bytearray(PullResponseHeader(ErrorCode.OK, 8).encode())
    struct.pack_into("<H", encoded, 4, 7)
    with pytest.raises(WireFormatError, match=r"response uses protocol version 7"):
        PullResponseHeader.decode(encoded)


# -- specs ------------------------------------------------------------------------------------


def _cache(blocks: int = 8, heads: int = 4, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.zeros(blocks, 2, heads, 16, 8, dtype=dtype)


def test_spec_normalises_lists_tensors_and_tuples():
    spec = PullSpec(
        "r",
        ["a", "b"],
        torch.tensor([4, 5]),
        [0, 1],
        remote_heads=(2, 4),
        local_heads=range(0, 2),
    )
    assert spec.layer_names == ("a", "b")
    assert spec.remote_block_ids == (4, 5)
    assert spec.local_block_ids == (0, 1)
    assert spec.remote_heads == range(2, 4)
    assert spec.num_blocks == 2


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"request_id": ""}, r"request_id must be a non-empty str, got ''"),
        ({"layer_names": []}, r"layer_names is empty"),
        ({"layer_names": "abc"}, r"layer_names must be a sequence of str, got 'abc'"),
        ({"layer_names": ["a", "a"]}, r"layer_names lists \['a'\] more than once"),
        ({"remote_block_ids": [1]}, r"remote_block_ids \(1\) and local_block_ids \(2\) must"),
        ({"local_block_ids": [3, 3]}, r"local_block_ids holds a block id twice"),
        ({"local_block_ids": [0, -1]}, r"local_block_ids holds a negative block id \(-1\)"),
        ({"remote_block_ids": [0, True]}, r"remote_block_ids must hold ints, got True"),
        ({"remote_block_ids": [0, 1 << 63]}, r"remote_block_ids holds a block id beyond int64"),
        ({"remote_block_ids": torch.tensor([0.0, 1.0])}, r"must be a 1-D integer tensor"),
        ({"remote_heads": range(0, 4, 2)}, r"remote_heads must be a non-empty range with step 1"),
        ({"local_heads": range(2, 2)}, r"local_heads must be a non-empty range"),
        ({"local_heads": [0, 1]}, r"local_heads must be a range or a \(start, stop\) tuple"),
        (
            {"remote_heads": range(0, 2), "local_heads": range(0, 3)},
            r"remote_heads range\(0, 2\) and local_heads range\(0, 3\) select different",
        ),
    ],
)
def test_spec_validation(kwargs, match):
    fields = {
        "request_id": "r",
        "layer_names": ["a"],
        "remote_block_ids": [1, 2],
        "local_block_ids": [0, 1],
    }
    fields.update(kwargs)
    with pytest.raises(ValueError, match=match):
        PullSpec(**fields)


def test_spec_from_topology_head_source():
    # Decode TP=2 reads from prefill TP=1: local rank 1 holds heads 2..3 of the remote's 4.
    topology = TransferTopology(
        tp_rank=1, tp_size=2, block_size=16, engine_id="decode", is_mla=False, total_num_kv_heads=4
    )
    topology.register_remote_engine(
        "prefill",
        EngineTransferInfo(
            remote_tp_size=1,
            remote_block_len=1,
            remote_block_size=16,
            remote_physical_blocks_per_logical=1,
        ),
    )
    (source,) = topology.head_sources("prefill")
    spec = PullSpec.for_head_source("r", ["a"], [7], [0], source)
    assert spec.remote_heads == range(2, 4)
    assert spec.local_heads == range(0, 2)


def test_plan_checks_local_layers_heads_and_blocks():
    local = {"a": _cache(heads=2), "b": _cache(heads=2)}
    plans = plan_pull(PullSpec("r", ["a", "b"], [9], [7], remote_heads=(2, 4)), local)
    assert [(p.name, p.local_heads) for p in plans] == [("a", range(2)), ("b", range(2))]
    with pytest.raises(ValueError, match=r"layers \['c'\] are not registered locally"):
        plan_pull(PullSpec("r", ["a", "c"], [0], [0]), local)
    with pytest.raises(ValueError, match=r"local block id 8 out of range for layer 'a' with 8"):
        plan_pull(PullSpec("r", ["a"], [0], [8]), local)
    with pytest.raises(ValueError, match=r"local_heads range\(1, 3\) out of bounds for layer 'a'"):
        plan_pull(PullSpec("r", ["a"], [0], [0], local_heads=(1, 3)), local)
    with pytest.raises(ValueError, match=r"remote_heads range\(0, 1\) selects 1 heads but layer"):
        plan_pull(PullSpec("r", ["a"], [0], [0], remote_heads=(0, 1)), local)


def test_plan_checks_peer_layouts_when_known():
    local = {"a": _cache(heads=2)}
    remote = {
        "a": KVLayout(num_blocks=16, num_kv_heads=4, block_size=16, head_dim=8, dtype="float32")
    }
    plan_pull(PullSpec("r", ["a"], [15], [0], remote_heads=(2, 4)), local, remote)
    with pytest.raises(ValueError, match=r"remote block id 16 out of range for layer 'a' with 16"):
        plan_pull(PullSpec("r", ["a"], [16], [0], remote_heads=(2, 4)), local, remote)
    with pytest.raises(ValueError, match=r"remote heads range\(0, 4\) of layer 'a' do not fit"):
        plan_pull(PullSpec("r", ["a"], [0], [0]), local, remote)
    with pytest.raises(ValueError, match=r"peer has no layer 'a'"):
        plan_pull(PullSpec("r", ["a"], [0], [0], remote_heads=(2, 4)), local, {})
    bf16 = {"a": KVLayout(16, 4, 16, 8, "bfloat16")}
    with pytest.raises(ValueError, match=r"layer 'a' dtype mismatch: local float32, remote bf"):
        plan_pull(PullSpec("r", ["a"], [0], [0], remote_heads=(2, 4)), local, bf16)
    other_block = {"a": KVLayout(16, 4, 32, 8, "float32")}
    with pytest.raises(ValueError, match=r"layer 'a' block_size mismatch: local 16, remote 32"):
        plan_pull(PullSpec("r", ["a"], [0], [0], remote_heads=(2, 4)), local, other_block)
    other_dim = {"a": KVLayout(16, 4, 16, 4, "float32")}
    with pytest.raises(ValueError, match=r"layer 'a' head_dim mismatch: local 8, remote 4"):
        plan_pull(PullSpec("r", ["a"], [0], [0], remote_heads=(2, 4)), local, other_dim)


@pytest.mark.parametrize(
    ("tensor", "match"),
    [
        (torch.zeros(4, 2, 2, 16), r"has shape \(4, 2, 2, 16\); expected \[num_blocks, 2,"),
        (torch.zeros(4, 3, 2, 16, 8), r"has shape \(4, 3, 2, 16, 8\)"),
        (
            torch.zeros(4, 1, 2, 16, 8).expand(4, 2, 2, 16, 8),
            r"KV cache 'x' has elements that share memory",
        ),
        (torch.zeros(0, 2, 2, 16, 8), r"KV cache 'x' is empty"),
        ([1, 2], r"KV cache 'x' must be a torch.Tensor, got list"),
    ],
)
def test_kv_cache_checks(tensor, match):
    with pytest.raises(ValueError, match=match):
        check_kv_cache("x", tensor)


def test_layout_dict_round_trip_and_missing_field():
    layout = KVLayout.of(_cache(blocks=5, heads=3, dtype=torch.bfloat16))
    assert layout == KVLayout(5, 3, 16, 8, "bfloat16")
    assert layout.element_size == 2
    assert KVLayout.from_dict(layout.as_dict()) == layout
    with pytest.raises(ValueError, match=r"KV layout lacks field 'dtype'"):
        KVLayout.from_dict({"num_blocks": 1, "num_kv_heads": 1, "block_size": 1, "head_dim": 1})


# -- gather / scatter -------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("heads", "local_heads", "local_total"),
    [
        (range(0, 6), range(0, 6), 6),
        (range(2, 4), range(0, 2), 2),
        (range(3, 5), range(1, 3), 4),
        (range(1, 2), range(5, 6), 6),
        (range(0, 3), range(3, 6), 6),
    ],
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gather_then_scatter_moves_exactly_the_head_slice(heads, local_heads, local_total, dtype):
    generator = torch.Generator().manual_seed(1)
    remote = torch.randn(10, 2, 6, 4, 3, generator=generator).to(dtype)
    local = torch.full((7, 2, local_total, 4, 3), -1.0, dtype=dtype)
    remote_ids = torch.tensor([9, 0, 4])
    local_ids = torch.tensor([6, 2, 3])
    nbytes = 3 * 2 * len(heads) * 4 * 3 * remote.element_size()
    segment = torch.empty(nbytes, dtype=torch.uint8)
    gather_into(segment, remote, row_view(remote_ids, 6, heads, 12))
    assert torch.equal(
        segment.view(dtype).view(3, 2, len(heads), 4, 3),
        remote[remote_ids][:, :, heads.start : heads.stop],
    )
    scatter_from(segment, local, row_view(local_ids, local_total, local_heads, 12))
    expected = torch.full_like(local, -1.0)
    expected[local_ids, :, local_heads.start : local_heads.stop] = remote[remote_ids][
        :, :, heads.start : heads.stop
    ]
    assert torch.equal(local, expected)


def test_buffer_pool_reuses_by_size_class_and_respects_its_cap():
    pool = BufferPool(max_cached_bytes=256 << 10)
    first = pool.acquire(70_000, torch.device("cpu"))
    assert first.numel() == 128 << 10
    pool.release(first)
    assert pool.cached_bytes == 128 << 10
    assert pool.acquire(100_000, torch.device("cpu")) is first
    assert pool.cached_bytes == 0
    small = pool.acquire(10, torch.device("cpu"))
    assert small.numel() == 64 << 10
    pool.release(pool.acquire(200 << 10, torch.device("cpu")))
    pool.release(torch.empty(512 << 10, dtype=torch.uint8))
    assert pool.cached_bytes == 256 << 10
    pool.release(torch.empty(1000, dtype=torch.uint8))
    assert pool.cached_bytes == 256 << 10


# -- config and import ------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"timeout_s": 0}, r"timeout_s must be > 0, got 0"),
        ({"timeout_s": "1"}, r"timeout_s must be a number, got '1'"),
        ({"chunk_bytes": 1.5}, r"chunk_bytes must be an int, got 1.5"),
        ({"pull_threads": True}, r"pull_threads must be an int, got True"),
        ({"buffer_pool_bytes": -1}, r"buffer_pool_bytes must be >= 0, got -1"),
        ({"inline_bytes": -1}, r"inline_bytes must be >= 0, got -1"),
        ({"inline_bytes": 2.0}, r"inline_bytes must be an int, got 2.0"),
    ],
)
def test_config_validation(kwargs, match):
    with pytest.raises(ValueError, match=match):
        TransportConfig(**kwargs)


def test_importing_the_transport_does_not_initialise_ucx():
    probe = (
        "import os, sys, json; import kvtransfer.transport as t; "
        "print(json.dumps(['ucxx' in sys.modules, 'UCX_RNDV_THRESH' in os.environ]))"
    )
    result = subprocess.run(
        [sys.executable, "-c", probe],
        capture_output=True,
        text=True,
        timeout=120,
        env={k: v for k, v in __import__("os").environ.items() if not k.startswith("UCX_")},
    )
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout) == [False, False]


def _push_ask(**changes) -> PushAskMessage:
    fields = {
        "reply_tag": 7,
        "reply_address": b"reply",
        "request_id": "r",
        "lease": ("r", "secret", "digest", 0),
        "push_lease": ("r/push/0", "other", "", 0),
        "consumer": encode_address(b"ucx-address"),
        "layouts": {"l0": KVLayout(8, 2, 4, 16, "float32").as_dict()},
        "layers": ("l0",),
        "block_ids": (3, 1),
        "dest_block_ids": (5, 6),
        "heads": (0, 1),
        "dest_heads": None,
    }
    return PushAskMessage(**{**fields, **changes})


def test_push_ask_round_trips():
    ask = _push_ask()
    assert PushAskMessage.decode(ask.encode()) == ask


def _ask_body(mutate) -> bytes:
    """A push ask whose JSON body ``mutate`` changed (the envelope kept consistent)."""
    _, _, body, packed = _decode_request(_push_ask().encode(), KIND_PUSH_ASK)
    mutate(body)
    return _encode_request(KIND_PUSH_ASK, 7, b"reply", body, block_ids=packed)


@pytest.mark.parametrize(
    ("mutate", "match"),
    [
        (lambda b: b.pop("push_lease"), "must present the request's lease and a push lease"),
        (lambda b: b.update(consumer="not base64!"), "consumer address is not base64"),
        (lambda b: b.update(layers=["l9"]), "must name layers of its layouts"),
        (lambda b: b.update(layers=["l0", "l0"]), "repeat a layer"),
        (lambda b: b.update(layouts={}), "must map 1 to"),
        (lambda b: b.update(dest_block_ids=[]), "dest_block_ids must be 1 to"),
        (lambda b: b.update(dest_block_ids=[-1]), "dest_block_ids must be 1 to"),
        (lambda b: b.update(dest_heads=[0]), "bad head range"),
    ],
)
def test_malformed_push_asks_are_bad_requests(mutate, match):
    with pytest.raises(WireFormatError, match=match) as refused:
        PushAskMessage.decode(_ask_body(mutate))
    assert refused.value.code == ErrorCode.BAD_REQUEST
