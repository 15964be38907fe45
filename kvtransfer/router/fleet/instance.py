"""`Instance`: one daemon (or vLLM server) of the fleet, as the router sees it: its channel,
health, circuit breaker, load and the requests it runs. It is a `policy.Candidate`."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import grpc

from kvtransfer.control.placement import Placement
from kvtransfer.router.fleet.breaker import CircuitBreaker
from kvtransfer.router.fleet.service import ServiceStats
from kvtransfer.router.fleet.vllm_endpoint import VllmEndpoint
from kvtransfer.router.names import AGGREGATED
from kvtransfer.router.routing.policy import InstanceLoad
from kvtransfer.v1 import admin_pb2_grpc, generation_pb2_grpc

SERVING = "SERVING"
NOT_CHECKED = "NOT_CHECKED"

# Where an instance came from, besides DNS names (``dns:NAME:PORT``).
STATIC = "static"
ADMIN = "admin"


@dataclass
class Health:
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
        self.health = Health()
        self.in_flight = 0
        self.picks = 0
        self.load: InstanceLoad | None = None
        # Its speed as measured from the calls routed here (the SLO rule predicts from it).
        self.service = ServiceStats()
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
            "service": self.service.describe(),
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
