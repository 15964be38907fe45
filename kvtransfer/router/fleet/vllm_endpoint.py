"""`VllmEndpoint`: how the fleet reaches one vLLM OpenAI server (``--engine vllm``) in place of a
daemon's gRPC channel: its base URL, its health and its load.

Health is ``GET /health`` (200: ``SERVING``; another status: ``NOT_SERVING (HTTP n)``; no
answer: ``UNREACHABLE (...)``). Load is read from ``GET /metrics``, vLLM's own Prometheus
gauges over its engines: ``vllm:num_requests_running`` and ``vllm:num_requests_waiting``
(summed), ``vllm:kv_cache_usage_perc`` (averaged). vLLM exports its KV use as a fraction, not
in blocks: the load reports it per `KV_USAGE_SCALE` "blocks", so the policies' share of KV in
use is right. A sample that is not a finite, non-negative number is left out (a gauge of
requests cannot be NaN or below 0), and counts are capped at `MAX_COUNT`.

The same text gives the SLO rule vLLM's own timing (`ServerTiming`): the running count and the
``vllm:inter_token_latency_seconds`` histogram's sum and count, which the instance's
`ServiceStats` turns into gaps between tokens as the engine measured them.

A redirect is not followed: whatever answers at its target (a login page, another server) does
not vouch for this instance, so a 3xx is ``NOT_SERVING (HTTP 3xx)``. ``/metrics`` is read up to
`MAX_METRICS_BYTES`; a larger or undecodable answer gives no load.
"""

from __future__ import annotations

import asyncio
import math

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

from kvtransfer.router.fleet.service import ServerTiming
from kvtransfer.router.routing.policy import InstanceLoad

SERVING = "SERVING"
KV_USAGE_SCALE = 10_000
# No server runs 2**31 requests: a larger count is nonsense, and capped so that no policy's
# arithmetic meets a number of 300 digits.
MAX_COUNT = 2**31 - 1
# vLLM's /metrics is some 100 KiB per engine (histograms included): far above any real one.
MAX_METRICS_BYTES = 16 * 2**20
# /health's body says nothing; reading a small one to its end keeps the connection for reuse.
_HEALTH_BYTES = 2**16
_RUNNING = "vllm:num_requests_running"
_WAITING = "vllm:num_requests_waiting"
_KV_USAGE = "vllm:kv_cache_usage_perc"
_ITL_SUM = "vllm:inter_token_latency_seconds_sum"
_ITL_COUNT = "vllm:inter_token_latency_seconds_count"
_SUMMED = (_RUNNING, _WAITING, _KV_USAGE, _ITL_SUM, _ITL_COUNT)


class VllmEndpoint:
    """One vLLM OpenAI server at ``address`` (HOST:PORT), reached over ``session`` (the
    fleet's, shared by every instance)."""

    def __init__(self, session: aiohttp.ClientSession, address: str) -> None:
        self.session = session
        self.base_url = f"http://{address}"

    def url(self, path: str) -> str:
        return self.base_url + path

    async def close(self) -> None:
        """Nothing of its own to close: the session is the fleet's."""

    async def check(self, timeout_s: float) -> tuple[str, InstanceLoad | None, ServerTiming | None]:
        """Its health state; its load and timing when ``/metrics`` answered with vLLM's."""
        timeout = aiohttp.ClientTimeout(total=timeout_s)
        health, metrics = await asyncio.gather(
            self._get("/health", timeout, _HEALTH_BYTES),
            self._get("/metrics", timeout, MAX_METRICS_BYTES),
            return_exceptions=True,
        )
        load = timing = None
        if isinstance(metrics, tuple) and metrics[0] == 200 and metrics[1] is not None:
            # Prometheus' text format is UTF-8; a bad byte spoils at most its own line.
            load, timing = parse_vllm_metrics(metrics[1].decode(errors="replace"))
        if isinstance(health, BaseException):
            if not isinstance(health, (aiohttp.ClientError, asyncio.TimeoutError, OSError)):
                raise health
            return f"UNREACHABLE ({type(health).__name__})", load, timing
        status = health[0]
        state = SERVING if status == 200 else f"NOT_SERVING (HTTP {status})"
        return state, load, timing

    async def _get(
        self, path: str, timeout: aiohttp.ClientTimeout, limit: int
    ) -> tuple[int, bytes | None]:
        """The status and up to ``limit`` bytes of the body (None: more than that)."""
        async with self.session.get(
            self.url(path), timeout=timeout, allow_redirects=False
        ) as response:
            return response.status, await read_at_most(response, limit)


def parse_vllm_metrics(text: str) -> tuple[InstanceLoad | None, ServerTiming | None]:
    """The load and the timing in vLLM's ``/metrics`` text; each ``None`` when the text lacks
    what it needs (not a vLLM server, or one too old to export it)."""
    sums: dict[str, float] = {}
    counts: dict[str, int] = {}
    try:
        families = list(text_string_to_metric_families(text))
    except ValueError:
        return None, None
    for family in families:
        for sample in family.samples:
            value = sample.value
            if sample.name in _SUMMED and 0 <= value < math.inf:
                sums[sample.name] = sums.get(sample.name, 0.0) + value
                counts[sample.name] = counts.get(sample.name, 0) + 1
    timing = None
    if _ITL_SUM in sums and _ITL_COUNT in sums and math.isfinite(sums[_ITL_SUM]):
        timing = ServerTiming(
            itl_sum_s=sums[_ITL_SUM],
            itl_count=_count(sums[_ITL_COUNT]),
            running=_count(sums.get(_RUNNING, 0.0)),
        )
    if _RUNNING not in sums and _WAITING not in sums:
        return None, timing
    # Requests add up over a data-parallel server's engines; their KV pools are alike, so the
    # share in use is their mean.
    usage = sums.get(_KV_USAGE, 0.0) / counts.get(_KV_USAGE, 1)
    usage = min(1.0, max(0.0, usage)) if math.isfinite(usage) else 1.0
    load = InstanceLoad(
        running=_count(sums.get(_RUNNING, 0.0)),
        waiting=_count(sums.get(_WAITING, 0.0)),
        kv_blocks_used=round(usage * KV_USAGE_SCALE) if _KV_USAGE in sums else 0,
        kv_blocks_total=KV_USAGE_SCALE if _KV_USAGE in sums else 0,
    )
    return load, timing


def _count(value: float) -> int:
    # A sum of finite samples may still overflow to inf.
    return MAX_COUNT if not value < MAX_COUNT else int(value)


async def read_at_most(response: aiohttp.ClientResponse, limit: int) -> bytes | None:
    """``response``'s body, or None (the rest unread) when it is longer than ``limit`` bytes:
    a server must not make the router buffer gigabytes."""
    if response.content_length is not None and response.content_length > limit:
        return None
    body = bytearray()
    async for chunk in response.content.iter_any():
        body += chunk
        if len(body) > limit:
            return None
    return bytes(body)
