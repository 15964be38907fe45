"""vLLM-CPU servers behind the router for ``benchmarks/goodput.py --engine vllm``.

The configurations (each engine pinned to a core of its own, as for our daemons):

- ``vllm-pd-ours``: a vLLM prefill (``kv_producer``) and a vLLM decode (``kv_consumer``) with
  our ``UcxConnector`` (``kvtransfer.integrations.vllm``), the router ``--engine vllm
  --prefill P --decode D``;
- ``vllm-pd-nixl``: the same with vLLM's ``NixlConnector`` (``kv_both``, host buffer, UCX over
  shared memory and TCP on ``lo``, a side-channel port per server);
- ``vllm-agg``: two plain vLLM servers (no KV connector) given to the router with
  ``--aggregated``: each runs whole requests, the router balancing load;
- ``vllm-slo``: ``vllm-pd-ours`` with the router's ``--slo-ttft-ms``/``--slo-itl-ms``.

Servers start as vllm_stage/check_pd.py starts them (benchmarks/vllm_pd.py too):
``python -m vllm.entrypoints.openai.api_server`` of the vLLM virtual environment (its ``vllm``
console script is broken: the distribution is named ``vllm-cpu``), ``--dtype float32
--enforce-eager --max-model-len 2048 --block-size 32`` (vLLM-CPU's attention takes multiples of
32), ``HF_HUB_OFFLINE=1``, 1 GiB of KV (``VLLM_CPU_KVCACHE_SPACE``), one OpenMP thread bound to
the server's core (``VLLM_CPU_OMP_THREADS_BIND``) and every process of the server under
``taskset -c`` that core, each server in a session of its own (stopped as a process group:
API server, engine core and worker together).
"""

from __future__ import annotations

import argparse
import contextlib
import http.client
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "vllm_stage"))

from check_pd import free_port  # noqa: E402

from kvtransfer.serve.launcher import ServiceProcess, router_command  # noqa: E402

VLLM_CONFIGS = ("vllm-pd-ours", "vllm-pd-nixl", "vllm-agg", "vllm-slo")
DEFAULT_VLLM_MODEL = ROOT / ".vllm-stage" / "tiny-llama"
DEFAULT_VLLM_PYTHON = ROOT / ".vllm-venv" / "bin" / "python"
VLLM_MODEL_NAME = "tiny-llama"
# The tiny Llama (4 layers, hidden 256) computes far faster than builtin:small. The SLOs relate
# to its lone requests as ours do to builtin:small's (TTFT about 1.7x a lone 1536-token
# prompt's, ITL about 2x a lone request's): on 2 cores a lone 1536-token prompt took 330-460 ms
# to its first token (vllm-pd-ours, vllm-agg, vllm-slo), ITL 8-11 ms (2026-11-28).
VLLM_DEFAULT_RATES = (0.5, 1.0, 2.0, 4.0)
VLLM_DEFAULT_SLO = (750.0, 20.0)  # TTFT, ITL ms
VLLM_BLOCK_SIZE = 32  # vLLM-CPU's attention refuses block sizes that are not multiples of 32
MAX_MODEL_LEN = 2048
VLLM_KV_CACHE_GIB = 1
START_TIMEOUT_S = 300.0
ROUTER_HEALTH_TIMEOUT_S = 60.0
STOP_TIMEOUT_S = 30.0
# How long every server's KV cache usage may take to return to 0 after the last request (a
# prefill's blocks wait for the decode's read, or its lease).
SETTLE_S = 30.0
USAGE = "vllm:kv_cache_usage_perc"
# Prompt tokens served from a server's own prefix cache (vLLM counts tokens, per engine).
PREFIX_HITS = "vllm:prefix_cache_hits_total"
OURS = {
    "kv_connector": "UcxConnector",
    "kv_connector_module_path": "kvtransfer.integrations.vllm",
    "kv_connector_extra_config": {"kv_ip": "127.0.0.1"},
}
NIXL = {"kv_connector": "NixlConnector", "kv_role": "kv_both", "kv_buffer_device": "cpu"}
NIXL_ENV = {
    "UCX_TLS": "self,sm,tcp",
    "UCX_NET_DEVICES": "lo",
    "VLLM_NIXL_SIDE_CHANNEL_HOST": "127.0.0.1",
}


class VllmError(RuntimeError):
    """Something that fails a vLLM configuration; the message says what."""


@dataclass(frozen=True)
class VllmConfig:
    name: str
    roles: tuple[str, str]  # what runs on the first core and on the second
    router_flags: tuple[str, ...]
    connector: str | None  # "ours", "nixl", or None (plain servers)


def vllm_configs(ttft_ms: float, itl_ms: float) -> dict[str, VllmConfig]:
    pair = ("prefill", "decode")
    slo = ("--slo-ttft-ms", f"{ttft_ms:g}", "--slo-itl-ms", f"{itl_ms:g}")
    return {
        "vllm-pd-ours": VllmConfig("vllm-pd-ours", pair, (), "ours"),
        "vllm-pd-nixl": VllmConfig("vllm-pd-nixl", pair, (), "nixl"),
        "vllm-agg": VllmConfig("vllm-agg", ("aggregated", "aggregated"), (), None),
        "vllm-slo": VllmConfig("vllm-slo", pair, slo, "ours"),
    }


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """goodput.py's options for --engine vllm."""
    parser.add_argument(
        "--vllm-python",
        default=None,
        help="--engine vllm: the Python with vLLM that runs the servers (default: this one if "
        "it has vLLM, else .vllm-venv/bin/python)",
    )
    parser.add_argument(
        "--vllm-model",
        default=str(DEFAULT_VLLM_MODEL),
        help="--engine vllm: the servers' checkpoint directory (default .vllm-stage/tiny-llama)",
    )
    parser.add_argument(
        "--vllm-server-arg",
        action="append",
        default=[],
        metavar="ARG",
        help="--engine vllm: one more argument for every vLLM server (repeat; e.g. "
        "--vllm-server-arg=--max-num-batched-tokens=512)",
    )
    parser.add_argument(
        "--no-router-tokenizer",
        dest="router_tokenizer",
        action="store_false",
        help="--engine vllm: no --tokenizer for the router (its SLO mode then decides "
        "prompt_tokens_unknown: P/D for every request)",
    )


def prepare(args: argparse.Namespace) -> tuple[Path, int, dict[str, Any]]:
    """(the checkpoint, its context for the servers, the report's setup entries) from the
    options; sets ``args.vllm_python`` (when not given) and ``args.vocab_size``."""
    if args.vllm_python is None:
        args.vllm_python = default_python()
    model = Path(args.vllm_model).resolve()
    if not (model / "config.json").is_file():
        raise VllmError(f"no checkpoint at {model}: run vllm_stage/run.sh (or pass --vllm-model)")
    version = vllm_version(args.vllm_python)
    max_len, args.vocab_size = model_limits(model)
    setup = {
        "engine": "vllm",
        "model": str(model),
        "vllm": version,
        "vllm_python": args.vllm_python,
        "max_model_len": max_len,
        "block_size": VLLM_BLOCK_SIZE,
        "kv_cache_gib": VLLM_KV_CACHE_GIB,
        "vllm_server_args": list(args.vllm_server_arg),
        "router_tokenizer": args.router_tokenizer,
    }
    return model, max_len, setup


def default_python() -> str:
    """This interpreter when it has vLLM (the script run under .vllm-venv), else .vllm-venv's."""
    import importlib.util

    if importlib.util.find_spec("vllm") is not None:
        return sys.executable
    return str(DEFAULT_VLLM_PYTHON)


def vllm_version(python: str) -> str:
    """The vLLM distribution's version in ``python``'s environment (no vLLM import: fast)."""
    code = (
        "import importlib.metadata as m\n"
        "for name in ('vllm-cpu', 'vllm'):\n"
        "    try:\n        print(name, m.version(name)); break\n"
        "    except m.PackageNotFoundError:\n        pass\n"
    )
    try:
        done = subprocess.run(
            [python, "-c", code], capture_output=True, text=True, timeout=60, check=False
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise VllmError(f"{python} does not run: {exc}") from None
    if done.returncode != 0 or not done.stdout.strip():
        raise VllmError(
            f"no vLLM in {python}'s environment (pass --vllm-python): {done.stderr.strip()[-300:]}"
        )
    return done.stdout.strip()


def nixl_missing(python: str) -> str | None:
    """Why vLLM's NixlConnector cannot load in ``python``'s environment, or None."""
    done = subprocess.run(
        [python, "-c", "import nixl._api"], capture_output=True, text=True, timeout=120, check=False
    )
    if done.returncode == 0:
        return None
    return (
        f"nixl._api does not import in {python}'s environment "
        f"({done.stderr.strip().splitlines()[-1] if done.stderr.strip() else done.returncode}): "
        "pip install nixl-cu12 && pip install --no-deps nixl==1.5.1"
    )


def model_limits(model: Path) -> tuple[int, int]:
    """(the context the servers get: ``--max-model-len``, the vocabulary size) of a HF checkpoint
    directory."""
    config = json.loads((model / "config.json").read_text())
    return min(MAX_MODEL_LEN, int(config["max_position_embeddings"])), int(config["vocab_size"])


# ------------------------------------------------------------------ servers


class VllmServer:
    """One vLLM OpenAI server on 127.0.0.1, pinned to ``core``, in a session of its own."""

    def __init__(
        self,
        name: str,
        python: str,
        model: Path,
        core: int,
        log: Path,
        kv: dict[str, Any] | None,
        env: dict[str, str],
        flags: Sequence[str],
    ) -> None:
        self.name = name
        self.port = free_port()
        self.log = log
        environment = {
            **os.environ,
            "HF_HUB_OFFLINE": "1",
            "VLLM_HOST_IP": "127.0.0.1",
            "VLLM_CPU_KVCACHE_SPACE": str(VLLM_KV_CACHE_GIB),
            "VLLM_NO_USAGE_STATS": "1",
            "VLLM_CPU_NUM_OF_RESERVED_CPU": "0",
            # One OpenMP thread, bound to the server's core.
            "VLLM_CPU_OMP_THREADS_BIND": str(core),
            "UCX_WARN_UNUSED_ENV_VARS": "n",
            **env,
        }
        command = [
            "taskset", "-c", str(core), python, "-m", "vllm.entrypoints.openai.api_server",
            "--model", str(model), "--served-model-name", VLLM_MODEL_NAME,
            "--dtype", "float32", "--enforce-eager",
            "--max-model-len", str(model_limits(model)[0]), "--block-size", str(VLLM_BLOCK_SIZE),
            "--host", "127.0.0.1", "--port", str(self.port), "--disable-uvicorn-access-log",
            *(() if kv is None else ("--kv-transfer-config", json.dumps(kv))), *flags,
        ]  # fmt: skip
        log.parent.mkdir(parents=True, exist_ok=True)
        with log.open("w") as out:
            self.process = subprocess.Popen(
                command, env=environment, stdout=out, stderr=subprocess.STDOUT,
                start_new_session=True,
            )  # fmt: skip

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def pid(self) -> int:
        return self.process.pid

    def wait_healthy(self, deadline: float) -> None:
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise VllmError(
                    f"{self.name} exited ({self.process.returncode}) before it was healthy; "
                    f"last log lines:\n{_tail(self.log)}"
                )
            with contextlib.suppress(OSError, http.client.HTTPException):
                if _get(self.address, "/health", 5)[0] == 200:
                    return
            time.sleep(1.0)
        raise VllmError(
            f"{self.name} not healthy within {START_TIMEOUT_S:g} s; last log lines:\n"
            f"{_tail(self.log)}"
        )

    def metric(self, name: str) -> float | None:
        """The sum of ``name``'s samples on this server's /metrics; None when it has none (or
        does not answer)."""
        try:
            status, text = _get(self.address, "/metrics", 30)
        except (OSError, http.client.HTTPException):
            return None
        if status != 200:
            return None
        values = [
            float(line.rsplit(" ", 1)[1])
            for line in text.splitlines()
            if line.startswith((name + "{", name + " "))
        ]
        return sum(values) if values else None

    def stop(self) -> None:
        """SIGTERM the server's process group, SIGKILL what is left after `STOP_TIMEOUT_S`."""
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.process.pid, signal.SIGTERM)
        try:
            self.process.wait(STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait(STOP_TIMEOUT_S)
        # Stragglers of the group (engine core, worker) once the API server is gone.
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.process.pid, signal.SIGKILL)


def kv_settings(config: VllmConfig, slot: int) -> tuple[dict[str, Any] | None, dict[str, str]]:
    """(the ``--kv-transfer-config`` of the server in ``slot``, its extra environment)."""
    if config.connector == "ours":
        role = "kv_producer" if config.roles[slot] == "prefill" else "kv_consumer"
        return {**OURS, "kv_role": role, "kv_port": free_port()}, {}
    if config.connector == "nixl":
        return dict(NIXL), {**NIXL_ENV, "VLLM_NIXL_SIDE_CHANNEL_PORT": str(free_port())}
    return None, {}


@contextlib.contextmanager
def vllm_cluster(
    config: VllmConfig, args: argparse.Namespace, model: Path, log_dir: Path
) -> Iterator[tuple[str, list[VllmServer]]]:
    """(the router's URL, the servers), on ``args.cores`` with ``args.vllm_server_arg`` and
    ``args.router_arg``. When the body raised nothing, every server's KV cache usage must
    return to 0 (a leak fails the run); everything started is stopped on the way out."""
    if config.connector == "nixl":
        missing = nixl_missing(args.vllm_python)
        if missing:
            raise VllmError(missing)
    servers: list[VllmServer] = []
    router: ServiceProcess | None = None
    try:
        # Both at once: each takes 20-50 s to load and profile.
        for slot, role in enumerate(config.roles):
            kv, env = kv_settings(config, slot)
            name = f"{config.name}-{role}{slot}"
            servers.append(
                VllmServer(
                    name, args.vllm_python, model, args.cores[slot], log_dir / f"{name}.log",
                    kv, env, args.vllm_server_arg,
                )
            )  # fmt: skip
        deadline = time.monotonic() + START_TIMEOUT_S
        for server in servers:
            server.wait_healthy(deadline)
        flags = ["--engine", "vllm", "--host", "127.0.0.1", "--port", "0"]
        flags += ["--model-name", VLLM_MODEL_NAME]
        if args.router_tokenizer:
            # The prompt's token ids in the router (the SLO mode needs them); every
            # configuration pays the same for it.
            flags += ["--tokenizer", str(model)]
        for role, server in zip(config.roles, servers, strict=True):
            flags += [f"--{role}", server.address]
        flags += [*config.router_flags, *args.router_arg]
        router = ServiceProcess.start(
            f"{config.name}-router", router_command(*flags), log_dir / f"{config.name}-router.log"
        )
        wait_router(router.address)
        yield router.address, servers
        leaks = kv_in_use(servers)
        if leaks:
            raise VllmError(
                f"KV cache usage not back to 0 within {SETTLE_S:g} s of the last request: "
                + ", ".join(leaks)
            )
    finally:
        if router is not None:
            router.terminate(STOP_TIMEOUT_S)
        for server in servers:
            server.stop()


def wait_router(url: str) -> None:
    """Until the router's /health is 200: it has found a pickable prefill and decode, or an
    aggregated instance (its first health checks of the servers)."""
    address = url.removeprefix("http://").rstrip("/")
    deadline = time.monotonic() + ROUTER_HEALTH_TIMEOUT_S
    while time.monotonic() < deadline:
        with contextlib.suppress(OSError, http.client.HTTPException):
            if _get(address, "/health", 5)[0] == 200:
                return
        time.sleep(0.5)
    raise VllmError(f"the router at {url} found no servers to pick within 60 s")


def kv_in_use(servers: Sequence[VllmServer]) -> list[str]:
    """Each server whose ``vllm:kv_cache_usage_perc`` did not return to 0 within `SETTLE_S`
    (a finished request's blocks left in its pool), with the last value read."""
    deadline = time.monotonic() + SETTLE_S
    pending = list(servers)
    last: dict[str, float | None] = {}
    while pending:
        for server in list(pending):
            last[server.name] = server.metric(USAGE)
            if last[server.name] == 0.0:
                pending.remove(server)
        if not pending or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    return [
        f"{s.name}: "
        + ("no metric" if last[s.name] is None else f"{100.0 * (last[s.name] or 0.0):.2f}%")
        for s in pending
    ]


def prefix_cache_hits(servers: Sequence[VllmServer]) -> float | None:
    """Prompt tokens the servers served from their own prefix caches so far, all together."""
    values = [server.metric(PREFIX_HITS) for server in servers]
    return None if None in values else sum(v or 0.0 for v in values)


def cached_pct(
    requests: Sequence[dict[str, Any]], before: float | None, after: float | None
) -> float | None:
    """The prompt tokens the servers served from a prefix cache between ``before`` and
    ``after`` (`prefix_cache_hits`), in percent of the completed ``requests``' prompt tokens."""
    prompt = sum(r["isl"] or 0.0 for r in requests if r["error"] is None)
    if before is None or after is None or not prompt:
        return None
    return 100.0 * (after - before) / prompt


def _get(address: str, path: str, timeout: float) -> tuple[int, str]:
    host, port = address.rsplit(":", 1)
    # http.client, not urllib: no proxy from the environment between us and 127.0.0.1.
    connection = http.client.HTTPConnection(host, int(port), timeout=timeout)
    try:
        connection.request("GET", path)
        response = connection.getresponse()
        return response.status, response.read().decode(errors="replace")
    finally:
        connection.close()


def _tail(path: Path, lines: int = 20) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""
