"""What the endpoints call, opened on the app's loop (grpc.aio channels belong to the loop that
creates them): each role's policy, the cache indexes' wiring, the fleet, and the flow of the
configured engine: a `ChoiceRunner` on the daemons' `Upstream`, or a `VllmProxy`."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

from aiohttp import web

from kvtransfer.router.config import RouterConfig
from kvtransfer.router.daemon_flow.choice import ChoiceRunner
from kvtransfer.router.daemon_flow.upstream import Upstream
from kvtransfer.router.fleet.cache_wiring import CacheIndexWiring
from kvtransfer.router.fleet.dns import DnsTarget, Resolver
from kvtransfer.router.fleet.fleet import Fleet
from kvtransfer.router.metrics import RouterMetrics
from kvtransfer.router.names import ROLES, VLLM, WORKER_ROLES
from kvtransfer.router.routing.policy import create_policy
from kvtransfer.router.tracing import TraceExporter
from kvtransfer.router.vllm_flow.proxy import VllmProxy


class Backend:
    """The fleet and the flow, from the app's startup (`open`, an aiohttp cleanup context) to
    its cleanup."""

    def __init__(self, config: RouterConfig, metrics: RouterMetrics, resolver: Resolver) -> None:
        self.config = config
        self.metrics = metrics
        self._resolver = resolver
        self._index_metrics_registered = False
        self._runner: ChoiceRunner | None = None
        # Set while the router serves vLLM servers (``engine`` vllm).
        self.vllm: VllmProxy | None = None

    @property
    def releases_in_flight(self) -> int:
        """``ReleaseKV`` calls started and not yet answered."""
        return 0 if self._runner is None else len(self._runner.releases)

    @property
    def runner(self) -> ChoiceRunner:
        if self._runner is None:
            raise RuntimeError("the router app has not started (no gRPC channels yet)")
        return self._runner

    @property
    def upstream(self) -> Upstream:
        upstream = self.runner.upstream
        if upstream is None:
            raise RuntimeError("the router app has stopped (no gRPC channels)")
        return upstream

    @property
    def fleet(self) -> Fleet:
        return self.upstream.fleet

    async def open(self, app: web.Application) -> AsyncIterator[None]:
        # grpc.aio channels belong to the loop that creates them: open them on the app's loop.
        config = self.config
        policies = {role: create_policy(config.policy_for(role), role, config) for role in ROLES}
        wiring = CacheIndexWiring(policies, config, self.metrics)
        if self._index_metrics_registered is False:
            wiring.register_metrics(self.metrics.registry)
            self._index_metrics_registered = True
        fleet = Fleet(
            policies,
            credentials=config.channel_credentials(),
            options=config.channel_options(),
            health_interval_s=config.health_interval_s,
            health_timeout_s=config.health_timeout_s,
            breaker_failures=config.breaker_failures,
            breaker_cooldown_s=config.breaker_cooldown_s,
            daemon_admin_token=config.daemon_admin_token,
            dns_targets=[
                DnsTarget(role, name, port)
                for role in WORKER_ROLES
                for name, port in config.dns_names(role)
            ],
            dns_interval_s=config.dns_interval_s,
            resolver=self._resolver,
            listener=wiring,
            engine=config.engine,
        )
        self.metrics.watch_instances(fleet.instances)
        try:
            for role in WORKER_ROLES:
                for address in config.addresses(role):
                    fleet.add(role, address)
            await fleet.start()
        except BaseException:
            await fleet.close()
            await wiring.close()
            raise
        upstream = Upstream(fleet)
        traces = None
        if config.otlp_traces_endpoint:
            traces = TraceExporter(config.otlp_traces_endpoint)
        runner = self._runner = ChoiceRunner(config, self.metrics, upstream, traces)
        if config.engine == VLLM:
            self.vllm = VllmProxy(config, self.metrics, fleet)
        try:
            yield
        finally:
            self.vllm = None
            # Handlers are done by now; the releases they started each have a deadline
            # (release_timeout_s), so waiting for them is bounded.
            await runner.close()
            self._runner = None
            if traces is not None:
                await asyncio.to_thread(traces.shutdown)
            await fleet.close()
            await wiring.close()
