"""The router's admin HTTP API: the fleet, read and changed while the router serves.

- ``GET /workers``: every instance with its role, source, health state, circuit breaker, in
  flight, picks and last reported load; and each role's policy.
- ``POST /workers`` with ``{"address": "HOST:PORT", "role": "prefill"|"decode"|"aggregated"}``:
  adds an instance, checks it once (health and load) and answers 201 with it; 400 naming what
  is wrong with the body, 409 when the address is in the fleet already.
- ``DELETE /workers/{address}``: takes the instance out now (no new request picks it; those in
  flight on it finish) and answers 200 with it as it was; 404 when it is not in the fleet. An
  instance that came from DNS comes back at the next resolution that still lists it.

Every call needs ``Authorization: Bearer <token>`` with the router's admin token (compared in
constant time): 401 without it or with another. A router started without a token answers 403:
the API is off. Errors have OpenAI's shape, like the rest of the router's.
"""

from __future__ import annotations

import hmac
import json
import logging
from collections.abc import Callable
from typing import Any

from aiohttp import web

from kvtransfer.router.config import check_address
from kvtransfer.router.echo import ECHO_CHARS, clipped, echo
from kvtransfer.router.fleet.fleet import Fleet
from kvtransfer.router.fleet.instance import ADMIN, InstancePresent
from kvtransfer.router.names import ROLES, WORKER_ROLES
from kvtransfer.router.openai.requests import error_body

logger = logging.getLogger("kvtransfer.router.admin")

_BEARER = "bearer"
_FIELDS = ("address", "role")


class AdminApi:
    def __init__(self, token: str | None, fleet: Callable[[], Fleet]) -> None:
        self._expected = None if token is None else token.encode()
        self._fleet = fleet

    def add_routes(self, app: web.Application) -> None:
        app.router.add_get("/workers", self.list_workers)
        app.router.add_post("/workers", self.add_worker)
        app.router.add_delete("/workers/{address}", self.remove_worker)

    async def list_workers(self, request: web.Request) -> web.Response:
        refused = self._refusal(request)
        if refused is not None:
            return refused
        fleet = self._fleet()
        return web.json_response(
            {
                "workers": [i.describe() for i in fleet.instances()],
                "policies": {role: fleet.policies[role].name for role in ROLES},
            }
        )

    async def add_worker(self, request: web.Request) -> web.Response:
        refused = self._refusal(request)
        if refused is not None:
            return refused
        try:
            address, role = _worker(await request.read())
        except _BadBody as exc:
            return _error(400, str(exc), param=exc.param)
        fleet = self._fleet()
        try:
            instance = fleet.add(role, address, ADMIN)
        except InstancePresent as exc:
            return _error(409, str(exc), param="address", code="worker_exists")
        await fleet.check_instances([instance])
        logger.info("admin API: %s added (%s)", instance.name, instance.state)
        return web.json_response(instance.describe(), status=201)

    async def remove_worker(self, request: web.Request) -> web.Response:
        refused = self._refusal(request)
        if refused is not None:
            return refused
        address = request.match_info["address"]
        try:
            instance = self._fleet().remove(address)
        except KeyError:
            return _error(404, f"{address} is not in the fleet", code="worker_not_found")
        logger.info("admin API: %s removed", instance.name)
        return web.json_response(instance.describe())

    def _refusal(self, request: web.Request) -> web.Response | None:
        """None when the request carries the admin token; else the answer to give."""
        if self._expected is None:
            message = (
                "the admin API is disabled: start the router with --admin-token-file or "
                "KVTRANSFER_ROUTER_ADMIN_TOKEN"
            )
            return _error(403, message, code="admin_api_disabled")
        scheme, _, given = request.headers.get("Authorization", "").partition(" ")
        if not scheme:
            problem = "missing admin token (send 'Authorization: Bearer <token>')"
        else:
            # Compared even when the scheme is wrong: no hint from the response time.
            matches = hmac.compare_digest(given.strip().encode("utf-8", "replace"), self._expected)
            problem = None if scheme.lower() == _BEARER and matches else "wrong admin token"
        if problem is None:
            return None
        logger.warning("admin API: %s %s refused: %s", request.method, request.path, problem)
        return _error(401, problem, code="unauthorized", headers={"WWW-Authenticate": "Bearer"})


class _BadBody(ValueError):
    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


def _worker(raw: bytes) -> tuple[str, str]:
    """(address, role) of a ``POST /workers`` body."""
    shape = '{"address": "HOST:PORT", "role": "prefill", "decode" or "aggregated"}'
    try:
        body: Any = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise _BadBody(f"the body is not JSON ({exc}); expected {shape}") from None
    if not isinstance(body, dict):
        raise _BadBody(f"the body must be a JSON object {shape}")
    unknown = sorted(set(body) - set(_FIELDS))
    if unknown:
        listed = clipped(", ".join(unknown), ECHO_CHARS)
        raise _BadBody(
            f"unknown field(s) {listed}; expected {shape}", clipped(unknown[0], ECHO_CHARS)
        )
    for name in _FIELDS:
        if name not in body:
            raise _BadBody(f"{name}: required; expected {shape}", name)
        if not isinstance(body[name], str):
            raise _BadBody(f"{name}: must be a string", name)
    address, role = body["address"], body["role"]
    if role not in WORKER_ROLES:
        raise _BadBody(
            f"role: must be 'prefill', 'decode' or 'aggregated', got {echo(role)}", "role"
        )
    try:
        check_address(address)
    except ValueError as exc:
        raise _BadBody(f"address: {exc}", "address") from None
    return address, role


def _error(
    status: int,
    message: str,
    *,
    param: str | None = None,
    code: str | None = None,
    headers: dict[str, str] | None = None,
) -> web.Response:
    body = error_body(message, "invalid_request_error", param, code)
    return web.json_response(body, status=status, headers=headers)
