"""`FleetListener`: what the fleet reports as it changes (the metrics, the cache indexes)."""

from __future__ import annotations

from typing import Protocol


class FleetListener(Protocol):
    """What the fleet reports as it changes (the metrics)."""

    def instance_health(
        self, role: str, address: str, healthy: bool, state: str, first: bool
    ) -> None: ...

    def instance_breaker(self, role: str, address: str, state: str) -> None: ...

    def instance_membership(self, role: str, address: str, source: str, change: str) -> None: ...
