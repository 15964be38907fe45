"""Two roles around a peer that dies in the middle of a large UCX message, run as processes.

``receive``: prints its packed address (one JSON line), reads the sender's from stdin, posts a
receive of ``--size`` bytes under tag 7 with a ``--timeout`` (its endpoint to the sender made
while the sender lives), says ``{"posted": true}``, and prints how the receive ended
(``{"ended": "timed out" | "error: ..." | "received"}``), then exits 0. Aborted by UCX, it
prints nothing more and exits by signal.

``send``: reads the receiver's address from stdin, prints its own (one JSON line), waits for a
line on stdin, sends ``--size`` bytes under tag 7 and SIGKILLs itself as soon as the send is
posted, before the receiver can have copied it all.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import threading

import numpy as np

from kvtransfer.transport.ucx import UcxLoop

TAG = 7


def _say(message: dict) -> None:
    print(json.dumps(message), flush=True)


def _receive(size: int, timeout_s: float) -> None:
    loop = UcxLoop(name="receiver")
    _say({"address": loop.address.hex()})
    sender = bytes.fromhex(json.loads(sys.stdin.readline())["address"])
    buffer = np.zeros(size, dtype=np.uint8)
    ended: list[str] = []
    done = threading.Event()

    def on_done(error: BaseException | None) -> None:
        ended.append("received" if error is None else f"error: {error}")
        done.set()

    def on_timeout() -> None:
        ended.append("timed out")
        done.set()

    loop.call(
        lambda: loop.recv(sender, buffer, TAG, on_done, timeout_s=timeout_s, on_timeout=on_timeout)
    ).result(timeout_s)
    _say({"posted": True})
    done.wait(timeout_s * 3)
    _say({"ended": ended[0] if ended else "never"})
    loop.close()


def _send(size: int) -> None:
    receiver = bytes.fromhex(json.loads(sys.stdin.readline())["address"])
    loop = UcxLoop(name="sender")
    _say({"address": loop.address.hex()})
    data = np.ones(size, dtype=np.uint8)
    sys.stdin.readline()
    loop.call(lambda: loop.send(receiver, data, TAG)).result(30)
    os.kill(os.getpid(), signal.SIGKILL)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("role", choices=["receive", "send"])
    parser.add_argument("--size", type=int, default=256 << 20)
    parser.add_argument("--timeout", type=float, default=5.0)
    args = parser.parse_args()
    if args.role == "receive":
        _receive(args.size, args.timeout)
    else:
        _send(args.size)


if __name__ == "__main__":
    main()
