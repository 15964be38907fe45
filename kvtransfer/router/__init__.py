"""The OpenAI-compatible router in front of prefill and decode daemons (``kvtransfer-router``).

In-process: ``async with RouterServer(RouterConfig(prefill=(...), decode=(...))) as server``;
``make_app(config)`` for an aiohttp app to serve yourself. The request life cycle is in
`web.app`, a choice's on the daemons in `daemon_flow.choice`, on vLLM servers in
`vllm_flow.proxy`; the instances and their health in `fleet`, the choice policies in `routing`.
The rooms and which may import which: tests/test_layers.py (ROUTER_LAYERS).
"""

from __future__ import annotations

from kvtransfer.router.config import RouterConfig
from kvtransfer.router.errors import UpstreamError
from kvtransfer.router.server import RouterServer
from kvtransfer.router.web.app import make_app

__all__ = ["RouterConfig", "RouterServer", "UpstreamError", "make_app"]
