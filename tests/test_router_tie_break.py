"""The cache-aware policy's tie-break (`cache_policy.tie_rank`) across processes: router replicas
are processes, each with its own salt for Python's ``hash`` of a str (``PYTHONHASHSEED``); they
must send a prefix to the same instance while loads tie, or each of its instances computes it.
The prefix index's block keys (Python's ``hash`` of int tuples, unsalted) agree as well. The
policy itself: tests/test_cache_policy.py."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import Any

import pytest

pytestmark = pytest.mark.integration

# Prints, as JSON, where the cache-aware policy sends each of 16 prompts over 4 idle instances
# (all tied: the first block decides).
_TIE_PICKS = """
import json
from kvtransfer.router.routing.cache_policy import CacheAwarePolicy
from kvtransfer.router.routing.policy import RouteContext
from kvtransfer.router.routing.prefix_index import PrefixIndex

class Idle:
    def __init__(self, address):
        self.address, self.in_flight, self.load = address, 0, None

policy = CacheAwarePolicy(PrefixIndex(default_block_size=4), role="prefill")
fleet = [Idle(f"10.0.0.{n}:8100") for n in range(4)]
prompts = [tuple(range(7 * n, 7 * n + 9)) for n in range(16)]
print(json.dumps([policy.choose(fleet, RouteContext("r", p)).address for p in prompts]))
"""


def _run(script: str, hash_seed: str) -> Any:
    """What ``script`` prints, as JSON, run by a fresh interpreter with ``hash_seed``."""
    env = {**os.environ, "PYTHONHASHSEED": hash_seed}
    done = subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True, check=True
    )
    return json.loads(done.stdout)


def test_router_replicas_break_ties_alike_whatever_their_hash_seed() -> None:
    # Replicas are processes with their own str-hash salt: each must send a prefix where the
    # others do, or their instances each compute it.
    picks = _run(_TIE_PICKS, "1")
    assert _run(_TIE_PICKS, "2") == picks
    assert _run(_TIE_PICKS, "random") == picks
    assert set(picks) == {f"10.0.0.{n}:8100" for n in range(4)}  # prefixes spread


_BLOCK_KEYS = """
import json
from kvtransfer.router.routing.prefix_index.keys import block_keys
print(json.dumps(block_keys(list(range(1000, 1040)), 16)))
"""


def test_the_prefix_indexs_block_keys_are_alike_whatever_the_hash_seed() -> None:
    keys = [_run(_BLOCK_KEYS, seed) for seed in ("1", "2", "random")]
    assert keys[0] == keys[1] == keys[2]
    assert len(keys[0]) == 2
