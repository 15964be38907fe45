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


class _Requests:
    """Requests at one order: each waits for its turn, logs how it was sent on, and holds the
    turn until released (`release`). ``slots`` and ``predict`` are what each brings to its
    turn unless told otherwise."""

    def __init__(self, order: PrefillOrder, arrived: float = 0.0, slots: int = 2, predict=None):
        self.order, self.arrived, self.slots = order, arrived, slots
        self.predict = predict or _rate(100.0)
        self.log: list[tuple[str, str]] = []
        self.events: dict[str, asyncio.Event] = {}

    @property
    def names(self) -> list[str]:
        return [name for name, _ in self.log]

    async def start(
        self, name: str, tokens: int | None, *, deadline: float = FAR, slots: int | None = None
    ) -> asyncio.Task[None]:
        slots = self.slots if slots is None else slots
        task = asyncio.create_task(self.hold(name, tokens, deadline, slots))
        await _settle()
        return task

    async def hold(self, name: str, tokens: int | None, deadline: float, slots: int) -> None:
        async with self.order.turn(tokens, self.arrived, deadline, slots, self.predict) as how:
            self.log.append((name, how))
            await self.event(name).wait()

    async def release(self, *names: str) -> None:
        for name in names or list(self.events):
            self.event(name).set()
            await _settle()

    def event(self, name: str) -> asyncio.Event:
        return self.events.setdefault(name, asyncio.Event())


async def _settle() -> None:
    for _ in range(5):
        await asyncio.sleep(0)


def test_the_request_that_can_be_on_time_with_the_fewest_tokens_goes_first():
    async def scenario() -> None:
        clock = _Clock()
        changes: list[tuple[int, int]] = []
        order = PrefillOrder(2.0, on_change=lambda *state: changes.append(state), clock=clock)
        requests = _Requests(order, arrived=clock.now)
        # 100 tokens/s: 150 tokens need 1.5 s, 50 need 0.5 s, 300 need 3 s (never in time).
        tasks = [
            await requests.start(name, tokens)
            for name, tokens in [
                ("a", 100),
                ("b", 100),
                ("late", 300),
                ("long", 150),
                ("short", 50),
            ]
        ]
        assert requests.log == [("a", AT_ONCE), ("b", AT_ONCE)]
        assert (order.inside, order.waiting, order.waiting_tokens) == (2, 3, 500)
        assert order.tokens_ahead(100) == 50  # a new 100-token prompt would follow "short"
        assert changes[-1] == (2, 3)
        await requests.release("a")
        assert requests.log[-1] == ("short", IN_TIME)
        # 0.4 s later "long" (1.5 s) still makes its 2 s; "late" (3 s) never could.
        clock.now += 0.4
        await requests.release("b")
        assert requests.log[-1] == ("long", IN_TIME)
        await requests.release("short")
        assert requests.log[-1] == ("late", LATE)
        await requests.release()
        await asyncio.gather(*tasks)
        assert (order.inside, order.waiting) == (0, 0)
        assert changes[-1] == (0, 0)

    asyncio.run(scenario())


def test_when_none_can_be_on_time_or_nothing_is_measured_arrival_order_holds():
    async def scenario() -> None:
        clock = _Clock()
        for predict, sent_as in ((_rate(1.0), LATE), (lambda tokens: None, IN_TIME)):
            requests = _Requests(PrefillOrder(1.0, clock=clock), clock.now, predict=predict)
            names = ["first", "second", "big", "small"]
            tasks = [
                await requests.start(name, tokens)
                for name, tokens in zip(names, [10, 10, 500, 5], strict=True)
            ]
            await requests.release(*names)
            await asyncio.gather(*tasks)
            assert requests.log == [
                ("first", AT_ONCE),
                ("second", AT_ONCE),
                ("big", sent_as),
                ("small", sent_as),
            ]

    asyncio.run(scenario())


def test_a_request_that_leaves_gives_up_its_place_and_any_turn_handed_to_it():
    async def scenario() -> None:
        order = PrefillOrder(10.0)
        requests = _Requests(order, slots=1)
        holder = await requests.start("holder", 10)
        gone = await requests.start("gone", 10)
        nxt = await requests.start("next", 20)
        # Its client leaves while it waits: out of the queue, nothing sent on.
        gone.cancel()
        await _settle()
        assert (order.inside, order.waiting) == (1, 1)
        # A turn handed over at the moment the waiter is cancelled passes on.
        last = await requests.start("last", 30)
        requests.event("holder").set()
        await asyncio.sleep(0)  # the holder ends: "next" is handed the turn ...
        nxt.cancel()  # ... and leaves before it sees it
        await _settle()
        assert requests.names == ["holder", "last"]
        assert (order.inside, order.waiting) == (1, 0)
        await requests.release("last")
        await asyncio.gather(holder, last)
        for task in (gone, nxt):
            with pytest.raises(asyncio.CancelledError):
                await task
        assert (order.inside, order.waiting) == (0, 0)

    asyncio.run(scenario())


def test_a_request_out_of_time_fails_without_reaching_a_prefill_and_no_prefill_means_no_wait():
    async def scenario() -> None:
        order = PrefillOrder(10.0)
        requests = _Requests(order, slots=1)
        holder = await requests.start("holder", 10)
        # Its deadline passes while it waits: it fails, named, and never had a turn.
        due = requests.hold("due", 10, time.monotonic() + 0.05, 1)
        with pytest.raises(PrefillWaitTimeout, match="deadline passed while it waited"):
            await due
        assert (order.inside, order.waiting) == (1, 0)
        # Its turn comes with 1 s left, and its 500 tokens need 5 s at 100 tokens/s: it fails
        # and the turn goes on to the next request.
        doomed = await requests.start("doomed", 500, deadline=time.monotonic() + 1.0)
        after = await requests.start("after", 10)
        await requests.release("holder")
        with pytest.raises(PrefillWaitTimeout, match=r"1\.0 s left .* needs about 5\.0 s"):
            await doomed
        assert requests.names == ["holder", "after"]
        # No prefill pickable (0 turns): nothing is held back.
        free = await requests.start("free", 10, slots=0)
        assert requests.log[-1] == ("free", AT_ONCE)
        await requests.release()
        await asyncio.gather(holder, after, free)
        assert (order.inside, order.waiting) == (0, 0)

    asyncio.run(scenario())


def test_turns_a_new_prefill_brings_go_to_those_already_waiting():
    async def scenario() -> None:
        order = PrefillOrder(10.0)
        requests = _Requests(order, slots=1)
        tasks = [await requests.start(name, 10) for name in ("first", "second", "third")]
        assert requests.names == ["first"]
        # A second prefill (two turns now): the next request sees them and the one waiting
        # longest goes before it, the newcomer waits its turn.
        tasks.append(await requests.start("new", 10, slots=2))
        assert requests.names == ["first", "second"]
        assert order.waiting == 2
        await requests.release("first", "second", "third", "new")
        await asyncio.gather(*tasks)
        assert requests.names == ["first", "second", "third", "new"]

    asyncio.run(scenario())


def test_a_prompt_of_unknown_length_goes_after_the_known_in_time_ones_before_late_ones():
    async def scenario() -> None:
        clock = _Clock()
        order = PrefillOrder(2.0, clock=clock)
        requests = _Requests(order, arrived=clock.now)
        tasks = [
            await requests.start(name, tokens)
            for name, tokens in [("a", 10), ("b", 10), ("late", 500), ("chat", None), ("known", 90)]
        ]
        assert (order.waiting_tokens, order.tokens_ahead(100)) == (590, 90)
        await requests.release("a", "b", "known", "chat", "late")
        await asyncio.gather(*tasks)
        assert requests.log[2:] == [("known", IN_TIME), ("chat", IN_TIME), ("late", LATE)]

    asyncio.run(scenario())


def test_the_ttft_target_is_checked():
    with pytest.raises(ValueError, match="the TTFT target must be > 0 s, got 0"):
        PrefillOrder(0)
