"""Small probes of running services for the end-to-end tests: HTTP calls to the router, admin
status of a daemon, and waiting for a condition."""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request

from serve_helpers.daemons import admin


def post(base_url: str, body: object, raw: bytes | None = None) -> tuple[int, str]:
    data = raw if raw is not None else json.dumps(body).encode()
    request = urllib.request.Request(
        f"{base_url}/v1/completions", data=data, headers={"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(request, timeout=120) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


def get(base_url: str, path: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(f"{base_url}{path}", timeout=30) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


def wait_until(what: str, condition, within_s: float) -> float:
    """Polls ``condition``; returns the seconds it took, failing after ``within_s``."""
    started = time.monotonic()
    while not condition():
        assert time.monotonic() - started < within_s, f"{what}: not within {within_s:g} s"
        time.sleep(0.05)
    return time.monotonic() - started


def used_blocks(daemon) -> int:
    return admin(daemon.address, "status").num_used_blocks


def started(daemon) -> int:
    return admin(daemon.address, "status").counters["requests_started"]
