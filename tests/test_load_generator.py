"""A standard OpenAI load generator (aiperf, in .aiperf-venv: ``scripts/dev.sh aiperf``) runs a
short streaming load against the router and real daemons, chat and completions, with zero
errors; the daemons' KV blocks are all free when they stop (`benchmarks/load.py` checks)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.integration, pytest.mark.client]

ROOT = Path(__file__).resolve().parent.parent
AIPERF = ROOT / ".aiperf-venv" / "bin" / "aiperf"


def test_aiperf_completes_chat_and_completions_with_zero_errors(tmp_path):
    assert AIPERF.is_file(), f"{AIPERF} is missing: run `scripts/dev.sh aiperf` first"
    out = tmp_path / "load.json"
    command = [sys.executable, str(ROOT / "benchmarks" / "load.py"), "--quick", "--json", str(out)]
    done = subprocess.run(command, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout + done.stderr
    results = json.loads(out.read_text())
    assert set(results) == {"completions", "chat"}
    for endpoint, result in results.items():
        assert (result["requests"], result["errors"]) == (12, 0), (endpoint, result)
        assert result["error_summary"] == []
        ttft = result["time_to_first_token"]
        assert 0 < ttft["p50"] <= ttft["p99"], (endpoint, ttft)
