"""The order of P/D requests at busy prefills (`routing.prefill_order`), in one process: who is
sent on at once, who next when a turn ends, and that nobody who leaves keeps a turn. With real
daemons: tests/test_router_slo.py."""

from __future__ import annotations

import asyncio
import time

import pytest

from kvtransfer.router.routing.prefill_order import (
    AT_ONCE,
    IN_TIME,
    LATE,
    PrefillOrder,
    PrefillWaitTimeout,
)

pytestmark = pytest.mark.unit

FAR = 1e9  # a deadline nobody reaches


class _Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def _rate(tokens_per_s: float, queued: int = 0):
    return lambda tokens: (queued + tokens) / tokens_per_s


async def _hold(
    order: PrefillOrder, name: str, tokens: int | None, arrived: float, log, release, **kw
):
    """One request: waits for its turn, logs it, holds it until ``release[name]`` is set."""
    predict = kw.get("predict", _rate(100.0))
    turn = order.turn(tokens, arrived, kw.get("deadline", FAR), kw.get("slots", 2), predict)
    async with turn as how:
        log.append((name, how))
        await release.setdefault(name, asyncio.Event()).wait()


async def _settle() -> None:
    for _ in range(5):
        await asyncio.sleep(0)


def test_the_request_that_can_be_on_time_with_the_fewest_tokens_goes_first():
    async def scenario() -> None:
        clock = _Clock()
        changes: list[tuple[int, int]] = []
        order = PrefillOrder(2.0, on_change=lambda *state: changes.append(state), clock=clock)
        log: list[tuple[str, str]] = []
        release: dict[str, asyncio.Event] = {}
        tasks = []
        # 100 tokens/s: 150 tokens need 1.5 s, 50 need 0.5 s, 300 need 3 s (never in time).
        for name, tokens in [("a", 100), ("b", 100), ("late", 300), ("long", 150), ("short", 50)]:
            tasks.append(asyncio.create_task(_hold(order, name, tokens, clock.now, log, release)))
            await _settle()
        assert log == [("a", AT_ONCE), ("b", AT_ONCE)]
        assert (order.inside, order.waiting, order.waiting_tokens) == (2, 3, 500)
        assert order.tokens_ahead(100) == 50  # a new 100-token prompt would follow "short"
        assert changes[-1] == (2, 3)
        release["a"].set()
        await _settle()
        assert log[-1] == ("short", IN_TIME)
        # 0.4 s later "long" (1.5 s) still makes its 2 s; "late" (3 s) never could.
        clock.now += 0.4
        release["b"].set()
        await _settle()
        assert log[-1] == ("long", IN_TIME)
        release["short"].set()
        await _settle()
        assert log[-1] == ("late", LATE)
        for event in release.values():
            event.set()
        await asyncio.gather(*tasks)
        assert (order.inside, order.waiting) == (0, 0)
        assert changes[-1] == (0, 0)

    asyncio.run(scenario())


def test_when_none_can_be_on_time_or_nothing_is_measured_arrival_order_holds():
    async def scenario() -> None:
        clock = _Clock()
        for predict in (_rate(1.0), lambda tokens: None):
            order = PrefillOrder(1.0, clock=clock)
            log: list[tuple[str, str]] = []
            release: dict[str, asyncio.Event] = {}
            names = ["first", "second", "big", "small"]
            tasks = []
            for name, tokens in zip(names, [10, 10, 500, 5], strict=True):
                task = _hold(order, name, tokens, clock.now, log, release, predict=predict)
                tasks.append(asyncio.create_task(task))
                await _settle()
            for name in names:
                release.setdefault(name, asyncio.Event()).set()
                await _settle()
            await asyncio.gather(*tasks)
            expected_order = LATE if predict(1) is not None else IN_TIME
            assert log == [
                ("first", AT_ONCE),
                ("second", AT_ONCE),
                ("big", expected_order),
                ("small", expected_order),
            ]

    asyncio.run(scenario())


def test_a_request_that_leaves_gives_up_its_place_and_any_turn_handed_to_it():
    async def scenario() -> None:
        order = PrefillOrder(10.0)
        log: list[tuple[str, str]] = []
        release: dict[str, asyncio.Event] = {}
        holder = asyncio.create_task(_hold(order, "holder", 10, 0.0, log, release, slots=1))
        await _settle()
        gone = asyncio.create_task(_hold(order, "gone", 10, 0.0, log, release, slots=1))
        await _settle()
        nxt = asyncio.create_task(_hold(order, "next", 20, 0.0, log, release, slots=1))
        await _settle()
        # Its client leaves while it waits: out of the queue, nothing sent on.
        gone.cancel()
        await _settle()
        assert (order.inside, order.waiting) == (1, 1)
        # A turn handed over at the moment the waiter is cancelled passes on.
        last = asyncio.create_task(_hold(order, "last", 30, 0.0, log, release, slots=1))
        await _settle()
        release["holder"].set()
        await asyncio.sleep(0)  # the holder ends: "next" is handed the turn ...
        nxt.cancel()  # ... and leaves before it sees it
        await _settle()
        assert log[-1][0] == "last"
        assert (order.inside, order.waiting) == (1, 0)
        release["last"].set()
        await asyncio.gather(holder, last)
        for task in (gone, nxt):
            with pytest.raises(asyncio.CancelledError):
                await task
        assert (order.inside, order.waiting) == (0, 0)

    asyncio.run(scenario())


def test_a_request_out_of_time_fails_without_reaching_a_prefill_and_no_prefill_means_no_wait():
    async def scenario() -> None:
        order = PrefillOrder(10.0)
        log: list[tuple[str, str]] = []
        release: dict[str, asyncio.Event] = {}
        holder = asyncio.create_task(_hold(order, "holder", 10, 0.0, log, release, slots=1))
        await _settle()
        # Its deadline passes while it waits: it fails, named, and never had a turn.
        due = _hold(order, "due", 10, 0.0, log, release, slots=1, deadline=time.monotonic() + 0.05)
        with pytest.raises(PrefillWaitTimeout, match="deadline passed while it waited"):
            await due
        assert (order.inside, order.waiting) == (1, 0)
        # Its turn comes with 1 s left, and its 500 tokens need 5 s at 100 tokens/s: it fails
        # and the turn goes on to the next request.
        short = time.monotonic() + 1.0
        doomed = asyncio.create_task(
            _hold(order, "doomed", 500, 0.0, log, release, slots=1, deadline=short)
        )
        await _settle()
        after = asyncio.create_task(_hold(order, "after", 10, 0.0, log, release, slots=1))
        await _settle()
        release["holder"].set()
        with pytest.raises(PrefillWaitTimeout, match=r"1\.0 s left .* needs about 5\.0 s"):
            await doomed
        await _settle()
        assert [name for name, _ in log] == ["holder", "after"]
        # No prefill pickable (0 turns): nothing is held back.
        free = asyncio.create_task(_hold(order, "free", 10, 0.0, log, release, slots=0))
        await _settle()
        assert log[-1] == ("free", AT_ONCE)
        for event in release.values():
            event.set()
        await asyncio.gather(holder, after, free)
        assert (order.inside, order.waiting) == (0, 0)

    asyncio.run(scenario())


def test_turns_a_new_prefill_brings_go_to_those_already_waiting():
    async def scenario() -> None:
        order = PrefillOrder(10.0)
        log: list[tuple[str, str]] = []
        release: dict[str, asyncio.Event] = {}
        tasks = [
            asyncio.create_task(_hold(order, name, 10, 0.0, log, release, slots=1))
            for name in ("first", "second", "third")
        ]
        await _settle()
        assert [name for name, _ in log] == ["first"]
        # A second prefill (two turns now): the next request sees them and the one waiting
        # longest goes before it, the newcomer waits its turn.
        tasks.append(asyncio.create_task(_hold(order, "new", 10, 0.0, log, release, slots=2)))
        await _settle()
        assert [name for name, _ in log] == ["first", "second"]
        assert order.waiting == 2
        for event in list(release.values()):
            event.set()
        for name in ("third", "new"):
            release.setdefault(name, asyncio.Event()).set()
        await asyncio.gather(*tasks)
        assert [name for name, _ in log] == ["first", "second", "third", "new"]

    asyncio.run(scenario())


def test_the_ttft_target_is_checked():
    with pytest.raises(ValueError, match="the TTFT target must be > 0 s, got 0"):
        PrefillOrder(0)
