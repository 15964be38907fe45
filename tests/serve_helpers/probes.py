"""Small probes of running services for the end-to-end tests: HTTP calls to the router, admin
status of a daemon (wait for them with `waiting.wait_until`)."""

from __future__ import annotations

import json
import threading
import urllib.error
import urllib.request
from typing import Any

import grpc

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


def used_blocks(daemon) -> int:
    return admin(daemon.address, "status").num_used_blocks


def started(daemon) -> int:
    return admin(daemon.address, "status").counters["requests_started"]


def cancel_after(call: Any, delay_s: float) -> None:
    """Read a streaming Generate ``call`` while a timer cancels it after ``delay_s``; the call
    must end CANCELLED (not finish first)."""
    timer = threading.Timer(delay_s, call.cancel)
    timer.start()
    try:
        for _ in call:
            pass
    except grpc.RpcError as exc:
        assert exc.code() is grpc.StatusCode.CANCELLED, exc
    else:
        raise AssertionError(f"the call finished before its cancel at {delay_s} s")
    finally:
        timer.join()
