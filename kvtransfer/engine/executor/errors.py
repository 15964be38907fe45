"""The errors an `Executor` raises, each naming the worker rank(s) it is about.

They live apart from `executor.py` because both the executor and the worker-process side of the
pipe (`executor_messages.Failed`) build them; `kvtransfer.engine.executor.executor` re-exports them.
"""

from __future__ import annotations

import signal
from collections.abc import Sequence

from kvtransfer.engine.parallel import ParallelRank


def describe_rank(rank: ParallelRank) -> str:
    """How messages name a worker, e.g. ``worker rank 1 (pp 0, tp 1)``."""
    return f"worker rank {rank.rank} (pp {rank.pp_rank}, tp {rank.tp_rank})"


class ExecutorError(RuntimeError):
    """Base of the executor's errors."""


class WorkerError(ExecutorError):
    """A worker raised; the worker's traceback is attached as a note and `traceback_text`."""

    def __init__(
        self, rank: ParallelRank, exc_type: str, message: str, traceback_text: str = ""
    ) -> None:
        super().__init__(f"{describe_rank(rank)} failed: {exc_type}: {message}")
        self.rank = rank
        self.exc_type = exc_type
        self.message = message
        self.traceback_text = traceback_text
        if traceback_text:
            self.add_note(f"traceback in {describe_rank(rank)}:\n{traceback_text.rstrip()}")


def describe_death(exitcode: int | None) -> str:
    """How a child process went away, for error messages (signal named when there is one)."""
    if exitcode is None:
        return "closed its pipe (exit code unknown)"
    if exitcode < 0:
        return f"died with exit code {exitcode} ({signal.Signals(-exitcode).name})"
    return f"died with exit code {exitcode}"


class WorkerDiedError(ExecutorError):
    """A worker process exited without being asked to (crash, signal, ``os._exit``)."""

    def __init__(self, rank: ParallelRank, exitcode: int | None) -> None:
        super().__init__(f"{describe_rank(rank)} {describe_death(exitcode)}")
        self.rank = rank
        self.exitcode = exitcode


class WorkerTimeoutError(ExecutorError):
    """Workers did not answer within the allowed time."""

    def __init__(self, ranks: Sequence[ParallelRank], what: str, timeout_s: float) -> None:
        names = ", ".join(describe_rank(r) for r in ranks)
        super().__init__(f"{names} did not answer {what} within {timeout_s:g} s")
        self.ranks = tuple(ranks)


class ExecutorClosedError(ExecutorError):
    """The executor was shut down, or failed earlier."""
