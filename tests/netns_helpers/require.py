"""`network`: a test network, or the test skipped where this machine cannot have one (failed
instead under ``KVTRANSFER_REQUIRE_NETNS=1``, as CI runs: that tier must never skip there)."""

from __future__ import annotations

import os

import pytest

from netns_helpers.topology import NetnsUnavailable, Network, check_shaping


def network(tag: str, *, shaped: bool = False) -> Network:
    """A test network (``shaped``: whose hosts' links `Network.shape` can slow down)."""
    try:
        if shaped:
            check_shaping()
        return Network(tag)
    except NetnsUnavailable as exc:
        if os.environ.get("KVTRANSFER_REQUIRE_NETNS") == "1":
            pytest.fail(f"KVTRANSFER_REQUIRE_NETNS=1 but {exc}")
        pytest.skip(str(exc))
