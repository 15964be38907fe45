"""Routing-decision latency of the cache-aware policy against a large prefix index.

A micro-benchmark (one process, no network): ``--instances`` instances hold, from KV events,
``--prompts`` prompts of each length in ``--lengths`` (each on one instance), then filler
chains over a shared pool of system prompts (prefixes overlapping across instances) up to
``--blocks`` blocks in all (100 000 by default), block size 16; each also has an approximate set
learned from routed prompts. Per scenario it times ``CacheAwarePolicy.choose`` (the index
look-up for every instance, the load guard, the pick), each call on its own:

* ``hit-N``: a prompt of N tokens whose every full block an instance holds (the look-up walks
  the whole prompt: the worst case for its length);
* ``half-N``: its first half cached, then new tokens;
* ``miss-N``: nothing cached (the look-up stops at the first block);

and, with the misses, ``observe`` of a new N-token prompt (what the router does after a pick).

Every decision gets a tuple of its own, as every request brings its own: the router hashes a
request's blocks once (as far as the look-up goes) and keeps the keys for the request's other
choices, so a first decision pays the hashing. ``2nd`` times the request's next decision (the
other role's policy, over an index with the same content), which finds the keys computed.

It also times applying events (``BlockStored`` of 16 blocks, then their removal) to the index.

    .venv/bin/python benchmarks/routing_index.py [--blocks 100000] [--json out.json]

Prints a table (microseconds per call: p50, p99, max) and writes the rows as JSON. The goal is
a routing decision within 0.2 ms at p99 with 100 000 blocks indexed (docs/benchmarks.md has the
figures measured).
"""

from __future__ import annotations

import argparse
import copy
import gc
import json
import platform
import random
import statistics
import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path

from plots import write_png

from kvtransfer.router.routing.cache_policy import CacheAwarePolicy
from kvtransfer.router.routing.policy import InstanceLoad, RouteContext
from kvtransfer.router.routing.prefix_index import PrefixIndex
from kvtransfer.serve.kv_events import BlockRemoved, BlockStored

BLOCK_SIZE = 16
VOCAB = 150_000
IN_FLIGHT = 64


@dataclass(eq=False)
class Instance:
    address: str
    in_flight: int = 0
    load: InstanceLoad | None = None


def _tokens(rng: random.Random, count: int) -> tuple[int, ...]:
    return tuple(rng.randrange(VOCAB) for _ in range(count))


def build(args: argparse.Namespace, rng: random.Random):
    """The index: the scenarios' cached prompts, then filler chains (over a shared pool of
    system prompts, so prefixes overlap across instances) up to ``--blocks``; and an
    approximate set per instance."""
    index = PrefixIndex(default_block_size=BLOCK_SIZE)
    instances = [
        Instance(
            f"10.0.0.{n}:50051",
            in_flight=rng.randrange(4),
            load=InstanceLoad(rng.randrange(8), rng.randrange(4), rng.randrange(1000), 4000),
        )
        for n in range(args.instances)
    ]
    for instance in instances:
        index.add_instance(instance.address)
        index.attach_events(instance.address)
        index.events_synced(instance.address, True)

    def store(address: str, prompt: tuple[int, ...]) -> int:
        count = len(prompt) // BLOCK_SIZE
        hashes = tuple(rng.getrandbits(64) for _ in range(count))
        index.apply(address, [BlockStored(hashes, None, prompt[: count * BLOCK_SIZE], BLOCK_SIZE)])
        return count

    cached: dict[int, list[tuple[int, ...]]] = {}
    total = 0
    for length in args.lengths:
        cached[length] = [_tokens(rng, length) for _ in range(args.prompts)]
        for prompt in cached[length]:
            total += store(rng.choice(instances).address, prompt)
    stems = [_tokens(rng, 4 * BLOCK_SIZE) for _ in range(64)]
    filler: list[tuple[int, ...]] = []
    while total < args.blocks:
        prompt = rng.choice(stems) + _tokens(rng, rng.randrange(1, 60) * BLOCK_SIZE)
        filler.append(prompt)
        total += store(rng.choice(instances).address, prompt)
    for instance in instances:
        for _ in range(200):
            index.observe(instance.address, rng.choice(filler))
        _caught_up(index, instance.address)
    return index, instances, cached


def _caught_up(index: PrefixIndex, address: str) -> None:
    """The instance's engine went on without storing anything new for the routed requests
    (the benchmark's index must not change between decisions): their picks ended, and its
    events arrive (else, with requests expected to store blocks and no message, the instance
    would fall back to its approximate set after ``max_event_lag_s``)."""
    index.picks_ended(address)
    index.message_received(address)


def scenarios(rng: random.Random, cached, args) -> dict[str, list[tuple[int, ...]]]:
    out: dict[str, list[tuple[int, ...]]] = {}
    for length in args.lengths:
        hits = cached[length]
        out[f"hit-{length}"] = hits
        out[f"half-{length}"] = [
            p[: length // 2] + _tokens(rng, length - length // 2) for p in hits
        ]
        out[f"miss-{length}"] = [_tokens(rng, length) for _ in range(args.prompts)]
    return out


def _stats(samples_ns: list[int]) -> dict[str, float]:
    ordered = sorted(samples_ns)
    p99 = ordered[min(len(ordered) - 1, round(0.99 * (len(ordered) - 1)))]
    return {
        "p50_us": statistics.median(ordered) / 1e3,
        "p99_us": p99 / 1e3,
        "max_us": ordered[-1] / 1e3,
    }


def time_choose(policy, other, instances, prompts, iterations: int):
    """The routing decision alone (the index does not change meanwhile), on a new tuple each
    time (a new request: nothing hashed yet). Then, in a second pass, the same request's
    decision by ``other`` (the other role's policy) after ``policy``'s, which finds its keys.

    A request holds its prompt until it ends: the last ``IN_FLIGHT`` requests' tuples stay
    alive, so a tuple is freed outside the decisions, as in a router with requests in flight
    (the router keeps the keys of its recent prompts, and with them their tuples: in an idle
    router the last reference, and the freeing, can fall in a later decision)."""
    copies = [list(p) for p in prompts]
    in_flight: deque[RouteContext] = deque(maxlen=IN_FLIGHT)
    first, second = [], []
    for n in range(iterations):
        route = RouteContext(f"r{n}", tuple(copies[n % len(copies)]))
        in_flight.append(route)
        start = time.perf_counter_ns()
        policy.choose(instances, route)
        first.append(time.perf_counter_ns() - start)
    for n in range(iterations):
        route = RouteContext(f"s{n}", tuple(copies[n % len(copies)]))
        in_flight.append(route)
        policy.choose(instances, route)
        start = time.perf_counter_ns()
        other.choose(instances, route)
        second.append(time.perf_counter_ns() - start)
    return _stats(first), _stats(second)


def time_observe(policy, instances, rng: random.Random, length: int, iterations: int):
    """What follows each pick: a prompt of ``length`` new tokens learned (the worst case: its
    keys not computed yet, all its blocks new), the request kept in flight a while as in
    `time_choose`; then its pick ends (untimed)."""
    in_flight: deque[RouteContext] = deque(maxlen=IN_FLIGHT)
    samples = []
    for n in range(iterations):
        route = RouteContext(f"o{n}", _tokens(rng, length))
        in_flight.append(route)
        instance = instances[n % len(instances)]
        start = time.perf_counter_ns()
        policy.observe(instance, route)
        samples.append(time.perf_counter_ns() - start)
        _caught_up(policy.index, instance.address)
    return _stats(samples)


def time_events(index: PrefixIndex, address: str, rng: random.Random, iterations: int):
    per_block_ns = []
    for _ in range(iterations):
        prompt = _tokens(rng, 16 * BLOCK_SIZE)
        hashes = tuple(rng.getrandbits(64) for _ in range(16))
        start = time.perf_counter_ns()
        index.apply(address, [BlockStored(hashes, None, prompt, BLOCK_SIZE)])
        index.apply(address, [BlockRemoved(hashes)])
        per_block_ns.append((time.perf_counter_ns() - start) // 32)
    return _stats(per_block_ns)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--blocks", type=int, default=100_000, help="blocks indexed (events)")
    parser.add_argument("--instances", type=int, default=8)
    parser.add_argument("--prompts", type=int, default=64, help="cached prompts per length")
    parser.add_argument("--lengths", type=int, nargs="+", default=[512, 2048, 4096, 8192])
    parser.add_argument("--iterations", type=int, default=2000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", type=Path, default=Path("routing_index.json"))
    args = parser.parse_args()
    rng = random.Random(args.seed)
    started = time.perf_counter()
    index, instances, cached = build(args, rng)
    build_s = time.perf_counter() - started
    indexed = sum(s.precise_blocks for s in index.stats())
    approx = sum(s.approx_blocks for s in index.stats())
    policy = CacheAwarePolicy(index, role="prefill")
    other = CacheAwarePolicy(copy.deepcopy(index), role="decode")
    gc.collect()
    rows = []
    for name, prompts in scenarios(rng, cached, args).items():
        length = len(prompts[0])
        row = {
            "scenario": name,
            "prompt_tokens": length,
            "cached_blocks": max(index.match(prompts[0]).values(), default=0),
        }
        first, second = time_choose(policy, other, instances, prompts, args.iterations)
        row |= {f"choose_{k}": v for k, v in first.items()}
        row |= {f"second_{k}": v for k, v in second.items()}
        if name.startswith("miss"):
            observe = time_observe(policy, instances, rng, length, min(args.iterations, 200))
            row |= {f"observe_{k}": v for k, v in observe.items()}
        rows.append(row)
    events = time_events(index, instances[0].address, rng, 500)
    modes = {index.mode(i.address) for i in instances} | {
        other.index.mode(i.address) for i in instances
    }
    if modes != {"precise"}:
        raise RuntimeError(f"instances left their precise sets while measured: {modes}")
    header = (
        f"{len(instances)} instances, {indexed} blocks indexed from events (+{approx} "
        f"approximate), block size {BLOCK_SIZE}, built in {build_s:.1f} s; "
        f"{args.iterations} decisions per row, microseconds per call"
    )
    print(header)
    print(
        f"{'scenario':<12} {'tokens':>6} {'cached':>6} | {'choose p50':>10} {'p99':>7} "
        f"{'max':>8} | {'2nd p50':>7} {'p99':>7} | {'observe p50':>11} {'p99':>7}"
    )
    for row in rows:
        observe = (
            f"{row['observe_p50_us']:>11.1f} {row['observe_p99_us']:>7.1f}"
            if "observe_p50_us" in row
            else ""
        )
        print(
            f"{row['scenario']:<12} {row['prompt_tokens']:>6} {row['cached_blocks']:>6} | "
            f"{row['choose_p50_us']:>10.1f} {row['choose_p99_us']:>7.1f} "
            f"{row['choose_max_us']:>8.1f} | {row['second_p50_us']:>7.1f} "
            f"{row['second_p99_us']:>7.1f} | {observe}"
        )
    print(
        f"events: {events['p50_us']:.2f} us per block stored or removed (p50), "
        f"{events['p99_us']:.2f} (p99)"
    )
    args.json.write_text(
        json.dumps(
            {
                "config": vars(args) | {"json": str(args.json)},
                "machine": platform.platform(),
                "python": platform.python_version(),
                "blocks_indexed": indexed,
                "approx_blocks": approx,
                "rows": rows,
                "events_per_block_us": events,
            },
            indent=2,
        )
    )
    print(f"wrote {args.json}")
    write_png("routing_index", args.json)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
