"""P/D profile: what ``kvtransfer plan`` needs, measured on a real prefill and decode daemon.

    .venv/bin/python benchmarks/pd_profile.py [--quick] [--out profile.json]
        [--lengths 128 512 1024 1536] [--batches 1 2 4 8] [--preset small] [--no-pin]

Writes the ``builtin:<preset>`` model with ``init_model_dir`` and starts a prefill and a decode
daemon on it (UcxConnector, as ``kvtransfer-prefill`` / ``kvtransfer-decode`` default to), on
127.0.0.1 with OS-picked ports, one OpenMP thread each and, unless ``--no-pin`` or with fewer
than 2 CPUs, pinned with ``taskset`` to core 0 (prefill) and core 1 (decode): an instance in
the profile is one core. The benchmark talks gRPC to both daemons itself, as the router does
(prefill with ``do_remote_decode``, then decode with the params and first token it returned):

1. Prefill: for each prompt length, ``--reps`` fresh random prompts (printable byte ids: no
   prefix-cache hit) one at a time, after one warm-up (which also pays the UCX handshake).
   ``prefill_ms`` is the prefill daemon's own ``ttft_s`` (admission to first token: how long
   the instance is busy with the prompt); ``client_ttft_ms`` is the same request as this
   client saw it. Each prompt is then decoded for 2 tokens, so the decode pulls its KV:
   ``kv_transfer_ms`` is the decode's ``kv_transfer_s`` (its wait for the remote KV; nothing
   else runs, so the whole transfer). Medians per length.
2. Decode: for each batch size N, N prompts of ``--decode-prompt-tokens`` are prefilled one
   after another, then N decode streams start together (a barrier) with ``ignore_eos`` and
   ``--decode-tokens`` tokens each. Only the gaps after every stream's first token and before
   any stream's last one count (then all N are in the batch, none is loading KV); a message
   of k tokens counts its gap / k. ``itl_ms`` is the median over ``--batch-reps`` rounds.

The profile (``--out``, JSON; `kvtransfer.planning.parse_profile` reads it):

- ``schema``: ``"kvtransfer.pd_profile/1"``; ``created`` (UTC, ISO 8601); ``model``
  (``builtin:<preset>``); ``machine``: hostname, cpus, cpu_model, python, torch, pinned,
  load_average_start / _end (1, 5, 15 min);
- ``engine``: the daemons' ``max_num_seqs``, ``max_num_batched_tokens``, ``block_size``
  (EngineConfig's defaults: the daemons have no flags for the first two);
- ``settings``: this run's repetitions, decode prompt and token counts, quick;
- ``prefill``: list of {``prompt_tokens``, ``prefill_ms``, ``tokens_per_s`` (= tokens /
  prefill_ms), ``client_ttft_ms``, ``kv_transfer_ms``, ``samples``};
- ``decode``: list of {``batch_size``, ``itl_ms`` (median), ``itl_p90_ms``, ``gaps``};
- ``kv_transfer_ms_per_token``: sum of kv_transfer_ms over sum of prompt_tokens (the long
  prompts weigh most, where the per-request fixed cost matters least);
  ``kv_transfer_source``: how it was obtained;
- ``overhead_ms``: median of client_ttft_ms - prefill_ms: gRPC and the client's hop, which add
  to the TTFT but do not occupy the instance (the router adds its own ~2-3 ms on top,
  ``pd_latency.py``'s breakdown).

``--quick``: 3 lengths, 3 repetitions, 16 decode tokens, one round per batch (about a minute
on 2 busy cores). Every process is stopped at the end, also on an error; logs are kept on
failure.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import itertools
import json
import math
import os
import platform
import random
import shutil
import statistics
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from kvtransfer.clients.generation import GenerationClient, generate_request
from kvtransfer.engine.config import EngineConfig
from kvtransfer.engine.model.builtin import init_model_dir
from kvtransfer.planning import PROFILE_SCHEMA
from kvtransfer.serve.launcher import ServiceProcess, ServiceStartError, daemon_command

LENGTHS = (128, 512, 1024, 1536)
QUICK_LENGTHS = (128, 512, 1024)
BATCHES = (1, 2, 4, 8)
BLOCK_SIZE = 16
PRINTABLE_IDS = range(32, 127)
REQUEST_TIMEOUT_S = 300.0
STOP_TIMEOUT_S = 30.0


class BenchError(RuntimeError):
    """A request failed: the setup is broken (the message says how)."""


@dataclasses.dataclass
class Prefilled:
    """A prompt the prefill computed and holds for the decode."""

    request_id: str
    prompt: list[int]
    params: dict[str, Any]
    first_tokens: list[int]
    daemon_ttft_s: float
    client_ttft_s: float


# ------------------------------------------------------------------ processes


def start_daemons(
    model: Path, log_dir: Path, pin: bool, num_kv_blocks: int
) -> tuple[ServiceProcess, ServiceProcess]:
    started: list[ServiceProcess] = []
    try:
        for core, role in enumerate(("prefill", "decode")):
            prefix = ["taskset", "-c", str(core)] if pin else []
            kv = {"kv_ip": "127.0.0.1", "kv_port": 0}
            argv = prefix + daemon_command(
                role,
                *("--model", str(model), "--host", "127.0.0.1", "--port", "0"),
                *("--block-size", str(BLOCK_SIZE), "--num-kv-blocks", str(num_kv_blocks)),
                *("--engine-id", f"profile-{role}", "--kv-transfer-config", json.dumps(kv)),
            )
            # One thread per engine: with pinning, more would only contend for the one core.
            env = {"OMP_NUM_THREADS": "1"}
            started.append(ServiceProcess.start(role, argv, log_dir / f"{role}.log", env=env))
    except BaseException:
        for process in started:
            process.terminate(STOP_TIMEOUT_S)
        raise
    return started[0], started[1]


# ------------------------------------------------------------------ requests


def random_prompt(rng: random.Random, length: int) -> list[int]:
    return [rng.choice(PRINTABLE_IDS) for _ in range(length)]


def prefill(client: GenerationClient, prompt: list[int]) -> Prefilled:
    rid = f"profile-{uuid.uuid4().hex}"
    request = generate_request(rid, prompt, 1, kv_transfer_params={"do_remote_decode": True})
    first: list[int] = []
    params: dict[str, Any] | None = None
    client_ttft = daemon_ttft = 0.0
    start = time.perf_counter()
    for message in client.stream(request, timeout_s=REQUEST_TIMEOUT_S):
        if message.token_ids and not first:
            client_ttft = time.perf_counter() - start
        first.extend(message.token_ids)
        if message.kv_transfer_params_json:
            params = json.loads(message.kv_transfer_params_json)
        if message.finished:
            if message.finish_reason == "error":
                raise BenchError(f"prefill of {len(prompt)} tokens failed: {message.error}")
            daemon_ttft = message.metrics.ttft_s
    if params is None or not first:
        raise BenchError("the prefill returned no kv_transfer_params or no token")
    return Prefilled(rid, prompt, params, first, daemon_ttft, client_ttft)


def decode_request(done: Prefilled, max_tokens: int, ignore_eos: bool) -> Any:
    request = generate_request(
        done.request_id, done.prompt, max_tokens, ignore_eos=ignore_eos,
        kv_transfer_params=done.params,
    )  # fmt: skip
    # As the router does: the decode continues after the prefill's token, computing no prompt.
    request.generated_token_ids.extend(done.first_tokens)
    return request


def pull(client: GenerationClient, done: Prefilled) -> float:
    """Decode 2 tokens after ``done``; the decode's wait for its KV, in seconds."""
    for message in client.stream(decode_request(done, 2, True), timeout_s=REQUEST_TIMEOUT_S):
        if message.finished:
            if message.finish_reason == "error":
                raise BenchError(f"decode after a prefill failed: {message.error}")
            return message.metrics.kv_transfer_s
    raise BenchError("the decode stream ended without a final message")


def stream_arrivals(client: GenerationClient, request: Any, barrier: threading.Barrier):
    """(arrival time, tokens in the message) for each message with tokens."""
    arrivals: list[tuple[float, int]] = []
    barrier.wait()
    for message in client.stream(request, timeout_s=REQUEST_TIMEOUT_S):
        if message.token_ids:
            arrivals.append((time.perf_counter(), len(message.token_ids)))
        if message.finished and message.finish_reason == "error":
            raise BenchError(f"decode in a batch failed: {message.error}")
    return arrivals


def full_batch_gaps(streams: Sequence[Sequence[tuple[float, int]]]) -> list[float]:
    """Per-token gaps while every stream had its first token and none had its last."""
    if any(len(arrivals) < 2 for arrivals in streams):
        raise BenchError("a decode stream gave fewer than two messages")
    start = max(arrivals[0][0] for arrivals in streams)
    end = min(arrivals[-1][0] for arrivals in streams)
    # (gap start, gap end, gap per token) after each stream's first token.
    gaps = [
        (prev, t, (t - prev) / n)
        for arrivals in streams
        for (prev, _), (t, n) in itertools.pairwise(arrivals)
    ]
    full = [gap for prev, t, gap in gaps if prev >= start and t <= end]
    # Streams that barely overlapped (a slow start): every gap after each first token.
    return full or [gap for _, _, gap in gaps]


# ------------------------------------------------------------------ the phases


def profile_prefill(
    prefill_client: GenerationClient,
    decode_client: GenerationClient,
    lengths: Sequence[int],
    reps: int,
    rng: random.Random,
) -> list[dict[str, Any]]:
    rows = []
    for length in lengths:
        print(f"prefill: {length}-token prompts ...", file=sys.stderr, flush=True)
        pull(decode_client, prefill(prefill_client, random_prompt(rng, length)))  # warm-up
        samples = []
        for _ in range(reps):
            done = prefill(prefill_client, random_prompt(rng, length))
            samples.append((done.daemon_ttft_s, done.client_ttft_s, pull(decode_client, done)))
        daemon_s, client_s, transfer_s = (
            statistics.median(column) for column in zip(*samples, strict=True)
        )
        rows.append(
            {
                "prompt_tokens": length,
                "prefill_ms": daemon_s * 1e3,
                "tokens_per_s": length / daemon_s,
                "client_ttft_ms": client_s * 1e3,
                "kv_transfer_ms": transfer_s * 1e3,
                "samples": reps,
            }
        )
    return rows


def profile_decode(
    prefill_client: GenerationClient,
    decode_client: GenerationClient,
    batches: Sequence[int],
    rounds: int,
    prompt_tokens: int,
    tokens: int,
    rng: random.Random,
) -> list[dict[str, Any]]:
    rows = []
    with ThreadPoolExecutor(max(batches)) as pool:
        for n in batches:
            print(f"decode: batch size {n} ...", file=sys.stderr, flush=True)
            gaps: list[float] = []
            for _ in range(rounds):
                done = [
                    prefill(prefill_client, random_prompt(rng, prompt_tokens)) for _ in range(n)
                ]
                barrier = threading.Barrier(n)
                requests = [decode_request(d, tokens, True) for d in done]
                # One channel for all streams: gRPC multiplexes them, as the router's does.
                futures = [
                    pool.submit(stream_arrivals, decode_client, r, barrier) for r in requests
                ]
                gaps += full_batch_gaps([f.result() for f in futures])
            ordered = sorted(gaps)
            rows.append(
                {
                    "batch_size": n,
                    "itl_ms": statistics.median(gaps) * 1e3,
                    "itl_p90_ms": ordered[min(len(ordered) - 1, int(0.9 * len(ordered)))] * 1e3,
                    "gaps": len(gaps),
                }
            )
    return rows


# ------------------------------------------------------------------ the profile


def machine(pin: bool) -> dict[str, Any]:
    import torch

    cpu_model = ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu_model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {
        "hostname": platform.node(),
        "cpus": os.cpu_count(),
        "cpu_model": cpu_model,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "pinned": pin,
        "load_average_start": list(os.getloadavg()),
    }


def print_table(profile: dict[str, Any]) -> None:
    m = profile["machine"]
    print(
        f"{profile['model']} on {m['hostname']} ({m['cpus']} CPUs, "
        f"{'pinned to one core each' if m['pinned'] else 'unpinned'}), {profile['created']}"
    )
    print(f"{'prompt_tokens':>13} {'prefill_ms':>10} {'tokens_per_s':>12} "
          f"{'client_ttft_ms':>14} {'kv_transfer_ms':>14}")  # fmt: skip
    for row in profile["prefill"]:
        print(
            f"{row['prompt_tokens']:>13} {row['prefill_ms']:>10.1f} {row['tokens_per_s']:>12.0f} "
            f"{row['client_ttft_ms']:>14.1f} {row['kv_transfer_ms']:>14.2f}"
        )
    print(f"{'batch_size':>13} {'itl_ms':>10} {'itl_p90_ms':>12} {'gaps':>14}")
    for row in profile["decode"]:
        print(
            f"{row['batch_size']:>13} {row['itl_ms']:>10.2f} {row['itl_p90_ms']:>12.2f} "
            f"{row['gaps']:>14}"
        )
    print(
        f"kv transfer {profile['kv_transfer_ms_per_token'] * 1e3:.2f} us per prompt token; "
        f"client overhead {profile['overhead_ms']:.2f} ms; load average "
        f"{', '.join(f'{x:.2f}' for x in m['load_average_end'])}"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer lengths and repetitions")
    parser.add_argument("--out", type=Path, default=None, help="write the profile JSON here")
    parser.add_argument("--preset", default="small", help="built-in model preset")
    parser.add_argument("--lengths", nargs="+", type=int, default=None)
    parser.add_argument("--batches", nargs="+", type=int, default=list(BATCHES))
    parser.add_argument("--reps", type=int, default=None, help="prompts per length (5; quick 3)")
    parser.add_argument("--batch-reps", type=int, default=None, help="rounds per batch (3; 1)")
    parser.add_argument("--decode-prompt-tokens", type=int, default=128)
    parser.add_argument("--decode-tokens", type=int, default=None, help="per stream (32; 16)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no-pin", action="store_true", help="no taskset")
    args = parser.parse_args(argv)
    lengths = args.lengths or list(QUICK_LENGTHS if args.quick else LENGTHS)
    reps = args.reps or (3 if args.quick else 5)
    rounds = args.batch_reps or (1 if args.quick else 3)
    tokens = args.decode_tokens or (16 if args.quick else 32)
    if min(lengths) < 1 or min(args.batches) < 1 or tokens < 3 or min(reps, rounds) < 1:
        parser.error("lengths, batches and repetitions must be >= 1, --decode-tokens >= 3")
    pin = not args.no_pin and (os.cpu_count() or 1) >= 2 and shutil.which("taskset") is not None
    # Room for the longest prompt twice over (warm-up and sample overlap briefly on the
    # prefill) and for the largest batch's prompts with their tokens, with slack.
    blocks_per = math.ceil((args.decode_prompt_tokens + tokens + 1) / BLOCK_SIZE)
    longest = math.ceil((max(lengths) + 2) / BLOCK_SIZE)
    num_kv_blocks = 2 * max(max(args.batches) * blocks_per, 2 * longest) + 16
    engine_defaults = {f.name: f.default for f in dataclasses.fields(EngineConfig)}
    rng = random.Random(args.seed)
    work = Path(tempfile.mkdtemp(prefix="kvtransfer-pd-profile-"))
    info = machine(pin)
    try:
        model = init_model_dir(work / "model", args.preset)
        print("starting the prefill and decode daemons ...", file=sys.stderr, flush=True)
        daemons = start_daemons(model, work, pin, num_kv_blocks)
        try:
            with (
                GenerationClient(daemons[0].address) as pc,
                GenerationClient(daemons[1].address) as dc,
            ):
                prefill_rows = profile_prefill(pc, dc, lengths, reps, rng)
                decode_rows = profile_decode(
                    pc, dc, args.batches, rounds, args.decode_prompt_tokens, tokens, rng
                )
        finally:
            for process in reversed(daemons):
                process.terminate(STOP_TIMEOUT_S)
    except KeyboardInterrupt:
        print(f"interrupted; logs kept in {work}", file=sys.stderr)
        return 130
    except (BenchError, ServiceStartError, OSError) as exc:
        print(f"failed: {exc}\nlogs kept in {work}", file=sys.stderr)
        return 1
    shutil.rmtree(work, ignore_errors=True)
    info["load_average_end"] = list(os.getloadavg())
    transfer_ms = sum(r["kv_transfer_ms"] for r in prefill_rows)
    profile = {
        "schema": PROFILE_SCHEMA,
        "created": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "model": f"builtin:{args.preset}",
        "machine": info,
        "engine": {
            key: engine_defaults[key]
            for key in ("max_num_seqs", "max_num_batched_tokens", "block_size")
        },
        "settings": {
            "repetitions": reps,
            "batch_rounds": rounds,
            "decode_prompt_tokens": args.decode_prompt_tokens,
            "decode_tokens": tokens,
            "quick": args.quick,
        },
        "prefill": prefill_rows,
        "decode": decode_rows,
        "kv_transfer_ms_per_token": transfer_ms / sum(r["prompt_tokens"] for r in prefill_rows),
        "kv_transfer_source": "measured: the decode daemon's kv_transfer_s after each prefill",
        "overhead_ms": statistics.median(
            max(0.0, r["client_ttft_ms"] - r["prefill_ms"]) for r in prefill_rows
        ),
    }
    print_table(profile)
    if args.out is not None:
        args.out.write_text(json.dumps(profile, indent=2) + "\n")
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
