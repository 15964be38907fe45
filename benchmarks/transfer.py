"""KV block pull throughput and latency: RMA and tagged mode vs NIXL READ, UCX's limit, memcpy.

Two processes on this host hold caches in the engine's paged layout (per layer
``[num_blocks, 2, heads, block_size, head_dim]``); the reader pulls scattered blocks:

* layout A: 8 layers x [512, 2, 8, 16, 128] float32: 128 KiB per block per layer, 1 MiB per
  block (512 MiB per process);
* layout B: 8 layers x [4096, 2, 1, 16, 128] bfloat16: 8 KiB per block per layer, a TP=8 shard
  (256 MiB per process). The 2048-block case uses B because A would move 2 GiB per request.

Cases: 1 (latency), 16 and 256 blocks of A, 2048 blocks of B, 256 blocks of A reading half the
heads (remote heads 4:8 into a 4-head cache, the decode-TP=2 case), 256 blocks of A for
layers 2..5 only, and 2048 blocks of B fragmented.
Block ids are seeded random permutations, so blocks are scattered on both sides: a request's
consecutive pairs are practically never adjacent on both sides at once, but sorted by id about
half the blocks of the 2048-of-4096 case sit next to another requested one. The fragmented case
takes every other block of B's pool (odd ids remote, even ids local, each side shuffled), so no
two requested blocks are adjacent on either side even after sorting: a transport that sorts and
coalesces contiguous runs gains nothing there, and it moves as many bytes as the random case.

Methods, each timed per request (median over iterations after warm-up):

* rma: `KVTransferAgent.pull` in RMA mode (``connect(..., one_sided=True)``): the reader
  computes the contiguous runs of the request and reads them one-sided from the producer's
  registered caches (same host: ``process_vm_readv``, what UCX's cma does); the producer runs
  nothing per read;
* tagged: `KVTransferAgent.pull` in tagged mode (server gathers into one buffer per <= 32 MiB
  message, UCX tagged send as eager fragments through shared memory (no cma, see
  ``docs/data-plane.md``), client scatters);
* limit: UCX's own ``ucx_perftest -t ucp_get`` of one contiguous buffer of the case's size
  between two processes (from the ``libucx`` wheel): no layout, no Python;
* tcp: the same gather, ``sendall`` over a loopback socket, ``recv_into``, the same scatter;
* memcpy: the same gather and scatter in one process (an upper bound for a gather/scatter
  design);
* nixl: NIXL one-sided READ over its UCX backend, DRAM segments, one descriptor per block and
  layer (per K/V plane for head slices), descriptor lists prepared once; only if ``nixl_cu12``
  imports (``pip install --no-deps nixl-cu12``). It runs before UCX is imported here, in its own
  processes, because ``import ucxx`` writes UCX variables into the environment. The initiator
  busy-polls the transfer state (one core spinning, no wake-ups) while our pulls sleep on
  events: keep that in mind when comparing small-pull latencies.

Every case is expressible in NIXL descriptors (a layer range and a block subset are index
subsets of the prepared lists, a head slice is one descriptor per K/V plane), so every case is
measured for every method. ``nixl_p50_ms`` sits next to ``ours_p50_ms`` in each row and the
table shows both with their ratio (``ours_over_nixl_p50``; the older ``ours/nixl`` column is the
throughput ratio, its inverse). A row whose NIXL figures are null says why in ``nixl_note``
(``--no-nixl``, ``nixl_cu12`` missing or its run failed).

The producer's CPU seconds per GiB served (``producer_cpu_s_per_gib_*``) are its process's
user + system time (all threads) over each method's timed and warm-up requests, divided by the
bytes they read: what serving costs the engine a prefill runs next to.

The producer's compute while serving: during the 16-block case the producer runs matrix
products for 3 s three times, idle, then while this process reads 16 MiB from it 20 times a
second in each mode, and reports its rates (what serving reads costs the engine beside it).

Every process uses one torch intra-op thread (``--torch-threads``): on a small shared host, OpenMP
threads of two processes preempt each other.

Handshake (``handshake_cold_ms``/``handshake_warm_ms``, medians, the same in every case's row):
a live ``UcxConnector`` prefill daemon (``kvtransfer-prefill``, built-in model, PP=2) runs as a
child process (`kvtransfer.serve.launcher.ServiceProcess`); the decode side's gRPC fetch of all
its worker payloads from the connector's handshake server (engine id and compatibility checked),
cold with a new `HandshakeClient` per fetch (channel connect + RPC), warm with the cached
client. The UCX endpoint connect is not included.
``--no-handshake`` skips it.

    python benchmarks/transfer.py [--iterations 10] [--json results.json] [--no-nixl]
        [--no-perftest] [--quick]

A full run takes about 2 minutes on a busy 2-CPU host. ``--quick`` (3 iterations, 1 warm-up, no
handshake) is a smoke run; most of its ~1.5 minutes there is process start-up and cache set-up.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import platform
import resource
import socket
import statistics
import struct
import subprocess
import sys
import threading
import time
import traceback
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch
from plots import write_png

from kvtransfer.transport.buffers import gather_into, row_view, scatter_from

MiB = 1 << 20


@dataclass(frozen=True)
class Layout:
    name: str
    num_blocks: int
    num_layers: int
    num_heads: int
    block_size: int
    head_dim: int
    dtype: torch.dtype

    def layer_name(self, layer: int) -> str:
        return f"{self.name}.layers.{layer}.self_attn"

    @property
    def head_elems(self) -> int:
        return self.block_size * self.head_dim

    @property
    def head_bytes(self) -> int:
        return self.head_elems * self.dtype.itemsize

    @property
    def block_bytes(self) -> int:
        return 2 * self.num_heads * self.head_bytes


LAYOUT_A = Layout("a", 512, 8, 8, 16, 128, torch.float32)
LAYOUT_B = Layout("b", 4096, 8, 1, 16, 128, torch.bfloat16)
LAYOUTS = {layout.name: layout for layout in (LAYOUT_A, LAYOUT_B)}


@dataclass(frozen=True)
class Case:
    name: str
    layout: Layout
    blocks: int
    heads: tuple[int, int] | None = None
    layers: tuple[int, int] | None = None
    # Every ``stride``-th block of the pool instead of a random subset (fragmented case).
    stride: int | None = None

    @property
    def layer_range(self) -> range:
        return range(*(self.layers or (0, self.layout.num_layers)))

    @property
    def head_range(self) -> range:
        return range(*(self.heads or (0, self.layout.num_heads)))

    @property
    def local_heads(self) -> int:
        return len(self.head_range)

    @property
    def nbytes(self) -> int:
        per_block = 2 * self.local_heads * self.layout.head_bytes
        return self.blocks * per_block * len(self.layer_range)

    def block_ids(self) -> tuple[list[int], list[int]]:
        generator = torch.Generator().manual_seed(self.blocks * 31 + len(self.name))
        if self.stride is not None:
            return self._strided_ids(self.stride, generator)
        remote = torch.randperm(self.layout.num_blocks, generator=generator)[: self.blocks]
        local = torch.randperm(self.layout.num_blocks, generator=generator)[: self.blocks]
        return remote.tolist(), local.tolist()

    def _strided_ids(self, stride: int, generator: torch.Generator) -> tuple[list[int], list[int]]:
        """Every ``stride``-th block, remote and local at different offsets, each shuffled.

        Shuffled independently, so neither request order nor sorting by id yields a run.
        """
        if stride < 2 or self.blocks * stride > self.layout.num_blocks:
            raise ValueError(f"{self.name}: {self.blocks} blocks at stride {stride} do not fit")
        remote = torch.arange(self.blocks) * stride + (stride - 1)
        local = torch.arange(self.blocks) * stride
        remote = remote[torch.randperm(self.blocks, generator=generator)]
        local = local[torch.randperm(self.blocks, generator=generator)]
        return remote.tolist(), local.tolist()


CASES = [
    Case("1 block", LAYOUT_A, 1),
    Case("16 blocks", LAYOUT_A, 16),
    Case("256 blocks", LAYOUT_A, 256),
    Case("2048 blocks (B)", LAYOUT_B, 2048),
    Case("256 blocks, half heads", LAYOUT_A, 256, heads=(4, 8)),
    Case("256 blocks, layers 2-5", LAYOUT_A, 256, layers=(2, 6)),
    Case("2048 blocks (B), frag.", LAYOUT_B, 2048, stride=2),
]


# -- caches -----------------------------------------------------------------------------------


def _int_view(dtype: torch.dtype) -> torch.dtype:
    return {2: torch.int16, 4: torch.int32}[dtype.itemsize]


def _pattern(layout: Layout, layer: int, start: torch.Tensor, count: int) -> torch.Tensor:
    """Cache contents from flat element ``start`` (per row) on: element index + layer * 7919.

    Computed in int32 (cast down to int16 for 2-byte dtypes, which keeps the low bits): no
    value reaches 2**31, and half the memory traffic of int64 keeps setup and checks quick.
    """
    if layout.num_blocks * layout.block_bytes // layout.dtype.itemsize + layer * 7919 >= 1 << 31:
        raise ValueError(f"layout {layout.name} is too large for int32 contents")
    values = start.to(torch.int32)[:, None] + torch.arange(count, dtype=torch.int32)
    return values.add_(layer * 7919).to(_int_view(layout.dtype))


def remote_cache(layout: Layout, layer: int) -> torch.Tensor:
    """Distinct, cheaply reproducible contents (compared bitwise through an int view)."""
    shape = (layout.num_blocks, 2, layout.num_heads, layout.block_size, layout.head_dim)
    numel = layout.num_blocks * 2 * layout.num_heads * layout.head_elems
    values = _pattern(layout, layer, torch.zeros(1, dtype=torch.int32), numel)
    return values.view(layout.dtype).view(shape)


def remote_blocks(layout: Layout, layer: int, ids: list[int]) -> torch.Tensor:
    """``remote_cache(layout, layer)[ids]`` without building the whole layer (for checks)."""
    shape = (len(ids), 2, layout.num_heads, layout.block_size, layout.head_dim)
    block_elems = 2 * layout.num_heads * layout.head_elems
    start = torch.tensor(ids, dtype=torch.int64) * block_elems
    return _pattern(layout, layer, start, block_elems).view(layout.dtype).view(shape)


def remote_caches() -> dict[str, torch.Tensor]:
    return {
        layout.layer_name(layer): remote_cache(layout, layer)
        for layout in LAYOUTS.values()
        for layer in range(layout.num_layers)
    }


def local_caches(layout: Layout, num_heads: int) -> dict[str, torch.Tensor]:
    shape = (layout.num_blocks, 2, num_heads, layout.block_size, layout.head_dim)
    return {
        layout.layer_name(layer): torch.zeros(shape, dtype=layout.dtype)
        for layer in range(layout.num_layers)
    }


def verify(case: Case, caches: dict[str, torch.Tensor], remote: list[int], local: list[int]):
    heads = case.head_range
    for layer in case.layer_range:
        name = case.layout.layer_name(layer)
        expected = remote_blocks(case.layout, layer, remote)[:, :, heads.start : heads.stop]
        got = caches[name][local]
        itype = _int_view(case.layout.dtype)
        if not torch.equal(got.view(itype), expected.contiguous().view(itype)):
            raise RuntimeError(f"{case.name}: layer {name} differs after the transfer")


# -- gather / scatter shared by tcp and memcpy ------------------------------------------------


def gather(case: Case, caches: dict[str, torch.Tensor], ids: list[int], out: torch.Tensor):
    index = torch.tensor(ids, dtype=torch.int64)
    view = row_view(index, case.layout.num_heads, case.head_range, case.layout.head_elems)
    per_layer = case.nbytes // len(case.layer_range)
    for i, layer in enumerate(case.layer_range):
        segment = out[i * per_layer : (i + 1) * per_layer]
        gather_into(segment, caches[case.layout.layer_name(layer)], view)


def scatter(case: Case, caches: dict[str, torch.Tensor], ids: list[int], data: torch.Tensor):
    index = torch.tensor(ids, dtype=torch.int64)
    heads = range(case.local_heads)
    view = row_view(index, case.local_heads, heads, case.layout.head_elems)
    per_layer = case.nbytes // len(case.layer_range)
    for i, layer in enumerate(case.layer_range):
        segment = data[i * per_layer : (i + 1) * per_layer]
        scatter_from(segment, caches[case.layout.layer_name(layer)], view)


# -- timing -----------------------------------------------------------------------------------


def timed(fn, iterations: int, warmup: int) -> list[float]:
    for _ in range(warmup):
        fn()
    samples = []
    for _ in range(iterations):
        start = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - start)
    return samples


def iterations_for(case: Case, base: int) -> int:
    # Small requests are cheap: take more samples so p99 means something.
    return base * 4 if case.nbytes <= 32 * MiB else base


def gbps(nbytes: int, samples: list[float] | None) -> float | None:
    if not samples:
        return None
    return nbytes / statistics.median(samples) / 1e9


def percentile_ms(samples: list[float], q: int) -> float:
    if len(samples) == 1:
        return samples[0] * 1e3
    return statistics.quantiles(samples, n=100, method="inclusive")[q - 1] * 1e3


# -- memcpy -----------------------------------------------------------------------------------


def run_memcpy(base: int, warmup: int) -> dict[str, list[float]]:
    remote = remote_caches()
    results = {}
    for case in CASES:
        local = local_caches(case.layout, case.local_heads)
        remote_ids, local_ids = case.block_ids()
        buffer = torch.empty(case.nbytes, dtype=torch.uint8)

        def once(case=case, local=local, remote_ids=remote_ids, local_ids=local_ids, b=buffer):
            gather(case, remote, remote_ids, b)
            scatter(case, local, local_ids, b)

        results[case.name] = timed(once, iterations_for(case, base), warmup)
        verify(case, local, remote_ids, local_ids)
    return results


# -- NIXL -------------------------------------------------------------------------------------


def _nixl_descs(caches: dict[str, torch.Tensor], layout: Layout, heads: range | None):
    """One (addr, len, dev) row per (layer, block) or, for a head slice, per (layer, block, K/V)."""
    import numpy as np

    rows = []
    for layer in range(layout.num_layers):
        tensor = caches[layout.layer_name(layer)]
        base = tensor.data_ptr()
        num_heads = tensor.shape[2]
        block_bytes = 2 * num_heads * layout.head_bytes
        if heads is None:
            for block in range(layout.num_blocks):
                rows.append((base + block * block_bytes, block_bytes, 0))
        else:
            plane = num_heads * layout.head_bytes
            for block in range(layout.num_blocks):
                for kv in range(2):
                    start = (
                        base + block * block_bytes + kv * plane + heads.start * layout.head_bytes
                    )
                    rows.append((start, len(heads) * layout.head_bytes, 0))
    return np.array(rows, dtype=np.uint64)


def _nixl_indices(case: Case, ids: list[int]):
    import numpy as np

    blocks = np.asarray(ids, dtype=np.int64)
    layers = np.asarray(list(case.layer_range), dtype=np.int64)
    flat = (layers[:, None] * case.layout.num_blocks + blocks[None, :]).reshape(-1)
    if case.heads is not None:
        flat = (flat[:, None] * 2 + np.arange(2)).reshape(-1)
    return flat.astype(np.int32)


def _nixl_target(meta_queue: Any, done_queue: Any, threads: int) -> None:
    from nixl_cu12._api import nixl_agent, nixl_agent_config

    torch.set_num_threads(threads)
    agent = nixl_agent("kv-target", nixl_agent_config(backends=["UCX"]))
    caches = remote_caches()
    agent.register_memory(list(caches.values()))
    addresses = {name: tensor.data_ptr() for name, tensor in caches.items()}
    meta_queue.put((agent.get_agent_metadata(), addresses))
    done_queue.get()


def _nixl_initiator(result_queue: Any, base: int, warmup: int, threads: int) -> None:
    try:
        from nixl_cu12._api import nixl_agent, nixl_agent_config

        torch.set_num_threads(threads)
        ctx = mp.get_context("spawn")
        meta_queue, done_queue = ctx.Queue(), ctx.Queue()
        target = ctx.Process(target=_nixl_target, args=(meta_queue, done_queue, threads))
        target.start()
        try:
            agent = nixl_agent("kv-initiator", nixl_agent_config(backends=["UCX"]))
            metadata, remote_addresses = meta_queue.get(timeout=300)
            remote_name = agent.add_remote_agent(metadata)
            remote_views = {
                name: _AddressOnly(address, LAYOUTS[name.split(".")[0]])
                for name, address in remote_addresses.items()
            }
            results = {}
            prepared: dict[tuple[str, bool], tuple[Any, Any, dict[str, torch.Tensor]]] = {}
            for case in CASES:
                key = (case.layout.name, case.heads is not None)
                if key not in prepared:
                    local = local_caches(case.layout, case.local_heads)
                    agent.register_memory(list(local.values()))
                    heads = None if case.heads is None else case.head_range
                    local_heads = None if case.heads is None else range(case.local_heads)
                    local_side = agent.prep_xfer_dlist(
                        "NIXL_INIT_AGENT", _nixl_descs(local, case.layout, local_heads), "DRAM"
                    )
                    remote_side = agent.prep_xfer_dlist(
                        remote_name, _nixl_descs(remote_views, case.layout, heads), "DRAM"
                    )
                    prepared[key] = (local_side, remote_side, local)
                local_side, remote_side, local = prepared[key]
                remote_ids, local_ids = case.block_ids()
                remote_index = _nixl_indices(case, remote_ids)
                local_index = _nixl_indices(case, local_ids)

                def once(ls=local_side, rs=remote_side, li=local_index, ri=remote_index):
                    handle = agent.make_prepped_xfer("READ", ls, li, rs, ri)
                    state = agent.transfer(handle)
                    while state == "PROC":
                        state = agent.check_xfer_state(handle)
                    agent.release_xfer_handle(handle)
                    if state != "DONE":
                        raise RuntimeError(f"NIXL transfer ended in state {state}")

                results[case.name] = timed(once, iterations_for(case, base), warmup)
                verify(case, local, remote_ids, local_ids)
            result_queue.put(("ok", results))
        finally:
            done_queue.put(None)
            target.join(60)
    except Exception as exc:
        result_queue.put(("error", f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"))


class _AddressOnly:
    """Stands in for a remote tensor in `_nixl_descs`: only its address and shape are used."""

    def __init__(self, address: int, layout: Layout) -> None:
        self._address = address
        self.shape = (layout.num_blocks, 2, layout.num_heads, layout.block_size, layout.head_dim)

    def data_ptr(self) -> int:
        return self._address


def _nixl_site() -> str | None:
    """Where ``nixl_cu12`` is when this environment lacks it: the vLLM stage's venv has it
    (``.vllm-venv``, see docs/vllm.md); appended to ``sys.path``, after our own packages, and
    inherited by the spawned NIXL processes."""
    root = Path(__file__).resolve().parent.parent
    for site in sorted(root.glob(".vllm-venv/lib/python*/site-packages")):
        if (site / "nixl_cu12").is_dir():
            return str(site)
    return None


def run_nixl(
    base: int, warmup: int, threads: int, site: str | None = None
) -> tuple[dict[str, list[float]] | None, str]:
    if site is not None and site not in sys.path:
        sys.path.append(site)
    try:
        import nixl_cu12._api  # noqa: F401
    except Exception as exc:
        return None, f"n/a (nixl_cu12 not importable: {type(exc).__name__}: {exc})"
    if "ucxx" in sys.modules:
        return None, "n/a (ucxx already imported: its UCX variables would leak into NIXL)"
    ctx = mp.get_context("spawn")
    result_queue = ctx.Queue()
    process = ctx.Process(target=_nixl_initiator, args=(result_queue, base, warmup, threads))
    process.start()
    status, payload = result_queue.get(timeout=1800)
    process.join(60)
    if status != "ok":
        return None, f"n/a (NIXL run failed: {payload.splitlines()[0]})"
    return payload, "nixl_cu12 READ, descriptor lists prepared once"


# -- ours and TCP: server process -------------------------------------------------------------

_TCP_REQUEST = struct.Struct("<8sIIIII")


def _serve_tcp(listener: socket.socket, caches: dict[str, torch.Tensor]) -> None:
    connection, _ = listener.accept()
    connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    buffers: dict[int, torch.Tensor] = {}
    with connection:
        while True:
            header = _recv_exact(connection, _TCP_REQUEST.size)
            if header is None:
                return
            layout_name, h0, h1, l0, l1, count = _TCP_REQUEST.unpack(header)
            layout = LAYOUTS[layout_name.rstrip(b"\0").decode()]
            ids_bytes = _recv_exact(connection, 8 * count)
            ids = torch.frombuffer(bytearray(ids_bytes), dtype=torch.int64).tolist()
            heads = None if (h0, h1) == (0, layout.num_heads) else (h0, h1)
            case = Case("tcp", layout, count, heads=heads, layers=(l0, l1))
            buffer = buffers.get(case.nbytes)
            if buffer is None:
                buffer = buffers[case.nbytes] = torch.empty(case.nbytes, dtype=torch.uint8)
            gather(case, caches, ids, buffer)
            connection.sendall(struct.pack("<Q", case.nbytes))
            connection.sendall(memoryview(buffer.numpy()))


def _recv_exact(connection: socket.socket, size: int) -> bytes | None:
    data = bytearray(size)
    view = memoryview(data)
    got = 0
    while got < size:
        n = connection.recv_into(view[got:])
        if n == 0:
            return None
        got += n
    return bytes(data)


def _cpu_seconds() -> float:
    """This process's user + system CPU time, all threads."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def _compute_rate(seconds: float) -> float:
    """Matrix products per second in this process for ``seconds``: an engine's compute."""
    a = torch.randn(256, 256)
    done = 0
    start = time.perf_counter()
    while time.perf_counter() - start < seconds:
        for _ in range(10):
            a = torch.tanh(a @ a)
        done += 10
    return done / (time.perf_counter() - start)


def _server_process(ready: Any, stop: Any, cpu: Any, threads: int, checksum: bool) -> None:
    from kvtransfer.transport import KVTransferAgent, TransportConfig

    torch.set_num_threads(threads)
    caches = remote_caches()
    # RMA mode: serves tagged pulls and hands its keys to one-sided readers.
    agent = KVTransferAgent(TransportConfig(checksum=checksum, data_plane="rma"))
    agent.register_kv_caches(caches)
    agent.start_server()
    listener = socket.create_server(("127.0.0.1", 0))
    tcp = threading.Thread(target=_serve_tcp, args=(listener, caches), daemon=True)
    tcp.start()
    ready.put((agent.address, listener.getsockname()[1]))
    # Answers "how much CPU have you used" and "compute for a while" until told to stop.
    while (command := stop.get()) is not None:
        cpu.put(_compute_rate(command[1]) if isinstance(command, tuple) else _cpu_seconds())
    listener.close()
    agent.close()


@dataclass
class Measured:
    """Per case: request times of each method, and the producer's CPU seconds per GiB served."""

    tagged: dict[str, list[float]]
    rma: dict[str, list[float]]
    tcp: dict[str, list[float]]
    tagged_cpu_per_gib: dict[str, float]
    rma_cpu_per_gib: dict[str, float]
    # The producer's compute rate idle and while serving back-to-back reads of each plane.
    compute: dict[str, float]


def run_ours_and_tcp(base: int, warmup: int, threads: int, config: Any) -> Measured:
    from kvtransfer.transport import KVTransferAgent, PullSpec

    ctx = mp.get_context("spawn")
    ready, stop, cpu = ctx.Queue(), ctx.Queue(), ctx.Queue()
    server = ctx.Process(target=_server_process, args=(ready, stop, cpu, threads, config.checksum))
    server.start()

    def server_cpu() -> float:
        stop.put("cpu")
        return cpu.get(timeout=60)

    measured = Measured({}, {}, {}, {}, {}, {})
    agents: dict[int, Any] = {}
    try:
        address, port = ready.get(timeout=600)
        connection = socket.create_connection(("127.0.0.1", port))
        connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        for case in CASES:
            # Local and remote layers share names, so each local head count needs its own agent.
            key = case.local_heads
            if key not in agents:
                agents[key] = KVTransferAgent(config)
            agent = agents[key]
            local = local_caches(case.layout, case.local_heads)
            agent.register_kv_caches(local)
            peer = agent.connect(address)
            one_sided = agent.connect(address, one_sided=True)
            remote_ids, local_ids = case.block_ids()
            spec = PullSpec(
                case.name,
                [case.layout.layer_name(i) for i in case.layer_range],
                remote_ids,
                local_ids,
                remote_heads=case.heads,
                local_heads=None if case.heads is None else (0, case.local_heads),
            )

            for plane, target, per_gib in (
                ("tagged", peer, measured.tagged_cpu_per_gib),
                ("rma", one_sided, measured.rma_cpu_per_gib),
            ):
                for tensor in local.values():
                    tensor.zero_()

                def pull(agent=agent, target=target, spec=spec):
                    agent.pull(target, spec).result(600)

                iterations = iterations_for(case, base)
                before = server_cpu()
                samples = timed(pull, iterations, warmup)
                served = (iterations + warmup) * case.nbytes / (1 << 30)
                per_gib[case.name] = (server_cpu() - before) / served
                getattr(measured, plane)[case.name] = samples
                verify(case, local, remote_ids, local_ids)

            for tensor in local.values():
                tensor.zero_()
            receive = torch.empty(case.nbytes, dtype=torch.uint8)
            request = _TCP_REQUEST.pack(
                case.layout.name.encode(),
                case.head_range.start,
                case.head_range.stop,
                case.layer_range.start,
                case.layer_range.stop,
                case.blocks,
            ) + struct.pack(f"<{case.blocks}q", *remote_ids)

            def over_tcp(case=case, local=local, local_ids=local_ids, receive=receive, r=request):
                connection.sendall(r)
                (size,) = struct.unpack("<Q", _recv_exact(connection, 8))
                view = memoryview(receive.numpy())[:size]
                got = 0
                while got < size:
                    got += connection.recv_into(view[got:])
                scatter(case, local, local_ids, receive)

            measured.tcp[case.name] = timed(over_tcp, iterations_for(case, base), warmup)
            verify(case, local, remote_ids, local_ids)
            if case.name == INTERFERENCE_CASE:
                measured.compute.update(
                    measure_interference(stop, cpu, agent, peer, one_sided, spec)
                )
        connection.close()
    finally:
        for agent in agents.values():
            agent.close()
        stop.put(None)
        server.join(120)
    return measured


INTERFERENCE_CASE = "16 blocks"
COMPUTE_S = 3.0
# Reads per second while the producer computes: the same load for both planes (16 MiB each:
# 320 MiB/s, what a decode pulling a 2k-token prompt of a 7B model every 0.3 s asks).
READS_PER_S = 20


def measure_interference(stop: Any, cpu: Any, agent: Any, peer: Any, one_sided: Any, spec: Any):
    """The producer computes for `COMPUTE_S` while this process reads from it at
    `READS_PER_S` (each plane), and once idle: its compute rates."""
    rates = {}
    for label, target in (("idle", None), ("tagged", peer), ("rma", one_sided)):
        stop.put(("compute", COMPUTE_S))
        reads = 0
        start = time.perf_counter()
        while target is not None and cpu.empty():
            agent.pull(target, spec).result(600)
            reads += 1
            # Paced, not back to back: the same offered load for both planes.
            time.sleep(max(0.0, start + reads / READS_PER_S - time.perf_counter()))
        rates[label] = cpu.get(timeout=600)
        rates[f"{label}_reads"] = reads
    return rates


# -- the limit: UCX's own perftest ------------------------------------------------------------


def run_perftest(
    case: Case,
    iterations: int,
    warmup: int,
    test: str = "ucp_get",
    environment: dict[str, str] | None = None,
) -> dict[str, float] | None:
    """``ucx_perftest -t <test>`` of one contiguous buffer of the case's size (``case.nbytes``)
    between two processes (what UCX reaches with no layout at all), with ``environment`` added
    to both; None if the wheel lacks it."""
    import libucx

    root = Path(libucx.__file__).parent
    binary = root / "bin" / "ucx_perftest"
    if not binary.exists():
        return None
    env = {
        **os.environ,
        "LD_LIBRARY_PATH": str(root / "lib"),
        "UCX_WARN_UNUSED_ENV_VARS": "n",
        **(environment or {}),
    }
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    server = subprocess.Popen(
        [str(binary), "-p", str(port)], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT
    )
    try:
        command = [str(binary), "127.0.0.1", "-p", str(port), "-t", test]
        command += ["-s", str(case.nbytes), "-n", str(iterations), "-w", str(warmup)]
        for _ in range(50):
            run = subprocess.run(command, env=env, capture_output=True, text=True, timeout=600)
            if "Final:" in run.stdout:
                break
            time.sleep(0.1)  # the server is still starting: retry (not synchronisation)
        else:
            return None
    finally:
        server.kill()
        server.wait()
    fields = run.stdout.split("Final:")[1].split()
    return {"p50_ms": float(fields[1]) / 1e3, "gbps": float(fields[5]) * 1e6 / 1e9}


# -- report -----------------------------------------------------------------------------------


HANDSHAKE_WHAT = "gRPC fetch of all payloads of a live PP=2 UcxConnector prefill daemon"


def run_handshake(iterations: int, warmup: int) -> dict[str, float]:
    """Median cold and warm handshake fetch (ms) against a live prefill daemon."""
    import asyncio
    import shutil
    import tempfile

    from kvtransfer.clients.control import (
        AdminClient,
        HandshakeClient,
        close_all,
        get_handshake_client,
    )
    from kvtransfer.connectors.ucx.identity import compat_from_layout
    from kvtransfer.connectors.ucx.metadata import UcxHandshakeMetadata
    from kvtransfer.engine.model.loader import load_model_config
    from kvtransfer.engine.runner.kv_cache import kv_cache_layout
    from kvtransfer.serve.launcher import ServiceProcess, daemon_command
    from kvtransfer.serve.settings import load_settings

    engine_id = "bench-prefill"
    flags = ["--port", "0", "--pp", "2", "--engine-id", engine_id]
    flags += ["--kv-transfer-config", json.dumps({"kv_ip": "127.0.0.1", "kv_port": 0})]
    # The daemon's own flags give its engine config here too (for the compatibility hash),
    # without building an engine in this process.
    config = load_settings("prefill", flags, environ={}).engine_config()
    log_dir = Path(tempfile.mkdtemp(prefix="kvtransfer-bench-transfer-"))
    daemon = ServiceProcess.start(engine_id, daemon_command("prefill", *flags), log_dir / "p.log")
    try:
        # The connector's handshake server (the daemon serves KVHandshake on its port too).
        address = str(daemon.ready.get("kv_handshake") or daemon.address)

        async def measure() -> dict[str, float]:
            admin = AdminClient(daemon.address)
            try:
                status = await admin.status()
            finally:
                await admin.close()
            num_blocks = status.num_free_blocks + status.num_used_blocks
            layout = kv_cache_layout(config, load_model_config(config.model), num_blocks)
            compat = compat_from_layout(layout)

            async def fetch_ms(client: HandshakeClient) -> float:
                start = time.perf_counter()
                fetched = await client.fetch(engine_id, compat, UcxHandshakeMetadata)
                elapsed = (time.perf_counter() - start) * 1e3
                if len(fetched.metadata) != config.world_size:
                    raise RuntimeError(f"expected {config.world_size} payloads, got {fetched!r}")
                return elapsed

            cold = []
            for _ in range(warmup + iterations):
                client = HandshakeClient(address)
                try:
                    cold.append(await fetch_ms(client))
                finally:
                    await client.close()
            warm_client = get_handshake_client(address)
            warm = [await fetch_ms(warm_client) for _ in range(warmup + iterations)]
            await close_all()
            return {
                "handshake_cold_ms": statistics.median(cold[warmup:]),
                "handshake_warm_ms": statistics.median(warm[warmup:]),
            }

        measured = asyncio.run(measure())
    finally:
        daemon.terminate()
    # Kept when something failed: the daemon's log is the place to look.
    shutil.rmtree(log_dir, ignore_errors=True)
    return measured


def _fmt(value: float | None, digits: int = 2) -> str:
    return "n/a" if value is None else f"{value:.{digits}f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--iterations", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--torch-threads", type=int, default=1)
    parser.add_argument("--no-nixl", action="store_true")
    parser.add_argument(
        "--nixl-site",
        help="a site-packages holding nixl_cu12 (default: .vllm-venv's, where ours lacks it)",
    )
    parser.add_argument("--chunk-mib", type=int, default=None, help="TransportConfig.chunk_bytes")
    parser.add_argument("--inflight", type=int, default=None, help="max_inflight_chunks")
    parser.add_argument("--no-handshake", action="store_true")
    parser.add_argument("--no-perftest", action="store_true", help="skip the ucx_perftest limit")
    parser.add_argument(
        "--checksum-cost",
        action="store_true",
        help="also run our pulls with payload checksums (kv_payload_checksum) and print their cost",
    )
    parser.add_argument(
        "--quick",
        action="store_true",
        help="smoke run: 3 iterations, 1 warm-up, no handshake (overrides those options)",
    )
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    if args.quick:
        args.iterations, args.warmup, args.no_handshake = 3, 1, True
    if args.iterations < 1 or args.warmup < 0 or args.torch_threads < 1:
        parser.error("--iterations and --torch-threads must be >= 1, --warmup >= 0")
    torch.set_num_threads(args.torch_threads)

    # Before UCX is imported here: the daemon must not inherit its UCX variables.
    handshake: dict[str, float | None] = {"handshake_cold_ms": None, "handshake_warm_ms": None}
    if not args.no_handshake:
        handshake.update(run_handshake(max(args.iterations, 20), max(args.warmup, 2)))
    memcpy = run_memcpy(args.iterations, args.warmup)
    if args.no_nixl:
        nixl, nixl_note = None, "n/a (--no-nixl)"
    else:
        try:
            import nixl_cu12  # noqa: F401

            site = None
        except ImportError:
            site = args.nixl_site or _nixl_site()
        nixl, nixl_note = run_nixl(args.iterations, args.warmup, args.torch_threads, site)
        if site is not None:
            nixl_note += f" (from {site})"
    from kvtransfer.transport import TransportConfig

    overrides: dict[str, int] = {}
    if args.chunk_mib is not None:
        overrides["chunk_bytes"] = args.chunk_mib * MiB
    if args.inflight is not None:
        overrides["max_inflight_chunks"] = args.inflight
    config = TransportConfig(**overrides)
    measured = run_ours_and_tcp(args.iterations, args.warmup, args.torch_threads, config)
    checked = None
    if args.checksum_cost:
        checked = run_ours_and_tcp(
            args.iterations, args.warmup, args.torch_threads, replace(config, checksum=True)
        ).tagged
    limits = (
        {}
        if args.no_perftest
        else {
            case.name: run_perftest(case, iterations_for(case, args.iterations), args.warmup)
            for case in CASES
        }
    )

    # Every case is expressible as NIXL descriptors: NIXL figures are missing only when the
    # whole NIXL run is, and then every row says why.
    nixl_missing = None if nixl is not None else nixl_note.removeprefix("n/a (").removesuffix(")")
    rows = []
    for case in CASES:
        nixl_samples = None if nixl is None else nixl[case.name]
        nixl_p50 = None if nixl_samples is None else percentile_ms(nixl_samples, 50)
        rma, tagged = measured.rma[case.name], measured.tagged[case.name]
        limit = limits.get(case.name)
        rma_gbps = gbps(case.nbytes, rma)
        rma_cpu, tagged_cpu = (
            measured.rma_cpu_per_gib[case.name],
            measured.tagged_cpu_per_gib[case.name],
        )
        row = {
            "case": case.name,
            "blocks": case.blocks,
            "bytes": case.nbytes,
            "rma_gbps": rma_gbps,
            "tagged_gbps": gbps(case.nbytes, tagged),
            "nixl_gbps": gbps(case.nbytes, nixl_samples),
            "tcp_gbps": gbps(case.nbytes, measured.tcp[case.name]),
            "memcpy_gbps": gbps(case.nbytes, memcpy[case.name]),
            "perftest_gbps": None if limit is None else limit["gbps"],
            "rma_p50_ms": percentile_ms(rma, 50),
            "rma_p99_ms": percentile_ms(rma, 99),
            "tagged_p50_ms": percentile_ms(tagged, 50),
            "tagged_p99_ms": percentile_ms(tagged, 99),
            "nixl_p50_ms": nixl_p50,
            "nixl_p99_ms": None if nixl_samples is None else percentile_ms(nixl_samples, 99),
            "perftest_p50_ms": None if limit is None else limit["p50_ms"],
            # > 1: RMA moves that many times NIXL's bytes per second.
            "rma_over_nixl": None
            if nixl_samples is None
            else rma_gbps / gbps(case.nbytes, nixl_samples),
            "rma_pct_of_perftest": None if limit is None else 100.0 * rma_gbps / limit["gbps"],
            # The producer's CPU seconds per GiB read from it (all its threads).
            "producer_cpu_s_per_gib_tagged": tagged_cpu,
            "producer_cpu_s_per_gib_rma": rma_cpu,
            "rma_cpu_pct_of_tagged": 100.0 * rma_cpu / tagged_cpu if tagged_cpu > 0 else None,
            # Why the NIXL figures of this row are null; None when they were measured.
            "nixl_note": nixl_missing,
            "tagged_checksum_gbps": None
            if checked is None
            else gbps(case.nbytes, checked[case.name]),
            "samples": len(rma),
            **handshake,
        }
        rows.append(row)

    header = (
        f"{'case':<24} {'MiB':>6} | {'p50 ms':>6} {'tagged':>7} {'nixl':>6} {'limit':>6} | "
        f"{'GB/s':>5} {'tagged':>6} {'nixl':>5} {'memcpy':>6} {'limit':>5} | "
        f"{'x nixl':>6} {'% lim':>5} | {'cpu/GiB tagged':>14} {'rma':>6} {'%':>5}"
    )
    print(f"# {platform.node()} {os.cpu_count()} CPUs, torch threads {args.torch_threads}")
    print(f"# nixl: {nixl_note}; limit: ucx_perftest -t ucp_get, one buffer of the case's size")
    print(
        "# first p50 and GB/s columns: ours, RMA mode (one-sided); x nixl: RMA GB/s over NIXL's;"
        " % lim: RMA GB/s as % of the limit; cpu/GiB: producer CPU s per GiB served"
    )
    handshake_what = "n/a (--no-handshake)" if args.no_handshake else HANDSHAKE_WHAT
    print(
        f"# handshake ({handshake_what}): cold {_fmt(handshake['handshake_cold_ms'])} ms, "
        f"warm {_fmt(handshake['handshake_warm_ms'])} ms"
    )
    print(header)
    print("-" * len(header))
    for row in rows:
        print(
            f"{row['case']:<24} {row['bytes'] / MiB:>6.1f} | "
            f"{row['rma_p50_ms']:>6.3f} {row['tagged_p50_ms']:>7.3f} "
            f"{_fmt(row['nixl_p50_ms'], 3):>6} {_fmt(row['perftest_p50_ms'], 3):>6} | "
            f"{_fmt(row['rma_gbps']):>5} {_fmt(row['tagged_gbps']):>6} "
            f"{_fmt(row['nixl_gbps']):>5} {_fmt(row['memcpy_gbps']):>6} "
            f"{_fmt(row['perftest_gbps']):>5} | "
            f"{_fmt(row['rma_over_nixl']):>6} {_fmt(row['rma_pct_of_perftest'], 0):>5} | "
            f"{row['producer_cpu_s_per_gib_tagged']:>14.3f} "
            f"{row['producer_cpu_s_per_gib_rma']:>6.3f} {_fmt(row['rma_cpu_pct_of_tagged'], 1):>5}"
        )
    compute = measured.compute
    if compute:
        idle = compute["idle"]
        print(
            f"# producer compute while a consumer reads {INTERFERENCE_CASE} {READS_PER_S} times "
            f"a second ({COMPUTE_S:g} s each): idle {idle:.0f}/s, tagged {compute['tagged']:.0f}/s "
            f"({100 * (compute['tagged'] / idle - 1):+.1f}%, {compute['tagged_reads']} reads), "
            f"rma {compute['rma']:.0f}/s ({100 * (compute['rma'] / idle - 1):+.1f}%, "
            f"{compute['rma_reads']} reads)"
        )
    if args.json is not None:
        args.json.write_text(
            json.dumps(
                {
                    "host": platform.node(),
                    "cpus": os.cpu_count(),
                    "torch_threads": args.torch_threads,
                    "nixl": nixl_note,
                    "handshake": handshake_what,
                    "layouts": {
                        layout.name: {
                            "num_blocks": layout.num_blocks,
                            "num_layers": layout.num_layers,
                            "num_heads": layout.num_heads,
                            "block_size": layout.block_size,
                            "head_dim": layout.head_dim,
                            "dtype": str(layout.dtype).removeprefix("torch."),
                        }
                        for layout in LAYOUTS.values()
                    },
                    "cases": rows,
                    "producer_compute_while_serving": compute,
                },
                indent=2,
            )
            + "\n"
        )
        write_png("transfer", args.json)


if __name__ == "__main__":
    main()
