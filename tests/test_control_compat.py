"""CompatibilityInfo, HandshakeBook and the typed errors, without a network."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys

import pytest
from control_helpers.fake_engine import FakeWorkerMetadata, make_compat, start_engine

from kvtransfer.clients.control import RetryPolicy
from kvtransfer.control import (
    CompatibilityInfo,
    HandshakeBook,
    HandshakeCompatibilityError,
    HandshakeNotFoundError,
    PeerUnavailableError,
)
from kvtransfer.control.compat import FieldDifference
from kvtransfer.v1 import handshake_pb2

pytestmark = pytest.mark.integration

# Pinned: peers running other kvtransfer versions compare this hash, so the canonical form must
# not drift (sorted keys, no whitespace).
CANONICAL = (
    '{"block_size":16,"dtype":"float16","head_size":32,"kv_layout":"HND",'
    '"model":"test/tiny-model","num_layers":8,"total_num_kv_heads":4,"wire_version":1}'
)


def test_compat_hash_is_sha256_of_the_pinned_canonical_json():
    assert make_compat().compat_hash() == hashlib.sha256(CANONICAL.encode()).hexdigest()


def test_compat_hash_is_the_same_in_another_process():
    code = "from control_helpers.fake_engine import make_compat; print(make_compat().compat_hash())"
    env = {**os.environ, "PYTHONHASHSEED": "12345", "PYTHONPATH": os.path.dirname(__file__)}
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True
    )
    assert out.stdout.strip() == make_compat().compat_hash()


@pytest.mark.parametrize(
    "field, value",
    [
        ("model", "other/model"),
        ("dtype", "bfloat16"),
        ("total_num_kv_heads", 8),
        ("head_size", 64),
        ("num_layers", 9),
        ("kv_layout", "NHD"),
        ("block_size", 32),
        ("wire_version", 2),
    ],
)
def test_every_field_changes_the_hash_and_is_reported(field, value):
    local, remote = make_compat(), make_compat(**{field: value})
    assert local.compat_hash() != remote.compat_hash()
    assert local.differences(remote) == [FieldDifference(field, getattr(local, field), value)]


def test_kv_layout_defaults_to_hnd_and_invalid_values_raise():
    assert make_compat().kv_layout == "HND"
    with pytest.raises(ValueError, match="block_size"):
        make_compat(block_size=0)
    with pytest.raises(ValueError, match="model"):
        make_compat(model="")


def test_proto_round_trip_and_invalid_peer_message():
    compat = make_compat(kv_layout="NHD")
    assert CompatibilityInfo.from_proto(compat.to_proto()) == compat
    with pytest.raises(ValueError, match="block_size"):
        CompatibilityInfo.from_proto(handshake_pb2.CompatibilityInfo(model="m", dtype="f16"))


def test_payload_wire_layout_starts_with_compat_hash_then_engine_id():
    fields = handshake_pb2.HandshakePayload.DESCRIPTOR.fields_by_number
    assert (fields[1].name, fields[2].name, fields[3].name) == (
        "compat_hash",
        "engine_id",
        "compat",
    )


def test_book_serves_what_the_connector_received():
    book = HandshakeBook("engine-a", make_compat())
    connector = start_engine(book, pp_size=2, tp_size=2)
    payloads = book.payloads()
    assert [(p.pp_rank, p.tp_rank) for p in payloads] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    for payload in payloads:
        rank = (payload.pp_rank, payload.tp_rank)
        assert FakeWorkerMetadata.decode(payload.metadata) == connector.received[rank]
        assert payload.compat_hash == make_compat().compat_hash()
        assert (payload.engine_id, payload.generation) == ("engine-a", book.generation)
    assert book.payload(1, 0).metadata == connector.received[(1, 0)].encode()


def test_book_lookup_errors():
    book = HandshakeBook("engine-a", make_compat())
    with pytest.raises(HandshakeNotFoundError, match="not published"):
        book.payloads()
    start_engine(book, pp_size=1, tp_size=2)
    with pytest.raises(HandshakeNotFoundError, match=r"\(1, 0\)") as info:
        book.payload(1, 0)
    assert isinstance(info.value, LookupError)


@pytest.mark.parametrize("bad_key", [(0, -1), ("0", 0), (0,), 0, (True, 0)])
def test_book_rejects_bad_rank_keys(bad_key):
    md = FakeWorkerMetadata(
        worker_address="w", layer_start=0, layer_end=1, num_kv_heads=1, base_addresses=()
    )
    with pytest.raises(ValueError, match="pp_rank, tp_rank"):
        HandshakeBook("engine-a", make_compat()).publish({bad_key: md})


def test_book_rejects_empty_non_metadata_and_second_publish():
    book = HandshakeBook("engine-a", make_compat())
    with pytest.raises(ValueError, match="no handshake metadata"):
        book.publish({})
    with pytest.raises(ValueError, match="KVConnectorHandshakeMetadata"):
        book.publish({(0, 0): {"worker_address": "w"}})
    start_engine(book, pp_size=1, tp_size=1)
    with pytest.raises(RuntimeError, match="new HandshakeBook"):
        start_engine(book, pp_size=1, tp_size=1)


def test_generation_is_fresh_per_book_and_validated():
    generations = {HandshakeBook("e", make_compat()).generation for _ in range(4)}
    assert len(generations) == 4
    assert all(0 <= g < 2**63 for g in generations)
    assert HandshakeBook("e", make_compat(), generation=7).generation == 7
    with pytest.raises(ValueError, match="uint64"):
        HandshakeBook("e", make_compat(), generation=-1)
    with pytest.raises(ValueError, match="engine_id"):
        HandshakeBook(" ", make_compat())


def test_error_messages_name_both_sides_and_the_peer():
    diffs = make_compat(block_size=16, model="a").differences(make_compat(block_size=32, model="b"))
    exc = HandshakeCompatibilityError(diffs, address="10.0.0.1:5", remote_engine_id="p-1")
    text = str(exc)
    assert "block_size: local=16 remote=32" in text
    assert "model: local='a' remote='b'" in text
    assert "'p-1'" in text and "10.0.0.1:5" in text
    assert isinstance(exc, ValueError)
    unavailable = PeerUnavailableError(
        address="10.0.0.1:5", method="GetHandshake", attempts=3, cause=OSError("refused")
    )
    assert isinstance(unavailable, ConnectionError)
    assert (
        str(unavailable) == "GetHandshake to 10.0.0.1:5 failed after 3 attempt(s): OSError: refused"
    )


def test_retry_policy_validation_and_backoff():
    with pytest.raises(ValueError, match="max_attempts"):
        RetryPolicy(max_attempts=0)
    policy = RetryPolicy(initial_backoff_s=0.1, max_backoff_s=0.3, multiplier=2.0)
    assert 0.08 <= policy.backoff_s(1) <= 0.12
    assert 0.16 <= policy.backoff_s(2) <= 0.24
    assert 0.24 <= policy.backoff_s(5) <= 0.36
