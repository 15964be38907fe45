"""Push against pull, one-sided, between two processes: the same blocks moved each way.

A peer process holds caches in the engine's paged layout (8 layers x [320, 2, 8, 16, 128]
float32: 1 MiB per block over the 8 layers). It serves one-sided reads of a read lease and
takes pushes of a push lease (`KVTransferAgent.start_server(grants, push_grants)`). This
process holds caches of the same layout and, per case (1, 16 and 256 scattered blocks),

* pull: reads the peer's blocks into its own (`KVTransferAgent.pull`, one-sided);
* push: writes its blocks into the peer's (`KVTransferAgent.push`: begin notice, row check,
  writes, flush, row check, landed notice);
* by layer: the same blocks a layer at a time, as a streaming consumer pulls (a pull per
  layer) and a producer computing layer after layer pushes (one `begin_push` session: one
  begin, a write per layer, one landed notice);

on two paths: ``direct`` (same host: ``process_vm_readv`` / ``process_vm_writev``) and
``network`` (this process counts the peer as another host: UCX gets / puts over TCP). NIXL's
READ and WRITE of the same blocks (one descriptor per layer and block, lists prepared once;
``nixl_cu12`` in processes of their own, with its own choice of UCX transports) run first
unless ``--no-nixl``. With ``--perftest``, UCX's own ``ucx_perftest -t ucp_get`` and ``-t
ucp_put_bw`` of one contiguous buffer of each size over UCX's TCP transport (the network path's
limit: no layout, no Python) run too. Bytes are checked after each of ours (the destination's
blocks equal the source's).

Prints one table (p50 ms and GB/s per method, push over pull) and, with ``--json``, writes it.

    python benchmarks/push.py [--iterations 10] [--perftest] [--no-nixl] [--json PATH] [--quick]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import platform
import statistics
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch
from transfer import run_perftest, timed

LAYERS = tuple(f"model.layers.{i}.self_attn" for i in range(8))
SHAPE = (320, 2, 8, 16, 128)  # blocks, K/V, heads, tokens, head_dim: 128 KiB per block, layer
BLOCK_BYTES = len(LAYERS) * 2 * 8 * 16 * 128 * 4
CASES = (1, 16, 256)
SECRET = "benchmark-secret"
READ_LEASE, PUSH_LEASE = "bench-read", "bench-push"


def _caches(seed: int | None) -> dict[str, torch.Tensor]:
    if seed is None:
        return {name: torch.zeros(SHAPE) for name in LAYERS}
    generator = torch.Generator().manual_seed(seed)
    return {name: torch.randn(SHAPE, generator=generator) for name in LAYERS}


def _ids(seed: int, count: int) -> tuple[int, ...]:
    return tuple(
        torch.randperm(SHAPE[0], generator=torch.Generator().manual_seed(seed))[:count].tolist()
    )


def _peer(ready: Any, commands: Any, answers: Any) -> None:
    """The peer: serves reads of `READ_LEASE` and takes pushes of `PUSH_LEASE` (re-granted
    per case), and answers checksums of its blocks."""
    from kvtransfer.transport import KVTransferAgent, LeaseGrants, TransportConfig, secret_digest

    torch.set_num_threads(1)
    caches = _caches(7)
    grants, push_grants = LeaseGrants(), LeaseGrants()
    agent = KVTransferAgent(TransportConfig(timeout_s=600))
    agent.register_kv_caches(caches)
    agent.start_server(grants, push_grants)
    ready.put((agent.address, agent.kv_layouts()))
    while (command := commands.get()) is not None:
        kind, blocks = command
        if kind == "grant":
            digest = secret_digest(SECRET)
            grants.revoke([READ_LEASE])
            push_grants.revoke_nowait([PUSH_LEASE])
            grants.grant(READ_LEASE, digest, blocks)
            push_grants.grant_push(PUSH_LEASE, digest, blocks, LAYERS)
            answers.put(True)
        else:  # "blocks": the peer's blocks, for the check
            answers.put({name: caches[name][list(blocks)].clone() for name in LAYERS})
    agent.close()


LAYER_BLOCK_BYTES = BLOCK_BYTES // len(LAYERS)


def _nixl_rows(addresses: list[int]) -> Any:
    """One (address, bytes, device) descriptor per (layer, block), layer-major."""
    import numpy as np

    return np.array(
        [
            (base + block * LAYER_BLOCK_BYTES, LAYER_BLOCK_BYTES, 0)
            for base in addresses
            for block in range(SHAPE[0])
        ],
        dtype=np.uint64,
    )


def _nixl_indices(ids: tuple[int, ...]) -> list[int]:
    return [layer * SHAPE[0] + block for layer in range(len(LAYERS)) for block in ids]


def _nixl_peer(meta_queue: Any, done_queue: Any) -> None:
    from nixl_cu12._api import nixl_agent, nixl_agent_config

    torch.set_num_threads(1)
    agent = nixl_agent("push-peer", nixl_agent_config(backends=["UCX"]))
    caches = _caches(7)
    agent.register_memory(list(caches.values()))
    meta_queue.put((agent.get_agent_metadata(), [caches[name].data_ptr() for name in LAYERS]))
    done_queue.get()


def _nixl_initiator(results: Any, iterations: int, warmup: int) -> None:
    """NIXL READ and WRITE of each case's blocks (descriptor lists prepared once), in a
    process of its own: NIXL must start before ucxx sets UCX variables in the environment."""
    try:
        from nixl_cu12._api import nixl_agent, nixl_agent_config

        torch.set_num_threads(1)
        ctx = mp.get_context("spawn")
        meta_queue, done_queue = ctx.Queue(), ctx.Queue()
        peer = ctx.Process(target=_nixl_peer, args=(meta_queue, done_queue))
        peer.start()
        try:
            agent = nixl_agent("push-initiator", nixl_agent_config(backends=["UCX"]))
            metadata, remote_addresses = meta_queue.get(timeout=300)
            remote_name = agent.add_remote_agent(metadata)
            local = _caches(11)
            agent.register_memory(list(local.values()))
            local_side = agent.prep_xfer_dlist(
                "NIXL_INIT_AGENT", _nixl_rows([local[name].data_ptr() for name in LAYERS]), "DRAM"
            )
            remote_side = agent.prep_xfer_dlist(remote_name, _nixl_rows(remote_addresses), "DRAM")
            out: dict[int, dict[str, list[float]]] = {}
            for count in CASES:
                remote, mine = _ids(1 + count, count), _ids(2 + count, count)
                local_index, remote_index = _nixl_indices(mine), _nixl_indices(remote)
                out[count] = {}
                for op in ("READ", "WRITE"):

                    def once(op: str = op, li: list = local_index, ri: list = remote_index):
                        handle = agent.make_prepped_xfer(op, local_side, li, remote_side, ri)
                        state = agent.transfer(handle)
                        while state == "PROC":
                            state = agent.check_xfer_state(handle)
                        agent.release_xfer_handle(handle)
                        if state != "DONE":
                            raise RuntimeError(f"NIXL {op} ended in state {state}")

                    runs = iterations * (4 if count <= 16 else 1)
                    out[count][op] = timed(once, runs, warmup)
            results.put(("ok", out))
        finally:
            done_queue.put(None)
            peer.join(60)
    except Exception as exc:  # reported in the table as n/a, with why
        results.put(("error", f"{type(exc).__name__}: {exc}"))


def run_nixl(iterations: int, warmup: int) -> tuple[dict | None, str]:
    try:
        import nixl_cu12._api  # noqa: F401
    except Exception as exc:
        return None, f"nixl_cu12 not importable: {type(exc).__name__}: {exc}"
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    process = ctx.Process(target=_nixl_initiator, args=(results, iterations, warmup))
    process.start()
    status, payload = results.get(timeout=1800)
    process.join(60)
    if status != "ok":
        return None, f"NIXL run failed: {payload}"
    return payload, "nixl_cu12 READ and WRITE over UCX (its own transports), DRAM"


def perftest(test: str, nbytes: int, iterations: int) -> float | None:
    """``ucx_perftest -t <test>`` ms per ``nbytes`` buffer (from its bandwidth) between two
    processes over UCX's TCP transport (the network path's limit; transfer.py's runner)."""
    result = run_perftest(
        SimpleNamespace(nbytes=nbytes), iterations, 2, test, {"UCX_TLS": "tcp,self"}
    )
    return None if result is None else nbytes / (result["gbps"] * 1e9) * 1e3


def push_layers(agent: Any, writer: Any, lease: Any, remote: tuple, mine: tuple) -> None:
    """One push session writing the blocks a layer at a time (one begin, one landed)."""
    from kvtransfer.transport import PullSpec

    with agent.begin_push(writer, lease, timeout_s=600) as session:
        for name in LAYERS:
            spec = PullSpec(f"ps-{name}", (name,), remote, mine, lease=lease)
            session.write(spec, timeout_s=600).result(600)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--iterations", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--perftest", action="store_true", help="UCX's own put/get limits")
    parser.add_argument("--no-nixl", action="store_true", help="skip NIXL READ/WRITE")
    parser.add_argument("--quick", action="store_true", help="3 iterations, 1 warm-up")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    if args.quick:
        args.iterations, args.warmup = 3, 1
    # Before ucxx is imported here (it writes UCX variables into the environment).
    nixl, nixl_note = (None, "skipped (--no-nixl)")
    if not args.no_nixl:
        nixl, nixl_note = run_nixl(args.iterations, args.warmup)
    from kvtransfer.transport import (
        KVTransferAgent,
        LeaseAccess,
        PullSpec,
        TransportConfig,
    )

    torch.set_num_threads(1)
    ctx = mp.get_context("spawn")
    ready, commands, answers = ctx.Queue(), ctx.Queue(), ctx.Queue()
    peer_process = ctx.Process(target=_peer, args=(ready, commands, answers))
    peer_process.start()
    rows = []
    try:
        address, layouts = ready.get(timeout=600)
        local = _caches(11)
        for path in ("direct", "network"):
            agent = KVTransferAgent(TransportConfig(timeout_s=600, shared_memory=path == "direct"))
            agent.register_kv_caches(local)
            reader = agent.connect(address, layouts=layouts, one_sided=True)
            writer = agent.connect(address, layouts=layouts)
            try:
                for count in CASES:
                    remote, mine = _ids(1 + count, count), _ids(2 + count, count)
                    commands.put(("grant", remote))
                    answers.get(timeout=60)
                    lease = LeaseAccess(READ_LEASE, SECRET, "", 0, remote)
                    push_lease = LeaseAccess(PUSH_LEASE, SECRET, "", 0, remote)
                    pull_spec = PullSpec(f"pull-{count}", LAYERS, remote, mine, lease=lease)
                    push_spec = PullSpec(f"push-{count}", LAYERS, remote, mine, lease=push_lease)
                    iterations = args.iterations * (4 if count <= 16 else 1)
                    pulls = timed(
                        lambda a=agent, r=reader, s=pull_spec: a.pull(r, s).result(600),
                        iterations,
                        args.warmup,
                    )
                    pulled = {name: local[name][list(mine)].clone() for name in LAYERS}
                    # Pushing writes different values than the peer holds: the check tells.
                    for name in LAYERS:
                        local[name][list(mine)] += 1.0
                    pushes = timed(
                        lambda a=agent, w=writer, s=push_spec: a.push(w, s).result(600),
                        iterations,
                        args.warmup,
                    )
                    # Layer by layer, as a streaming consumer pulls and a computing producer
                    # pushes: a pull per layer, or one session's begin, a write per layer, end.
                    layer_pulls = timed(
                        lambda a=agent, r=reader, lease=lease, rm=remote, mi=mine: [
                            a.pull(r, PullSpec(f"pl-{n}", (n,), rm, mi, lease=lease)).result(600)
                            for n in LAYERS
                        ],
                        iterations,
                        args.warmup,
                    )
                    for name in LAYERS:
                        local[name][list(mine)] += 1.0
                    layer_pushes = timed(
                        lambda a=agent, w=writer, lease=push_lease, rm=remote, mi=mine: push_layers(
                            a, w, lease, rm, mi
                        ),
                        iterations,
                        args.warmup,
                    )
                    commands.put(("blocks", remote))
                    theirs = answers.get(timeout=60)
                    for name in LAYERS:
                        if not torch.equal(theirs[name], local[name][list(mine)]):
                            raise SystemExit(f"push {count} blocks: the peer's {name} differs")
                        if torch.equal(pulled[name], local[name][list(mine)]):
                            raise SystemExit("the pushed values were the pulled ones")
                    nbytes = count * BLOCK_BYTES
                    row = {
                        "path": path,
                        "blocks": count,
                        "mib": nbytes / (1 << 20),
                        "pull_p50_ms": statistics.median(pulls) * 1e3,
                        "push_p50_ms": statistics.median(pushes) * 1e3,
                    }
                    row["pull_gbps"] = nbytes / statistics.median(pulls) / 1e9
                    row["push_gbps"] = nbytes / statistics.median(pushes) / 1e9
                    row["push_over_pull"] = row["push_p50_ms"] / row["pull_p50_ms"]
                    row["pull_layers_p50_ms"] = statistics.median(layer_pulls) * 1e3
                    row["push_layers_p50_ms"] = statistics.median(layer_pushes) * 1e3
                    if nixl is not None and path == "direct":
                        row["nixl_read_p50_ms"] = statistics.median(nixl[count]["READ"]) * 1e3
                        row["nixl_write_p50_ms"] = statistics.median(nixl[count]["WRITE"]) * 1e3
                    if args.perftest and path == "network":
                        row["ucx_get_p50_ms"] = perftest("ucp_get", nbytes, iterations)
                        row["ucx_put_p50_ms"] = perftest("ucp_put_bw", nbytes, iterations)
                    rows.append(row)
            finally:
                agent.close()
    finally:
        commands.put(None)
        peer_process.join(120)
    header = ["path", "blocks", "MiB", "pull p50 ms", "push p50 ms", "pull GB/s", "push GB/s"]
    header += ["push/pull", "pull by layer ms", "push by layer ms"]
    header += ["nixl read ms", "nixl write ms", "ucx get ms", "ucx put ms"]
    print(" | ".join(header))
    for row in rows:
        cells = [
            row["path"],
            str(row["blocks"]),
            f"{row['mib']:.0f}",
            f"{row['pull_p50_ms']:.3f}",
            f"{row['push_p50_ms']:.3f}",
            f"{row['pull_gbps']:.2f}",
            f"{row['push_gbps']:.2f}",
            f"{row['push_over_pull']:.2f}",
            f"{row['pull_layers_p50_ms']:.3f}",
            f"{row['push_layers_p50_ms']:.3f}",
        ]
        for key in ("nixl_read_p50_ms", "nixl_write_p50_ms", "ucx_get_p50_ms", "ucx_put_p50_ms"):
            value = row.get(key)
            cells.append("-" if value is None else f"{value:.3f}")
        print(" | ".join(cells))
    print(f"nixl: {nixl_note}; on the direct lines: one host, it picks shared memory itself")
    if args.json is not None:
        meta = {
            "host": platform.node(),
            "cpus": os.cpu_count(),
            "iterations": args.iterations,
            "nixl": nixl_note,
        }
        args.json.write_text(json.dumps({"meta": meta, "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
