"""kvtransfer's router (``--engine vllm``) in front of vLLM servers running vLLM's NixlConnector.

    python vllm_stage/check_router_nixl.py --model DIR [--logs DIR]

Not part of the CI stage: it needs NIXL in the vLLM environment (``pip install nixl-cu12 &&
pip install --no-deps nixl==1.5.1``, as for benchmarks/vllm_pd.py). One vLLM prefill and one
vLLM decode, both ``kv_both`` with NixlConnector over UCX (TCP and shared memory on loopback),
and the router. Checks: through the router, greedy tokens equal the prefill server's own plain
answers (the single-instance reference) for every prompt, JSON and streamed, and the decode
received the KV of the prompt tokens it lacked (vLLM's own token-source counters).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from check_pd import (
    MAX_TOKENS,
    PROMPTS,
    START_TIMEOUT_S,
    Router,
    Server,
    StageFailure,
    check,
    free_port,
    report_failure,
    tokens,
)

NIXL = {"kv_connector": "NixlConnector", "kv_role": "kv_both", "kv_buffer_device": "cpu"}
NIXL_ENV = {"UCX_TLS": "self,sm,tcp", "UCX_NET_DEVICES": "lo"}


def nixl_server(name: str, model: str, logs: Path, core: int) -> Server:
    env = {
        **NIXL_ENV,
        "VLLM_NIXL_SIDE_CHANNEL_HOST": "127.0.0.1",
        "VLLM_NIXL_SIDE_CHANNEL_PORT": str(free_port()),
    }
    return Server(name, model, logs, NIXL, core=core, env=env)


def run(model: str, logs: Path) -> None:
    p = nixl_server("nixl-prefill", model, logs, core=0)
    d = nixl_server("nixl-decode", model, logs, core=1)
    router = None
    try:
        deadline = time.monotonic() + START_TIMEOUT_S
        p.wait_healthy(deadline)
        d.wait_healthy(deadline)
        reference = {}
        for prompt in PROMPTS:
            status, answer = p.complete(prompt, MAX_TOKENS)
            check(status == 200, "reference answered")
            reference[prompt] = tokens(answer)
        router = Router(model, logs, [p], [d])
        router.wait_healthy()
        source = "vllm:prompt_tokens_by_source_total"
        for prompt in PROMPTS:
            pulled = d.metric(source, source="external_kv_transfer")
            hit = d.metric(source, source="local_cache_hit")
            status, answer = router.complete(prompt, MAX_TOKENS)
            check(
                status == 200 and tokens(answer) == reference[prompt],
                f"router + NixlConnector: tokens equal the single instance for {prompt[:30]!r}...",
            )
            pulled = d.metric(source, source="external_kv_transfer") - pulled
            hit = d.metric(source, source="local_cache_hit") - hit
            prompt_tokens = answer["usage"]["prompt_tokens"]
            check(
                pulled > 0 and pulled + hit == prompt_tokens,
                f"router + NixlConnector: the decode received the KV it lacked ({pulled:.0f} "
                f"transferred, {hit:.0f} from its own prefix cache, {prompt_tokens} prompt tokens)",
            )
        status, last, text = router.streamed(PROMPTS[2], MAX_TOKENS)
        status, whole = p.complete(PROMPTS[2], MAX_TOKENS)
        check(
            last == "[DONE]" and text == whole["choices"][0]["text"],
            "router + NixlConnector: the streamed text equals the single instance's",
        )
    finally:
        if router is not None:
            router.stop()
        d.stop()
        p.stop()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--logs", type=Path, default=Path(".vllm-stage/logs-nixl"))
    args = parser.parse_args()
    args.logs.mkdir(parents=True, exist_ok=True)
    try:
        run(args.model, args.logs)
    except StageFailure as failure:
        report_failure(failure, args.logs)
        return 1
    print("router in front of NixlConnector servers: passed", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
