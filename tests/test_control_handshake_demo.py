"""The control-plane handshake walkthrough across two processes (formerly the main demo)."""

from __future__ import annotations

import pytest
from script_modules import load_script

pytestmark = pytest.mark.integration

demo = load_script("handshake_demo")


def test_demo_runs_end_to_end(capsys):
    assert demo.main([]) == 0
    out = capsys.readouterr().out
    assert "fetched 4 worker payloads" in out
    for pp, tp, layers in [(0, 0, "0-7"), (0, 1, "0-7"), (1, 0, "8-15"), (1, 1, "8-15")]:
        assert any(line.split()[:3] == [str(pp), str(tp), layers] for line in out.splitlines())
    assert "HandshakeCompatibilityError" in out
    assert "block_size: local=32 remote=16" in out
    assert "health (grpc.health.v1): SERVING" in out
    assert "exit code 0" in out
    assert out.rstrip().endswith("demo OK")
