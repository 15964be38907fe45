"""Start `control_helpers.prefill_server` in a subprocess and stop it cleanly."""

from __future__ import annotations

import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from helper_processes import read_ready_line, spawn, stop


@dataclass(frozen=True)
class ServerProcess:
    address: str
    generation: int
    received: dict[str, str]
    process: subprocess.Popen[str]


@contextmanager
def prefill_server(*args: str, timeout_s: float = 30.0) -> Iterator[ServerProcess]:
    process = spawn("control_helpers.prefill_server", *args)
    try:
        ready = read_ready_line(process, timeout_s, "prefill server")
        yield ServerProcess(ready["address"], ready["generation"], ready["received"], process)
    finally:
        stop(process, 10)
    if process.returncode != 0:
        raise RuntimeError(f"prefill server exited with {process.returncode}")
