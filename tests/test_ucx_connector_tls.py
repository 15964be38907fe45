"""`UcxConnector` with TLS on its handshake/notify port (``tls_*`` keys of
``kv_connector_extra_config``): real producer and consumer engines on 127.0.0.1 give the tokens
of a colocated run; a consumer that does not speak TLS fails its loads per
``kv_load_failure_policy``; bad keys are refused naming the key."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import Any

import pytest
from control_helpers.certs import Certs, make_certs
from engine_helpers.builtin import PROMPTS, colocated, engine_config
from ucx_helpers.engines import kv_config, pd_run, scheduler_half

from kvtransfer.connector.config import KVTransferConfig
from kvtransfer.connectors.ucx import UcxConfig
from kvtransfer.control import TLSFiles
from kvtransfer.engine.llm import LLM

pytestmark = pytest.mark.integration

LOAD_FAILED = "KV load failed for request gen-0 (kv_load_failure_policy=fail)"


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> Certs:
    return make_certs(tmp_path_factory.mktemp("certs"))


@pytest.fixture(scope="module")
def expected() -> list[list[int]]:
    return [o.token_ids for o in colocated(PROMPTS)]


def server_keys(certs: Certs) -> dict[str, str]:
    """A producer that requires client certificates (mTLS)."""
    return {
        "tls_cert_file": certs.server_cert,
        "tls_key_file": certs.server_key,
        "tls_ca_file": certs.ca,
    }


def client_keys(certs: Certs) -> dict[str, str]:
    return {
        "tls_cert_file": certs.client_cert,
        "tls_key_file": certs.client_key,
        "tls_ca_file": certs.ca,
        # The producer advertises 127.0.0.1; check the certificate's DNS name instead.
        "tls_server_name": "localhost",
    }


@pytest.fixture(scope="module")
def tls_producer(certs: Certs) -> Iterator[LLM]:
    # A short lease: blocks a plaintext consumer could never release free themselves.
    config = kv_config("kv_producer", "prefill-tls", kv_lease_s=1.0, **server_keys(certs))
    with LLM(engine_config(config)) as llm:
        yield llm


def test_tls_pair_gives_the_colocated_tokens(tls_producer, certs, expected):
    producer = scheduler_half(tls_producer.engine)
    before = producer.stats_totals
    config = kv_config("kv_consumer", "decode-tls", **client_keys(certs))
    with LLM(engine_config(config)) as consumer:
        results = pd_run(tls_producer, consumer, PROMPTS)
        received = scheduler_half(consumer.engine).stats_totals
    assert [r.token_ids for r in results] == expected
    assert (received["num_handshakes"], received["num_loads"]) == (1, len(PROMPTS))
    assert received.get("num_loads_failed", 0) == 0
    sent = {k: v - before.get(k, 0.0) for k, v in producer.stats_totals.items()}
    # Released over the TLS notify channel, not freed by the lease running out.
    assert sent["num_sends"] == len(PROMPTS)
    assert sent.get("num_leases_expired", 0) == 0


@pytest.mark.parametrize("policy", ["fail", "recompute"])
def test_plaintext_consumer_fails_the_load_per_policy(tls_producer, expected, policy, caplog):
    config = kv_config("kv_consumer", f"decode-plain-{policy}", policy, handshake_timeout_s=1.0)
    with (
        LLM(engine_config(config)) as consumer,
        caplog.at_level(logging.WARNING, logger="kvtransfer.connectors.ucx.worker"),
    ):
        (result,) = pd_run(tls_producer, consumer, [PROMPTS[1]])
        failed = scheduler_half(consumer.engine).stats_totals["num_loads_failed"]
    assert failed == 1
    assert "PeerUnavailableError: GetHandshake to 127.0.0.1:" in caplog.text
    if policy == "fail":
        assert result.finish_reason == "error"
        assert result.error.startswith(LOAD_FAILED + ": ")
    else:
        assert result.token_ids == expected[1]


def test_consumer_without_a_client_certificate_fails_the_load(tls_producer, certs, caplog):
    keys = {"tls_ca_file": certs.ca}
    config = kv_config("kv_consumer", "decode-no-cert", handshake_timeout_s=1.0, **keys)
    with (
        LLM(engine_config(config)) as consumer,
        caplog.at_level(logging.WARNING, logger="kvtransfer.connectors.ucx.worker"),
    ):
        (result,) = pd_run(tls_producer, consumer, [PROMPTS[0]])
    assert result.error.startswith(LOAD_FAILED + ": ")
    assert "present a client certificate" in caplog.text


# -- configuration --------------------------------------------------------------------------


def ucx_config(role: str, **extra: Any) -> UcxConfig:
    config = KVTransferConfig(
        kv_connector="UcxConnector", kv_role=role, kv_connector_extra_config=extra
    )
    return UcxConfig.from_transfer_config(config)


def test_tls_keys_make_tls_files(certs):
    assert ucx_config("kv_consumer").tls is None
    consumer = ucx_config("kv_consumer", **client_keys(certs))
    assert consumer.tls == TLSFiles(certs.client_cert, certs.client_key, certs.ca, "localhost")
    producer = ucx_config("kv_both", **server_keys(certs), tls_server_name="localhost")
    assert producer.tls is not None and producer.tls.server_name == "localhost"
    assert producer.server_tls == TLSFiles(certs.server_cert, certs.server_key, certs.ca)
    assert ucx_config("kv_consumer", tls_ca_file=certs.ca).tls == TLSFiles(ca_file=certs.ca)


@pytest.mark.parametrize(
    ("role", "extra", "message"),
    [
        ("kv_consumer", {"tls_ca_file": 3}, r"tls_ca_file must be a non-empty string, got 3"),
        ("kv_consumer", {"tls_server_name": " "}, r"tls_server_name must be a non-empty string"),
        ("kv_consumer", {"tls_ca_file": "/nonexistent/ca.pem"}, r"tls_ca_file: '/nonexistent"),
        ("kv_producer", {"tls_ca_file": "CA"}, r"tls_cert_file and tls_key_file are required"),
        ("kv_consumer", {"tls_cert_file": "CERT"}, r"tls_key_file is required when tls_cert_file"),
        ("kv_consumer", {"tls_cafile": "CA"}, r"unknown kv_connector_extra_config key\(s\)"),
    ],
)
def test_bad_tls_keys_name_the_key(certs, role, extra, message):
    files = {"CA": certs.ca, "CERT": certs.client_cert}
    extra = {key: files.get(value, value) for key, value in extra.items()}
    with pytest.raises(ValueError, match=message):
        ucx_config(role, **extra)
