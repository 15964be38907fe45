"""Handshake latency: fetch every worker of a PP=2 x TP=2 prefill engine in another process.

cold: a new channel per fetch (connect + first RPC), what a decode engine pays per new peer;
warm: the cached client of `get_handshake_client`, what every later fetch costs.

    python benchmarks/handshake.py [--iterations 200] [--json results.json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import platform
import statistics
import sys
import time
from pathlib import Path

from plots import write_png

from kvtransfer.clients.control import (
    HandshakeClient,
    close_all,
    get_handshake_client,
    wait_until_serving,
)

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
from handshake_demo import (
    DEMO_COMPAT,
    DEMO_ENGINE_ID,
    PP_SIZE,
    TP_SIZE,
    DemoWorkerMetadata,
    spawn_prefill_server,
)


async def _fetch_ms(client: HandshakeClient) -> float:
    start = time.perf_counter()
    fetched = await client.fetch(DEMO_ENGINE_ID, DEMO_COMPAT, DemoWorkerMetadata)
    elapsed_ms = (time.perf_counter() - start) * 1e3
    if len(fetched.metadata) != PP_SIZE * TP_SIZE:
        raise RuntimeError(f"expected {PP_SIZE * TP_SIZE} payloads, got {len(fetched.metadata)}")
    return elapsed_ms


async def _measure(address: str, iterations: int, warmup: int) -> dict[str, list[float]]:
    await wait_until_serving(address)
    cold = []
    for _ in range(iterations):
        client = HandshakeClient(address)
        try:
            cold.append(await _fetch_ms(client))
        finally:
            await client.close()
    warm_client = get_handshake_client(address)
    for _ in range(warmup):
        await _fetch_ms(warm_client)
    warm = [await _fetch_ms(warm_client) for _ in range(iterations)]
    await close_all()
    return {"cold": cold, "warm": warm}


def _percentile(samples: list[float], q: int) -> float:
    return statistics.quantiles(samples, n=100, method="inclusive")[q - 1]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iterations", type=int, default=200)
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--json", type=Path, help="also write the results here")
    args = parser.parse_args(argv)
    if args.iterations < 2:
        parser.error("--iterations must be >= 2 (percentiles need two samples)")

    prefill = spawn_prefill_server(DEMO_ENGINE_ID)
    try:
        samples = asyncio.run(_measure(prefill.address, args.iterations, args.warmup))
    finally:
        prefill.stop()

    rows = {
        mode: {
            "p50_ms": _percentile(values, 50),
            "p99_ms": _percentile(values, 99),
            "mean_ms": statistics.fmean(values),
            "n": len(values),
        }
        for mode, values in samples.items()
    }
    print(f"handshake of {PP_SIZE}x{TP_SIZE} workers over {prefill.address}")
    print(f"{'mode':<6}{'p50 ms':>10}{'p99 ms':>10}{'mean ms':>10}{'n':>6}")
    for mode, row in rows.items():
        print(
            f"{mode:<6}{row['p50_ms']:>10.3f}{row['p99_ms']:>10.3f}{row['mean_ms']:>10.3f}{row['n']:>6}"
        )
    if args.json is not None:
        result = {
            "benchmark": "handshake",
            "pp_size": PP_SIZE,
            "tp_size": TP_SIZE,
            "python": platform.python_version(),
            "machine": platform.machine(),
            "results": rows,
        }
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=2) + "\n")
        print(f"wrote {args.json}")
        write_png("handshake", args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
