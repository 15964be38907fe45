"""Sleep and wake-up of an engine with `UcxConnector` (vLLM 0.33's sleep hooks, in our engine):
the KV pool is freed and mapped again at other memory, the connector drops its registration and
makes a new one, the engine publishes the new handshake under a new generation, and a consumer
holding the old one gets a typed error, never stale bytes. Real gRPC and UCX on 127.0.0.1, on
both data planes."""

from __future__ import annotations

import logging
import socket

import pytest
import torch
from engine_helpers.builtin import (
    DECODE,
    PROMPTS,
    colocated,
    engine_config,
    finish,
    worker_caches,
)
from ucx_helpers.engines import (
    kv_config,
    pd_run,
    prefill,
    scheduler_half,
    stepping,
    worker_half,
)
from waiting import wait_until

from kvtransfer.connector.base import KVConnectorBase_V1
from kvtransfer.connector.config import KVTransferConfig
from kvtransfer.connectors.multi import MultiConnector
from kvtransfer.connectors.shared_storage.connector import SharedStorageConnector
from kvtransfer.connectors.ucx import UcxConnector
from kvtransfer.engine.engine_core import EngineSleepingError
from kvtransfer.engine.llm import LLM
from kvtransfer.engine.sampling_params import SamplingParams

pytestmark = pytest.mark.integration


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.mark.parametrize("data_plane", ["rma", "tagged"])
def test_a_producer_sleeps_and_wakes_and_serves_only_its_new_registration(data_plane, caplog):
    expected = [o.token_ids for o in colocated(PROMPTS[:3])]
    # A fixed port: after the wake-up the producer answers at the same address, so only the
    # generation tells a consumer that its cached handshake (agent address, keys) is stale.
    producer_kv = KVTransferConfig(
        kv_connector="UcxConnector",
        kv_role="kv_producer",
        engine_id="sleeper",
        kv_port=_free_port(),
        # Short, so the sleep's drain does not wait long for the unpulled request's lease; not
        # shorter: the first load (handshake, UCX connect) must keep it alive in time, which
        # took over 0.3 s once in CI with both cores busy (the lease expired, the load failed).
        kv_connector_extra_config={"kv_lease_s": 3.0, "data_plane": data_plane},
    )
    consumer_kv = kv_config("kv_consumer", "sleep-decode", data_plane=data_plane)
    with LLM(engine_config(producer_kv)) as producer, LLM(engine_config(consumer_kv)) as decode:
        core = producer.engine
        before = pd_run(producer, decode, [PROMPTS[0]])
        assert before[0].token_ids == expected[0]
        (stale,) = prefill(producer, [PROMPTS[1]])
        generation, address = scheduler_half(core).book.generation, scheduler_half(core).address
        caches = worker_caches(core)
        pointers = {name: cache.data_ptr() for name, cache in caches.items()}

        core.sleep()  # drains: the unpulled request's lease runs out first
        assert core.is_sleeping and worker_half(core).agent is None
        assert all(cache.untyped_storage().nbytes() == 0 for cache in caches.values())
        # Another tenant takes the freed memory meanwhile (the worker is in this process), so
        # the woken pool lands elsewhere, as it may after a real sleep.
        squatters = [torch.empty(cache.numel(), dtype=cache.dtype) for cache in caches.values()]
        with pytest.raises(EngineSleepingError, match="the engine is asleep"):
            core.add_request("late", PROMPTS[2], SamplingParams(max_tokens=1))
        core.sleep()  # idempotent

        core.wake_up()
        core.wake_up()  # idempotent
        half = scheduler_half(core)
        assert not core.is_sleeping and half.address == address
        assert half.book.generation != generation
        assert all(c.untyped_storage().nbytes() > 0 for c in caches.values())
        del squatters
        moved = [name for name, cache in caches.items() if cache.data_ptr() != pointers[name]]
        assert moved == list(caches)
        after = pd_run(producer, decode, [PROMPTS[2]])
        with caplog.at_level(logging.WARNING, logger="kvtransfer.connectors.ucx.worker"):
            (refused,) = pd_run(producer, decode, [PROMPTS[1]], [stale.kv_transfer_params])
        handshakes = scheduler_half(decode.engine).stats_totals["num_handshakes"]
        new_generation = half.book.generation
        finish(core, decode.engine)
    assert after[0].token_ids == expected[2]
    assert refused.error.startswith(
        f"KV load failed for request {refused.request_id} (kv_load_failure_policy=fail): "
        "StaleGenerationError: engine 'sleeper' at 127.0.0.1:"
    )
    assert (
        f"re-registered its KV cache (slept and woke up): it serves handshake generation "
        f"{new_generation}, the request's KV was produced by generation {generation}"
    ) in refused.error
    # Before the sleep, after it (the new generation), and the stale request's own attempt,
    # which found the producer at another generation than its params name.
    assert handshakes == 3


def test_a_sleeping_decode_refuses_a_request_and_frees_the_producers_kv():
    # vLLM 0.33's paused engine: the request is added and aborted at once, so the producer
    # hears that nobody will read its KV (not after its 120 s lease).
    with (
        LLM(engine_config(kv_config("kv_producer", "awake"))) as producer,
        LLM(engine_config(kv_config("kv_consumer", "dozing"))) as decode,
    ):
        (output,) = prefill(producer, [PROMPTS[0]])
        leases = scheduler_half(producer.engine).leases
        assert len(leases) == 1
        decode.engine.sleep()
        with pytest.raises(EngineSleepingError, match="'late': the engine is asleep"):
            decode.engine.add_request("late", PROMPTS[0], DECODE, output.kv_transfer_params)
        with stepping(producer.engine):
            wait_until(lambda: len(leases) == 0, "the producer to free the refused KV")
        finish(producer.engine)
        decode.engine.wake_up()
        finish(decode.engine)


def test_sleep_refuses_while_requests_run():
    with LLM(engine_config(kv_config("kv_producer", "busy"))) as llm:
        core = llm.engine
        core.add_request("running", PROMPTS[0], SamplingParams(max_tokens=4))
        with pytest.raises(EngineSleepingError, match="unfinished requests"):
            core.sleep()
        assert not core.is_sleeping and worker_half(core).agent is not None
        core.abort_request(["running"])
        finish(core)


def test_an_engine_whose_connector_cannot_follow_a_sleep_refuses_to_sleep():
    recording = KVTransferConfig(
        kv_connector="RecordingConnector",
        kv_connector_module_path="kvtransfer.testing.recording",
        kv_role="kv_both",
    )
    with LLM(engine_config(recording)) as llm:
        with pytest.raises(EngineSleepingError, match="RecordingConnector does not follow a"):
            llm.engine.sleep()
        assert not llm.engine.is_sleeping
        assert llm.generate([PROMPTS[0]], SamplingParams(max_tokens=2))[0].finish_reason
        finish(llm.engine)


def test_each_connector_says_whether_it_follows_a_sleep():
    ucx = KVTransferConfig(kv_connector="UcxConnector", kv_role="kv_both")
    storage = KVTransferConfig(kv_connector="SharedStorageConnector", kv_role="kv_both")

    def multi(*children: str) -> KVTransferConfig:
        return KVTransferConfig(
            kv_connector="MultiConnector",
            kv_role="kv_both",
            kv_connector_extra_config={"connectors": [{"kv_connector": name} for name in children]},
        )

    # vLLM's base says True with hooks that do nothing; ours says False until a connector
    # implements them.
    assert KVConnectorBase_V1.supports_sleep_mode(ucx) is False
    assert UcxConnector.supports_sleep_mode(ucx) is True
    assert SharedStorageConnector.supports_sleep_mode(storage) is True
    assert MultiConnector.supports_sleep_mode(multi("UcxConnector", "SharedStorageConnector"))
    assert MultiConnector.supports_sleep_mode(multi()) is False
