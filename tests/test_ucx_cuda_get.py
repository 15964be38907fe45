"""The UCX setting kvtransfer passes for one-sided reads of GPU memory: cuda_ipc GET zero-copy
on (UCX leaves it off without NVLink, and CUDA reads then crawl), unless the operator chose."""

from __future__ import annotations

import logging
import os

import pytest

from kvtransfer.transport import ucx

pytestmark = pytest.mark.unit


def test_get_zero_copy_is_turned_on_when_nobody_chose():
    environ: dict[str, str] = {}
    assert ucx.cuda_get_zcopy(environ) == ("on", True)
    assert environ == {"UCX_CUDA_IPC_ENABLE_GET_ZCOPY": "on"}


@pytest.mark.parametrize("chosen", ["off", "auto", "on"])
def test_the_operators_choice_wins(chosen):
    environ = {"UCX_CUDA_IPC_ENABLE_GET_ZCOPY": chosen}
    assert ucx.cuda_get_zcopy(environ) == (chosen, False)
    assert environ == {"UCX_CUDA_IPC_ENABLE_GET_ZCOPY": chosen}


def test_set_before_a_ucx_context_reads_its_environment_and_logged_once(monkeypatch, caplog):
    monkeypatch.delenv("UCX_CUDA_IPC_ENABLE_GET_ZCOPY", raising=False)
    monkeypatch.setattr(ucx, "_cuda_get_logged", False)
    with caplog.at_level(logging.INFO, logger="kvtransfer.transport.ucx"):
        ucx._ucx_modules()
        ucx._ucx_modules()
    assert os.environ["UCX_CUDA_IPC_ENABLE_GET_ZCOPY"] == "on"
    lines = [r.getMessage() for r in caplog.records if "cuda_ipc GET zero-copy" in r.getMessage()]
    assert lines == [
        "UCX cuda_ipc GET zero-copy (one-sided reads of GPU memory): "
        "UCX_CUDA_IPC_ENABLE_GET_ZCOPY=on (kvtransfer's default; set it to override)"
    ]
