"""Start `transport_helpers.kv_server` subprocesses and stop them cleanly (or kill them)."""

from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from pathlib import Path

from kvtransfer.transport import KVLayout
from transport_helpers.kv import LayerGroup

TESTS_DIR = Path(__file__).resolve().parents[1]


@dataclass(frozen=True)
class ServerSpec:
    seed: int
    groups: tuple[LayerGroup, ...]
    serve: bool = True


@dataclass(frozen=True)
class KVServerProcess:
    address: bytes
    layouts: dict[str, KVLayout]
    process: subprocess.Popen[str]

    def kill(self) -> None:
        self.process.kill()
        self.process.wait()


def _spawn(spec: ServerSpec) -> subprocess.Popen[str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(TESTS_DIR), env.get("PYTHONPATH")]))
    # One intra-op thread: the test machine may have two cores shared by several processes.
    env.setdefault("OMP_NUM_THREADS", "1")
    args = [sys.executable, "-m", "transport_helpers.kv_server", "--seed", str(spec.seed)]
    for group in spec.groups:
        args += ["--group", group.encode()]
    if not spec.serve:
        args.append("--no-serve")
    return subprocess.Popen(args, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)


@contextmanager
def kv_servers(
    specs: Sequence[ServerSpec], *, timeout_s: float = 60.0
) -> Iterator[list[KVServerProcess]]:
    """Start all servers at once (they boot in parallel), yield them once all are serving."""
    processes = [_spawn(spec) for spec in specs]
    try:
        servers = []
        for process in processes:
            ready = _read_ready_line(process, timeout_s)
            servers.append(
                KVServerProcess(
                    bytes.fromhex(ready["address"]),
                    {name: KVLayout.from_dict(v) for name, v in ready["layouts"].items()},
                    process,
                )
            )
        yield servers
    finally:
        for process in processes:
            _stop(process)
    # A killed server is part of a test; any other non-zero exit is a failure.
    failed = [p.returncode for p in processes if p.returncode not in (0, -signal.SIGKILL)]
    if failed:
        raise RuntimeError(f"KV server(s) exited with {failed}")


@contextmanager
def kv_server(
    seed: int, groups: Sequence[LayerGroup], *, serve: bool = True
) -> Iterator[KVServerProcess]:
    with kv_servers([ServerSpec(seed, tuple(groups), serve)]) as (server,):
        yield server


def _stop(process: subprocess.Popen[str]) -> None:
    try:
        if process.stdin is not None and not process.stdin.closed:
            with suppress(BrokenPipeError):
                process.stdin.close()
        try:
            process.wait(timeout=20)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
            raise
    finally:
        if process.stdout is not None:
            process.stdout.close()


def _read_ready_line(process: subprocess.Popen[str], timeout_s: float) -> dict:
    lines: queue.Queue[str] = queue.Queue()
    stdout = process.stdout
    if stdout is None:
        raise RuntimeError("no stdout pipe")
    threading.Thread(target=lambda: lines.put(stdout.readline()), daemon=True).start()
    line = lines.get(timeout=timeout_s)
    if not line:
        raise RuntimeError(f"KV server exited with {process.wait()} before serving")
    return json.loads(line)
