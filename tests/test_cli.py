from __future__ import annotations

import pytest

from kvtransfer.cli import main

pytestmark = pytest.mark.unit


def test_demo_flags_reach_the_demo(capsys):
    with pytest.raises(SystemExit) as info:
        main(["demo", "--help"])
    assert info.value.code == 0
    assert "usage: kvtransfer demo" in capsys.readouterr().out


def test_unknown_command_is_a_usage_error(capsys):
    with pytest.raises(SystemExit) as info:
        main(["bogus"])
    assert info.value.code == 2
    assert "invalid choice: 'bogus'" in capsys.readouterr().err
