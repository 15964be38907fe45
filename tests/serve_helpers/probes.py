"""Small probes of running services for the end-to-end tests: HTTP calls to the router, admin
status of a daemon (wait for them with `waiting.wait_until`)."""

from __future__ import annotations

import json
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


def used_blocks(daemon) -> int:
    return admin(daemon.address, "status").num_used_blocks


def started(daemon) -> int:
    return admin(daemon.address, "status").counters["requests_started"]
