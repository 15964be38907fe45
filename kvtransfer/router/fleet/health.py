"""The instances' health and load, as the router keeps them.

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
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import Callable, Sequence

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kvtransfer.control.placement import Placement
from kvtransfer.control.security import admin_token_metadata
from kvtransfer.router.fleet.breaker import CLOSED
from kvtransfer.router.fleet.instance import NOT_CHECKED, SERVING, Instance
from kvtransfer.router.fleet.listener import FleetListener
from kvtransfer.router.fleet.vllm_endpoint import VllmEndpoint
from kvtransfer.router.routing.policy import InstanceLoad
from kvtransfer.v1 import admin_pb2

logger = logging.getLogger("kvtransfer.router.fleet")

# Health-check pace while some instance is out of the pool (at most the configured interval).
RECOVERY_INTERVAL_S = 0.2


class HealthChecker:
    """Checks every instance (grpc.health.v1 ``Check`` and KVAdmin ``GetStatus``, or a vLLM
    server's ``/health`` and ``/metrics``), ejects and re-admits them, and tells the listener."""

    def __init__(
        self,
        instances: Callable[[], list[Instance]],
        *,
        interval_s: float,
        timeout_s: float,
        daemon_admin_token: str | None,
        listener: FleetListener | None,
    ) -> None:
        self._instances = instances
        self._interval_s = interval_s
        self._timeout_s = timeout_s
        self._status_metadata = admin_token_metadata(daemon_admin_token)
        self._listener = listener

    async def check_instances(self, instances: Sequence[Instance]) -> None:
        started = time.monotonic()
        states = await asyncio.gather(*(self.probe(i) for i in instances))
        for instance, state in zip(instances, states, strict=True):
            if instance.removed:
                continue
            if state == SERVING and instance.health.ejected_at >= started:
                continue
            self.set(instance, state == SERVING, state, "health check")

    def eject(self, instance: Instance, code: grpc.StatusCode, details: str) -> None:
        """A call to ``instance`` failed at the transport level: stop picking it now."""
        instance.health.ejected_at = time.monotonic()
        self.set(instance, False, f"UNREACHABLE ({code.name})", f"a call failed: {details}")

    async def run_forever(self) -> None:
        while True:
            # An instance out of the pool is looked at more often, so one that restarted or
            # resumed serves again within a fraction of a second of being ready.
            healthy = all(i.healthy for i in self._instances())
            interval = self._interval_s if healthy else min(self._interval_s, RECOVERY_INTERVAL_S)
            await asyncio.sleep(interval)
            try:
                await self.check_instances(self._instances())
            except Exception:  # a bug here must not silently end health checking
                logger.exception("health check failed")

    async def probe(self, instance: Instance) -> str:
        before = instance.in_flight
        if isinstance(instance.channel, VllmEndpoint):
            state, load, timing = await instance.channel.check(self._timeout_s)
            if timing is not None:
                instance.service.server_timing(timing)
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

    def set(self, instance: Instance, healthy: bool, state: str, why: str) -> None:
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
