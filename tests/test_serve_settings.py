"""Daemon settings: defaults < config file < KVTRANSFER_* environment < flags, one validation,
errors naming the setting; the command exits 2 without a traceback."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from kvtransfer.clients.limits import DEFAULT_MAX_REQUEST_BYTES
from kvtransfer.serve.settings import SettingsError, load_settings
from kvtransfer.serve.text_stream import TextStream

pytestmark = pytest.mark.integration


def test_defaults_per_role():
    prefill = load_settings("prefill", [], environ={})
    decode = load_settings("decode", [], environ={})
    assert (prefill.port, decode.port) == (50051, 50061)
    assert prefill.transfer_config().kv_role == "kv_producer"
    assert decode.transfer_config().kv_role == "kv_consumer"
    assert decode.transfer_config().kv_connector == "UcxConnector"
    # The router's default too: what it accepts, the daemons' gRPC servers take.
    assert prefill.max_request_bytes == decode.max_request_bytes == DEFAULT_MAX_REQUEST_BYTES
    flag = load_settings("decode", ["--max-request-bytes", "1024"], environ={})
    env = load_settings("decode", [], environ={"KVTRANSFER_MAX_REQUEST_BYTES": "2048"})
    assert (flag.max_request_bytes, env.max_request_bytes) == (1024, 2048)


def test_layers_override_in_order(tmp_path):
    config = tmp_path / "prefill.toml"
    config.write_text(
        'port = 7000\ntp = 2\nlog_level = "debug"\n[kv_transfer_config]\nkv_port = 9\n'
    )
    environ = {"KVTRANSFER_PORT": "7001", "KVTRANSFER_ENGINE_ID": "from-env"}
    settings = load_settings("prefill", ["--config", str(config), "--tp", "1"], environ=environ)
    assert settings.port == 7001  # env beats the file
    assert settings.tp == 1  # the flag beats the file
    assert settings.log_level == "DEBUG"
    transfer = settings.transfer_config()
    assert (transfer.kv_port, transfer.engine_id) == (9, "from-env")


def test_json_config_file_and_env_json(tmp_path):
    config = tmp_path / "decode.json"
    config.write_text(json.dumps({"model": "builtin:tiny", "metrics-port": 0}))
    environ = {"KVTRANSFER_KV_TRANSFER_CONFIG": '{"kv_load_failure_policy": "recompute"}'}
    settings = load_settings("decode", ["--config", str(config)], environ=environ)
    assert settings.metrics_port == 0
    assert settings.transfer_config().kv_load_failure_policy == "recompute"


@pytest.mark.parametrize(
    ("argv", "environ", "message"),
    [
        (["--port", "70000"], {}, "--port: Input should be less than or equal to 65535"),
        (["--tp", "0"], {}, "--tp: Input should be greater than or equal to 1"),
        (["--speculative", "magic"], {}, "--speculative: Input should be 'draft' or 'ngram'"),
        (["--kv-transfer-config", "{nope"], {}, "--kv-transfer-config: Value error, not valid"),
        ([], {"KVTRANSFER_PP": "two"}, "--pp: Input should be a valid integer"),
        (["--log-level", "loud"], {}, "--log-level: Input should be 'DEBUG'"),
        (["--max-request-bytes", "0"], {}, "--max-request-bytes: Input should be greater than"),
    ],
)
def test_bad_settings_name_the_setting(argv, environ, message):
    with pytest.raises(SettingsError, match="^" + message.replace("(", r"\(")):
        load_settings("decode", argv, environ=environ)


def test_config_file_problems(tmp_path):
    with pytest.raises(SettingsError, match="--config: cannot read"):
        load_settings("decode", ["--config", str(tmp_path / "missing.json")], environ={})
    bad = tmp_path / "bad.json"
    bad.write_text('{"colour": "blue"}')
    with pytest.raises(SettingsError, match=r"--config: unknown setting\(s\) \['colour'\]"):
        load_settings("decode", ["--config", str(bad)], environ={})


def test_tls_and_token_problems_fail_before_start(tmp_path):
    with pytest.raises(SettingsError, match="--tls-cert and --tls-key are required"):
        load_settings("decode", ["--tls-ca", str(tmp_path / "ca.pem")], environ={})
    missing = ["--tls-cert", str(tmp_path / "c.pem"), "--tls-key", str(tmp_path / "k.pem")]
    with pytest.raises(SettingsError, match=r"^--tls-\*: .*does not exist"):
        load_settings("decode", missing, environ={})
    with pytest.raises(SettingsError, match=r"^--admin-token: "):
        load_settings("decode", [], environ={"KVTRANSFER_ADMIN_TOKEN": "has space"})


def test_daemon_command_exits_2_naming_the_flag():
    done = subprocess.run(
        [sys.executable, "-m", "kvtransfer.serve.decode_node", "--port", "-1"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2
    assert done.stderr.startswith("kvtransfer-decode: error: --port: Input should be greater")
    assert "Traceback" not in done.stderr


class _Bytes:
    """The byte-level tokenizer's contract, enough for text streaming."""

    def decode(self, ids):
        return bytes(ids).decode("utf-8", errors="replace")


def test_text_stream_holds_back_partial_characters_and_stop_prefixes():
    stream = TextStream(_Bytes(), stop=["END"])
    euro = list("€".encode())
    assert stream.feed(euro[:2]).text == ""  # an incomplete character waits
    assert stream.feed(euro[2:]).text == "€"
    assert stream.feed(list(b"ab E")).text == "ab "  # "E" may start "END"
    delta = stream.feed(list(b"NDxyz"))
    assert delta.stopped and delta.text == ""
    assert stream.text == "€ab "


def test_text_stream_without_stop_flushes_on_the_final_feed():
    stream = TextStream(_Bytes())
    assert stream.feed(list(b"hi"), final=False).text == "hi"
    assert stream.feed([0xE2], final=True).text == "\ufffd"
