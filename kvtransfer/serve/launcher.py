"""`ServiceProcess`: start a daemon or the router as a child process and wait until it is ready.

The demo and the end-to-end tests use it. A child announces readiness with one stdout line
(``kvtransfer-<role> ready {json}`` or ``router listening on http://...``); everything else
it writes goes to a log file, so a failed start can be shown to the user.
"""

from __future__ import annotations

import json
import os
import re
import selectors
import signal
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

DEFAULT_START_TIMEOUT_S = 120.0
# The daemon's last log line reads "stopped: N KV blocks in use at exit".
EXIT_BLOCKS_PREFIX = "stopped: "
EXIT_BLOCKS_MARKER = "KV blocks in use at exit"
_ROUTER_READY = re.compile(r"router listening on (http://\S+)")


class ServiceStartError(RuntimeError):
    """The child exited, or did not report ready in time; the message holds its log tail."""


class ServiceProcess:
    def __init__(
        self, name: str, popen: subprocess.Popen[str], log_path: Path, ready: dict[str, Any]
    ) -> None:
        self.name = name
        self.popen = popen
        self.log_path = log_path
        self.ready = ready

    @classmethod
    def start(
        cls,
        name: str,
        argv: Sequence[str],
        log_path: Path,
        *,
        env: Mapping[str, str] | None = None,
        timeout_s: float = DEFAULT_START_TIMEOUT_S,
    ) -> ServiceProcess:
        log_path.parent.mkdir(parents=True, exist_ok=True)
        log = log_path.open("w")
        popen = subprocess.Popen(
            list(argv),
            stdout=subprocess.PIPE,
            stderr=log,
            text=True,
            env={**os.environ, **(env or {})},
        )
        log.close()
        try:
            ready = _wait_ready(name, popen, log_path, timeout_s)
        except BaseException:
            popen.kill()
            popen.wait()
            raise
        return cls(name, popen, log_path, ready)

    @property
    def address(self) -> str:
        """A daemon's gRPC address, or the router's base URL."""
        return str(self.ready.get("grpc") or self.ready["url"])

    @property
    def pid(self) -> int:
        return self.popen.pid

    def is_alive(self) -> bool:
        return self.popen.poll() is None

    def terminate(self, timeout_s: float = 60.0) -> int:
        """SIGTERM, wait up to ``timeout_s``, then SIGKILL; returns the exit code."""
        if self.popen.poll() is None:
            self.popen.send_signal(signal.SIGTERM)
            try:
                self.popen.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.popen.kill()
                self.popen.wait()
        self._close_stdout()
        return int(self.popen.returncode)

    def kill(self) -> None:
        if self.popen.poll() is None:
            self.popen.kill()
        self.popen.wait()
        self._close_stdout()

    def blocks_in_use_at_exit(self) -> int | None:
        """What a stopped daemon logged last: KV blocks still in use (``None``: not reported)."""
        for line in reversed(self.log_path.read_text(errors="replace").splitlines()):
            if EXIT_BLOCKS_MARKER in line:
                value = line.rsplit(EXIT_BLOCKS_PREFIX, 1)[1].split(" ", 1)[0]
                return None if value == "unknown" else int(value)
        return None

    def log_tail(self, lines: int = 20) -> str:
        return log_tail(self.log_path, lines)

    def _close_stdout(self) -> None:
        if self.popen.stdout is not None:
            self.popen.stdout.close()


def daemon_command(role: str, *flags: str) -> list[str]:
    module = {"prefill": "kvtransfer.serve.prefill_node", "decode": "kvtransfer.serve.decode_node"}[
        role
    ]
    return [sys.executable, "-m", module, *flags]


def router_command(*flags: str) -> list[str]:
    return [sys.executable, "-m", "kvtransfer.router", *flags]


def log_tail(path: Path, lines: int = 20) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""


def _wait_ready(
    name: str, popen: subprocess.Popen[str], log_path: Path, timeout_s: float
) -> dict[str, Any]:
    assert popen.stdout is not None  # Popen was given stdout=PIPE
    selector = selectors.DefaultSelector()
    selector.register(popen.stdout, selectors.EVENT_READ)
    deadline = time.monotonic() + timeout_s
    try:
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise ServiceStartError(
                    f"{name} did not report ready within {timeout_s:g} s; last log lines:\n"
                    f"{log_tail(log_path)}"
                )
            if not selector.select(min(remaining, 0.5)):
                continue
            line = popen.stdout.readline()
            if not line:
                code = popen.wait()
                raise ServiceStartError(
                    f"{name} exited with code {code} before it was ready; last log lines:\n"
                    f"{log_tail(log_path)}"
                )
            ready = _parse_ready(line)
            if ready is not None:
                return ready
    finally:
        selector.close()


def _parse_ready(line: str) -> dict[str, Any] | None:
    if " ready {" in line and line.startswith("kvtransfer-"):
        return json.loads(line.split(" ready ", 1)[1])
    match = _ROUTER_READY.search(line)
    if match:
        return {"url": match.group(1)}
    return None
