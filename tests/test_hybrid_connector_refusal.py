"""A hybrid model behind a connector that follows one KV cache group is refused when the engine
starts, naming the connector and what it lacks, and leaves no worker behind."""

from __future__ import annotations

import os

import pytest
from serve_helpers.pair import descendants
from waiting import wait_until

from kvtransfer.connector.config import KVTransferConfig
from kvtransfer.engine.config import EngineConfig
from kvtransfer.engine.engine_core import EngineCore

pytestmark = pytest.mark.integration


def test_a_one_group_connector_is_refused_for_a_hybrid_model(tmp_path):
    before = set(descendants(os.getpid()))
    storage = KVTransferConfig(
        kv_connector="SharedStorageConnector",
        kv_role="kv_both",
        kv_connector_extra_config={"shared_storage_path": str(tmp_path)},
    )
    config = EngineConfig(
        model="builtin:tiny-hybrid", block_size=4, num_kv_blocks=64, kv_transfer_config=storage
    )
    with pytest.raises(ValueError) as info:
        EngineCore(config)
    assert str(info.value) == (
        "KV connector SharedStorageConnector does not support hybrid KV caches (SupportsHMA), "
        "and this model has a sliding-window group (window 24) beside full attention; use one "
        "that does, such as UcxConnector"
    )
    wait_until(lambda: set(descendants(os.getpid())) <= before, "the engine's workers exited", 30)
