"""Load through the router with a standard OpenAI load generator (aiperf), chat and completions.

    .venv/bin/python benchmarks/load.py [--aiperf PATH] [--quick] [--json out.json]

Starts, as real processes on 127.0.0.1 (ports picked by the OS), a prefill and a decode daemon
(UcxConnector) on a checkpoint written by ``kvtransfer model init`` and the router in front of
them; then runs ``aiperf profile`` once per endpoint type (``completions`` and ``chat``,
streaming, synthetic prompts of ``--input-tokens`` tokens, ``--output-tokens`` tokens out with
``ignore_eos``) at ``--concurrency``, with the checkpoint's directory as aiperf's tokenizer, and
prints aiperf's summary: requests/s, TTFT and inter-token latency percentiles, and its error
count. aiperf lives in its own virtual environment (about 1.2 GB; ``scripts/dev.sh aiperf``
makes ``.aiperf-venv``); it is not a dependency of kvtransfer. Do not set ``HF_HUB_OFFLINE``:
aiperf's offline path refuses a local tokenizer directory (it loads with no network as is).

The daemons' KV blocks must all be free when they stop (checked: a leak fails the run).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from kvtransfer.engine.model.builtin import init_model_dir
from kvtransfer.serve.launcher import ServiceProcess, daemon_command, router_command

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_AIPERF = ROOT / ".aiperf-venv" / "bin" / "aiperf"
MODEL_NAME = "tiny-chat"
ENDPOINTS = ("completions", "chat")
# aiperf's summary keys, and how the table names them.
METRICS = {
    "request_throughput": "req/s",
    "time_to_first_token": "TTFT ms",
    "inter_token_latency": "ITL ms",
    "request_latency": "latency ms",
}


def main() -> int:
    args = _parse()
    if not Path(args.aiperf).is_file():
        sys.exit(f"aiperf not found at {args.aiperf}: run `scripts/dev.sh aiperf` or pass --aiperf")
    work = Path(tempfile.mkdtemp(prefix="kvtransfer-load-"))
    model = init_model_dir(work / "model", "tiny")
    results = {}
    with _Cluster(work, model) as url:
        for endpoint in ENDPOINTS:
            results[endpoint] = run_aiperf(args, url, model, endpoint, work / endpoint)
    _print_table(results, args)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2) + "\n")
    errors = sum(r["errors"] for r in results.values())
    return 1 if errors else 0


def run_aiperf(
    args: argparse.Namespace, url: str, model: Path, endpoint: str, out: Path
) -> dict[str, Any]:
    """One aiperf run; its summary (percentiles per metric) and its error count."""
    command = [
        str(args.aiperf),
        "profile",
        "--model",
        MODEL_NAME,
        "--url",
        url,
        "--endpoint-type",
        endpoint,
        "--streaming",
        "--tokenizer",
        str(model),
        "--concurrency",
        str(args.concurrency),
        "--request-count",
        str(args.requests),
        "--synthetic-input-tokens-mean",
        str(args.input_tokens),
        "--synthetic-input-tokens-stddev",
        "0",
        "--output-tokens-mean",
        str(args.output_tokens),
        "--output-tokens-stddev",
        "0",
        "--extra-inputs",
        "ignore_eos:true",
        "--output-artifact-dir",
        str(out),
        "--no-auto-plot",
        "--ui-type",
        "none",
    ]
    env = {k: v for k, v in os.environ.items() if k != "HF_HUB_OFFLINE"}
    done = subprocess.run(command, capture_output=True, text=True, env=env, timeout=900)
    if done.returncode != 0:
        tail = "\n".join((done.stdout + done.stderr).splitlines()[-40:])
        raise RuntimeError(f"aiperf ({endpoint}) exited {done.returncode}:\n{tail}")
    summary = json.loads(next(out.rglob("profile_export_aiperf.json")).read_text())
    return _summarise(summary)


def _summarise(summary: dict[str, Any]) -> dict[str, Any]:
    result: dict[str, Any] = {}
    for key in METRICS:
        metric = summary.get(key) or {}
        result[key] = {p: metric.get(p) for p in ("avg", "p50", "p90", "p99") if p in metric}
    count = (summary.get("request_count") or {}).get("avg")
    result["requests"] = int(count) if count is not None else None
    errors = summary.get("error_request_count") or {}
    result["errors"] = int(errors.get("avg", 0) or 0)
    result["error_summary"] = summary.get("error_summary") or []
    return result


class _Cluster:
    """The daemons and the router, stopped (and checked for leaked blocks) on exit."""

    def __init__(self, work: Path, model: Path) -> None:
        self._work, self._model = work, model
        self._processes: list[ServiceProcess] = []

    def __enter__(self) -> str:
        common = ("--port", "0", "--model", str(self._model), "--num-kv-blocks", "512")
        for role in ("prefill", "decode"):
            argv = daemon_command(role, *common, "--engine-id", role[0])
            self._processes.append(ServiceProcess.start(role, argv, self._work / f"{role}.log"))
        prefill, decode = self._processes
        flags = ("--port", "0", "--model-name", MODEL_NAME)
        flags += ("--prefill", prefill.address, "--decode", decode.address)
        router = ServiceProcess.start("router", router_command(*flags), self._work / "router.log")
        self._processes.append(router)
        return router.address

    def __exit__(self, *exc: object) -> None:
        leaks = []
        for process in reversed(self._processes):
            process.terminate()
            if process.name != "router" and process.blocks_in_use_at_exit() != 0:
                leaks.append(f"{process.name}: {process.blocks_in_use_at_exit()} blocks")
        if leaks and exc[0] is None:
            raise RuntimeError(f"KV blocks still in use at exit: {', '.join(leaks)}")


def _print_table(results: dict[str, dict[str, Any]], args: argparse.Namespace) -> None:
    print(
        f"aiperf against the router (1 prefill + 1 decode, builtin tiny checkpoint), "
        f"concurrency {args.concurrency}, {args.requests} requests, "
        f"{args.input_tokens} tokens in, {args.output_tokens} out, streaming"
    )
    header = ["endpoint", "requests", "errors", "req/s"]
    for name in ("TTFT ms", "ITL ms", "latency ms"):
        header += [f"{name} p50", f"{name} p99"]
    print("| " + " | ".join(header) + " |")
    print("|" + " --- |" * len(header))
    for endpoint, result in results.items():
        row = [endpoint, str(result["requests"]), str(result["errors"])]
        row.append(_fmt(result["request_throughput"].get("avg")))
        for key in ("time_to_first_token", "inter_token_latency", "request_latency"):
            row += [_fmt(result[key].get("p50")), _fmt(result[key].get("p99"))]
        print("| " + " | ".join(row) + " |")


def _fmt(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def _parse() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--aiperf", default=str(DEFAULT_AIPERF), help="the aiperf executable")
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--requests", type=int, default=60)
    parser.add_argument("--input-tokens", type=int, default=128)
    parser.add_argument("--output-tokens", type=int, default=16)
    parser.add_argument("--quick", action="store_true", help="12 requests at concurrency 2")
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args()
    if args.quick:
        args.requests, args.concurrency = 12, 2
    return args


if __name__ == "__main__":
    raise SystemExit(main())
