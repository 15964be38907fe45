"""The vLLM TP pairings in a loop, servers started afresh each run, stalls caught in the act.

    python vllm_stage/soak_pd.py --model DIR --pairing 1-2 --runs 20 [--logs DIR]
        [--data-plane rma|tagged] [--connector ucx|nixl] [--cold] [--keep-going] [--json FILE]

Issue 34: the pinned TP 1 prefill -> TP 2 decode pairing (the prefill on core 0, the decode's
ranks on cores 0 and 1) killed the decode's engine in one run of three, three times over, each
"fixed" from a handful of runs. This script says how often, with numbers:

1. the single-vLLM references (a TP 1 and a TP 2 server, no connector, placed as the pairing
   places its engines) are computed once;
2. each run starts the pairing's prefill and decode afresh (`check_pd.tp_servers`; ours, or
   vLLM's NixlConnector with ``--connector nixl``), warms each up with one plain request
   (``--cold``: not, so the first P/D request meets vLLM's first-forward compile, see
   `check_pd.WARM_UP`), P/Ds every TP prompt, holds the tokens against the references and
   waits for the producer's KV to be given back (`check_pd.check_tp_pairing`), then stops
   both;
3. a `StallCatcher` watches both servers' logs: at vLLM's first "No available shared memory
   broadcast block" it dumps every process's stacks (py-spy, Python and native) and every
   thread's CPU share and affinity into ``LOGS/run-N/dumps``; a `ThreadSampler` records the
   most CPU any of kvtransfer's threads (``kvtx-*``) took in each run;
4. a table per run (start-up, P/D, total seconds, pass / stall / FAIL, stall lines, engine
   deaths, our threads' peak CPU) and a JSON file with the same.

"pass": every check held, no stall; "stall": every check held and no engine died, but vLLM
reported a step stalled (the dumps say where); "FAIL": a check failed or an engine died.
Exits 1 unless every run passed.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import check_pd
from check_pd import (
    START_TIMEOUT_S,
    TP_PROMPTS,
    TP_TOKENS,
    StageFailure,
    check_tp_pairing,
    single_servers,
    tokens,
    tp_servers,
    warm_up,
)
from stall_catcher import StallCatcher, ThreadSampler


def references(model: str, logs: Path) -> dict[str, dict[int, list[int]]]:
    """prompt -> TP size -> a single vLLM's greedy tokens, each server started once."""
    found: dict[str, dict[int, list[int]]] = {prompt: {} for prompt in TP_PROMPTS}
    logs.mkdir(parents=True, exist_ok=True)
    for tp, server in single_servers(model, logs).items():
        try:
            server.wait_healthy(time.monotonic() + START_TIMEOUT_S)
            for prompt in TP_PROMPTS:
                status, answer = server.complete(prompt, TP_TOKENS)
                if status != 200:
                    raise StageFailure(f"the TP {tp} reference answered {status}: {answer}")
                found[prompt][tp] = tokens(answer)
        finally:
            server.stop()
    return found


def one_run(
    model: str,
    logs: Path,
    pairing: tuple[int, int],
    expected: dict[str, dict[int, list[int]]],
    connector: str,
    cold: bool,
) -> dict:
    producer_tp, consumer_tp = pairing
    logs.mkdir(parents=True, exist_ok=True)
    began = time.monotonic()
    p, d = tp_servers(model, logs, producer_tp, consumer_tp, connector=connector)
    groups = [p.process.pid, d.process.pid]
    catcher = StallCatcher([p.log, d.log], groups, logs / "dumps")
    sampler = ThreadSampler({p.process.pid: p.name, d.process.pid: d.name}, logs / "dumps-spin")
    row: dict = {"passed": False, "error": None}
    try:
        deadline = time.monotonic() + START_TIMEOUT_S
        p.wait_healthy(deadline)
        d.wait_healthy(deadline)
        if not cold:
            warm_up(p, d)
        row["start_s"] = round(time.monotonic() - began, 1)
        pd_began = time.monotonic()
        check_tp_pairing(p, d, producer_tp, consumer_tp, expected)
        row["pd_s"] = round(time.monotonic() - pd_began, 1)
        row["passed"] = True
    except StageFailure as failure:
        row["error"] = str(failure)
    except Exception as exc:  # a server that stops answering (timeouts) fails that run only
        row["error"] = f"{type(exc).__name__}: {exc}"
    finally:
        sampler.stop()
        catcher.stop()
        d.stop()
        p.stop()
    row["total_s"] = round(time.monotonic() - began, 1)
    row["stall_lines"] = catcher.stall_lines
    row["engine_deaths"] = catcher.deaths
    row["dumps"] = [str(where) for where in (catcher.caught, sampler.caught) if where]
    row["ours_peak_cpu"] = {name: round(share, 3) for name, share in sampler.ours_max.items()}
    # Passed: every check held and no engine died. A step vLLM reported stalled is counted
    # apart (its dumps say whose it was) and still fails the soak's exit status.
    row["passed"] = row["passed"] and not catcher.deaths
    row["result"] = "FAIL" if not row["passed"] else "stall" if catcher.stall_lines else "pass"
    return row


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--pairing", choices=("1-2", "2-1"), default="1-2")
    parser.add_argument("--runs", type=int, default=20)
    parser.add_argument("--logs", type=Path, default=Path("vllm-soak-logs"))
    parser.add_argument("--data-plane", choices=("rma", "tagged"), default="rma")
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument(
        "--keep-going", action="store_true", help="run every run even after a failure"
    )
    parser.add_argument(
        "--connector", choices=("ucx", "nixl"), default="ucx",
        help="ours, or vLLM's NixlConnector (needs NIXL in the venv)",
    )  # fmt: skip
    parser.add_argument(
        "--cold", action="store_true",
        help="no warm-up request: the first P/D request meets vLLM's first-forward compile",
    )  # fmt: skip
    args = parser.parse_args()
    check_pd.DATA_PLANE["value"] = args.data_plane
    pairing = tuple(int(x) for x in args.pairing.split("-"))
    label = (
        f"TP {pairing[0]} -> TP {pairing[1]} "
        f"({'NixlConnector' if args.connector == 'nixl' else 'UcxConnector ' + args.data_plane}"
        f"{', cold' if args.cold else ''})"
    )
    args.logs.mkdir(parents=True, exist_ok=True)
    began = time.monotonic()
    expected = references(args.model, args.logs / "references")
    print(f"references computed in {time.monotonic() - began:.0f} s", flush=True)
    rows = []
    for n in range(1, args.runs + 1):
        row = {
            "run": n,
            **one_run(
                args.model, args.logs / f"run-{n}", pairing, expected, args.connector, args.cold
            ),
        }
        rows.append(row)
        print(
            f"{label} run {n}/{args.runs}: {row['result']} "
            f"start {row.get('start_s', '-')} s, P/D {row.get('pd_s', '-')} s, "
            f"total {row['total_s']} s, stalls {row['stall_lines']}, "
            f"deaths {len(row['engine_deaths'])}, ours peak {row['ours_peak_cpu']}"
            + (f"\n  error: {row['error']}" if row["error"] else "")
            + (f"\n  dumps: {row['dumps']}" if row["dumps"] else ""),
            flush=True,
        )
        if row["result"] != "pass" and not args.keep_going:
            break
    passed = sum(row["passed"] for row in rows)
    peak = max((s for row in rows for s in row["ours_peak_cpu"].values()), default=0.0)
    summary = {
        "pairing": label,
        "runs": len(rows),
        "passed": passed,
        "engine_deaths": sum(len(row["engine_deaths"]) > 0 for row in rows),
        "stalled_runs": sum(row["stall_lines"] > 0 for row in rows),
        "ours_peak_cpu": round(peak, 3),
        "wall_s": round(time.monotonic() - began, 1),
        "rows": rows,
    }
    print(
        f"\n{'run':>4} {'result':>6} {'start s':>8} {'P/D s':>6} {'total s':>8} {'stalls':>6} "
        f"{'deaths':>6} {'ours peak cpu':>13}"
    )
    for row in rows:
        ours = max(row["ours_peak_cpu"].values(), default=0.0)
        print(
            f"{row['run']:>4} {row['result']:>6} "
            f"{row.get('start_s', '-'):>8} {row.get('pd_s', '-'):>6} {row['total_s']:>8} "
            f"{row['stall_lines']:>6} {len(row['engine_deaths']):>6} {ours * 100:>12.1f}%"
        )
    print(
        f"{label}: {passed}/{len(rows)} passed, {summary['engine_deaths']} engine deaths, "
        f"{summary['stalled_runs']} stalled runs, kvtransfer threads' peak "
        f"{peak * 100:.1f}% of a core, {summary['wall_s']:.0f} s"
    )
    out = args.json or args.logs / f"soak-tp{pairing[0]}-tp{pairing[1]}.json"
    out.write_text(json.dumps(summary, indent=2))
    print(f"wrote {out}")
    clean = passed == len(rows) == args.runs and not summary["stalled_runs"]
    return 0 if clean else 1


if __name__ == "__main__":
    sys.exit(main())
