"""The router's choice policies, circuit breaker, admission queue, fleet membership and the
flags and config that set them, in one process (no daemon, no server). Against fake daemons:
tests/test_router_fleet.py."""

from __future__ import annotations

import asyncio
import importlib.util
import random
import socket
from dataclasses import dataclass

import grpc
import pytest

from kvtransfer.router.__main__ import _parser, config_from_args
from kvtransfer.router.config import RouterConfig
from kvtransfer.router.errors import NoHealthyDaemon, UpstreamError
from kvtransfer.router.fleet.breaker import CLOSED, HALF_OPEN, OPEN, CircuitBreaker
from kvtransfer.router.fleet.dns import DnsTarget, host_port
from kvtransfer.router.fleet.fleet import Fleet
from kvtransfer.router.fleet.instance import Instance, InstancePresent
from kvtransfer.router.names import CACHE_AWARE_MODULE, check_policy_name
from kvtransfer.router.routing.policy import (
    InstanceLoad,
    LeastLoad,
    PowerOfTwo,
    RoundRobin,
    RouteContext,
    create_policy,
    load_score,
    token_ids_of,
)
from kvtransfer.router.web.admission import Admission, QueueFull, QueueTimeout

pytestmark = pytest.mark.unit

ROUTE = RouteContext("req-1")
GOOD = {"prefill": ("127.0.0.1:1",), "decode": ("127.0.0.1:2",)}


@dataclass
class Fake:
    address: str
    in_flight: int = 0
    load: InstanceLoad | None = None


def report(running: int = 0, waiting: int = 0, used: int = 0, total: int = 100, mine: int = 0):
    return InstanceLoad(running, waiting, used, total, router_in_flight=mine)


# ---------------------------------------------------------------------- policies


def test_round_robin_takes_the_candidates_in_turn():
    a, b, c = Fake("a"), Fake("b"), Fake("c", in_flight=9)
    policy = RoundRobin()
    assert [policy.choose([a, b, c], ROUTE).address for _ in range(4)] == ["a", "b", "c", "a"]


def test_load_score_counts_this_routers_requests_once():
    assert load_score(Fake("a", in_flight=2)) == 2
    # The report counts the 2 in flight here when it was read: 3 more are other routers'.
    assert load_score(Fake("a", in_flight=2, load=report(running=4, waiting=1, mine=2))) == 5
    # A report older than requests that have ended since adds nothing negative.
    assert load_score(Fake("a", in_flight=0, load=report(running=1, mine=3))) == 0
    assert report(used=25, total=100).kv_usage == 0.25
    assert report(total=0).kv_usage == 0.0


def test_least_load_picks_the_lowest_score_then_kv_use_and_rotates_ties():
    policy = LeastLoad()
    idle, busy = Fake("idle"), Fake("busy", in_flight=1)
    assert [policy.choose([busy, idle], ROUTE).address for _ in range(2)] == ["idle", "idle"]
    others = Fake("others", load=report(running=3))
    assert policy.choose([others, busy], ROUTE).address == "busy"
    full, empty = Fake("full", load=report(used=90)), Fake("empty", load=report(used=10))
    assert policy.choose([full, empty], ROUTE).address == "empty"
    # Equals in turn: an idle fleet is served round robin.
    a, b, c = Fake("a"), Fake("b"), Fake("c")
    rotating = LeastLoad()
    assert [rotating.choose([a, b, c], ROUTE).address for _ in range(4)] == ["a", "b", "c", "a"]


def test_power_of_two_never_picks_the_busiest_of_two_and_spreads_otherwise():
    policy = PowerOfTwo(random.Random(5))
    idle, mid, worst = Fake("idle"), Fake("mid", in_flight=3), Fake("worst", in_flight=9)
    picks = [policy.choose([idle, mid, worst], ROUTE).address for _ in range(300)]
    assert "worst" not in picks
    assert picks.count("idle") > picks.count("mid") > 0
    assert policy.choose([worst], ROUTE) is worst
    even = [Fake(str(i)) for i in range(4)]
    assert {policy.choose(even, ROUTE).address for _ in range(200)} == {"0", "1", "2", "3"}


def test_policies_by_name_and_the_cache_aware_slot():
    config = RouterConfig(**GOOD)
    made = [create_policy(name, "decode", config) for name in ("round_robin", "least_load")]
    assert [p.name for p in made] == ["round_robin", "least_load"]
    assert create_policy("power_of_two", "prefill", config).name == "power_of_two"
    # Each role gets its own state.
    assert create_policy("least_load", "prefill", config) is not made[1]
    with pytest.raises(ValueError, match="unknown policy 'random'; expected one of round_robin"):
        check_policy_name("random")
    if importlib.util.find_spec(CACHE_AWARE_MODULE) is None:
        message = "policy 'cache_aware' is not available in this build"
        with pytest.raises(ValueError, match=message):
            check_policy_name("cache_aware")
        with pytest.raises(ValueError, match=message):
            RouterConfig(**GOOD, decode_policy="cache_aware")
    else:
        policy = create_policy("cache_aware", "decode", config)
        assert policy.name == "cache_aware"
        assert policy.choose([Fake("a")], ROUTE).address == "a"


def test_prompt_token_ids_are_known_only_for_token_prompts_by_default():
    assert token_ids_of((1, 2, 3)) == (1, 2, 3)
    assert token_ids_of("hello") is None


# ---------------------------------------------------------------------- circuit breaker


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_a_breaker_opens_half_opens_and_closes():
    clock, seen = Clock(), []
    breaker = CircuitBreaker(3, 10.0, clock=clock, on_change=seen.append)
    for _ in range(2):
        breaker.failure()
    breaker.success()  # a success resets the count
    for _ in range(2):
        breaker.failure()
    assert (breaker.state, breaker.allows(0)) == (CLOSED, True)
    breaker.failure()
    assert (breaker.state, breaker.allows(0)) == (OPEN, False)
    clock.now += 9.9
    assert breaker.state == OPEN
    clock.now += 0.1
    # Half-open: one call at a time.
    assert (breaker.state, breaker.allows(0), breaker.allows(1)) == (HALF_OPEN, True, False)
    breaker.failure()
    assert breaker.state == OPEN
    clock.now += 10
    assert breaker.state == HALF_OPEN
    breaker.success()
    assert (breaker.state, breaker.consecutive_failures) == (CLOSED, 0)
    assert seen == [OPEN, HALF_OPEN, OPEN, HALF_OPEN, CLOSED]


def test_a_breaker_with_no_threshold_never_opens():
    breaker = CircuitBreaker(0, 1.0)
    for _ in range(100):
        breaker.failure()
    assert breaker.state == CLOSED


# ---------------------------------------------------------------------- admission


async def settle() -> None:
    """Let every task that can run, run (a handed-over slot takes a few loop turns)."""
    for _ in range(20):
        await asyncio.sleep(0)


def test_admission_runs_queues_in_order_and_refuses_beyond():
    async def scenario():
        changes = []
        admission = Admission(2, 2, on_change=lambda r, q: changes.append((r, q)))
        far = asyncio.get_running_loop().time() + 60  # time.monotonic's clock
        order: list[str] = []
        release = {name: asyncio.Event() for name in "abcd"}

        async def request(name: str) -> None:
            async with admission.slot(far):
                order.append(name)
                await release[name].wait()

        tasks = {name: asyncio.create_task(request(name)) for name in "abcd"}
        await settle()
        assert (admission.running, admission.queued, order) == (2, 2, ["a", "b"])
        with pytest.raises(QueueFull, match="2 requests are running and 2 waiting"):
            async with admission.slot(far):
                pass
        release["b"].set()
        await tasks["b"]
        await settle()
        assert order == ["a", "b", "c"] and admission.queued == 1
        for name in "acd":
            release[name].set()
        await asyncio.gather(*tasks.values())
        assert (admission.running, admission.queued) == (0, 0)
        assert changes[-1] == (0, 0) and max(q for _, q in changes) == 2

    asyncio.run(scenario())


def test_a_queued_request_times_out_or_leaves_without_taking_a_slot():
    async def scenario():
        admission = Admission(1, 5)
        loop = asyncio.get_running_loop()
        hold = asyncio.Event()

        async def holder() -> None:
            async with admission.slot(loop.time() + 60):
                await hold.wait()

        first = asyncio.create_task(holder())
        await settle()
        with pytest.raises(QueueTimeout, match="timed out waiting for admission"):
            async with admission.slot(loop.time() + 0.01):
                pass
        leaving = asyncio.create_task(holder())
        await settle()
        assert admission.queued == 1
        leaving.cancel()
        await asyncio.gather(leaving, return_exceptions=True)
        assert (admission.running, admission.queued) == (1, 0)
        hold.set()
        await first
        assert admission.running == 0
        # 0: no limit at all.
        unlimited = Admission(0, 0)
        async with unlimited.slot(loop.time()), unlimited.slot(loop.time()):
            assert unlimited.running == 2

    asyncio.run(scenario())


# ---------------------------------------------------------------------- the fleet


def make_fleet(policy=None, **kwargs) -> Fleet:
    return Fleet(
        {"prefill": policy or RoundRobin(), "decode": policy or RoundRobin()},
        **kwargs,
    )


def healthy(fleet: Fleet, *addresses: str) -> None:
    for address in addresses:
        instance = fleet.get(address)
        assert instance is not None
        instance.health.healthy, instance.health.state = True, "SERVING"


def test_the_fleet_picks_healthy_untried_instances_and_leases_them():
    async def scenario():
        fleet = make_fleet()
        a, b = fleet.add("prefill", "10.0.0.1:1"), fleet.add("prefill", "10.0.0.2:1")
        with pytest.raises(NoHealthyDaemon, match=r"10.0.0.1:1: NOT_CHECKED; 10.0.0.2:1: NOT_"):
            fleet.pick("prefill", ROUTE)
        with pytest.raises(NoHealthyDaemon, match="the fleet has no decode daemon yet"):
            fleet.pick("decode", ROUTE)
        healthy(fleet, a.address, b.address)
        picked = fleet.pick("prefill", ROUTE)
        assert (picked, picked.in_flight, picked.picks) == (a, 1, 1)
        assert fleet.pick("prefill", ROUTE, exclude=[b]) is a
        assert a.in_flight == 2
        fleet.release(a)
        fleet.release(a)
        with pytest.raises(InstancePresent, match="in the fleet already"):
            fleet.add("decode", a.address)
        with pytest.raises(ValueError, match="role must be one of prefill, decode"):
            fleet.add("both", "10.0.0.3:1")
        # An open breaker takes it out; /health says why.
        for _ in range(5):
            a.failed()
        assert fleet.states("prefill")[a.address] == "SERVING, breaker open"
        assert all(fleet.pick("prefill", ROUTE) is b for _ in range(3))
        await fleet.close()

    asyncio.run(scenario())


def test_a_removed_instance_is_never_picked_and_its_channel_closes_after_its_last_request():
    async def scenario():
        fleet = make_fleet()
        a, b = fleet.add("decode", "10.0.0.1:1"), fleet.add("decode", "10.0.0.2:1")
        healthy(fleet, a.address, b.address)
        assert fleet.pick("decode", ROUTE) is a
        assert fleet.remove(a.address) is a
        assert [fleet.pick("decode", ROUTE) for _ in range(3)] == [b, b, b]
        assert fleet.instances() == [b] and a.removed and not a.pickable()
        closed = asyncio.Event()
        original = a.channel.close

        async def close(grace=None):
            closed.set()
            await original(grace)

        a.channel.close = close
        await asyncio.sleep(0)
        assert not closed.is_set()  # a request still runs on it
        fleet.release(a)
        await asyncio.wait_for(closed.wait(), 5)
        with pytest.raises(KeyError):
            fleet.remove(a.address)
        await fleet.close()

    asyncio.run(scenario())


class _NoMetrics:
    def instance_health(self, *args) -> None: ...

    def instance_breaker(self, *args) -> None: ...

    def instance_membership(self, *args) -> None: ...


def test_cache_aware_picks_count_pending_until_they_end_fail_or_their_instance_goes_out():
    """Through the fleet: a burst on a new prefix with live events lands on one instance until
    the load guard; leases ending, an open breaker or an ejection drop what was pending."""
    from prometheus_client import CollectorRegistry

    from kvtransfer.router.fleet.cache_wiring import CacheIndexWiring

    async def scenario():
        config = RouterConfig(**GOOD, prefill_policy="cache_aware")
        policy = create_policy("cache_aware", "prefill", config)
        wiring = CacheIndexWiring({"prefill": policy}, config, _NoMetrics())
        fleet = make_fleet(policy, listener=wiring)
        addresses = [f"10.0.0.{n}:1" for n in range(1, 4)]
        instances = [fleet.add("prefill", address) for address in addresses]
        healthy(fleet, *addresses)
        index = policy.index
        for address in addresses:
            index.attach_events(address)  # (a subscriber does this with kv_events_port)
            index.events_synced(address, True)
        prompt = tuple(range(1000, 1000 + 64 * config.kv_block_size))

        def pick(rid: str) -> Instance:
            return fleet.pick("prefill", RouteContext(rid, prompt))

        burst = [pick(f"r{n}") for n in range(6)]
        assert burst[:4] == [burst[0]] * 4 and burst[4:] == [burst[4]] * 2 != burst[:2]
        registry = CollectorRegistry()
        wiring.register_metrics(registry)

        def pending(address: str) -> float | None:
            labels = {"role": "prefill", "address": address, "source": "pending"}
            return registry.get_sample_value("kvtransfer_router_index_blocks", labels)

        assert pending(burst[0].address) == 64 and pending(burst[4].address) == 64
        # Every lease ends before the engines announce anything: nothing pending is left.
        for instance in burst:
            fleet.release(instance)
        idle = pick("after")  # the next choice sees nothing of the router running anywhere
        assert [pending(a) for a in addresses].count(0) == 2
        fleet.release(idle)
        # An open breaker fails what ran there; so does an ejection.
        a = pick("r-breaker")
        assert pending(a.address) == 64
        for _ in range(5):
            a.failed()
        assert pending(a.address) == 0
        fleet.release(a)
        b = pick("r-eject")
        assert b is not a and pending(b.address) == 64
        fleet.eject(b, grpc.StatusCode.UNAVAILABLE, "connection reset")
        assert pending(b.address) == 0
        fleet.release(b)
        assert all(not i.in_flight for i in instances)
        await fleet.close()
        await wiring.close()

    asyncio.run(scenario())


def test_dns_resolutions_add_and_remove_instances():
    async def scenario():
        answers: list[object] = [["10.0.0.1", "fd00::1"]]

        async def resolver(name: str, port: int) -> list[str]:
            answer = answers[-1]
            if isinstance(answer, BaseException):
                raise answer
            return answer  # type: ignore[return-value]

        target = DnsTarget("decode", "decode.pd.svc", 5)
        fleet = make_fleet(resolver=resolver, health_timeout_s=0.05)
        fleet.add("decode", "10.0.0.9:5")  # a static one is never touched by the name
        await fleet.resolve(target)
        by_source = {i.address: i.source for i in fleet.instances()}
        assert by_source == {
            "10.0.0.9:5": "static",
            "10.0.0.1:5": "dns:decode.pd.svc:5",
            "[fd00::1]:5": "dns:decode.pd.svc:5",
        }
        answers.append(["10.0.0.2", "10.0.0.9"])
        await fleet.resolve(target)
        assert [i.address for i in fleet.instances()] == ["10.0.0.9:5", "10.0.0.2:5"]
        answers.append(socket.gaierror(socket.EAI_AGAIN, "Temporary failure"))
        await fleet.resolve(target)
        assert len(fleet.instances()) == 2
        answers.append(socket.gaierror(socket.EAI_NONAME, "Name or service not known"))
        await fleet.resolve(target)
        assert [i.address for i in fleet.instances()] == ["10.0.0.9:5"]
        await fleet.close()

    asyncio.run(scenario())


def test_host_port_brackets_ipv6():
    assert host_port("10.0.0.1", 5) == "10.0.0.1:5"
    assert host_port("fd00::1", 5) == "[fd00::1]:5"


# ---------------------------------------------------------------------- errors


def test_which_failures_are_retried():
    def error(status: int, reason: str) -> UpstreamError:
        return UpstreamError(status, "m", "prefill", "h:1", reason)

    assert error(503, "UNAVAILABLE").retryable
    assert error(502, "finish_error").retryable
    assert not error(503, "DEADLINE_EXCEEDED").retryable
    assert not error(400, "INVALID_ARGUMENT").retryable
    assert not NoHealthyDaemon("decode", {}).retryable


# ---------------------------------------------------------------------- config and flags


def test_fleet_config_is_checked_up_front():
    for overrides, message in [
        ({"prefill": ()}, "at least one prefill daemon is required (HOST:PORT or dns:NAME:PORT)"),
        ({"decode": ["dns:svc"]}, "'dns:svc' is not dns:NAME:PORT"),
        ({"decode": ["dns::5"]}, "'dns::5' is not dns:NAME:PORT"),
        ({"decode": ["h:1", "h:1"]}, "decode: a daemon is listed twice"),
        ({"decode": ["127.0.0.1:1"]}, "127.0.0.1:1: listed as both a prefill and a decode"),
        ({"policy": "random"}, "unknown policy 'random'"),
        ({"max_retries": -1}, "max_retries must be an integer >= 0, got -1"),
        ({"max_queued_requests": 1.5}, "max_queued_requests must be an integer >= 0"),
        ({"breaker_cooldown_s": 0}, "breaker_cooldown_s must be > 0"),
        ({"dns_interval_s": -1}, "dns_interval_s must be > 0"),
        ({"admin_token": "has space"}, "admin token must be non-empty printable ASCII"),
        ({"daemon_admin_token": ""}, "the daemons' admin token must be non-empty"),
    ]:
        with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
            RouterConfig(**{**GOOD, **overrides})
    # With the admin API on, a role may start empty.
    token = "s3cr3t-t0ken"
    config = RouterConfig(prefill=(), decode=("dns:decode.svc:5", "h:6"), admin_token=token)
    assert config.addresses("decode") == ("h:6",)
    assert config.dns_names("decode") == (("decode.svc", 5),)
    assert token not in repr(config)
    mixed = RouterConfig(**GOOD, policy="power_of_two", decode_policy="least_load")
    assert (mixed.policy_for("prefill"), mixed.policy_for("decode")) == (
        "power_of_two",
        "least_load",
    )


def test_fleet_flags(tmp_path):
    token_file = tmp_path / "token"
    token_file.write_text("s3cret\n")
    argv = [
        "--decode",
        "dns:decode.pd.svc:50061",
        "--policy",
        "power_of_two",
        "--decode-policy",
        "round_robin",
        "--max-retries",
        "1",
        "--breaker-failures",
        "3",
        "--breaker-cooldown-s",
        "5",
        "--max-concurrent-requests",
        "8",
        "--max-queued-requests",
        "16",
        "--dns-interval-s",
        "2",
        "--disagg-min-prompt-tokens",
        "64",
        "--admin-token-file",
        str(token_file),
    ]
    environ = {"KVTRANSFER_ADMIN_TOKEN": "daemons"}
    config = config_from_args(_parser().parse_args(argv), environ)
    assert config.prefill == () and config.decode == ("dns:decode.pd.svc:50061",)
    assert (config.policy_for("prefill"), config.policy_for("decode")) == (
        "power_of_two",
        "round_robin",
    )
    assert (config.max_retries, config.breaker_failures, config.breaker_cooldown_s) == (1, 3, 5)
    assert (config.max_concurrent_requests, config.max_queued_requests) == (8, 16)
    assert (config.dns_interval_s, config.disagg_min_prompt_tokens) == (2, 64)
    assert (config.admin_token, config.daemon_admin_token) == ("s3cret", "daemons")
    from_env = config_from_args(
        _parser().parse_args(["--prefill", "h:1"]), {"KVTRANSFER_ROUTER_ADMIN_TOKEN": "e"}
    )
    assert (from_env.admin_token, from_env.decode) == ("e", ())
    defaults = config_from_args(_parser().parse_args(["--prefill", "h:1", "--decode", "h:2"]), {})
    assert (defaults.policy_for("prefill"), defaults.policy_for("decode")) == (
        "least_load",
        "least_load",
    )
    assert (defaults.max_retries, defaults.admin_token, defaults.daemon_admin_token) == (
        2,
        None,
        None,
    )
    with pytest.raises(ValueError, match="cannot read the token file"):
        config_from_args(
            _parser().parse_args(["--prefill", "h:1", "--admin-token-file", "/nope"]), {}
        )
    empty = tmp_path / "empty"
    empty.write_text("\n")
    with pytest.raises(ValueError, match="is empty"):
        config_from_args(
            _parser().parse_args(["--prefill", "h:1", "--admin-token-file", str(empty)]), {}
        )
