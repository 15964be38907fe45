"""The daemons the router routes to: a `Fleet` of prefill and decode instances that changes while
the router runs.

Membership. An instance is a daemon's gRPC address and its role; an address is in the fleet at
most once. Instances come from the command line (``--prefill HOST:PORT``), from DNS
(``--prefill dns:NAME:PORT``: NAME is resolved at start and every ``dns_interval_s``, and one
instance per address it resolves to is added or removed to match: a headless Kubernetes Service
gives one per ready pod), or from the admin API (``POST``/``DELETE /workers``). Removing an
instance takes it out of the fleet at once, so no new request picks it; requests in flight on it
run to their end on its channel, which closes after the last. A role may be empty (503 naming
it) while DNS or the admin API will fill it. A name that does not resolve (NXDOMAIN: a Service
with no ready pod) empties its instances; any other resolution failure keeps them.

Picking (`Fleet.pick`). The candidates are the role's instances that are healthy, whose circuit
breaker lets a call through, and that this request has not tried yet; the role's `Policy`
chooses one. The pick is a lease: the instance's ``in_flight`` counts it until `Fleet.release`.

Health. An instance is healthy while its last grpc.health.v1 ``Check`` answered SERVING and no
call failed at the transport level since. A call that fails with UNAVAILABLE (refused, reset,
draining), or a ``Generate`` call that fails with DEADLINE_EXCEEDED before the daemon sent
anything, ejects the instance at once (`Fleet.eject`); a background task checks every instance
each ``health_interval_s`` (deadline ``health_timeout_s``) and re-admits it once it answers
SERVING; while any instance is out, checks run every ``RECOVERY_INTERVAL_S`` (0.2 s) instead.
An instance's state is ``SERVING``, ``NOT_SERVING`` (draining: not picked), ``SERVICE_UNKNOWN``
or ``UNREACHABLE (<code>)``; ``NOT_CHECKED`` only until its first check, which runs before the
router serves (for instances added later: before they are picked).

Load. With each health check the instance's KVAdmin ``GetStatus`` is read (with the daemons'
admin token when they need one): running and waiting requests, KV blocks in use and in all,
kept as its `InstanceLoad` for the policies. An instance without KVAdmin has no load.

Circuit breaker (`CircuitBreaker`, one per instance). A daemon that answers its health checks
but fails every call is not ejected by them; the breaker takes it out: after ``failures``
consecutive failed calls (5xx outcomes of its own: transport errors, error finishes, unusable
answers) it opens, and the instance is not picked for ``cooldown_s``; then it is half-open: it
may be picked while it has no request in flight (one trial at a time); a success closes the
breaker, a failure opens it again. Refusals of the input (4xx) count neither way. The failures
belong to a process: when ``GetStatus`` shows the daemon's uptime went back (it restarted), its
breaker closes at once instead of waiting out the cooldown (a restarted daemon took 30 s to get
traffic again); a daemon that crash-loops costs at most ``failures`` calls per start.
"""

from __future__ import annotations

import asyncio
import dataclasses
import errno
import logging
import socket
import time
from collections.abc import Awaitable, Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Protocol

import aiohttp
import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kvtransfer.control.placement import Placement
from kvtransfer.control.security import admin_token_metadata
from kvtransfer.router.errors import NoHealthyDaemon
from kvtransfer.router.names import AGGREGATED, ENGINES, KVTRANSFER, VLLM, WORKER_ROLES
from kvtransfer.router.routing.policy import CandidateEstimator, InstanceLoad, Policy, RouteContext
from kvtransfer.router.vllm_endpoint import VllmEndpoint
from kvtransfer.v1 import admin_pb2, admin_pb2_grpc, generation_pb2_grpc

logger = logging.getLogger("kvtransfer.router.fleet")

SERVING = "SERVING"
NOT_CHECKED = "NOT_CHECKED"
# An aggregated daemon runs whole requests itself (a colocated engine): it is in the decode
# role, picked by its policy among the decodes, and never sent KV from a prefill.
# Health-check pace while some instance is out of the pool (at most the configured interval).
RECOVERY_INTERVAL_S = 0.2

CLOSED = "closed"
OPEN = "open"
HALF_OPEN = "half_open"
BREAKER_STATES = (CLOSED, OPEN, HALF_OPEN)

STATIC = "static"
ADMIN = "admin"

Resolver = Callable[[str, int], Awaitable[Sequence[str]]]
"""``(name, port) -> host addresses``; raises `socket.gaierror` when the name does not resolve."""

_EMPTY_ANSWERS = {socket.EAI_NONAME, getattr(socket, "EAI_NODATA", errno.ENODATA)}


async def resolve_host(name: str, port: int) -> list[str]:
    """The default `Resolver`: every address ``name`` resolves to, IPv4 and IPv6."""
    infos = await asyncio.get_running_loop().getaddrinfo(name, port, type=socket.SOCK_STREAM)
    return sorted({str(info[4][0]) for info in infos})


def host_port(host: str, port: int) -> str:
    """``HOST:PORT``, an IPv6 literal in brackets."""
    if ":" in host and not host.startswith("["):
        return f"[{host}]:{port}"
    return f"{host}:{port}"


@dataclass(frozen=True)
class DnsTarget:
    """``dns:NAME:PORT``: NAME's addresses, each an instance on PORT."""

    role: str
    name: str
    port: int

    @property
    def source(self) -> str:
        return f"dns:{self.name}:{self.port}"


class FleetListener(Protocol):
    """What the fleet reports as it changes (the metrics)."""

    def instance_health(
        self, role: str, address: str, healthy: bool, state: str, first: bool
    ) -> None: ...

    def instance_breaker(self, role: str, address: str, state: str) -> None: ...

    def instance_membership(self, role: str, address: str, source: str, change: str) -> None: ...


class CircuitBreaker:
    """closed -> open after ``failures`` consecutive failures (0: never) -> half-open after
    ``cooldown_s`` -> closed on a success, open again on a failure."""

    def __init__(
        self,
        failures: int,
        cooldown_s: float,
        *,
        clock: Callable[[], float] = time.monotonic,
        on_change: Callable[[str], None] | None = None,
    ) -> None:
        self._threshold = failures
        self._cooldown_s = cooldown_s
        self._clock = clock
        self._on_change = on_change
        self._state = CLOSED
        self._opened_at = 0.0
        self.consecutive_failures = 0

    @property
    def state(self) -> str:
        if self._state == OPEN and self._clock() - self._opened_at >= self._cooldown_s:
            self._become(HALF_OPEN)
        return self._state

    def allows(self, in_flight: int) -> bool:
        """Whether a call may go through now; half-open lets one through at a time."""
        state = self.state
        return state == CLOSED or (state == HALF_OPEN and in_flight == 0)

    def reset(self) -> None:
        """Forget the failures (they were another process's): closed."""
        self.consecutive_failures = 0
        if self._state != CLOSED:
            self._become(CLOSED)

    def success(self) -> None:
        self.consecutive_failures = 0
        if self.state != CLOSED:
            self._become(CLOSED)

    def failure(self) -> None:
        self.consecutive_failures += 1
        state = self.state
        if state == HALF_OPEN or (
            state == CLOSED and self._threshold and self.consecutive_failures >= self._threshold
        ):
            self._opened_at = self._clock()
            self._become(OPEN)

    def _become(self, state: str) -> None:
        self._state = state
        if self._on_change is not None:
            self._on_change(state)


@dataclass
class _Health:
    state: str = NOT_CHECKED
    healthy: bool = False
    # time.monotonic() of the last ejection by a failed call: a check that began before it
    # saw the daemon earlier and must not re-admit it.
    ejected_at: float = float("-inf")


class Instance:
    """One daemon: its channel (reused by every request; a `VllmEndpoint` for a vLLM server),
    health, breaker and load. It is a `policy.Candidate` (``address``, ``in_flight``,
    ``load``)."""

    def __init__(
        self,
        role: str,
        address: str,
        source: str,
        channel: grpc.aio.Channel | VllmEndpoint,
        breaker: tuple[int, float],
        on_breaker: Callable[[Instance, str], None],
        aggregated: bool = False,
    ) -> None:
        self.role = role
        self.aggregated = aggregated
        self.address = address
        self.source = source
        self.channel = channel
        self._stubs = (
            None
            if isinstance(channel, VllmEndpoint)
            else (
                generation_pb2_grpc.GenerationStub(channel),
                admin_pb2_grpc.KVAdminStub(channel),
            )
        )
        self.breaker = CircuitBreaker(*breaker, on_change=lambda state: on_breaker(self, state))
        self.health = _Health()
        self.in_flight = 0
        self.picks = 0
        self.load: InstanceLoad | None = None
        # Where it computes, from its GetStatus (None: not reported, or not yet).
        self.placement: Placement | None = None
        self.removed = False
        # Calls outside any lease (ReleaseKV): the channel stays open for them too.
        self.other_calls = 0
        self.channel_closing = False
        # The last reason GetStatus gave no load (logged once per reason).
        self.load_problem: str | None = None
        # The daemon's uptime in its last GetStatus: less next time means a new process.
        self.uptime_s: float | None = None
        # Of the breaker's consecutive failures, those of calls that found it unreachable.
        self.unreachable_failures = 0

    @property
    def stub(self) -> generation_pb2_grpc.GenerationStub:
        return self._grpc_stubs()[0]

    @property
    def admin(self) -> admin_pb2_grpc.KVAdminStub:
        return self._grpc_stubs()[1]

    def _grpc_stubs(
        self,
    ) -> tuple[generation_pb2_grpc.GenerationStub, admin_pb2_grpc.KVAdminStub]:
        if self._stubs is None:
            raise TypeError(f"{self.name} is a vLLM server: it is called over HTTP, not gRPC")
        return self._stubs

    @property
    def kind(self) -> str:
        """Its role as named on the command line and in the admin API: ``aggregated`` for an
        aggregated instance (whose ``role`` is decode)."""
        return AGGREGATED if self.aggregated else self.role

    @property
    def name(self) -> str:
        return f"{self.kind} daemon {self.address}"

    @property
    def state(self) -> str:
        return self.health.state

    @property
    def healthy(self) -> bool:
        return self.health.healthy

    @property
    def breaker_state(self) -> str:
        return self.breaker.state

    def pickable(self) -> bool:
        return not self.removed and self.health.healthy and self.breaker.allows(self.in_flight)

    def succeeded(self) -> None:
        """A call ended well: the breaker closes (or stays closed)."""
        self.unreachable_failures = 0
        self.breaker.success()

    def failed(self, unreachable: bool = False) -> None:
        """A call failed through this daemon's fault (a 5xx of its own); ``unreachable``: it
        failed because the daemon could not be reached (and was ejected for it)."""
        self.unreachable_failures = self.unreachable_failures + 1 if unreachable else 0
        self.breaker.failure()

    @property
    def busy(self) -> bool:
        return bool(self.in_flight or self.other_calls)

    def describe(self) -> dict[str, object]:
        """What ``GET /workers`` shows of it."""
        load = self.load
        return {
            "address": self.address,
            "role": self.kind,
            "source": self.source,
            "state": self.state,
            "healthy": self.healthy,
            "breaker": self.breaker_state,
            "pickable": self.pickable(),
            "in_flight": self.in_flight,
            "picks": self.picks,
            "load": None
            if load is None
            else {
                "running": load.running,
                "waiting": load.waiting,
                "kv_blocks_used": load.kv_blocks_used,
                "kv_blocks_total": load.kv_blocks_total,
            },
        }


class InstancePresent(ValueError):
    """The address is in the fleet already."""


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
        self._interval_s = health_interval_s
        self._timeout_s = health_timeout_s
        self._breaker = (breaker_failures, breaker_cooldown_s)
        self._status_metadata = admin_token_metadata(daemon_admin_token)
        self._dns_targets = tuple(dns_targets)
        self._dns_interval_s = dns_interval_s
        self._resolver = resolver
        self._listener = listener
        self._instances: dict[str, Instance] = {}
        # Removed while requests still ran on them: their channels close after the last.
        self._retired: set[Instance] = set()
        self._closing: set[asyncio.Task[None]] = set()
        self._tasks: list[asyncio.Task[None]] = []

    # ------------------------------------------------------------------ membership

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

    # ------------------------------------------------------------------ picking

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
        instance.health.ejected_at = time.monotonic()
        self._set(instance, False, f"UNREACHABLE ({code.name})", f"a call failed: {details}")

    # ------------------------------------------------------------------ checks

    async def start(self) -> None:
        """Resolve every DNS name, check every instance once (so the first request sees real
        health), then keep checking and resolving in the background."""
        await asyncio.gather(*(self.resolve(target) for target in self._dns_targets))
        await self.check()
        self._tasks.append(asyncio.create_task(self._check_forever()))
        if self._dns_targets:
            self._tasks.append(asyncio.create_task(self._resolve_forever()))

    async def check(self) -> None:
        """Health-check every instance (and read its load) concurrently; apply the answers."""
        await self.check_instances(self.instances())

    async def check_instances(self, instances: Sequence[Instance]) -> None:
        started = time.monotonic()
        states = await asyncio.gather(*(self._check(i) for i in instances))
        for instance, state in zip(instances, states, strict=True):
            if instance.removed:
                continue
            if state == SERVING and instance.health.ejected_at >= started:
                continue
            self._set(instance, state == SERVING, state, "health check")

    async def resolve(self, target: DnsTarget) -> None:
        """Resolve ``target`` once; add and remove its instances to match (then check the new
        ones)."""
        try:
            hosts = await self._resolver(target.name, target.port)
        except socket.gaierror as exc:
            if exc.errno not in _EMPTY_ANSWERS:
                logger.warning("%s did not resolve (%s): instances kept", target.source, exc)
                return
            hosts = []
        except OSError as exc:
            logger.warning("%s did not resolve (%s): instances kept", target.source, exc)
            return
        wanted = {host_port(host, target.port) for host in hosts}
        mine = {i.address for i in self.instances(target.role) if i.source == target.source}
        added = []
        for address in sorted(wanted - mine):
            present = self._instances.get(address)
            if present is not None:
                logger.debug("%s: %s is in the fleet already", target.source, address)
                continue
            added.append(self.add(target.role, address, target.source))
        for address in sorted(mine - wanted):
            self.remove(address)
        if added:
            await self.check_instances(added)

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

    async def _check(self, instance: Instance) -> str:
        before = instance.in_flight
        if isinstance(instance.channel, VllmEndpoint):
            state, load = await instance.channel.check(self._timeout_s)
            if load is not None:
                in_flight = max(before, instance.in_flight)
                load = dataclasses.replace(load, router_in_flight=in_flight)
            instance.load = load
            return state
        health = health_pb2_grpc.HealthStub(instance.channel)
        answers = await asyncio.gather(
            health.Check(health_pb2.HealthCheckRequest(service=""), timeout=self._timeout_s),
            instance.admin.GetStatus(
                admin_pb2.GetStatusRequest(),
                timeout=self._timeout_s,
                metadata=self._status_metadata,
            ),
            return_exceptions=True,
        )
        answer, status = answers
        if isinstance(status, admin_pb2.GetStatusResponse):
            instance.load = InstanceLoad(
                running=status.num_running_requests,
                waiting=status.num_waiting_requests,
                kv_blocks_used=status.num_used_blocks,
                kv_blocks_total=status.num_used_blocks + status.num_free_blocks,
                router_in_flight=max(before, instance.in_flight),
            )
            instance.load_problem = None
            instance.placement = Placement.reported(status.host_id, status.cpus)
            self._note_uptime(instance, status.uptime_s)
        elif isinstance(status, grpc.aio.AioRpcError):
            self._no_load(instance, status)
        elif isinstance(status, BaseException):
            raise status
        if isinstance(answer, grpc.aio.AioRpcError):
            return f"UNREACHABLE ({answer.code().name})"
        if isinstance(answer, BaseException):
            raise answer
        return health_pb2.HealthCheckResponse.ServingStatus.Name(answer.status)

    def _note_uptime(self, instance: Instance, uptime_s: float) -> None:
        previous, instance.uptime_s = instance.uptime_s, uptime_s
        if previous is None or uptime_s >= previous:
            return
        if instance.breaker.state != CLOSED or instance.breaker.consecutive_failures:
            logger.info(
                "%s restarted (uptime %.1f s, was %.1f s): its breaker forgets the old "
                "process's failures",
                instance.name,
                uptime_s,
                previous,
            )
            instance.breaker.reset()

    def _no_load(self, instance: Instance, exc: grpc.aio.AioRpcError) -> None:
        code = exc.code()
        if code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
            return  # health says so; the last load stands until it answers again
        instance.load = None
        problem = code.name
        if problem == instance.load_problem:
            return
        instance.load_problem = problem
        if code == grpc.StatusCode.UNIMPLEMENTED:
            logger.info("%s has no KVAdmin: its load is the router's count", instance.name)
        else:
            hint = (
                " (give the router the daemons' admin token: --daemon-admin-token-file)"
                if code == grpc.StatusCode.UNAUTHENTICATED
                else ""
            )
            logger.warning("%s: GetStatus failed: %s%s", instance.name, problem, hint)

    async def _check_forever(self) -> None:
        while True:
            # An instance out of the pool is looked at more often, so one that restarted or
            # resumed serves again within a fraction of a second of being ready.
            healthy = all(i.healthy for i in self._instances.values())
            interval = self._interval_s if healthy else min(self._interval_s, RECOVERY_INTERVAL_S)
            await asyncio.sleep(interval)
            try:
                await self.check()
            except Exception:  # a bug here must not silently end health checking
                logger.exception("health check failed")

    async def _resolve_forever(self) -> None:
        while True:
            await asyncio.sleep(self._dns_interval_s)
            for target in self._dns_targets:
                try:
                    await self.resolve(target)
                except Exception:  # a bug here must not silently end resolving
                    logger.exception("%s: resolution failed", target.source)

    def _set(self, instance: Instance, healthy: bool, state: str, why: str) -> None:
        if instance.removed:
            return  # out of the fleet: a late answer about it changes nothing
        health = instance.health
        first = health.state == NOT_CHECKED
        flipped = health.healthy != healthy
        health.state, health.healthy = state, healthy
        name = instance.name
        if first:
            if healthy:
                logger.info("%s: %s at start-up", name, state)
            else:
                logger.warning("%s: %s at start-up, not picked until SERVING", name, state)
        elif flipped and healthy:
            logger.info("%s re-admitted: %s", name, state)
            breaker = instance.breaker
            if breaker.state != CLOSED and 0 < breaker.consecutive_failures <= (
                instance.unreachable_failures
            ):
                # Every failure that opened it was a call the outage cut (a partition ends
                # all calls in flight at once): the daemon is back, as after a restart.
                logger.info(
                    "%s: its breaker forgets the %d calls that found it unreachable",
                    name,
                    breaker.consecutive_failures,
                )
                instance.unreachable_failures = 0
                breaker.reset()
        elif flipped:
            logger.warning("%s ejected: %s (%s)", name, state, why)
        if (first or flipped) and self._listener is not None:
            self._listener.instance_health(instance.role, instance.address, healthy, state, first)

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
