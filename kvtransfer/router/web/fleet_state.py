"""What the fleet page shows, as JSON (``GET /dashboard/state``): the router, every instance by
role, and the last requests (`recent.RecentRequests`). Read from what the router holds; no
daemon is called.

Shape::

    {"router": {"model", "engine", "uptime_s", "running", "queued", "max_running",
                "max_queued", "policies": {"prefill", "decode"}, "admin_api",
                "recent_capacity"},
     "instances": {"prefill": [...], "decode": [...], "aggregated": [...]},
     "requests": [newest first: `recent.RequestSummary.brief`]}

Each instance is what ``GET /workers`` shows of it (`Instance.describe`) plus its breaker's
consecutive failures, why it reports no load (``load_problem``), the daemon's uptime, and what
its role's prefix index holds for it (``index``: None unless the role's policy is cache-aware).
"""

from __future__ import annotations

from typing import Any

from kvtransfer.router.config import RouterConfig
from kvtransfer.router.fleet.fleet import Fleet
from kvtransfer.router.fleet.instance import Instance
from kvtransfer.router.names import ROLES, WORKER_ROLES
from kvtransfer.router.routing.cache_policy import CacheAwarePolicy
from kvtransfer.router.routing.prefix_index import InstanceIndexStats
from kvtransfer.router.web.admission import Admission
from kvtransfer.router.web.recent import RecentRequests


def fleet_state(
    config: RouterConfig,
    fleet: Fleet,
    admission: Admission,
    recent: RecentRequests,
    uptime_s: float,
) -> dict[str, Any]:
    indexed = _index_stats(fleet)
    return {
        "router": {
            "model": config.model_name,
            "engine": config.engine,
            "uptime_s": round(uptime_s, 3),
            "running": admission.running,
            "queued": admission.queued,
            "max_running": admission.max_running,
            "max_queued": admission.max_queued,
            "policies": {role: fleet.policies[role].name for role in ROLES},
            "admin_api": config.admin_token is not None,
            "recent_capacity": recent.capacity,
        },
        "instances": {
            kind: [
                instance_state(i, indexed.get((i.role, i.address)))
                for i in fleet.instances()
                if i.kind == kind
            ]
            for kind in WORKER_ROLES
        },
        "requests": [summary.brief() for summary in recent.newest_first()],
    }


def instance_state(instance: Instance, index: InstanceIndexStats | None) -> dict[str, Any]:
    return {
        **instance.describe(),
        "consecutive_failures": instance.breaker.consecutive_failures,
        "load_problem": instance.load_problem,
        "uptime_s": instance.uptime_s,
        "index": None if index is None else index_state(index),
    }


def index_state(stats: InstanceIndexStats) -> dict[str, Any]:
    """``blocks``: those its choices are scored from now (its KV events' while precise, the
    router's own picks' while approximate)."""
    precise = stats.mode == "precise"
    return {
        "mode": stats.mode,
        "blocks": stats.precise_blocks if precise else stats.approx_blocks,
        "events_blocks": stats.precise_blocks,
        "routed_blocks": stats.approx_blocks,
        "pending_blocks": stats.pending_blocks,
        "block_size": stats.block_size,
    }


def _index_stats(fleet: Fleet) -> dict[tuple[str, str], InstanceIndexStats]:
    found: dict[tuple[str, str], InstanceIndexStats] = {}
    for role in ROLES:
        policy = fleet.policies.get(role)
        if isinstance(policy, CacheAwarePolicy):
            for stats in policy.index.stats():
                found[(role, stats.address)] = stats
    return found
