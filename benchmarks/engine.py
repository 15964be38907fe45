"""Engine throughput: prefill and decode tokens/s per preset at TP=1, and what an active no-op
KV connector costs compared with none (the null object).

    .venv/bin/python benchmarks/engine.py [--presets tiny small] [--json out.json]

Prefill: the first step of a batch, which computes every prompt (prompt tokens / time). Decode:
the remaining steps (decoded tokens / time). The no-op connector is `KVConnectorBase_V1` itself,
so every hook runs and does nothing. Run it on an otherwise idle machine.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

from plots import write_png

from kvtransfer.connector.config import KVTransferConfig
from kvtransfer.engine.config import EngineConfig
from kvtransfer.engine.llm import LLM
from kvtransfer.engine.sampling_params import SamplingParams

NOOP_CONNECTOR = KVTransferConfig(
    kv_connector="KVConnectorBase_V1",
    kv_connector_module_path="kvtransfer.connector.base",
    kv_role="kv_both",
)


def prompts(batch: int, length: int) -> list[list[int]]:
    return [[(17 * r + 31 * i) % 250 + 1 for i in range(length)] for r in range(batch)]


def timed_run(llm: LLM, batch: list[list[int]], decode_tokens: int) -> tuple[float, float]:
    """(prefill seconds, decode seconds) of one batch: the first step prefills every prompt
    (the token budget fits them all), the remaining steps decode."""
    engine = llm.engine
    params = SamplingParams(max_tokens=decode_tokens + 1, ignore_eos=True)
    for i, prompt in enumerate(batch):
        engine.add_request(f"bench-{time.monotonic_ns()}-{i}", prompt, params)
    start = time.perf_counter()
    engine.step()
    prefill_s = time.perf_counter() - start
    start = time.perf_counter()
    while engine.has_unfinished_requests():
        engine.step()
    decode_s = time.perf_counter() - start
    engine.drain()
    return prefill_s, decode_s


def run(preset: str, connector: bool, args: argparse.Namespace) -> dict:
    config = EngineConfig(
        model=f"builtin:{preset}",
        max_num_batched_tokens=args.batch * args.prompt_len,
        max_num_seqs=args.batch,
        enable_prefix_caching=False,
        kv_transfer_config=NOOP_CONNECTOR if connector else None,
    )
    batch = prompts(args.batch, args.prompt_len)
    with LLM(config) as llm:
        timed_run(llm, batch[:2], 2)  # warm-up
        runs = [timed_run(llm, batch, args.decode_tokens) for _ in range(args.repeats)]
    prefill_s = statistics.median(r[0] for r in runs)
    decode_s = statistics.median(r[1] for r in runs)
    return {
        "preset": preset,
        "connector": "no-op (active)" if connector else "none (null object)",
        "prefill_tokens_per_s": args.batch * args.prompt_len / prefill_s,
        "decode_tokens_per_s": args.batch * args.decode_tokens / decode_s,
        "prefill_s": prefill_s,
        "decode_s": decode_s,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--presets", nargs="+", default=["tiny", "small"])
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--decode-tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", type=Path, default=None, help="also write the rows here")
    args = parser.parse_args(argv)

    rows = [run(p, connector, args) for p in args.presets for connector in (False, True)]
    print(
        f"TP=1, batch {args.batch} x {args.prompt_len} prompt tokens, "
        f"{args.decode_tokens} decode tokens each, median of {args.repeats}"
    )
    print(f"{'preset':<8} {'connector':<20} {'prefill tok/s':>14} {'decode tok/s':>13}")
    for row in rows:
        print(
            f"{row['preset']:<8} {row['connector']:<20} {row['prefill_tokens_per_s']:>14.0f} "
            f"{row['decode_tokens_per_s']:>13.1f}"
        )
    for preset in args.presets:
        none, noop = (r for r in rows if r["preset"] == preset)
        total = none["prefill_s"] + none["decode_s"]
        overhead = (noop["prefill_s"] + noop["decode_s"] - total) / total * 100
        print(f"{preset}: active no-op connector vs none: {overhead:+.1f}% wall time")
    if args.json is not None:
        args.json.write_text(
            json.dumps({"config": vars(args) | {"json": str(args.json)}, "rows": rows}, indent=2)
        )
        write_png("engine", args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
