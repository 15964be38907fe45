"""The router's fleet page (``/dashboard``) in a real browser (Debian's chromium, headless,
`browser_helpers.chromium`) in front of real prefill and decode daemons (child processes): the
fleet renders by role, healthy; a P/D request shows up with its route and its timeline drawn;
an instance added through the admin API appears and one killed turns unhealthy, without a
reload; the page's own admin actions are refused without the right token (the API's message
shown, nothing changed) and done with it; a client's markup in an error shows as text; no
script error, failed load or policy violation but the refused calls (`Browser.console_errors`).
Screenshots go to the artifacts folder (``$KVTRANSFER_ARTIFACTS``, CI keeps them). Without
chromium this fails, it does not skip. The page's JSON and the recent-requests ring alone:
tests/test_router_fleet_state.py and tests/test_router_recent.py."""

from __future__ import annotations

import contextlib
import json
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from decimal import ROUND_HALF_UP, Decimal
from pathlib import Path
from typing import Any

import pytest
from browser_helpers.chromium import Browser, artifacts_dir
from serve_helpers.daemons import BLOCK_SIZE, PROMPTS, start_daemon, start_router
from serve_helpers.probes import post

from kvtransfer.serve.launcher import ServiceProcess

pytestmark = pytest.mark.integration

TOKEN = "fleet-page-admin-token"
# The page polls this often in the test (its default is 1 s): changes show within a poll.
INTERVAL_MS = 200
MAX_TOKENS = 8
HOSTILE = "<img src=x onerror=alert(1)>"

# Every instance row the page shows, as the test reads it.
INSTANCE_ROWS = """
Array.from(document.querySelectorAll('#roles section.role')).flatMap((section) =>
  Array.from(section.querySelectorAll('tbody tr')).map((row) => {
    const text = (col) => row.querySelector(`td[data-col="${col}"]`).textContent;
    return {
      section: section.dataset.role,
      hidden: section.hidden,
      address: row.dataset.address,
      health: row.dataset.health,
      breaker: row.dataset.breaker,
      state: text('health'),
      source: text('source'),
      picks: text('picks'),
      index: text('index'),
    };
  }))
"""

# The last requests' rows: request id -> cells.
REQUEST_ROWS = """
Object.fromEntries(Array.from(document.querySelectorAll('#requests tbody tr')).map((row) => [
  row.dataset.requestId,
  Object.fromEntries(Array.from(row.cells, (c) => [c.dataset.col, c.textContent])),
]))
"""

# The timeline drawn: whose, its lanes and how many bars.
TIMELINE = """
({
  id: document.getElementById('timeline-id').textContent,
  lanes: Array.from(document.querySelectorAll('#timeline-body g.lane'), (g) => g.dataset.lane),
  bars: document.querySelectorAll('#timeline-body rect.span').length,
})
"""

ADMIN_RESULT = """
({
  outcome: document.getElementById('admin-result').dataset.outcome,
  status: document.getElementById('admin-result').dataset.status,
  what: document.getElementById('admin-what').textContent,
  message: document.getElementById('admin-message').textContent,
})
"""


@dataclass
class Fleet:
    router: ServiceProcess
    prefill: ServiceProcess
    decode: ServiceProcess
    # Not in the router's flags: the test adds it through the admin API.
    spare: ServiceProcess


@pytest.fixture
def fleet(tmp_path: Path) -> Iterator[Fleet]:
    logs = tmp_path / "logs"
    token_file = tmp_path / "admin-token"
    token_file.write_text(TOKEN + "\n")
    with contextlib.ExitStack() as stack:

        def started(process: ServiceProcess) -> ServiceProcess:
            stack.callback(process.terminate)
            return process

        prefill = started(start_daemon("prefill", logs, "--engine-id", "p"))
        decode = started(start_daemon("decode", logs, "--engine-id", "d"))
        spare = started(start_daemon("decode", logs, "--engine-id", "d2", name="decode2"))
        # Health checks every 0.2 s: a killed daemon is seen out within a fraction of a second.
        router = started(
            start_router(
                logs,
                [prefill],
                [decode],
                "--admin-token-file",
                str(token_file),
                "--health-interval-s",
                "0.2",
                # The prefix index's column has something to show: the picks' blocks.
                "--policy",
                "cache_aware",
                "--tokenizer",
                "builtin",
            )
        )
        yield Fleet(router, prefill, decode, spare)


@pytest.fixture
def browser(tmp_path: Path) -> Iterator[Browser]:
    with Browser.start(tmp_path / "chromium") as chromium:
        yield chromium


def admin_api(base_url: str, method: str, path: str, body: Any = None) -> tuple[int, Any]:
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(
        f"{base_url}{path}",
        data=data,
        method=method,
        headers={"Authorization": f"Bearer {TOKEN}", "Content-Type": "application/json"},
    )
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def workers(base_url: str) -> set[str]:
    status, body = admin_api(base_url, "GET", "/workers")
    assert status == 200, body
    return {w["address"] for w in body["workers"]}


def rows_by_address(rows: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    return {row["address"]: row for row in rows}


def complete(base_url: str) -> dict[str, Any]:
    status, text = post(base_url, {"prompt": PROMPTS[2], "max_tokens": MAX_TOKENS})
    assert status == 200, text
    return json.loads(text)


def to_fixed_1(value: float) -> str:
    """JavaScript's ``value.toFixed(1)`` of a value >= 0: the float's exact value rounded half
    up (Python's ``f"{value:.1f}"`` rounds a tie to even: 12.25 is "12.2", toFixed's "12.3")."""
    return str(Decimal(value).quantize(Decimal("0.1"), rounding=ROUND_HALF_UP))


def refused(base_url: str, body: dict[str, Any]) -> tuple[int, str, dict[str, Any]]:
    """(status, request id, error) of a request the router refuses."""
    request = urllib.request.Request(
        f"{base_url}/v1/completions",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    with pytest.raises(urllib.error.HTTPError) as failed:
        urllib.request.urlopen(request, timeout=30)
    error = failed.value
    return error.code, error.headers["x-request-id"], json.loads(error.read())["error"]


def type_token(browser: Browser, token: str) -> None:
    browser.evaluate(
        "(() => { const t = document.getElementById('token'); "
        f"t.value = {json.dumps(token)}; t.dispatchEvent(new Event('input')); }})()"
    )


def click_remove(browser: Browser, address: str) -> None:
    browser.evaluate(
        "Array.from(document.querySelectorAll('#roles button[data-action=\"remove\"]'))"
        f".find((b) => b.dataset.address === {json.dumps(address)}).click()"
    )


def wait_for_result(browser: Browser, what: str, status: str) -> dict[str, Any]:
    return browser.wait_for(
        ADMIN_RESULT,
        f"the page to show the answer to {what!r} ({status})",
        check=lambda r: r["what"].startswith(what) and r["status"] == status,
    )


def test_the_fleet_page_follows_the_fleet_live(fleet: Fleet, browser: Browser):
    url = fleet.router.address
    p, d, spare = fleet.prefill.address, fleet.decode.address, fleet.spare.address
    browser.navigate(f"{url}/dashboard?interval_ms={INTERVAL_MS}")

    # The fleet by role, each instance healthy with its breaker closed.
    rows = browser.wait_for(
        INSTANCE_ROWS,
        "the prefill and decode rows, healthy",
        check=lambda rows: (
            {r["address"]: r["health"] for r in rows} == {p: "healthy", d: "healthy"}
        ),
    )
    assert rows_by_address(rows) == {
        p: {
            "section": "prefill",
            "hidden": False,
            "address": p,
            "health": "healthy",
            "breaker": "closed",
            "state": "SERVING",
            "source": "static",
            "picks": "0",
            "index": "0 (routed)",
        },
        d: {
            "section": "decode",
            "hidden": False,
            "address": d,
            "health": "healthy",
            "breaker": "closed",
            "state": "SERVING",
            "source": "static",
            "picks": "0",
            "index": "0 (routed)",
        },
    }
    facts = browser.evaluate(
        "Object.fromEntries(Array.from(document.querySelectorAll('#router-facts > div'), "
        "(f) => [f.dataset.fact, f.querySelector('dd').textContent]))"
    )
    assert (facts["model"], facts["admin API"]) == ("builtin", "on")
    assert facts["policies"] == "prefill cache_aware, decode cache_aware"
    assert browser.evaluate("document.querySelector('section[data-role=\"aggregated\"]').hidden")

    # A P/D request: listed with its route, its timeline drawn bar for span.
    answer = complete(url)
    rid, info = answer["id"], answer["kvtransfer"]
    requests = browser.wait_for(
        REQUEST_ROWS, f"request {rid} in the last requests", check=lambda rows: rid in rows
    )
    assert requests[rid] | {"arrived": "", "ttft": "", "total": ""} == {
        "arrived": "",
        "id": rid,
        "status": "200",
        "prompt": str(answer["usage"]["prompt_tokens"]),
        "out": str(MAX_TOKENS),
        "route": f"{p} → {d}",
        "kv_stream": "yes",
        "retries": "0",
        "ttft": "",
        "total": "",
        "error": "",
    }
    # The ring rounds the answer's TTFT to the microsecond, the page shows it to 0.1 ms.
    assert requests[rid]["ttft"] == to_fixed_1(round(info["ttft_s"] * 1e3, 3))
    timeline = browser.wait_for(
        TIMELINE, f"{rid}'s timeline drawn", check=lambda t: t["id"] == rid and t["bars"] > 0
    )
    assert timeline == {
        "id": rid,
        "lanes": ["router", "prefill", "KV", "decode"],
        "bars": len(info["timeline"]),
    }
    # One pick each, and each role's prefix index learned the prompt's full blocks there (from
    # the pick: the daemons publish no KV events here).
    blocks = answer["usage"]["prompt_tokens"] // BLOCK_SIZE
    rows = browser.wait_for(
        INSTANCE_ROWS,
        "one pick on each daemon",
        check=lambda rows: [r["picks"] for r in rows] == ["1", "1"],
    )
    assert [(r["address"], r["index"]) for r in rows] == [
        (p, f"{blocks} (routed)"),
        (d, f"{blocks} (routed)"),
    ]
    browser.screenshot(artifacts_dir() / "dashboard-request.png")

    # An instance added through the admin API appears, without a reload.
    status, added = admin_api(url, "POST", "/workers", {"address": spare, "role": "decode"})
    assert (status, added["state"]) == (201, "SERVING"), added
    # A poll during the API's first check of it may show it unchecked: wait for the next.
    rows = browser.wait_for(
        INSTANCE_ROWS,
        f"the added decode {spare}, healthy",
        check=lambda rows: rows_by_address(rows).get(spare, {}).get("health") == "healthy",
    )
    assert {k: rows_by_address(rows)[spare][k] for k in ("section", "health", "source")} == {
        "section": "decode",
        "health": "healthy",
        "source": "admin",
    }

    # The page's admin actions, refused: the API's message shown, the fleet unchanged.
    type_token(browser, "")
    browser.evaluate(
        "document.getElementById('add-address').value = '127.0.0.1:9'; "
        "document.getElementById('add-role').value = 'prefill'; "
        "document.getElementById('admin-form').requestSubmit()"
    )
    shown = wait_for_result(browser, "add 127.0.0.1:9 as prefill", "401")
    assert (shown["outcome"], shown["message"]) == (
        "refused",
        "missing admin token (send 'Authorization: Bearer <token>')",
    )
    type_token(browser, "guess")
    click_remove(browser, spare)
    shown = wait_for_result(browser, f"remove {spare}", "401")
    assert (shown["outcome"], shown["message"]) == ("refused", "wrong admin token")
    assert workers(url) == {p, d, spare}
    # The token stays in the tab's storage, never in the address.
    assert browser.evaluate("sessionStorage.getItem('kvtransfer.router.adminToken')") == "guess"
    assert browser.evaluate("window.location.href") == (
        f"{url}/dashboard?interval_ms={INTERVAL_MS}"
    )

    # A daemon killed turns unhealthy on the page, without a reload; requests go elsewhere.
    fleet.decode.kill()
    rows = browser.wait_for(
        INSTANCE_ROWS,
        f"the killed decode {d} unhealthy",
        check=lambda rows: rows_by_address(rows).get(d, {}).get("health") == "unhealthy",
    )
    assert rows_by_address(rows)[d]["state"].startswith("UNREACHABLE ("), rows
    assert {r["address"]: r["health"] for r in rows} == {
        p: "healthy",
        d: "unhealthy",
        spare: "healthy",
    }
    second = complete(url)["id"]
    requests = browser.wait_for(
        REQUEST_ROWS, f"request {second} listed", check=lambda rows: second in rows
    )
    assert requests[second]["route"] == f"{p} → {spare}"
    browser.wait_for(TIMELINE, f"{second}'s timeline drawn", check=lambda t: t["id"] == second)
    browser.screenshot(artifacts_dir() / "dashboard-fleet.png")

    # With the right token, the page's action goes through.
    type_token(browser, TOKEN)
    click_remove(browser, d)
    shown = wait_for_result(browser, f"remove {d}", "200")
    assert (shown["outcome"], shown["message"]) == ("ok", "removed")
    browser.wait_for(
        INSTANCE_ROWS,
        f"{d}'s row gone",
        check=lambda rows: set(rows_by_address(rows)) == {p, spare},
    )
    assert workers(url) == {p, spare}

    # A client's markup in an error the page lists: shown as text, never parsed.
    status, failed, error = refused(url, {"prompt": "x", "model": HOSTILE})
    assert (status, error["message"]) == (
        404,
        f"model '{HOSTILE}' does not exist (this router serves 'builtin')",
    )
    requests = browser.wait_for(
        REQUEST_ROWS, f"request {failed} listed", check=lambda rows: failed in rows
    )
    assert (requests[failed]["status"], requests[failed]["error"]) == ("404", error["message"])
    assert browser.evaluate("document.querySelectorAll('img').length") == 0

    # The browser logged the two refused admin calls as failed loads, and nothing else: no
    # script error, no other failed load, no policy violation.
    refusal = "network: Failed to load resource: the server responded with a status of 401"
    assert browser.console_errors == [
        f"{refusal} (Unauthorized) ({url}/workers)",
        f"{refusal} (Unauthorized) ({url}/workers/{urllib.parse.quote(spare, safe='')})",
    ]
