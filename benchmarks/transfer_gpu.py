"""KV block pulls and pushes between processes on one CUDA device, against UCX's limits.

The GPU counterpart of ``benchmarks/transfer.py`` (host memory only). A producer process holds
caches on ``cuda:0`` in the engine's paged layout (per layer
``[num_blocks, 2, heads, block_size, head_dim]``; layout A: 8 layers x [512, 2, 8, 16, 128]
float32, 1 MiB per block; layout B: 8 layers x [4096, 2, 1, 16, 128] bfloat16, 64 KiB per
block), this process pulls scattered blocks into its own caches on the same device with
`KVTransferAgent.pull`:

* tagged: the producer gathers into a device buffer and sends it as UCX tagged messages (one
  host's messages are eager: ``transport_options``), the consumer scatters;
* rma: one-sided, through the producer's CUDA IPC handles: the pull's runs copied by a
  gather and a scatter kernel per pair of storages (`transport.cuda_ipc`); with
  ``--no-cuda-ipc`` the peers publish no handles and UCX gets each contiguous run
  (``ucp_get``, its ``cuda_ipc`` transport between processes of one host);
* push: the same blocks written the other way, into a third process's caches (on the same
  device) under a push lease it granted (`KVTransferAgent.push`: begin notice, lease row
  check, the writes (kernels, or ``ucp_put`` per run), row check, landed notice);
* local: the same gather and scatter inside one process (``index_select``/``index_copy_``),
  what the device's own memory bandwidth allows;
* limit (get) and limit (put): ``ucx_perftest -t ucp_get`` and ``-t ucp_put_bw`` with ``-m
  cuda`` of one contiguous buffer of the case's size between two processes (from the
  ``libucx`` wheel), where the wheel has it.

Every pull is checked bitwise against the producer's contents afterwards, every push in the
destination process against the same contents, so a row is also a correctness check of the
CUDA data plane. Per case and method the median request time over
``--iterations`` after ``--warmup``, and the GB/s it gives; which path served the one-sided
reads and writes (``direct_*``: IPC kernels, ``ucx_*``: UCX; the agent's counters) and
``UCX_CUDA_IPC_ENABLE_GET_ZCOPY`` as UCX saw it are in the JSON.

    python benchmarks/transfer_gpu.py [--iterations 10] [--warmup 2] [--json out.json]
        [--no-perftest] [--no-cuda-ipc] [--device cuda:0]

Needs CUDA; exits with status 2 and says so without it. ``--device cpu`` runs the same cases
on host memory (a dry run of the script where no GPU is; ``benchmarks/transfer.py`` is the
host benchmark).
"""

from __future__ import annotations

import argparse
import faulthandler
import json
import multiprocessing as mp
import os
import socket
import statistics
import subprocess
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

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
    def shape(self) -> tuple[int, int, int, int, int]:
        return (self.num_blocks, 2, self.num_heads, self.block_size, self.head_dim)

    @property
    def block_bytes(self) -> int:
        return 2 * self.num_heads * self.block_size * self.head_dim * self.dtype.itemsize


LAYOUT_A = Layout("a", 512, 8, 8, 16, 128, torch.float32)
LAYOUT_B = Layout("b", 4096, 8, 1, 16, 128, torch.bfloat16)
LAYOUTS = (LAYOUT_A, LAYOUT_B)


@dataclass(frozen=True)
class Case:
    name: str
    layout: Layout
    blocks: int

    @property
    def nbytes(self) -> int:
        return self.blocks * self.layout.block_bytes * self.layout.num_layers

    def block_ids(self) -> tuple[list[int], list[int]]:
        generator = torch.Generator().manual_seed(self.blocks * 31 + len(self.name))
        remote = torch.randperm(self.layout.num_blocks, generator=generator)[: self.blocks]
        local = torch.randperm(self.layout.num_blocks, generator=generator)[: self.blocks]
        return remote.tolist(), local.tolist()


CASES = (
    Case("1 block", LAYOUT_A, 1),
    Case("16 blocks", LAYOUT_A, 16),
    Case("64 blocks", LAYOUT_A, 64),
    Case("256 blocks", LAYOUT_A, 256),
    Case("2048 blocks (B)", LAYOUT_B, 2048),
)


def _int_view(dtype: torch.dtype) -> torch.dtype:
    return {2: torch.int16, 4: torch.int32}[dtype.itemsize]


def filled_caches(layout: Layout, device: str) -> dict[str, torch.Tensor]:
    """The producer's contents: element index + layer * 7919, bitwise (cheap to rebuild)."""
    numel = layout.block_bytes // layout.dtype.itemsize * layout.num_blocks
    caches = {}
    for layer in range(layout.num_layers):
        values = torch.arange(numel, dtype=torch.int32, device=device).add_(layer * 7919)
        caches[layout.layer_name(layer)] = (
            values.to(_int_view(layout.dtype)).view(layout.dtype).view(layout.shape)
        )
    return caches


def empty_caches(layout: Layout, device: str) -> dict[str, torch.Tensor]:
    return {
        layout.layer_name(layer): torch.zeros(layout.shape, dtype=layout.dtype, device=device)
        for layer in range(layout.num_layers)
    }


def verify(
    case: Case,
    local: dict[str, torch.Tensor],
    reference: dict[str, torch.Tensor],
    remote_ids: list[int],
    local_ids: list[int],
) -> None:
    synchronize()
    itype = _int_view(case.layout.dtype)
    device = next(iter(local.values())).device
    remote_index = torch.tensor(remote_ids, device=device)
    local_index = torch.tensor(local_ids, device=device)
    for name, tensor in local.items():
        got = tensor.index_select(0, local_index).view(itype)
        want = reference[name].index_select(0, remote_index).view(itype)
        if not torch.equal(got, want):
            raise RuntimeError(f"{case.name}: {name} differs from the producer's after the pull")


def synchronize() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def timed(fn: Callable[[], None], iterations: int, warmup: int) -> list[float]:
    for _ in range(warmup):
        fn()
    synchronize()
    samples = []
    for _ in range(iterations):
        start = time.perf_counter()
        fn()
        synchronize()
        samples.append(time.perf_counter() - start)
    return samples


def _producer(ready: Any, stop: Any, device: str, cuda_ipc: bool) -> None:
    from kvtransfer.transport import KVTransferAgent, TransportConfig

    faulthandler.enable()
    if device.startswith("cuda"):
        torch.cuda.set_device(device)
    caches = {name: t for layout in LAYOUTS for name, t in filled_caches(layout, device).items()}
    synchronize()
    agent = KVTransferAgent(TransportConfig(data_plane="rma", cuda_ipc=cuda_ipc))
    agent.register_kv_caches(caches)
    agent.start_server()
    ready.put(agent.address)
    stop.get()
    agent.close()


PUSH_LEASE, PUSH_SECRET = "bench-push", "bench-push-secret"


def _push_target(ready: Any, commands: Any, answers: Any, device: str, cuda_ipc: bool) -> None:
    """Takes pushes: zeroed caches, one push lease re-granted per case, and a check that the
    pushed blocks hold the producer's contents (`filled_caches`, rebuilt here)."""
    from kvtransfer.transport import KVTransferAgent, LeaseGrants, TransportConfig, secret_digest

    faulthandler.enable()
    if device.startswith("cuda"):
        torch.cuda.set_device(device)
    caches = {name: t for layout in LAYOUTS for name, t in empty_caches(layout, device).items()}
    push_grants = LeaseGrants()
    agent = KVTransferAgent(TransportConfig(data_plane="rma", cuda_ipc=cuda_ipc))
    agent.register_kv_caches(caches)
    agent.start_server(LeaseGrants(), push_grants)
    ready.put((agent.address, agent.kv_layouts()))
    while (command := commands.get()) is not None:
        kind, layout_name, blocks = command
        layout = next(layout for layout in LAYOUTS if layout.name == layout_name)
        names = [layout.layer_name(i) for i in range(layout.num_layers)]
        if kind == "grant":
            push_grants.revoke_nowait([PUSH_LEASE])
            for name in names:
                caches[name].zero_()
            synchronize()
            push_grants.grant_push(PUSH_LEASE, secret_digest(PUSH_SECRET), blocks, names)
            answers.put("")
            continue
        reference = filled_caches(layout, device)
        index = torch.tensor(blocks, device=device)
        itype = _int_view(layout.dtype)
        differs = [
            name
            for name in names
            if not torch.equal(
                caches[name].index_select(0, index).view(itype),
                reference[name].index_select(0, index).view(itype),
            )
        ]
        answers.put(f"{layout_name}: {differs} differ after the push" if differs else "")
    agent.close()


@dataclass
class Row:
    case: str
    nbytes: int
    method: str
    p50_ms: float | None
    gbps: float | None
    iterations: int
    note: str = ""


def _row(case: Case, method: str, samples: list[float], note: str = "") -> Row:
    p50 = statistics.median(samples)
    print(f"{case.name}: {method} {p50 * 1e3:.3f} ms", file=sys.stderr, flush=True)
    return Row(
        case.name, case.nbytes, method, p50 * 1e3, case.nbytes / p50 / 1e9, len(samples), note
    )


def run_local(base: int, warmup: int, device: str) -> list[Row]:
    """Gather and scatter in this process: the device's own copy rate for the layout."""
    rows = []
    for layout in LAYOUTS:
        reference = filled_caches(layout, device)
        for case in (c for c in CASES if c.layout is layout):
            local = empty_caches(layout, device)
            remote_ids, local_ids = case.block_ids()
            r_index = torch.tensor(remote_ids, device=device)
            l_index = torch.tensor(local_ids, device=device)

            def once(local=local, reference=reference, r=r_index, li=l_index) -> None:
                for name, tensor in local.items():
                    tensor.index_copy_(0, li, reference[name].index_select(0, r))

            rows.append(_row(case, "local", timed(once, base, warmup)))
            verify(case, local, reference, remote_ids, local_ids)
        del reference
    return rows


def run_pulls(
    base: int, warmup: int, device: str, cuda_ipc: bool
) -> tuple[list[Row], dict[str, int]]:
    from kvtransfer.transport import KVTransferAgent, PullSpec, TransportConfig

    ctx = mp.get_context("spawn")
    ready, stop = ctx.Queue(), ctx.Queue()
    producer = ctx.Process(target=_producer, args=(ready, stop, device, cuda_ipc), daemon=True)
    producer.start()
    target_ready, commands, answers = ctx.Queue(), ctx.Queue(), ctx.Queue()
    push_target = ctx.Process(
        target=_push_target, args=(target_ready, commands, answers, device, cuda_ipc), daemon=True
    )
    push_target.start()
    rows: list[Row] = []
    agent = KVTransferAgent(TransportConfig(data_plane="rma"))
    try:
        address = ready.get(timeout=300)
        target_address, target_layouts = target_ready.get(timeout=300)
        local = {name: t for layout in LAYOUTS for name, t in empty_caches(layout, device).items()}
        agent.register_kv_caches(local)
        targets = {
            "tagged": agent.connect(address),
            "rma": agent.connect(address, one_sided=True),
        }
        writer = agent.connect(target_address, layouts=target_layouts)
        for layout in LAYOUTS:
            reference = filled_caches(layout, device)
            layer_names = [layout.layer_name(i) for i in range(layout.num_layers)]
            mine = {name: local[name] for name in layer_names}
            for case in (c for c in CASES if c.layout is layout):
                remote_ids, local_ids = case.block_ids()
                spec = PullSpec(case.name, tuple(layer_names), remote_ids, local_ids)
                for method, target in targets.items():
                    for tensor in mine.values():
                        tensor.zero_()

                    def pull(target=target, spec=spec) -> None:
                        agent.pull(target, spec).result(120)

                    try:
                        samples = timed(pull, base, warmup)
                        verify(case, mine, reference, remote_ids, local_ids)
                        rows.append(_row(case, method, samples))
                    except Exception as exc:
                        rows.append(Row(case.name, case.nbytes, method, None, None, 0, _why(exc)))
                        print(traceback.format_exc(), file=sys.stderr, flush=True)
                # `mine` now holds the producer's blocks (the last pull was checked): push
                # them into the target's blocks of the same ids as the producer's.
                rows.append(
                    push_row(agent, writer, case, layer_names, (commands, answers), base, warmup)
                )
            del reference
        counters = asdict(agent.one_sided_counters)
    finally:
        agent.close()
        stop.put(None)
        commands.put(None)
        producer.join(60)
        push_target.join(60)
    return rows, counters


def push_row(
    agent: Any,
    writer: Any,
    case: Case,
    layer_names: list[str],
    target: tuple[Any, Any],
    iterations: int,
    warmup: int,
) -> Row:
    """Push ``case``'s blocks into the target (granted for exactly them), then have it check."""
    from kvtransfer.transport import LeaseAccess, PullSpec

    commands, answers = target

    remote_ids, local_ids = case.block_ids()
    try:
        commands.put(("grant", case.layout.name, remote_ids))
        answers.get(timeout=120)
        lease = LeaseAccess(PUSH_LEASE, PUSH_SECRET, "", 0, tuple(remote_ids))
        spec = PullSpec(f"push {case.name}", tuple(layer_names), remote_ids, local_ids, lease=lease)
        samples = timed(lambda: agent.push(writer, spec).result(120), iterations, warmup)
        commands.put(("check", case.layout.name, remote_ids))
        if differs := answers.get(timeout=300):
            raise RuntimeError(differs)
        return _row(case, "push", samples)
    except Exception as exc:
        print(traceback.format_exc(), file=sys.stderr, flush=True)
        return Row(case.name, case.nbytes, "push", None, None, 0, _why(exc))


def _why(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}".splitlines()[0][:300]


PERFTESTS = {"ucp_get": "lim-get", "ucp_put_bw": "lim-put"}


def run_perftest(case: Case, iterations: int, warmup: int, device: str, test: str) -> Row:
    """``ucx_perftest -t TEST -m cuda`` of one buffer of the case's size, two processes."""
    method = PERFTESTS[test]
    import libucx

    root = Path(libucx.__file__).parent
    binary = root / "bin" / "ucx_perftest"
    if not binary.exists():
        return Row(case.name, case.nbytes, method, None, None, 0, "no ucx_perftest in libucx")
    env = {**os.environ, "LD_LIBRARY_PATH": str(root / "lib"), "UCX_WARN_UNUSED_ENV_VARS": "n"}
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    server = subprocess.Popen(
        [str(binary), "-p", str(port)], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT
    )
    try:
        command = [str(binary), "127.0.0.1", "-p", str(port), "-t", test]
        command += ["-m", "cuda" if device.startswith("cuda") else "host"]
        command += ["-s", str(case.nbytes), "-n", str(iterations), "-w", str(warmup)]
        for _ in range(50):
            run = subprocess.run(command, env=env, capture_output=True, text=True, timeout=120)
            if "Final:" in run.stdout:
                break
            time.sleep(0.1)  # the server is still starting: retry (not synchronisation)
        else:
            tail = (run.stdout + run.stderr).strip().splitlines()[-3:]
            return Row(case.name, case.nbytes, method, None, None, 0, " | ".join(tail)[:300])
    finally:
        server.kill()
        server.wait()
    # Final: iterations, latency (usec) median, average, overall, bandwidth (MiB/s)...; the
    # median of a few iterations is not one (2 iterations gave 34 us for 16 MiB), so the
    # average stands in for it.
    fields = run.stdout.split("Final:")[1].split()
    p50_ms = float(fields[2]) / 1e3
    rate = case.nbytes / (p50_ms / 1e3) / 1e9
    return Row(case.name, case.nbytes, method, p50_ms, rate, iterations, "average, not median")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--iterations", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--device", default="cuda:0", help="cuda:N, or cpu (a dry run)")
    parser.add_argument("--no-perftest", action="store_true")
    parser.add_argument(
        "--no-cuda-ipc",
        action="store_true",
        help="peers publish no CUDA IPC handles: UCX's cuda_ipc moves each run",
    )
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    # A crash inside UCX or CUDA leaves the Python stack that led there (seen once: a
    # segfault with UCX's cuda_ipc gets, no output).
    faulthandler.enable()
    if args.iterations < 1 or args.warmup < 0:
        parser.error("--iterations must be >= 1 and --warmup >= 0")
    device = args.device
    if device.startswith("cuda"):
        if not torch.cuda.is_available():
            print("transfer_gpu: needs CUDA (torch.cuda.is_available() is False)", file=sys.stderr)
            return 2
        torch.cuda.set_device(device)
        name = torch.cuda.get_device_name(device)
    elif device == "cpu":
        name = "cpu"
    else:
        parser.error(f"--device must be cuda[:N] or cpu, got {device!r}")
    rows = run_local(args.iterations, args.warmup, device)
    pulled, counters = run_pulls(args.iterations, args.warmup, device, not args.no_cuda_ipc)
    rows += pulled
    if not args.no_perftest:
        rows += [
            run_perftest(case, args.iterations, args.warmup, device, test)
            for case in CASES
            for test in PERFTESTS
        ]
    get_zcopy = os.environ.get("UCX_CUDA_IPC_ENABLE_GET_ZCOPY", "unset")
    print(
        f"device: {name}; cuda_ipc {not args.no_cuda_ipc}; "
        f"UCX_CUDA_IPC_ENABLE_GET_ZCOPY={get_zcopy}; RMA: {counters}"
    )
    print(f"{'case':<18} {'MiB':>8} {'method':<7} {'p50_ms':>9} {'GB/s':>8}  note")
    for row in sorted(rows, key=lambda r: (r.nbytes, r.method)):
        p50 = "n/a" if row.p50_ms is None else f"{row.p50_ms:.3f}"
        rate = "n/a" if row.gbps is None else f"{row.gbps:.2f}"
        size = f"{row.nbytes / MiB:>8.2f}"
        print(f"{row.case:<18} {size} {row.method:<7} {p50:>9} {rate:>8}  {row.note}")
    if args.json is not None:
        report = {
            "device": name,
            "torch": torch.__version__,
            "rma_counters": counters,
            "cuda_ipc_get_zcopy": get_zcopy,
            "cuda_ipc_handles": not args.no_cuda_ipc,
            "rows": [asdict(row) for row in rows],
        }
        args.json.write_text(json.dumps(report, indent=2) + "\n")
    failed = [row for row in rows if row.p50_ms is None and row.method not in PERFTESTS.values()]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
