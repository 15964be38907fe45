from __future__ import annotations

import subprocess
import sys

import pytest


@pytest.mark.parametrize("role", ["prefill", "decode"])
def test_daemon_placeholder_says_it_is_not_there_yet(role):
    result = subprocess.run(
        [sys.executable, "-m", f"{role}_node"], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 2
    assert f"kvtransfer-{role}: the {role} daemon is not implemented yet" in result.stderr
