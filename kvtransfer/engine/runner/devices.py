"""The CUDA device of a worker, and a typed refusal on a machine where torch sees none."""

from __future__ import annotations

import os

import torch


class NoCudaDeviceError(ValueError):
    """``device="cuda"`` was asked for where torch sees no CUDA device."""


def cuda_device_for(rank: int) -> torch.device:
    """The GPU of global rank ``rank``: ranks take the visible devices in turn.

    Raises `NoCudaDeviceError` where there is none (a CPU-only torch build, no driver,
    ``CUDA_VISIBLE_DEVICES`` empty): ``rank % 0`` would fail with a bare ZeroDivisionError.
    """
    count = torch.cuda.device_count()
    if count == 0:
        visible = os.environ.get("CUDA_VISIBLE_DEVICES", "unset")
        raise NoCudaDeviceError(
            f"device 'cuda' was asked for but torch {torch.__version__} sees no CUDA device "
            f"(torch built for CUDA {torch.version.cuda}, CUDA_VISIBLE_DEVICES={visible}); "
            "use device 'cpu' or run on a machine with a GPU"
        )
    return torch.device("cuda", rank % count)
