"""`LayerReadiness`: a streaming lease's layer becomes readable only once its writes are done.

Host caches: at ``saved``. Device caches: once the event recorded at ``saved`` completed (here
an event the test completes by hand, standing in for ``torch.cuda.Event``; the GPU tier runs the
real one)."""

from __future__ import annotations

import threading

import pytest

from kvtransfer.connectors.ucx.layer_ready import LayerReadiness
from kvtransfer.transport import LeaseGrants

pytestmark = pytest.mark.unit

LAYERS = ("l0", "l1", "l2")


class HandEvent:
    """An event the test completes; ``synchronize`` blocks until then."""

    def __init__(self) -> None:
        self.done = threading.Event()

    def synchronize(self) -> None:
        assert self.done.wait(10), "the test never completed this event"


def _granted(*lease_ids: str) -> LeaseGrants:
    grants = LeaseGrants()
    for lease_id in lease_ids:
        grants.grant(lease_id, b"d", [1, 2], pending_layers=LAYERS)
    return grants


def _wait_ready(grants: LeaseGrants, lease_id: str, layer: str) -> None:
    for _ in range(1000):
        if grants.ready(lease_id, [layer]):
            return
        grants.wait_for_change(0.01)
    raise AssertionError(f"{lease_id}/{layer} never became ready")


def test_host_layers_are_ready_when_saved():
    grants = _granted("a", "b")
    readiness = LayerReadiness(grants)
    readiness.saved(["a"], "l0")
    assert grants.ready("a", ["l0"]) and not grants.ready("a", ["l1"])
    assert not grants.ready("b", ["l0"])
    readiness.saved([], "l1")  # no streaming lease: nothing happens
    readiness.step_done(["a", "b"])
    assert grants.ready("a", LAYERS) and grants.ready("b", LAYERS)


def test_device_layers_wait_for_their_own_event_not_the_step():
    grants = _granted("a")
    events: list[HandEvent] = []

    def record() -> HandEvent:
        events.append(HandEvent())
        return events[-1]

    readiness = LayerReadiness(grants, record)
    try:
        readiness.saved(["a"], "l0")
        readiness.saved(["a"], "l1")
        assert len(events) == 2
        # Queued, not done: nobody may read layer 0 yet.
        grants.wait_for_change(0.05)
        assert not grants.ready("a", ["l0"])
        events[0].done.set()
        _wait_ready(grants, "a", "l0")
        assert not grants.ready("a", ["l1"])
        events[1].done.set()
        _wait_ready(grants, "a", "l1")
        assert not grants.ready("a", ["l2"])
    finally:
        for event in events:
            event.done.set()
        readiness.close()


def test_the_end_of_the_step_makes_every_layer_ready_even_with_events_queued():
    grants = _granted("a")
    blocked = HandEvent()
    readiness = LayerReadiness(grants, lambda: blocked)
    try:
        readiness.saved(["a"], "l0")
        readiness.step_done(["a"])  # the runner synchronized to sample: all of it is written
        assert grants.ready("a", LAYERS)
    finally:
        blocked.done.set()
        readiness.close()
