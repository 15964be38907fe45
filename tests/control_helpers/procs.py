"""Start `control_helpers.prefill_server` in a subprocess and stop it cleanly."""

from __future__ import annotations

import json
import os
import queue
import subprocess
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

TESTS_DIR = Path(__file__).resolve().parents[1]


@dataclass(frozen=True)
class ServerProcess:
    address: str
    generation: int
    received: dict[str, str]
    process: subprocess.Popen[str]


@contextmanager
def prefill_server(*args: str, timeout_s: float = 30.0) -> Iterator[ServerProcess]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(TESTS_DIR), env.get("PYTHONPATH")]))
    process = subprocess.Popen(
        [sys.executable, "-m", "control_helpers.prefill_server", *args],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env=env,
    )
    try:
        ready = _read_ready_line(process, timeout_s)
        yield ServerProcess(ready["address"], ready["generation"], ready["received"], process)
    finally:
        if process.stdin is not None:
            process.stdin.close()
        try:
            process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
            raise
        finally:
            if process.stdout is not None:
                process.stdout.close()
    if process.returncode != 0:
        raise RuntimeError(f"prefill server exited with {process.returncode}")


def _read_ready_line(process: subprocess.Popen[str], timeout_s: float) -> dict[str, Any]:
    lines: queue.Queue[str] = queue.Queue()
    stdout = process.stdout
    if stdout is None:
        raise RuntimeError("no stdout pipe")
    threading.Thread(target=lambda: lines.put(stdout.readline()), daemon=True).start()
    line = lines.get(timeout=timeout_s)
    if not line:
        raise RuntimeError(f"prefill server exited with {process.wait()} before serving")
    return json.loads(line)
