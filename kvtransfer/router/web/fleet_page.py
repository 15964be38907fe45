"""The fleet page: the router's instances by role and its last requests, live, in a browser.

- ``GET /dashboard``: the page, plain HTML with its script and style beside it
  (``/dashboard/fleet.js``, ``/dashboard/fleet.css``; files in ``static/``, no build step). The
  script polls the state every second (``?interval_ms=N`` changes that, 100 to 60000) and draws
  a request's timeline as SVG bars, a lane per party.
- ``GET /dashboard/state``: the JSON it draws (`fleet_state`).
- ``GET /dashboard/requests/{request_id}``: one of the last requests with its choices' timeline
  rows; 404 when it is not among them.

Reading is open, as ``/health`` and ``/metrics`` are: the page shows what those and the logs
tell (addresses, states, counts, timings, the timeline rows answers carry) and no prompt,
completion or token id. A request's error message is shown as the router wrote it, and may
quote a field of the request (an unknown model's name: at most `echo.ECHO_CHARS` of it, the
message at most `recent.MAX_ERROR_CHARS`). The page changes nothing by itself: changing the
fleet from it (adding or removing an instance) calls the admin API (`admin_api`) with the token
typed into the page, sent as ``Authorization: Bearer`` and kept in the tab's
``sessionStorage``, never in a URL; its 401 and 403 answers are shown as they come.

Who may read it is the network's business: the router binds 127.0.0.1 by default, which keeps
the page off the network but not from a web page that a browser on the same host opened and
that rebinds its own name to 127.0.0.1 (DNS rebinding: it could read what this page shows,
and change nothing without the token). Expose ``/dashboard`` only where the operators' network
policy lets them reach it, or start the router with ``--no-dashboard``: these routes are left
out (404) and no record of requests is kept.

The page is served with a Content-Security-Policy that runs only its own script and reaches
only this router, and may not be framed (its buttons cannot be clickjacked); its script writes
every fleet-provided string as text, never as markup.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from importlib import resources

from aiohttp import web

from kvtransfer.router.config import RouterConfig
from kvtransfer.router.fleet.fleet import Fleet
from kvtransfer.router.openai.requests import error_body
from kvtransfer.router.web.admission import Admission
from kvtransfer.router.web.fleet_state import fleet_state
from kvtransfer.router.web.recent import RecentRequests

_STATIC = {
    "fleet.html": "text/html",
    "fleet.js": "text/javascript",
    "fleet.css": "text/css",
}
_PAGE_HEADERS = {
    "Content-Security-Policy": (
        "default-src 'none'; script-src 'self'; style-src 'self'; connect-src 'self'; "
        "img-src 'self' data:; base-uri 'none'; form-action 'none'; frame-ancestors 'none'"
    ),
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-cache",
}
_LIVE = {"Cache-Control": "no-store", "X-Content-Type-Options": "nosniff"}


class FleetPage:
    def __init__(
        self,
        config: RouterConfig,
        fleet: Callable[[], Fleet],
        admission: Admission,
        recent: RecentRequests,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._config = config
        self._fleet = fleet
        self._admission = admission
        self._recent = recent
        self._clock = clock
        self._started = clock()
        folder = resources.files(__package__).joinpath("static")
        self._files = {name: folder.joinpath(name).read_bytes() for name in _STATIC}

    def add_routes(self, app: web.Application) -> None:
        app.router.add_get("/dashboard", self._file_handler("fleet.html"))
        app.router.add_get("/dashboard/fleet.js", self._file_handler("fleet.js"))
        app.router.add_get("/dashboard/fleet.css", self._file_handler("fleet.css"))
        app.router.add_get("/dashboard/state", self.state)
        app.router.add_get("/dashboard/requests/{request_id}", self.request)

    def _file_handler(self, name: str) -> Callable[[web.Request], Awaitable[web.Response]]:
        body, content_type = self._files[name], _STATIC[name]

        async def serve(request: web.Request) -> web.Response:
            return web.Response(
                body=body, content_type=content_type, charset="utf-8", headers=_PAGE_HEADERS
            )

        return serve

    async def state(self, request: web.Request) -> web.Response:
        body = fleet_state(
            self._config,
            self._fleet(),
            self._admission,
            self._recent,
            self._clock() - self._started,
        )
        return web.json_response(body, headers=_LIVE)

    async def request(self, request: web.Request) -> web.Response:
        request_id = request.match_info["request_id"]
        summary = self._recent.get(request_id)
        if summary is None:
            message = (
                f"{request_id} is not among the last {self._recent.capacity} requests "
                "this router answered"
            )
            body = error_body(message, "invalid_request_error", None, "request_not_found")
            return web.json_response(body, status=404, headers=_LIVE)
        return web.Response(
            body=summary.detail_json, content_type="application/json", headers=_LIVE
        )
