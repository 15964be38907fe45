"""Start `transport_helpers.kv_server` subprocesses and stop them cleanly (or kill them)."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

from helper_processes import read_ready_line, spawn, stop

from kvtransfer.transport import KVLayout
from transport_helpers.kv import LayerGroup


@dataclass(frozen=True)
class ServerSpec:
    seed: int
    groups: tuple[LayerGroup, ...]
    serve: bool = True
    order: str = "B2HND"
    data_plane: str = "rma"
    # "ID:SECRET:7,3,9": also take pushes, granting that push lease (see kv_server).
    push_lease: str | None = None


@dataclass(frozen=True)
class KVServerProcess:
    address: bytes
    layouts: dict[str, KVLayout]
    process: subprocess.Popen[str]

    def kill(self) -> None:
        self.process.kill()
        self.process.wait()

    def counters(self) -> dict[str, int]:
        """What the server's code handled so far (``messages_received``: every message)."""
        assert self.process.stdin is not None
        self.process.stdin.write("counters\n")
        self.process.stdin.flush()
        return read_ready_line(self.process, 30, "KV server")


def _spawn(spec: ServerSpec) -> subprocess.Popen[str]:
    args = ["--seed", str(spec.seed)]
    for group in spec.groups:
        args += ["--group", group.encode()]
    if not spec.serve:
        args.append("--no-serve")
    args += ["--order", spec.order, "--data-plane", spec.data_plane]
    if spec.push_lease is not None:
        args += ["--push-lease", spec.push_lease]
    # One intra-op thread: the test machine may have two cores shared by several processes.
    threads = os.environ.get("OMP_NUM_THREADS", "1")
    return spawn("transport_helpers.kv_server", *args, env={"OMP_NUM_THREADS": threads})


@contextmanager
def kv_servers(
    specs: Sequence[ServerSpec], *, timeout_s: float = 60.0
) -> Iterator[list[KVServerProcess]]:
    """Start all servers at once (they boot in parallel), yield them once all are serving."""
    processes = [_spawn(spec) for spec in specs]
    try:
        servers = []
        for process in processes:
            ready = read_ready_line(process, timeout_s, "KV server")
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
            stop(process, 20)
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


def freeze(pid: int, timeout_s: float = 10.0) -> None:
    """SIGSTOP ``pid`` and return once every one of its threads is stopped.

    ``kill`` only queues the stop: one thread takes it and then stops the others, and until
    it is scheduled the rest run on. On two busy cores that took long enough for a UCX
    progress thread to serve a whole 64-block read after ``kill`` had returned."""
    os.kill(pid, signal.SIGSTOP)
    deadline = time.monotonic() + timeout_s
    while not all(_thread_state(pid, tid) in ("T", "t") for tid in os.listdir(f"/proc/{pid}/task")):
        if time.monotonic() > deadline:
            raise TimeoutError(f"process {pid} not stopped {timeout_s} s after SIGSTOP")
        time.sleep(0.001)


def _thread_state(pid: int, tid: str) -> str:
    try:
        with open(f"/proc/{pid}/task/{tid}/stat") as stat:
            # The state follows the command name, which may itself hold spaces and ")".
            return stat.read().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return "T"  # the thread exited: nothing of it runs
