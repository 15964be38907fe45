"""The GPU stage: vLLM's CUDA build with our UcxConnector, a prefill and a decode on one GPU.

    python vllm_stage/check_pd_gpu.py --model DIR --backend FLASH_ATTN|FLASHINFER
        [--cuda-graphs] [--kv-cache-layout NHD|HND] [--prefill-pp N] [--decode-pp N]
        [--dtype float16] [--logs DIR] [--data-plane rma|tagged]
    python vllm_stage/check_pd_gpu.py --model DIR --host-staging-refused [--logs DIR]

Written for ``vllm_stage/run_gpu.sh`` on a machine with an NVIDIA GPU; not run yet (no GPU was
lent while it was written). Reuses ``check_pd``'s server and request helpers; what differs from
the CPU stage: no core pinning, ``--dtype float16`` (FlashAttention and FlashInfer take no
float32; the later flag wins over check_pd's ``--dtype float32``, as ``--no-enforce-eager`` wins
over its ``--enforce-eager`` for ``--cuda-graphs``), ``--gpu-memory-utilization 0.35`` per server
so both fit on one GPU, ``--attention-backend`` for the backend, ``VLLM_KV_CACHE_LAYOUT`` for
the layout, and the decode started once the prefill is healthy (vLLM's memory profiling must
not see the other server grow).

Checks, each failing the run with a message: greedy P/D tokens equal the prefill's own answer
(PP splits no layer, so a PP 2 and a PP 1 engine compute alike; on a mismatch the first
differing position is printed) for several prompts; vLLM counts the KV of every prompt
token as transferred (equal tokens alone could come from a recompute); a prefix hit on the
decode transfers only the tokens beyond it; our counters in both servers' ``/metrics``; the
prefill's KV cache usage back to 0. ``--host-staging-refused``: a server configured with
``kv_buffer_device`` "cpu" must exit at start-up naming that limit.

PP needs a GPU per stage (vLLM's worker for PP rank 1 asks for device 1): ``--prefill-pp 2``
puts the prefill on GPUs 0 and 1 and the decode on GPU 0.
"""

from __future__ import annotations

import argparse
import re
import sys
import time
from pathlib import Path

import check_pd
from check_pd import (
    BLOCK_SIZE,
    PROMPTS,
    SHARED,
    START_TIMEOUT_S,
    Server,
    StageFailure,
    check,
    kv_config,
    prefill,
    tokens,
    wait_for,
)

GPU_MEMORY_UTILIZATION = "0.35"
MAX_TOKENS = 32
REFUSAL = "kv_buffer_device 'cpu'"


def gpu_flags(args: argparse.Namespace, pp: int) -> list[str]:
    flags = [
        "--dtype", args.dtype,
        "--gpu-memory-utilization", GPU_MEMORY_UTILIZATION,
        "--attention-backend", args.backend,
    ]  # fmt: skip
    if args.cuda_graphs:
        flags.append("--no-enforce-eager")
    if pp > 1:
        flags += ["--pipeline-parallel-size", str(pp), "--distributed-executor-backend", "mp"]
    return flags


def gpu_env(args: argparse.Namespace, pp: int) -> dict[str, str]:
    env = {"CUDA_VISIBLE_DEVICES": ",".join(str(i) for i in range(pp))}
    if args.kv_cache_layout:
        env["VLLM_KV_CACHE_LAYOUT"] = args.kv_cache_layout
    return env


def first_difference(got: list[int], want: list[int]) -> str:
    for i, (a, b) in enumerate(zip(got, want, strict=False)):
        if a != b:
            return f"position {i}: {a} != {b}"
    return f"lengths {len(got)} != {len(want)}"


def backend_line(server: Server) -> str:
    """The server's own log line naming its attention backend, for the reader."""
    lines = server.log.read_text(errors="replace").splitlines()
    found = [line for line in lines if re.search(r"Using .*(backend|Backend)", line)]
    return found[-1].strip() if found else "(no 'Using ... backend' line in the log)"


def run(args: argparse.Namespace) -> None:
    label = (
        f"{args.backend}, {'CUDA graphs' if args.cuda_graphs else 'eager'}, layout "
        f"{args.kv_cache_layout or 'default'}, PP {args.prefill_pp} -> PP {args.decode_pp}"
    )
    name = re.sub(r"[^a-z0-9]+", "-", label.lower()).strip("-")
    p = Server(
        f"{name}-prefill", args.model, args.logs, kv_config("kv_producer"),
        *gpu_flags(args, args.prefill_pp), core=None, env=gpu_env(args, args.prefill_pp),
    )  # fmt: skip
    servers = [p]
    try:
        p.wait_healthy(time.monotonic() + START_TIMEOUT_S)
        d = Server(
            f"{name}-decode", args.model, args.logs, kv_config("kv_consumer"),
            *gpu_flags(args, args.decode_pp), core=None, env=gpu_env(args, args.decode_pp),
        )  # fmt: skip
        servers.append(d)
        d.wait_healthy(time.monotonic() + START_TIMEOUT_S)
        print(f"prefill: {backend_line(p)}\ndecode: {backend_line(d)}", flush=True)
        # The prefill's own answers: the decode must not see these prompts before its P/D
        # runs, or its prefix cache would serve part of them.
        reference: dict[str, list[int]] = {}
        for prompt in [*PROMPTS, SHARED]:
            status, answer = p.complete(prompt, MAX_TOKENS)
            check(
                status == 200 and len(tokens(answer)) == MAX_TOKENS,
                f"{label}: the prefill answered {prompt[:24]!r}... alone",
            )
            reference[prompt] = tokens(answer)
        check(
            len({tuple(t) for t in reference.values()}) == len(reference),
            f"{label}: the single-instance answers differ between prompts",
        )
        source = "vllm:prompt_tokens_by_source_total"
        for prompt in PROMPTS:
            before = d.metric(source, source="external_kv_transfer")
            status, answer = d.complete(prompt, MAX_TOKENS, prefill(p, prompt))
            if status != 200:
                raise StageFailure(f"{label}: the P/D decode failed (HTTP {status}: {answer})")
            got, want = tokens(answer), reference[prompt]
            difference = "" if got == want else f" ({first_difference(got, want)})"
            check(
                got == want,
                f"{label}: P/D tokens equal the single instance for {prompt[:24]!r}...{difference}",
            )
            pulled = d.metric(source, source="external_kv_transfer") - before
            prompt_tokens = answer["usage"]["prompt_tokens"]
            check(
                pulled == prompt_tokens,
                f"{label}: vLLM counts the KV of all {prompt_tokens} prompt tokens as "
                f"transferred ({pulled:.0f})",
            )
        status, answer = d.complete(SHARED, MAX_TOKENS, prefill(p, SHARED))
        check(
            status == 200 and tokens(answer) == reference[SHARED],
            f"{label}: the first shared prompt equals the single instance",
        )
        pulled_before = d.metric(source, source="external_kv_transfer")
        local_before = d.metric(source, source="local_cache_hit")
        status, answer = d.complete(SHARED, MAX_TOKENS, prefill(p, SHARED))
        check(
            status == 200 and tokens(answer) == reference[SHARED],
            f"{label}: the second shared prompt equals the single instance",
        )
        pulled = d.metric(source, source="external_kv_transfer") - pulled_before
        local = d.metric(source, source="local_cache_hit") - local_before
        check(local >= BLOCK_SIZE, f"{label}: the decode hit its prefix cache ({local:.0f})")
        check(0 < pulled < BLOCK_SIZE, f"{label}: and pulled only the rest ({pulled:.0f})")
        received = d.metric("vllm:kvtransfer_bytes_received_total")
        sent = p.metric("vllm:kvtransfer_bytes_sent_total")
        check(received > 0 and sent > 0, f"{label}: our byte counters in /metrics ({received:.0f})")
        wait_for(
            lambda: p.metric("vllm:kv_cache_usage_perc") == 0.0,
            f"{label}: the prefill's KV to be given back",
        )
        check(True, f"{label}: the prefill's KV cache usage is back to 0")
    finally:
        for server in reversed(servers):
            server.stop()


def host_staging_refused(args: argparse.Namespace) -> None:
    """kv_buffer_device "cpu" on a GPU: the server must exit at start-up naming the limit."""
    kv = kv_config("kv_producer")
    kv["kv_buffer_device"] = "cpu"
    server = Server(
        "host-staging", args.model, args.logs, kv, *gpu_flags(args, 1), core=None,
        env=gpu_env(args, 1),
    )  # fmt: skip
    try:
        deadline = time.monotonic() + START_TIMEOUT_S
        while server.process.poll() is None:
            if server.healthy():
                raise StageFailure("a server with kv_buffer_device 'cpu' on a GPU became healthy")
            if time.monotonic() > deadline:
                raise StageFailure(f"the host-staging server did not exit in {START_TIMEOUT_S} s")
            time.sleep(2.0)
        check(server.process.returncode != 0, "the host-staging server exited at start-up")
        log = server.log.read_text(errors="replace")
        check(REFUSAL in log, f"and its log names the limit ({REFUSAL!r} ...)")
    finally:
        server.stop()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--logs", type=Path, default=Path("vllm-gpu-stage-logs"))
    parser.add_argument("--backend", choices=("FLASH_ATTN", "FLASHINFER"), default="FLASH_ATTN")
    parser.add_argument("--cuda-graphs", action="store_true", help="capture CUDA graphs")
    parser.add_argument("--kv-cache-layout", choices=("NHD", "HND"), default=None)
    parser.add_argument("--prefill-pp", type=int, default=1)
    parser.add_argument("--decode-pp", type=int, default=1)
    parser.add_argument("--dtype", choices=("float16", "bfloat16"), default="float16")
    parser.add_argument("--data-plane", choices=("rma", "tagged"), default="rma")
    parser.add_argument("--host-staging-refused", action="store_true")
    args = parser.parse_args()
    check_pd.DATA_PLANE["value"] = args.data_plane
    args.logs.mkdir(parents=True, exist_ok=True)
    try:
        if args.host_staging_refused:
            host_staging_refused(args)
        else:
            run(args)
    except StageFailure as failure:
        check_pd.report_failure(failure, args.logs)
        return 1
    print("GPU check passed", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
