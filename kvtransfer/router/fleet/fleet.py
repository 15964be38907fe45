"""The daemons the router routes to: a `Fleet` of prefill and decode instances that changes while
the router runs.

Membership. An instance is a daemon's gRPC address and its role; an address is in the fleet at
most once. Instances come from the command line (``--prefill HOST:PORT``), from DNS
(``--prefill dns:NAME:PORT``, `dns`), or from the admin API (``POST``/``DELETE /workers``).
Removing an instance takes it out of the fleet at once, so no new request picks it; requests in
flight on it run to their end on its channel, which closes after the last. A role may be empty
(503 naming it) while DNS or the admin API will fill it.

Picking (`Fleet.pick`). The candidates are the role's instances that are healthy, whose circuit
breaker lets a call through, and that this request has not tried yet; the role's `Policy`
chooses one. The pick is a lease: the instance's ``in_flight`` counts it until `Fleet.release`.

Health and load (`health`), circuit breakers (`breaker`) and DNS names (`dns`) each have a
module of their own; the fleet holds them together.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterable, Sequence

import aiohttp
import grpc

from kvtransfer.router.errors import NoHealthyDaemon
from kvtransfer.router.fleet.breaker import CLOSED, OPEN
from kvtransfer.router.fleet.dns import DnsTarget, DnsWatcher, Resolver, resolve_host
from kvtransfer.router.fleet.health import HealthChecker
from kvtransfer.router.fleet.instance import STATIC, Instance, InstancePresent
from kvtransfer.router.fleet.listener import FleetListener
from kvtransfer.router.fleet.vllm_endpoint import VllmEndpoint
from kvtransfer.router.names import AGGREGATED, ENGINES, KVTRANSFER, VLLM, WORKER_ROLES
from kvtransfer.router.routing.policy import CandidateEstimator, Policy, RouteContext

logger = logging.getLogger("kvtransfer.router.fleet")


class Fleet:
    """Every instance of both roles, each role with its `Policy`."""

    def __init__(
        self,
        policies: dict[str, Policy],
        *,
        credentials: grpc.ChannelCredentials | None = None,
        options: Sequence[tuple[str, int | str]] = (),
        health_interval_s: float = 1.0,
        health_timeout_s: float = 1.0,
        breaker_failures: int = 5,
        breaker_cooldown_s: float = 30.0,
        daemon_admin_token: str | None = None,
        dns_targets: Sequence[DnsTarget] = (),
        dns_interval_s: float = 5.0,
        resolver: Resolver = resolve_host,
        listener: FleetListener | None = None,
        engine: str = KVTRANSFER,
    ) -> None:
        if engine not in ENGINES:
            raise ValueError(f"engine must be one of {', '.join(ENGINES)}, got {engine!r}")
        self.policies = policies
        self.engine = engine
        # vLLM servers' HTTP connections, opened at the first vLLM instance (inside the loop).
        self._http: aiohttp.ClientSession | None = None
        self._credentials = credentials
        self._options = list(options)
        self._breaker = (breaker_failures, breaker_cooldown_s)
        self._listener = listener
        self.health = HealthChecker(
            self.instances,
            interval_s=health_interval_s,
            timeout_s=health_timeout_s,
            daemon_admin_token=daemon_admin_token,
            listener=listener,
        )
        self.dns = DnsWatcher(self, dns_targets, dns_interval_s, resolver)
        self._instances: dict[str, Instance] = {}
        # Removed while requests still ran on them: their channels close after the last.
        self._retired: set[Instance] = set()
        self._closing: set[asyncio.Task[None]] = set()
        self._tasks: list[asyncio.Task[None]] = []

    def instances(self, role: str | None = None) -> list[Instance]:
        """In the order they were added; a role's are those of that ``role`` (decode includes
        the aggregated ones) or ``kind`` (aggregated)."""
        return [i for i in self._instances.values() if role is None or role in (i.role, i.kind)]

    def get(self, address: str) -> Instance | None:
        return self._instances.get(address)

    def add(self, role: str, address: str, source: str = STATIC) -> Instance:
        """A new instance, not checked yet (so not picked before `check_instances`)."""
        if role not in WORKER_ROLES:
            raise ValueError(f"role must be one of {', '.join(WORKER_ROLES)}, got {role!r}")
        aggregated = role == AGGREGATED
        if aggregated:
            role = "decode"
        present = self._instances.get(address)
        if present is not None:
            raise InstancePresent(f"{address} is in the fleet already (as a {present.kind})")
        channel: grpc.aio.Channel | VllmEndpoint
        if self.engine == VLLM:
            channel = VllmEndpoint(self.http_session(), address)
        elif self._credentials is None:
            channel = grpc.aio.insecure_channel(address, options=self._options)
        else:
            channel = grpc.aio.secure_channel(address, self._credentials, options=self._options)
        instance = Instance(
            role, address, source, channel, self._breaker, self._breaker_changed, aggregated
        )
        self._instances[address] = instance
        logger.info("%s added (%s)", instance.name, source)
        if self._listener is not None:
            self._listener.instance_membership(role, address, source, "added")
        return instance

    def http_session(self) -> aiohttp.ClientSession:
        """The session every vLLM instance is called over (no cap on connections: admission
        bounds the requests)."""
        if self._http is None:
            connector = aiohttp.TCPConnector(limit=0)
            self._http = aiohttp.ClientSession(connector=connector)
        return self._http

    def remove(self, address: str) -> Instance:
        """Out of the fleet now; its channel closes once its last request ended.
        Raises ``KeyError`` when the address is not in the fleet."""
        instance = self._instances.pop(address)
        instance.removed = True
        logger.info(
            "%s removed (%d request(s) in flight finish on it)", instance.name, instance.in_flight
        )
        if self._listener is not None:
            self._listener.instance_membership(instance.role, address, instance.source, "removed")
        self._close_if_idle(instance)
        return instance

    def pick(
        self,
        role: str,
        route: RouteContext,
        exclude: Iterable[Instance] = (),
        *,
        aggregated: bool | None = None,
    ) -> Instance:
        """An instance of ``role`` chosen by its policy among the candidates (not in
        ``exclude``; with ``aggregated`` True or False, only the decode instances that are, or
        are not, aggregated), leased until `release`; `NoHealthyDaemon` when there is none."""
        excluded = {id(i) for i in exclude}
        candidates = [
            i
            for i in self.instances(role)
            if i.pickable()
            and id(i) not in excluded
            and (aggregated is None or i.aggregated == aggregated)
        ]
        if not candidates:
            raise NoHealthyDaemon(role, self.states(role))
        policy = self.policies[role]
        chosen = policy.choose(candidates, route)
        instance = next((c for c in candidates if c is chosen), None)
        if instance is None:
            raise RuntimeError(f"policy {policy.name!r} chose something that was not offered")
        instance.in_flight += 1
        instance.picks += 1
        tokens = route.token_ids
        if tokens and isinstance(policy, CandidateEstimator):
            # Before `observe`: the prediction is what the index held, not this pick.
            uncached = policy.candidate_uncached_tokens(instance, tokens)
            route.predicted_cached_tokens[role] = len(tokens) - uncached
        policy.observe(instance, route)
        return instance

    def release(self, instance: Instance) -> None:
        """The request leased with `pick` no longer uses ``instance``."""
        instance.in_flight -= 1
        self._close_if_idle(instance)

    def call_started(self, instance: Instance) -> None:
        """A call outside any lease (``ReleaseKV``) is about to use ``instance``'s channel."""
        instance.other_calls += 1

    def call_ended(self, instance: Instance) -> None:
        instance.other_calls -= 1
        self._close_if_idle(instance)

    def require_pickable(self, role: str) -> None:
        if not self.any_pickable(role):
            raise NoHealthyDaemon(role, self.states(role))

    def any_pickable(self, role: str) -> bool:
        return any(i.pickable() for i in self.instances(role))

    def states(self, role: str) -> dict[str, str]:
        """address -> state as last seen (an open breaker said so); no call is made."""
        states = {}
        for instance in self.instances(role):
            breaker = instance.breaker_state
            suffix = "" if breaker == CLOSED else f", breaker {breaker.replace('_', '-')}"
            states[instance.address] = instance.state + suffix
        return states

    def eject(self, instance: Instance, code: grpc.StatusCode, details: str) -> None:
        """A call to ``instance`` failed at the transport level: stop picking it now."""
        self.health.eject(instance, code, details)

    async def start(self) -> None:
        """Resolve every DNS name, check every instance once (so the first request sees real
        health), then keep checking and resolving in the background."""
        await asyncio.gather(*(self.resolve(target) for target in self.dns.targets))
        await self.check()
        self._tasks.append(asyncio.create_task(self.health.run_forever()))
        if self.dns.targets:
            self._tasks.append(asyncio.create_task(self.dns.run_forever()))

    async def check(self) -> None:
        """Health-check every instance (and read its load) concurrently; apply the answers."""
        await self.check_instances(self.instances())

    async def check_instances(self, instances: Sequence[Instance]) -> None:
        await self.health.check_instances(instances)

    async def resolve(self, target: DnsTarget) -> None:
        """Resolve ``target`` once; add and remove its instances to match (then check the new
        ones)."""
        await self.dns.resolve(target)

    async def close(self) -> None:
        tasks, self._tasks = self._tasks, []
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        retired, self._retired = self._retired, set()
        instances = [*self._instances.values(), *retired]
        await asyncio.gather(*(i.channel.close() for i in instances))
        await asyncio.gather(*self._closing, return_exceptions=True)
        if self._http is not None:
            await self._http.close()
            self._http = None

    def _breaker_changed(self, instance: Instance, state: str) -> None:
        failures = instance.breaker.consecutive_failures
        if state == OPEN:
            logger.warning("%s: circuit breaker open (%d failed calls)", instance.name, failures)
        else:
            logger.info("%s: circuit breaker %s", instance.name, state.replace("_", "-"))
        if self._listener is not None:
            self._listener.instance_breaker(instance.role, instance.address, state)

    def _close_if_idle(self, instance: Instance) -> None:
        if not instance.removed or instance.channel_closing:
            return
        if instance.busy:
            self._retired.add(instance)
            return
        self._retired.discard(instance)
        instance.channel_closing = True
        task = asyncio.get_running_loop().create_task(instance.channel.close())
        self._closing.add(task)
        task.add_done_callback(self._closing.discard)
