"""A decode leg's lease ends however its closing goes: the instance's ``in_flight`` is what a
half-open circuit breaker waits to see at zero, so one lease that never ends keeps the instance
out for good (seen in `benchmarks/chaos.py`: a restarted decode refused for two minutes).

One layer in isolation: the leg with a stand-in upstream that records releases, and a reader
task whose unwinding outlasts the close (a gRPC cancel that takes its time)."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

from kvtransfer.router.daemon_flow.decode_leg import DecodeLeg
from kvtransfer.router.daemon_flow.leases import Lease

pytestmark = pytest.mark.unit


class _Fleet:
    def __init__(self) -> None:
        self.released: list[object] = []

    def release(self, instance: object) -> None:
        self.released.append(instance)


async def _slow_to_unwind(started: asyncio.Event, unwinding: asyncio.Event) -> None:
    started.set()
    try:
        await asyncio.Event().wait()
    except asyncio.CancelledError:
        unwinding.set()
        await asyncio.sleep(3600)  # until cancelled once more


def _leg(fleet: _Fleet, instance: object) -> DecodeLeg:
    upstream = SimpleNamespace(fleet=fleet)
    return DecodeLeg(upstream, SimpleNamespace(), Lease(upstream, instance))  # type: ignore[arg-type]


def test_a_close_cancelled_while_its_call_unwinds_still_ends_the_lease():
    async def scenario() -> None:
        fleet, instance = _Fleet(), object()
        leg = _leg(fleet, instance)
        started, unwinding = asyncio.Event(), asyncio.Event()
        reader = asyncio.create_task(_slow_to_unwind(started, unwinding))
        leg._reader = reader
        await started.wait()
        closing = asyncio.create_task(leg.close())
        await unwinding.wait()  # the close cancelled the call, which is still unwinding
        # The handler is cancelled again (the client left, the router stops) mid-close.
        closing.cancel()
        (outcome,) = await asyncio.gather(closing, return_exceptions=True)
        assert isinstance(outcome, asyncio.CancelledError)
        assert fleet.released == [instance]
        assert reader.done()

    asyncio.run(asyncio.wait_for(scenario(), 10))


def test_a_stream_that_fails_to_close_still_ends_the_lease_once():
    async def scenario() -> None:
        fleet, instance = _Fleet(), object()
        leg = _leg(fleet, instance)

        class _Broken:
            def cancel(self) -> None:
                pass

            async def aclose(self) -> None:
                raise RuntimeError("aclose(): asynchronous generator is already running")

        leg._stream = _Broken()  # type: ignore[assignment]
        with pytest.raises(RuntimeError, match="already running"):
            await leg.close()
        assert fleet.released == [instance]
        await leg.close()  # idempotent: a second close releases nothing more
        assert fleet.released == [instance]

    asyncio.run(asyncio.wait_for(scenario(), 10))
