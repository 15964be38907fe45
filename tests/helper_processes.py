"""Test helper modules run as child processes (``python -m control_helpers.prefill_server``,
``transport_helpers.kv_server``, ...): started with ``tests/`` importable, ready once they print
one JSON line, stopped by closing their stdin."""

from __future__ import annotations

import json
import os
import queue
import subprocess
import sys
import threading
from contextlib import suppress
from pathlib import Path
from typing import Any

TESTS_DIR = Path(__file__).resolve().parent


def spawn(module: str, *args: str, env: dict[str, str] | None = None) -> subprocess.Popen[str]:
    """``python -m module args...`` with pipes to stdin and stdout; ``env`` adds variables."""
    full = {**os.environ, **(env or {})}
    full["PYTHONPATH"] = os.pathsep.join(filter(None, [str(TESTS_DIR), full.get("PYTHONPATH")]))
    return subprocess.Popen(
        [sys.executable, "-m", module, *args],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env=full,
    )


def read_ready_line(process: subprocess.Popen[str], timeout_s: float, name: str) -> dict[str, Any]:
    """The JSON line a helper prints once it serves; fails if it exits first or stays silent."""
    lines: queue.Queue[str] = queue.Queue()
    stdout = process.stdout
    if stdout is None:
        raise RuntimeError("no stdout pipe")
    threading.Thread(target=lambda: lines.put(stdout.readline()), daemon=True).start()
    line = lines.get(timeout=timeout_s)
    if not line:
        raise RuntimeError(f"{name} exited with {process.wait()} before serving")
    return json.loads(line)


def stop(process: subprocess.Popen[str], timeout_s: float) -> None:
    """Close its stdin (the helper's cue to exit) and wait; kill it and raise if it hangs."""
    try:
        if process.stdin is not None and not process.stdin.closed:
            with suppress(BrokenPipeError):
                process.stdin.close()
        try:
            process.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
            raise
    finally:
        if process.stdout is not None:
            process.stdout.close()
