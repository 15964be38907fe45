"""Daemons, the router and HTTP clients run inside test hosts (`topology.Host`).

Processes are started as ``ip netns exec <namespace> python -m ...``: ``ip`` execs the
command, so the `ServiceProcess` pid is the daemon itself and SIGTERM reaches it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from serve_helpers.daemons import COMMON_FLAGS, stream_flags

from kvtransfer.serve.launcher import ServiceProcess, daemon_command, router_command
from netns_helpers.call import TOKEN_ENV
from netns_helpers.topology import Host

_TESTS_DIR = str(Path(__file__).resolve().parents[1])


def start_daemon(
    host: Host,
    role: str,
    logs: Path,
    *flags: str,
    kv_ip: str | None = None,
    extra: dict[str, Any] | None = None,
    bind: str | None = None,
    policy: str | None = None,
) -> ServiceProcess:
    """A daemon serving gRPC on ``bind`` (default: the host's address) with its KV traffic on
    ``kv_ip`` (default: the same address); ``extra`` is its ``kv_connector_extra_config``,
    ``policy`` its ``kv_load_failure_policy`` (default: the daemon's, "fail")."""
    bind = bind or host.address
    config: dict[str, Any] = {
        "kv_ip": kv_ip or bind,
        "kv_port": 0,
        "kv_connector_extra_config": extra or {},
    }
    if policy is not None:
        config["kv_load_failure_policy"] = policy
    argv = daemon_command(
        role, "--host", bind, *COMMON_FLAGS, "--kv-transfer-config", json.dumps(config), *flags
    )
    name = f"{role}-{host.name}"
    return ServiceProcess.start(name, host.command(argv), logs / f"{name}.log")


def start_router(
    host: Host,
    logs: Path,
    prefills: Sequence[ServiceProcess],
    decodes: Sequence[ServiceProcess],
    *flags: str,
    bind: str | None = None,
    name: str | None = None,
) -> ServiceProcess:
    """A router on ``bind`` (default: the host's address); ``name`` tells several routers of one
    test apart (their process names and logs, ``<name>.log``; default ``router.log``)."""
    argv = ["--host", bind or host.address, "--port", "0", *stream_flags(flags), *flags]
    for daemon in prefills:
        argv += ["--prefill", daemon.address]
    for daemon in decodes:
        argv += ["--decode", daemon.address]
    return ServiceProcess.start(
        name or f"router-{host.name}",
        host.command(router_command(*argv)),
        logs / f"{name or 'router'}.log",
    )


def start_together(*starts: Any) -> list[ServiceProcess]:
    """Call each zero-argument ``start`` at once (engines load in parallel); stops the ones
    that started if another fails."""
    with ThreadPoolExecutor(len(starts)) as pool:
        futures = [pool.submit(start) for start in starts]
    started = [f.result() for f in futures if f.exception() is None]
    for future in futures:
        if future.exception() is not None:
            for process in started:
                process.kill()
            raise future.exception()  # type: ignore[misc]
    return started


def run_requests(
    host: Host,
    url: str,
    bodies: Sequence[dict[str, Any]],
    *,
    concurrency: int = 1,
    timeout_s: float = 60.0,
    delay_s: float = 0.0,
) -> subprocess.Popen[str]:
    """POST every body to ``url``/v1/completions from inside ``host``; the child prints one JSON
    line per finished request (see `netns_helpers.load`). Read them with `results`."""
    argv = [
        sys.executable,
        "-m",
        "netns_helpers.load",
        "--url",
        url,
        "--concurrency",
        str(concurrency),
        "--timeout-s",
        str(timeout_s),
        "--delay-s",
        str(delay_s),
        "--bodies",
        json.dumps(list(bodies)),
    ]
    return subprocess.Popen(host.command(argv), stdout=subprocess.PIPE, text=True, cwd=_TESTS_DIR)


def results(process: subprocess.Popen[str], timeout_s: float = 300.0) -> list[dict[str, Any]]:
    """Every result line of a `run_requests` child, in request order, once it exits."""
    stdout, _ = process.communicate(timeout=timeout_s)
    assert process.returncode == 0, f"request runner exited with {process.returncode}"
    lines = [json.loads(line) for line in stdout.splitlines() if line.strip()]
    return sorted(lines, key=lambda result: result["index"])


def complete(host: Host, url: str, bodies: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    return results(run_requests(host, url, bodies), 300.0)


def admin_status(host: Host, target: str) -> dict[str, Any]:
    """``kvtransfer admin status --json`` of the daemon at ``target``, asked from ``host``."""
    return _admin(host, target, "status")


def admin_transfers(host: Host, target: str) -> list[dict[str, Any]]:
    """The KV transfers in flight on the daemon at ``target`` (``kvtransfer admin transfers``):
    ``request_id``, ``peer_engine_id``, ``direction`` ("send": KV it holds for a consumer,
    "recv": a load under way), ``num_blocks``, ``num_bytes``, ``age_s``."""
    return _admin(host, target, "transfers")["transfers"]


def _admin(host: Host, target: str, action: str) -> dict[str, Any]:
    argv = [sys.executable, "-m", "kvtransfer", "admin", action, "--target", target, "--json"]
    done = subprocess.run(host.command(argv), capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def http_call(
    host: Host,
    method: str,
    url: str,
    body: Any = None,
    *,
    token: str | None = None,
) -> tuple[int, Any]:
    """One HTTP call from inside ``host`` (``body`` sent as JSON; ``token`` as a bearer token):
    ``(status, answer)``, the answer parsed as JSON when it is JSON, else its text; status 0
    when no HTTP answer came."""
    argv = [sys.executable, "-m", "netns_helpers.call", "http", method, url]
    if body is not None:
        argv += ["--body", json.dumps(body)]
    env = {**os.environ, TOKEN_ENV: token} if token is not None else None
    answer = _call(host, argv, env)
    return answer["status"], answer["body"]


def generate_on(
    host: Host,
    target: str,
    prompt: str,
    max_tokens: int,
    *,
    request_id: str = "direct",
    params: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """The daemon at ``target`` called directly from inside ``host`` (no router; ``params``: the
    request's ``kv_transfer_params``): ``token_ids``, ``finish_reason``, ``error``,
    ``num_prompt_tokens``, ``kv_transfer_params``, ``elapsed_s`` (the call alone)."""
    argv = [sys.executable, "-m", "netns_helpers.call", "generate", target, prompt]
    argv += [str(max_tokens), "--request-id", request_id]
    if params is not None:
        argv += ["--params", json.dumps(params)]
    return _call(host, argv, None)


def _call(host: Host, argv: list[str], env: dict[str, str] | None) -> dict[str, Any]:
    done = subprocess.run(
        host.command(argv),
        capture_output=True,
        text=True,
        timeout=120,
        cwd=_TESTS_DIR,
        env=env,
    )
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)
