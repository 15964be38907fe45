"""The names the router's settings, its fleet and its policies share: roles, engines and policy
names, with the check of a policy name. The lowest module of the router: the config checks
names that the policies implement, and the policies read the config; both import them from
here, so neither imports the other."""

from __future__ import annotations

import importlib.util

# The roles a request is split into; an aggregated daemon is picked among the decodes.
ROLES = ("prefill", "decode")
# The roles a daemon is listed under: an aggregated daemon runs whole requests itself.
AGGREGATED = "aggregated"
WORKER_ROLES = ("prefill", "decode", AGGREGATED)
# What the instances are: kvtransfer daemons (gRPC) or vLLM OpenAI servers (HTTP).
KVTRANSFER = "kvtransfer"
VLLM = "vllm"
ENGINES = (KVTRANSFER, VLLM)

ROUND_ROBIN = "round_robin"
LEAST_LOAD = "least_load"
POWER_OF_TWO = "power_of_two"
CACHE_AWARE = "cache_aware"
POLICY_NAMES = (ROUND_ROBIN, LEAST_LOAD, POWER_OF_TWO, CACHE_AWARE)
# Looked up by name, not imported: a build may leave the cache-aware policy out.
CACHE_AWARE_MODULE = "kvtransfer.router.routing.cache_policy"


def check_policy_name(name: str) -> None:
    """Raises ``ValueError`` for an unknown name, or ``cache_aware`` when it is not built."""
    if name not in POLICY_NAMES:
        raise ValueError(f"unknown policy {name!r}; expected one of {', '.join(POLICY_NAMES)}")
    if name == CACHE_AWARE and importlib.util.find_spec(CACHE_AWARE_MODULE) is None:
        raise ValueError(
            f"policy {CACHE_AWARE!r} is not available in this build ({CACHE_AWARE_MODULE} is "
            f"missing); use {LEAST_LOAD}, {POWER_OF_TWO} or {ROUND_ROBIN}"
        )
