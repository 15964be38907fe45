"""`device="cuda"` on a machine where torch sees no GPU is a typed error naming the problem
(it was a bare ZeroDivisionError from ``rank % device_count()``); with GPUs, ranks take the
visible devices in turn."""

from __future__ import annotations

import pytest
import torch

from kvtransfer.engine.config import EngineConfig
from kvtransfer.engine.executor.errors import WorkerError
from kvtransfer.engine.llm import LLM
from kvtransfer.engine.runner.devices import NoCudaDeviceError, cuda_device_for

pytestmark = pytest.mark.unit

NO_GPU = torch.cuda.device_count() == 0


def _refusal() -> str:
    return (
        f"device 'cuda' was asked for but torch {torch.__version__} sees no CUDA device "
        f"(torch built for CUDA {torch.version.cuda}, CUDA_VISIBLE_DEVICES=unset); "
        "use device 'cpu' or run on a machine with a GPU"
    )


@pytest.mark.skipif(not NO_GPU, reason="torch sees a GPU here")
def test_no_gpu_is_a_typed_error_naming_it(monkeypatch):
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    with pytest.raises(NoCudaDeviceError) as raised:
        cuda_device_for(0)
    assert str(raised.value) == _refusal()
    assert isinstance(raised.value, ValueError)


@pytest.mark.skipif(not NO_GPU, reason="torch sees a GPU here")
def test_an_engine_asked_for_cuda_without_a_gpu_says_why(monkeypatch):
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    with pytest.raises(WorkerError) as raised:
        LLM(EngineConfig(device="cuda"))
    assert (raised.value.exc_type, raised.value.message) == ("NoCudaDeviceError", _refusal())


@pytest.mark.skipif(NO_GPU, reason="needs CUDA")
def test_ranks_take_the_visible_gpus_in_turn():
    count = torch.cuda.device_count()
    assert [cuda_device_for(rank) for rank in range(2 * count)] == [
        torch.device("cuda", rank % count) for rank in range(2 * count)
    ]
