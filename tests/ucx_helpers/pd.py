"""Helpers for `PDPair` tests that freeze or kill the prefill while decode waits on it."""

from __future__ import annotations

import threading
import time
from typing import Any

from pd_harness import PDPair

from ucx_helpers.engines import DECODE, PROMPTS


def decode_while_loading(
    pair: PDPair, params: dict[str, Any], prompt: list[int] = PROMPTS[3]
) -> tuple[threading.Thread, list[object]]:
    """Start decoding ``prompt`` with ``params`` on a thread and return once its load is
    posted; the list gets the result (or the exception) when the thread ends."""
    outcome: list[object] = []

    def decode() -> None:
        try:
            outcome.extend(pair.run_decode([prompt], DECODE, [params]))
        except Exception as exc:
            outcome.append(exc)

    thread = threading.Thread(target=decode)
    thread.start()
    deadline = time.monotonic() + 30
    while pair.decode.stats()["num_loading_remote_kvs"] == 0:
        if time.monotonic() >= deadline:
            raise AssertionError("the decode request never started loading")
        time.sleep(0.01)
    time.sleep(0.3)  # the worker posts its pull on its next step
    return thread, outcome
