"""`RouterServer`: the router app served over HTTP inside a running asyncio loop.

    async with RouterServer(RouterConfig(prefill=("127.0.0.1:50051",), decode=(...))) as server:
        ...  # server.url == "http://127.0.0.1:<server.port>"

Stopping stops accepting connections, lets in-flight requests finish for up to
``shutdown_timeout_s`` (then cancels them, which aborts them on the daemons), and closes the
gRPC channels.
"""

from __future__ import annotations

from types import TracebackType

from aiohttp import web

from kvtransfer.router.config import RouterConfig
from kvtransfer.router.fleet.dns import Resolver, resolve_host
from kvtransfer.router.routing.policy import PromptTokenizer
from kvtransfer.router.web.app import ROUTER, RouterHandlers, make_app


class RouterServer:
    """``resolver`` and ``tokenizer``: see `make_app`."""

    def __init__(
        self,
        config: RouterConfig,
        *,
        resolver: Resolver = resolve_host,
        tokenizer: PromptTokenizer | None = None,
    ) -> None:
        self.config = config
        self.app = make_app(config, resolver=resolver, tokenizer=tokenizer)
        self._runner: web.AppRunner | None = None
        self._port: int | None = None

    @property
    def handlers(self) -> RouterHandlers:
        return self.app[ROUTER]

    @property
    def port(self) -> int:
        """The bound port (the real one when the config asked for 0)."""
        if self._port is None:
            raise RuntimeError("the router is not started")
        return self._port

    @property
    def url(self) -> str:
        host = self.config.host
        # A wildcard bind is reachable on loopback; an IPv6 literal needs brackets in a URL.
        if host in ("0.0.0.0", "::", ""):
            host = "127.0.0.1"
        elif ":" in host:
            host = f"[{host}]"
        return f"http://{host}:{self.port}"

    async def start(self) -> None:
        if self._runner is not None:
            raise RuntimeError("the router is already started")
        runner = web.AppRunner(
            self.app,
            # A client that disconnects cancels its handler, and so its upstream gRPC calls.
            handler_cancellation=True,
            shutdown_timeout=self.config.shutdown_timeout_s,
            access_log=None,
        )
        await runner.setup()
        try:
            site = web.TCPSite(runner, self.config.host, self.config.port)
            await site.start()
        except BaseException:
            await runner.cleanup()
            raise
        self._runner = runner
        self._port = int(runner.addresses[0][1])

    async def stop(self) -> None:
        """Idempotent graceful stop (see the module docstring)."""
        runner, self._runner = self._runner, None
        if runner is not None:
            await runner.cleanup()

    async def __aenter__(self) -> RouterServer:
        await self.start()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.stop()
