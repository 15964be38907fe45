"""A control-plane handshake walkthrough between two processes on 127.0.0.1.

1. start a "prefill engine" process (PP=2 x TP=2) whose scheduler-side connector publishes its
   four workers' handshake metadata and serves it over `KVHandshake`;
2. wait until its health service reports SERVING;
3. fetch every worker's metadata with compatibility checking, timing a cold (new channel) and a
   warm (reused channel) handshake;
4. fetch again pretending to have another block size, to show the typed error;
5. stop the prefill process (closing its stdin) and require a clean exit.

`benchmarks/handshake.py` reuses its pieces; the P/D demo is `kvtransfer demo`.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import queue
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from kvtransfer.clients.control import HandshakeClient, check_health, wait_until_serving
from kvtransfer.connector.base import KVConnectorBase_V1
from kvtransfer.connector.config import KVTransferConfig
from kvtransfer.connector.metadata import (
    KVConnectorHandshakeMetadata,
    KVConnectorRole,
    PpTpRank,
    merge_handshake_metadata,
)
from kvtransfer.control import (
    BasicAdminBackend,
    CompatibilityInfo,
    ControlPlaneError,
    ControlServerThread,
    HandshakeBook,
    HandshakeCompatibilityError,
)

PP_SIZE = 2
TP_SIZE = 2
DEMO_ENGINE_ID = "demo-prefill-0"
DEMO_COMPAT = CompatibilityInfo(
    model="kvtransfer/cli/demo-llama-1b",
    dtype="bfloat16",
    total_num_kv_heads=8,
    head_size=64,
    num_layers=16,
    block_size=16,
    wire_version=1,
)
_NUM_WARM_FETCHES = 10


class DemoWorkerMetadata(KVConnectorHandshakeMetadata):
    """What a demo worker publishes: where its KV lives and which slice of the model it holds."""

    worker_address: str
    layer_start: int
    layer_end: int  # exclusive
    num_kv_heads: int


def worker_metadata(pp_rank: int, tp_rank: int) -> DemoWorkerMetadata:
    layers_per_stage = DEMO_COMPAT.num_layers // PP_SIZE
    return DemoWorkerMetadata(
        worker_address=f"ucx://127.0.0.1/{DEMO_ENGINE_ID}/pp{pp_rank}-tp{tp_rank}",
        layer_start=pp_rank * layers_per_stage,
        layer_end=(pp_rank + 1) * layers_per_stage,
        num_kv_heads=DEMO_COMPAT.total_num_kv_heads // TP_SIZE,
    )


class DemoPrefillConnector(KVConnectorBase_V1):
    """Scheduler half of a PP-aware connector: publishes the workers' metadata to its book."""

    def __init__(self, config: KVTransferConfig, role: KVConnectorRole, book: HandshakeBook):
        super().__init__(config, role)
        self._book = book

    def set_xfer_handshake_metadata_pp_aware(
        self, metadata: Mapping[PpTpRank, KVConnectorHandshakeMetadata]
    ) -> None:
        self._book.publish(metadata)


# ------------------------------------------------------------------ prefill side (child)


def serve(engine_id: str) -> int:
    """Run the prefill side until stdin closes; prints one JSON line once it is serving."""
    book = HandshakeBook(engine_id, DEMO_COMPAT)
    config = KVTransferConfig(
        kv_connector="DemoPrefillConnector", engine_id=engine_id, kv_role="kv_producer"
    )
    connector = DemoPrefillConnector(config, KVConnectorRole.SCHEDULER, book)
    # The engine's start-up path: each worker reports its metadata, the engine merges them and
    # hands the result to the scheduler-side connector.
    per_worker = [
        {(pp, tp): worker_metadata(pp, tp)} for pp in range(PP_SIZE) for tp in range(TP_SIZE)
    ]
    connector.set_xfer_handshake_metadata_pp_aware(merge_handshake_metadata(per_worker))
    admin = BasicAdminBackend(
        role="kv_producer",
        engine_id=engine_id,
        model=DEMO_COMPAT.model,
        tp_size=TP_SIZE,
        pp_size=PP_SIZE,
        num_blocks=1024,
    )
    with ControlServerThread(book=book, admin=admin) as server:
        print(json.dumps({"address": server.address, "generation": book.generation}), flush=True)
        sys.stdin.read()  # EOF: the parent asked us to stop (or died)
    return 0


# ------------------------------------------------------------------ decode side (parent)


@dataclass
class PrefillProcess:
    process: subprocess.Popen[str]
    address: str
    generation: int

    def stop(self, timeout_s: float = 10.0) -> int:
        """Close stdin (the stop signal) and wait; kill if it hangs. Returns the exit code."""
        if self.process.stdin is not None and not self.process.stdin.closed:
            self.process.stdin.close()
        try:
            return self.process.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
            return -9
        finally:
            if self.process.stdout is not None:
                self.process.stdout.close()


def spawn_prefill_server(
    engine_id: str = DEMO_ENGINE_ID, *, timeout_s: float = 30.0
) -> PrefillProcess:
    """Start this module with ``--serve`` in a child process; wait for its address line."""
    process = subprocess.Popen(
        [
            sys.executable,
            __file__,
            "--serve",
            "--engine-id",
            engine_id,
        ],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    stdout = process.stdout
    if stdout is None:  # never with stdout=PIPE; narrows the type
        raise RuntimeError("no stdout pipe to the prefill process")
    # readline() has no timeout; a helper thread keeps a hung child from hanging us.
    lines: queue.Queue[str] = queue.Queue()
    threading.Thread(target=lambda: lines.put(stdout.readline()), daemon=True).start()
    try:
        line = lines.get(timeout=timeout_s)
    except queue.Empty:
        process.kill()
        process.wait()
        stdout.close()
        raise TimeoutError(f"prefill process did not report an address in {timeout_s} s") from None
    if not line:
        code = process.wait()
        stdout.close()
        raise RuntimeError(f"prefill process exited with code {code} before serving")
    ready = json.loads(line)
    return PrefillProcess(process, ready["address"], int(ready["generation"]))


async def _timed_fetch(
    client: HandshakeClient, compat: CompatibilityInfo, engine_id: str
) -> tuple[float, dict[PpTpRank, DemoWorkerMetadata]]:
    start = time.perf_counter()
    fetched = await client.fetch(engine_id, compat, DemoWorkerMetadata)
    return (time.perf_counter() - start) * 1e3, fetched.metadata


def _print_table(metadata: Mapping[PpTpRank, DemoWorkerMetadata]) -> None:
    print(f"  {'pp':>2}  {'tp':>2}  {'layers':<8}  {'kv heads':>8}  {'payload bytes':>13}")
    for (pp, tp), md in sorted(metadata.items()):
        layers = f"{md.layer_start}-{md.layer_end - 1}"
        print(f"  {pp:>2}  {tp:>2}  {layers:<8}  {md.num_kv_heads:>8}  {len(md.encode()):>13}")


async def _run_decode_side(prefill: PrefillProcess, engine_id: str) -> bool:
    await wait_until_serving(prefill.address)
    client = HandshakeClient(prefill.address)
    try:
        cold_ms, metadata = await _timed_fetch(client, DEMO_COMPAT, engine_id)
        warm_ms = statistics.median(
            [
                (await _timed_fetch(client, DEMO_COMPAT, engine_id))[0]
                for _ in range(_NUM_WARM_FETCHES)
            ]
        )
        expected = {
            (pp, tp): worker_metadata(pp, tp) for pp in range(PP_SIZE) for tp in range(TP_SIZE)
        }
        if metadata != expected:
            print("FAIL: fetched metadata differs from what the prefill engine published")
            return False
        short_hash = DEMO_COMPAT.compat_hash()[:12]
        print(f"fetched {len(metadata)} worker payloads (compat hash {short_hash}...):")
        _print_table(metadata)
        print(
            f"handshake latency: cold {cold_ms:.2f} ms (new channel), "
            f"warm {warm_ms:.2f} ms (reused channel, median of {_NUM_WARM_FETCHES})"
        )

        mismatched = CompatibilityInfo(**{**DEMO_COMPAT.model_dump(), "block_size": 32})
        print("fetching again with block_size=32 (must be refused):")
        try:
            await client.fetch(engine_id, mismatched, DemoWorkerMetadata)
        except HandshakeCompatibilityError as exc:
            print(f"  {type(exc).__name__}: {exc}")
        else:
            print("FAIL: an incompatible handshake was accepted")
            return False
    finally:
        await client.close()

    health = await check_health(prefill.address)
    print(f"health (grpc.health.v1): {health}")
    return health == "SERVING"


def run_demo(engine_id: str = DEMO_ENGINE_ID) -> int:
    print(f"starting prefill engine {engine_id!r} (PP={PP_SIZE} x TP={TP_SIZE}) in a new process")
    prefill = spawn_prefill_server(engine_id)
    print(f"prefill engine serving on {prefill.address}, generation {prefill.generation:#x}")
    try:
        ok = asyncio.run(_run_decode_side(prefill, engine_id))
    finally:
        exit_code = prefill.stop()
    print(f"prefill engine process stopped (exit code {exit_code})")
    ok = ok and exit_code == 0
    print("demo OK" if ok else "demo FAILED")
    return 0 if ok else 1


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python scripts/handshake_demo.py", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--engine-id", default=DEMO_ENGINE_ID)
    parser.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.serve:
        return serve(args.engine_id)
    try:
        return run_demo(args.engine_id)
    except (ControlPlaneError, OSError, RuntimeError, TimeoutError) as exc:
        print(f"demo FAILED: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
