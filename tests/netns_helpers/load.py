"""Run completion requests against a router from inside a test host; stdlib only, so it starts
fast. Posts a JSON list of bodies (``--bodies``) with ``--concurrency`` threads (starting one
every ``--delay-s``) and prints one JSON line per finished request as it finishes::

    {"index": 3, "status": 200, "body": {...}, "elapsed_s": 0.41, "started_s": 1.2,
     "started_at": 5123.4}

``status`` 0 means no HTTP answer at all (the body then holds the exception's text).
``started_at`` is `time.monotonic` when the request was sent: one clock for every namespace of
the machine, so a test can tell which requests were sent while it had a host cut off.
"""

from __future__ import annotations

import argparse
import json
import threading
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from typing import Any


def post(url: str, body: dict[str, Any], timeout_s: float) -> tuple[int, Any]:
    request = urllib.request.Request(
        f"{url}/v1/completions",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as response:
            return response.status, _decode(response.read())
    except urllib.error.HTTPError as exc:
        return exc.code, _decode(exc.read())
    except Exception as exc:
        return 0, f"{type(exc).__name__}: {exc}"


def _decode(raw: bytes) -> Any:
    try:
        return json.loads(raw)
    except ValueError:
        return raw.decode(errors="replace")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--url", required=True)
    parser.add_argument("--concurrency", type=int, default=1)
    parser.add_argument("--timeout-s", type=float, default=60.0)
    parser.add_argument("--delay-s", type=float, default=0.0)
    parser.add_argument("--bodies", required=True, help="JSON list of request bodies")
    args = parser.parse_args()
    bodies = json.loads(args.bodies)
    lock = threading.Lock()
    origin = time.monotonic()

    def run(index: int, body: dict[str, Any]) -> None:
        # Paced from the start, not from the previous answer: a stalled request does not
        # hold the next ones back (the load's pacing, not synchronisation).
        time.sleep(max(0.0, origin + index * args.delay_s - time.monotonic()))
        started = time.monotonic()
        status, answer = post(args.url, body, args.timeout_s)
        line = {
            "index": index,
            "status": status,
            "body": answer,
            "elapsed_s": round(time.monotonic() - started, 3),
            "started_s": round(started - origin, 3),
            "started_at": started,
        }
        with lock:
            print(json.dumps(line), flush=True)

    with ThreadPoolExecutor(max(1, args.concurrency)) as pool:
        for index, body in enumerate(bodies):
            pool.submit(run, index, body)


if __name__ == "__main__":
    main()
