"""The OpenAI-compatible router in front of prefill and decode daemons (``kvtransfer-router``).

In-process: ``async with RouterServer(RouterConfig(prefill=(...), decode=(...))) as server``;
``make_app(config)`` for an aiohttp app to serve yourself. The request life cycle is in `app`.
"""

from __future__ import annotations

from kvtransfer.router.app import make_app
from kvtransfer.router.config import RouterConfig
from kvtransfer.router.server import RouterServer
from kvtransfer.router.upstream import UpstreamError

__all__ = ["RouterConfig", "RouterServer", "UpstreamError", "make_app"]
