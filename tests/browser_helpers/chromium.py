"""A real browser for tests: Debian's ``chromium``, headless, driven over the Chrome DevTools
Protocol (CDP) on a websocket. ``console_errors`` collects what a page got wrong: uncaught
exceptions, ``console.error``, and the browser's own error log (a resource that failed to load,
a Content-Security-Policy violation).

`Browser.start` launches one chromium with a throwaway profile and asks it for a free debugging
port (``--remote-debugging-port=0``; chromium writes the port it took into the profile's
``DevToolsActivePort`` file). Calls are synchronous for the tests' sake: each one runs the
websocket exchange on the browser's own event loop.
"""

from __future__ import annotations

import asyncio
import base64
import itertools
import json
import os
import shutil
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp

_START_TIMEOUT_S = 30.0


class BrowserError(RuntimeError):
    """Chromium did not start, or a page raised, or a condition never came true."""


def chromium_path() -> str:
    """The browser binary; CI installs Debian's ``chromium`` (.ci/run), so its absence fails."""
    for name in ("chromium", "chromium-browser"):
        found = shutil.which(name)
        if found:
            return found
    raise BrowserError("no chromium on PATH: install Debian's chromium (apt-get install chromium)")


@dataclass
class Browser:
    process: subprocess.Popen[bytes]
    profile: Path
    _loop: asyncio.AbstractEventLoop
    _session: aiohttp.ClientSession
    _ws: aiohttp.ClientWebSocketResponse
    _ids: itertools.count[int]
    console_errors: list[str]

    @classmethod
    def start(cls, profile: Path, width: int = 1280, height: int = 900) -> Browser:
        profile.mkdir(parents=True, exist_ok=True)
        log = (profile / "chromium.log").open("wb")
        process = subprocess.Popen(
            [
                chromium_path(),
                "--headless",
                # Root in CI and here: chromium's sandbox refuses to run as root.
                "--no-sandbox",
                "--disable-gpu",
                "--disable-dev-shm-usage",
                "--no-first-run",
                "--no-default-browser-check",
                f"--user-data-dir={profile}",
                "--remote-debugging-address=127.0.0.1",
                "--remote-debugging-port=0",
                f"--window-size={width},{height}",
                "about:blank",
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
        )
        loop = asyncio.new_event_loop()
        try:
            port = _wait_for_port(profile / "DevToolsActivePort", process)
            session, ws = loop.run_until_complete(_connect_page(port))
        except BaseException:
            process.kill()
            process.wait()
            loop.close()
            raise
        browser = cls(process, profile, loop, session, ws, itertools.count(1), [])
        browser.call("Page.enable")
        browser.call("Runtime.enable")
        # The browser's own errors: failed loads (a 404), Content-Security-Policy violations.
        browser.call("Log.enable")
        return browser

    def call(self, method: str, **params: Any) -> dict[str, Any]:
        """One CDP command; its ``result``, or `BrowserError` with CDP's error."""
        return self._loop.run_until_complete(self._call(method, params))

    async def _call(self, method: str, params: dict[str, Any]) -> dict[str, Any]:
        ident = next(self._ids)
        await self._ws.send_str(json.dumps({"id": ident, "method": method, "params": params}))
        while True:
            message = await asyncio.wait_for(self._ws.receive(), _START_TIMEOUT_S)
            if message.type != aiohttp.WSMsgType.TEXT:
                raise BrowserError(f"chromium's debugging socket closed during {method}")
            data = json.loads(message.data)
            self._collect_error(data)
            if data.get("id") != ident:
                continue
            if "error" in data:
                raise BrowserError(f"{method}: {data['error']}")
            return data["result"]

    def _collect_error(self, event: dict[str, Any]) -> None:
        """``console_errors`` gets the page's uncaught exceptions, its ``console.error`` calls
        and the browser's error entries (with the URL they are about)."""
        method, params = event.get("method"), event.get("params") or {}
        if method == "Runtime.exceptionThrown":
            details = params["exceptionDetails"]
            self.console_errors.append(json.dumps(details.get("exception", details)))
        elif method == "Runtime.consoleAPICalled" and params.get("type") == "error":
            args = params.get("args", [])
            self.console_errors.append(" ".join(str(a.get("value")) for a in args))
        elif method == "Log.entryAdded" and params["entry"].get("level") == "error":
            entry = params["entry"]
            where = f" ({entry['url']})" if entry.get("url") else ""
            self.console_errors.append(f"{entry.get('source')}: {entry.get('text')}{where}")

    def navigate(self, url: str) -> None:
        self.call("Page.navigate", url=url)
        self.wait_for("document.readyState === 'complete'", f"{url} to load")

    def evaluate(self, expression: str) -> Any:
        """The value of a JavaScript expression in the page (promises awaited)."""
        result = self.call(
            "Runtime.evaluate", expression=expression, returnByValue=True, awaitPromise=True
        )
        if "exceptionDetails" in result:
            raise BrowserError(f"{expression!r} raised: {result['exceptionDetails']}")
        return result["result"].get("value")

    def wait_for(
        self,
        expression: str,
        what: str,
        timeout_s: float = 30.0,
        check: Callable[[Any], bool] = bool,
    ) -> Any:
        """Polls ``expression`` until ``check`` holds for its value; the page changes on its own
        timers, so polling the DOM is the only way to see it change. Raises naming ``what``."""
        deadline = time.monotonic() + timeout_s
        value: Any = None
        while time.monotonic() < deadline:
            value = self.evaluate(expression)
            if check(value):
                return value
            self._loop.run_until_complete(asyncio.sleep(0.1))
        raise BrowserError(f"timed out after {timeout_s:.0f} s waiting for {what}; last {value!r}")

    def screenshot(self, path: Path) -> Path:
        data = self.call("Page.captureScreenshot", format="png", captureBeyondViewport=True)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(base64.b64decode(data["data"]))
        return path

    def close(self) -> None:
        try:
            self._loop.run_until_complete(self._ws.close())
            self._loop.run_until_complete(self._session.close())
        finally:
            self._loop.close()
            self.process.terminate()
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()

    def __enter__(self) -> Browser:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _wait_for_port(active_port: Path, process: subprocess.Popen[bytes]) -> int:
    deadline = time.monotonic() + _START_TIMEOUT_S
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise BrowserError(f"chromium exited with {process.returncode} before listening")
        if active_port.exists():
            first = active_port.read_text().split("\n", 1)[0].strip()
            if first.isdigit():
                return int(first)
        time.sleep(0.05)
    raise BrowserError(f"chromium wrote no {active_port.name} in {_START_TIMEOUT_S:.0f} s")


async def _connect_page(port: int) -> tuple[aiohttp.ClientSession, aiohttp.ClientWebSocketResponse]:
    session = aiohttp.ClientSession()
    try:
        async with session.get(f"http://127.0.0.1:{port}/json/list") as response:
            targets = await response.json()
        pages = [t for t in targets if t.get("type") == "page"]
        if not pages:
            raise BrowserError("chromium opened no page target")
        ws = await session.ws_connect(pages[0]["webSocketDebuggerUrl"], max_msg_size=0)
    except BaseException:
        await session.close()
        raise
    return session, ws


def artifacts_dir() -> Path:
    """Where screenshots are kept for CI to upload: ``$KVTRANSFER_ARTIFACTS`` or
    ``test-artifacts/`` at the repository root (ignored by git)."""
    configured = os.environ.get("KVTRANSFER_ARTIFACTS")
    root = Path(__file__).resolve().parents[2]
    return Path(configured) if configured else root / "test-artifacts"
