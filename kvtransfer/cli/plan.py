"""``kvtransfer plan``: prefill and decode instance counts for a rate under TTFT/ITL SLOs.

Reads a profile written by ``benchmarks/pd_profile.py`` and prints the smallest prefill +
decode split that meets both SLOs (and an aggregated-only count beside it), the predicted
TTFT and ITL at that rate, each instance's utilisation, and which constraint set each count.
The model is `kvtransfer.planning`'s (docs/planning.md). Exit 0 with a plan, 1 when no split
fits ``--max-instances``, 2 on bad input (one line on stderr).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math

from kvtransfer.planning import (
    UNREACHABLE,
    Plan,
    Workload,
    WorkloadError,
    load_profile,
    plan,
)


def add_plan_parser(commands: argparse._SubParsersAction) -> None:
    cmd = commands.add_parser(
        "plan", help="prefill/decode instance counts for a rate under SLOs, from a profile"
    )
    # Numbers are read as text and checked here: a bad one gets one line, not argparse's usage.
    cmd.add_argument("--profile", required=True, help="JSON from benchmarks/pd_profile.py")
    cmd.add_argument("--rate", required=True, help="requests per second")
    cmd.add_argument("--ttft-ms", required=True, help="SLO on the mean time to first token")
    cmd.add_argument("--itl-ms", required=True, help="SLO on the mean inter-token latency")
    prompts = cmd.add_mutually_exclusive_group(required=True)
    prompts.add_argument("--prompt-tokens", help="every prompt's length")
    prompts.add_argument(
        "--prompt-mix",
        metavar="TOKENS:PERCENT,...",
        help="prompt lengths and their shares, e.g. 64:40,256:25,768:20,1536:15 (the queue's "
        "wait grows with their spread)",
    )
    cmd.add_argument("--output-tokens", required=True, help="tokens generated per request")
    cmd.add_argument("--max-instances", default="64", help="most instances in total (default 64)")
    cmd.add_argument("--json", action="store_true", help="print the plan as one JSON object")


def _positive(text: str, flag: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise WorkloadError(f"{flag} must be a number, got {text!r}") from None
    if not (math.isfinite(value) and value > 0):
        raise WorkloadError(f"{flag} must be a positive number, got {text!r}")
    return value


def _prompt_mix(text: str) -> list[tuple[float, float]]:
    mix = []
    for part in text.split(","):
        tokens, sep, percent = part.partition(":")
        if not sep:
            raise WorkloadError(f"--prompt-mix: expected TOKENS:PERCENT, got {part!r}")
        mix.append(
            (_positive(tokens, "--prompt-mix tokens"), _positive(percent, "--prompt-mix percent"))
        )
    total = sum(percent for _, percent in mix)
    if not math.isclose(total, 100.0, rel_tol=1e-9):
        raise WorkloadError(f"--prompt-mix: the percents must add to 100, got {total:g}")
    return mix


def run_plan(args: argparse.Namespace) -> int:
    """Raises `PlanningError` (a ValueError) on bad input; the caller prints it, exit 2."""
    rate = _positive(args.rate, "--rate")
    output_tokens = _positive(args.output_tokens, "--output-tokens")
    ttft_slo_s = _positive(args.ttft_ms, "--ttft-ms") / 1e3
    itl_slo_s = _positive(args.itl_ms, "--itl-ms") / 1e3
    if args.prompt_mix is not None:
        mix = _prompt_mix(args.prompt_mix)
        work = Workload.mixed(rate, mix, output_tokens, ttft_slo_s, itl_slo_s)
    else:
        prompt_tokens = _positive(args.prompt_tokens, "--prompt-tokens")
        work = Workload(rate, prompt_tokens, output_tokens, ttft_slo_s, itl_slo_s)
    try:
        max_instances = int(args.max_instances)
    except ValueError:
        raise WorkloadError(
            f"--max-instances must be a whole number, got {args.max_instances!r}"
        ) from None
    if max_instances < 2:
        raise WorkloadError(f"--max-instances must be at least 2, got {max_instances}")
    profile = load_profile(args.profile)
    result = plan(profile, work, max_instances)
    if args.json:
        print(json.dumps(dataclasses.asdict(result) | {"total": result.disaggregated_total}))
    else:
        print(f"profile: {args.profile} ({profile.label or 'unlabelled'})")
        print("\n".join(describe(result)))
    return 0 if result.disaggregated_total is not None else 1


def describe(result: Plan) -> list[str]:
    w = result.workload
    prompts = f"{w.prompt_tokens:g} prompt tokens"
    if w.prompt_mix:
        shares = ", ".join(f"{100 * share:g}% {tokens:g}" for tokens, share in w.prompt_mix)
        prompts = f"prompts of {shares} tokens (mean {w.prompt_tokens:.4g})"
    lines = [
        f"workload: {w.rate:g} req/s, {prompts}, "
        f"{w.output_tokens:g} output tokens; SLOs: mean TTFT <= {_ms(w.ttft_slo_s)} ms, "
        f"mean ITL <= {_ms(w.itl_slo_s)} ms",
    ]
    p, d, a = result.prefill, result.decode, result.aggregated
    total = result.disaggregated_total
    if total is not None and p is not None and d is not None:
        lines.append(f"suggested: {p.instances} prefill + {d.instances} decode = {total} instances")
    elif p is not None and d is not None:
        lines.append(
            f"suggested: none within --max-instances {result.max_instances} "
            f"(needs {p.instances} prefill + {d.instances} decode)"
        )
    elif any(
        why.startswith(UNREACHABLE) for why in (result.prefill_binding, result.decode_binding)
    ):
        lines.append("suggested: none: an SLO is below what an unloaded instance achieves")
    else:
        lines.append(f"suggested: none within --max-instances {result.max_instances}")
    if p is not None:
        lines.append(
            f"  prefill x{p.instances}: {_ms(p.service_s)} ms per prompt (mean), utilisation "
            f"{p.utilisation:.2f}, queueing {_ms(p.wait_s)} ms, transfer {_ms(p.transfer_s)} ms "
            f"-> TTFT {_ms(p.ttft_s)} ms"
        )
    lines.append(_why("prefill", p is not None, result.prefill_binding))
    if d is not None:
        lines.append(
            f"  decode x{d.instances}: mean batch {d.batch:.2f} per instance, ITL "
            f"{_ms(d.itl_s)} ms, utilisation {d.utilisation:.2f} (of the largest batch "
            "within the ITL SLO)"
        )
    lines.append(_why("decode", d is not None, result.decode_binding))
    if a is not None:
        lines.append(
            f"aggregated only: {a.instances} instances: prefill utilisation "
            f"{a.prefill_utilisation:.2f}, mean batch {a.batch:.2f}, TTFT {_ms(a.ttft_s)} ms, "
            f"ITL {_ms(a.itl_s)} ms (a gap with a prefill chunk: {_ms(a.worst_gap_s)} ms)"
        )
    lines.append(_why("aggregated", a is not None, result.aggregated_binding))
    lines.append(
        "model: means only (M/G/1 prefill queue, Little's law decode batch); see docs/planning.md"
    )
    return lines


def _why(pool: str, found: bool, binding: str) -> str:
    if found:
        return f"    {pool} count set by (what fails with one fewer): {binding}"
    return f"  {pool}: no count: {binding}"


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.1f}"
