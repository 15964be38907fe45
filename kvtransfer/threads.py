"""kvtransfer's own threads as the operating system sees them: a name `top -H` shows, and an
optional CPU set of their own.

Inside vLLM our threads live in vLLM's worker processes, which vLLM-CPU pins to the cores of
their OpenMP team. A thread of ours that takes CPU there takes it from the rank computing on
that core, and per-thread tools (``top -H``, ``ps -L``, ``/proc/PID/task``) only show "python"
for every thread unless the thread names itself. So each long-lived thread of ours calls
`enter_own_thread` first: its kernel name becomes ``kvtx-...`` (15 bytes at most, the kernel's
limit) and, when a CPU set is configured (`set_thread_cpus`, the ``KVTRANSFER_THREAD_CPUS``
environment variable or the connector's ``thread_cpus``), it moves itself onto it.
"""

from __future__ import annotations

import ctypes
import logging
import os
import threading

logger = logging.getLogger(__name__)

_PR_SET_NAME = 15
_KERNEL_NAME_BYTES = 15
_ENV_CPUS = "KVTRANSFER_THREAD_CPUS"

_lock = threading.Lock()
_cpus: frozenset[int] | None = None
_libc: ctypes.CDLL | None = None


def kernel_name(name: str) -> str:
    """The ``kvtx-`` name a thread called ``name`` shows the kernel (at most 15 bytes)."""
    short = name.removeprefix("kvtransfer-").removeprefix("kvtx-")
    return ("kvtx-" + short).encode()[:_KERNEL_NAME_BYTES].decode(errors="ignore")


def parse_cpus(text: str) -> frozenset[int]:
    """``"0"``, ``"2-3"``, ``"0,2-3"`` -> the CPU numbers; `ValueError` naming the text."""
    cpus: set[int] = set()
    for part in text.split(","):
        part = part.strip()
        try:
            if "-" in part:
                first, last = (int(x) for x in part.split("-", 1))
                if first > last:
                    raise ValueError
                cpus.update(range(first, last + 1))
            else:
                cpus.add(int(part))
        except ValueError:
            raise ValueError(
                f"thread_cpus {text!r} is not a CPU list like '3' or '2-3' or '0,2-3'"
            ) from None
    if not cpus or min(cpus) < 0:
        raise ValueError(f"thread_cpus {text!r} names no CPU")
    return frozenset(cpus)


def set_thread_cpus(cpus: frozenset[int] | None) -> None:
    """The CPU set threads entering after this call move onto (None: they stay on the
    process's). `ValueError` naming a CPU this machine does not have."""
    global _cpus
    if cpus is not None:
        missing = sorted(cpus - set(range(os.cpu_count() or 1)))
        if missing:
            raise ValueError(f"thread_cpus names CPUs this machine does not have: {missing}")
    with _lock:
        _cpus = cpus


def thread_cpus() -> frozenset[int] | None:
    """The configured CPU set (`set_thread_cpus`, else ``KVTRANSFER_THREAD_CPUS``), or None."""
    with _lock:
        if _cpus is not None:
            return _cpus
    text = os.environ.get(_ENV_CPUS, "").strip()
    return parse_cpus(text) if text else None


def enter_own_thread(name: str) -> None:
    """Call first thing in a long-lived thread of ours: names it for the kernel and moves it
    onto the configured CPU set. Never raises: a thread that cannot be named or moved still
    runs (logged once at debug)."""
    global _libc
    try:
        if _libc is None:
            # The process's own symbols hold libc's prctl (find_library would fork a helper).
            _libc = ctypes.CDLL(None, use_errno=True)
        _libc.prctl(_PR_SET_NAME, kernel_name(name).encode(), 0, 0, 0)
    except (OSError, AttributeError):
        logger.debug("cannot name thread %s for the kernel", name, exc_info=True)
    try:
        cpus = thread_cpus()
    except ValueError:
        logger.warning("ignoring %s: not a CPU list", _ENV_CPUS)
        return
    if cpus is None:
        return
    try:
        # pid 0 is the calling thread only (Linux affinity is per thread).
        os.sched_setaffinity(0, cpus)
    except OSError as exc:
        logger.warning("thread %s cannot move onto CPUs %s: %s", name, sorted(cpus), exc)
