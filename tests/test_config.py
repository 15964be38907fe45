from __future__ import annotations

import json
import uuid

import pytest

from kvtransfer import KVTransferConfig, KVTransferConfigError

pytestmark = pytest.mark.unit


def test_parses_a_vllm_nixl_config_unchanged():
    vllm_json = json.dumps(
        {
            "kv_connector": "NixlConnector",
            "kv_role": "kv_both",
            "kv_buffer_device": "cuda",
            "kv_buffer_size": 5e9,
            "kv_rank": 0,
            "kv_parallel_size": 2,
            "kv_ip": "10.0.0.1",
            "kv_port": 14579,
            "kv_connector_extra_config": {"backends": ["UCX"]},
            "kv_load_failure_policy": "recompute",
        }
    )
    config = KVTransferConfig.from_json(vllm_json)
    assert config.kv_connector == "NixlConnector"
    assert config.is_kv_producer and config.is_kv_consumer
    assert config.get_from_extra_config("backends") == ["UCX"]
    assert config.kv_load_failure_policy == "recompute"


def test_defaults():
    config = KVTransferConfig.from_json("{}")
    assert config.kv_connector is None and not config.is_kv_transfer_instance
    assert config.kv_load_failure_policy == "fail"
    assert config.kv_connector_extra_config == {}
    uuid.UUID(config.engine_id)  # a fresh uuid
    assert KVTransferConfig().engine_id != config.engine_id


def test_roles():
    assert KVTransferConfig(kv_role="kv_producer").is_kv_producer
    assert not KVTransferConfig(kv_role="kv_producer").is_kv_consumer
    assert KVTransferConfig(kv_role="kv_consumer").is_kv_consumer
    assert not KVTransferConfig(kv_role="kv_consumer").is_kv_producer


def test_extra_config_default_is_not_shared():
    a, b = KVTransferConfig(), KVTransferConfig()
    assert a.kv_connector_extra_config is not b.kv_connector_extra_config


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        ({"kv_conector": "X"}, "kv_conector: unknown key"),
        ({"kv_role": "producer"}, "kv_role: Input should be 'kv_producer', 'kv_consumer' or"),
        ({"kv_load_failure_policy": "retry"}, "kv_load_failure_policy: Input should be"),
        ({"kv_buffer_device": "tpu"}, "kv_buffer_device: Input should be 'cpu' or 'cuda'"),
        ({"kv_port": "not-a-port"}, "kv_port: Input should be a valid integer"),
        ({"kv_port": 70000}, "kv_port: Input should be less than or equal to 65535"),
        ({"kv_parallel_size": 0}, "kv_parallel_size: Input should be greater than or equal to 1"),
        ({"engine_id": "  "}, "engine_id: Value error, must not be blank"),
        ({"kv_connector_extra_config": [1]}, "kv_connector_extra_config: Input should be"),
    ],
)
def test_bad_values_name_the_key(raw, message):
    with pytest.raises(KVTransferConfigError, match="invalid kv_transfer_config") as info:
        KVTransferConfig.from_dict(raw)
    assert message in str(info.value)


def test_several_problems_are_all_named():
    with pytest.raises(KVTransferConfigError) as info:
        KVTransferConfig.from_dict({"kv_role": "x", "bogus": 1})
    assert "kv_role:" in str(info.value) and "bogus: unknown key" in str(info.value)


@pytest.mark.parametrize(
    ("text", "message"),
    [("{not json", "not valid JSON"), ("[1, 2]", "must be a JSON object, got list")],
)
def test_bad_json(text, message):
    with pytest.raises(KVTransferConfigError, match=message):
        KVTransferConfig.from_json(text)


def test_config_is_a_value_error_and_frozen():
    assert issubclass(KVTransferConfigError, ValueError)
    config = KVTransferConfig()
    with pytest.raises(ValueError, match="frozen"):
        config.kv_role = "kv_both"
