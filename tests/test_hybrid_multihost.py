"""The hybrid models (``builtin:tiny-hybrid``: sliding window; ``builtin:tiny-mamba``: Mamba2
state) through the router with prefill, decode, router and client each on a host (network
namespace) of its own, on both data planes: completions equal colocated, the decode receives the
window's tail only (or the state block), nothing stays in use."""

from __future__ import annotations

import pytest
from netns_helpers.require import network
from netns_helpers.services import admin_status, complete, start_router, start_together
from netns_helpers.services import start_daemon as netns_daemon
from serve_helpers.daemons import BLOCK_SIZE, PROMPTS, colocated
from serve_helpers.hybrid import MAMBA_MODEL, MODEL, prompt_tokens, window_tail_blocks
from waiting import wait_until

from kvtransfer.serve.launcher import ServiceProcess

pytestmark = [pytest.mark.deploy, pytest.mark.netns]

MAX_TOKENS = 6


@pytest.fixture(scope="module")
def expected() -> dict[str, list[list[int]]]:
    return {model: colocated(PROMPTS, MAX_TOKENS, model=model) for model in (MODEL, MAMBA_MODEL)}


def blocks_moved(model: str, num_tokens: int) -> int:
    """Every full-attention block, and the window's tail or the one state block."""
    if model == MAMBA_MODEL:
        return -(-num_tokens // BLOCK_SIZE) + 1
    return -(-num_tokens // BLOCK_SIZE) + window_tail_blocks(num_tokens)


@pytest.mark.parametrize(
    ("model", "data_plane"),
    [(MODEL, "rma"), (MODEL, "tagged"), (MAMBA_MODEL, "rma"), (MAMBA_MODEL, "tagged")],
    ids=["sliding-rma", "sliding-tagged", "mamba-rma", "mamba-tagged"],
)
def test_hybrid_through_the_router_across_hosts_equals_colocated(
    tmp_path, expected, model, data_plane
):
    """Prefill, decode, router and client each in a network namespace of its own: the hybrid
    model's completions through the router equal colocated, nothing stays in use."""
    with network(f"h{model[-1]}{data_plane[0]}") as net:
        hosts = {name: net.add_host(name) for name in ("prefill", "decode", "router", "client")}
        client = hosts["client"]
        extra = {"data_plane": data_plane}
        processes: list[ServiceProcess] = []
        try:
            processes += start_together(
                *(
                    (
                        lambda role=role: netns_daemon(
                            hosts[role], role, tmp_path, "--model", model, extra=extra
                        )
                    )
                    for role in ("prefill", "decode")
                )
            )
            prefill, decode = processes
            router = start_router(hosts["router"], tmp_path, [prefill], [decode])
            processes.append(router)
            bodies = [{"prompt": p, "max_tokens": MAX_TOKENS} for p in PROMPTS]
            answers = complete(client, router.address, bodies)
            for answer, tokens, prompt in zip(answers, expected[model], PROMPTS, strict=True):
                assert answer["status"] == 200, answer
                info = answer["body"]["kvtransfer"]
                assert info["token_ids"] == tokens
                assert info["kv_blocks_received"] == blocks_moved(model, prompt_tokens(prompt))
                assert info["num_recomputed_tokens"] == 0
            wait_until(
                lambda: (
                    not any(
                        admin_status(client, d.address)["num_used_blocks"]
                        for d in (prefill, decode)
                    )
                ),
                "no KV block in use on either side",
                30,
                interval=0.5,
            )
        finally:
            for process in reversed(processes):
                process.terminate()
