"""A real daemon publishing KV cache events over ZeroMQ TCP on 127.0.0.1 (ports the OS chose),
indexed by the router's subscriber: a text prompt tokenized in the router (`RouteTokenizer`)
matches every full block the engine cached; after the daemon restarts on the same addresses the
index forgets the old engine's blocks (its cache is empty) and follows the new one."""

from __future__ import annotations

import asyncio

import pytest
from serve_helpers.daemons import exit_used_blocks, start_daemon
from waiting import wait_until_async

from kvtransfer.clients.generation import GenerationClient, generate_request
from kvtransfer.router.openai.tokens import RouteTokenizer
from kvtransfer.router.routing.kv_events import EventSource, KVEventSubscriber
from kvtransfer.router.routing.prefix_index import PrefixIndex
from kvtransfer.serve.launcher import ServiceProcess

pytestmark = pytest.mark.integration

BLOCK_SIZE = 16  # serve_helpers.daemons.COMMON_FLAGS
TEXT = "The router's prefix index keys what the engine caches, block by block. " * 3


def _events_flags(endpoint: str, replay: str) -> tuple[str, ...]:
    return ("--kv-events-endpoint", endpoint, "--kv-events-replay-endpoint", replay)


def _generate(daemon: ServiceProcess, request_id: str) -> None:
    with GenerationClient(daemon.address) as client:
        result = client.generate(generate_request(request_id, TEXT, 4))
    assert result.finish_reason in ("length", "stop"), result.error


def test_a_daemons_events_feed_the_router_index_across_a_restart(tmp_path):
    tokens = RouteTokenizer("builtin").route_tokens(TEXT)
    assert tokens is not None
    blocks = len(tokens) // BLOCK_SIZE
    assert blocks >= 5
    daemon = start_daemon(
        "prefill", tmp_path, *_events_flags("tcp://127.0.0.1:0", "tcp://127.0.0.1:0")
    )
    endpoint, replay = daemon.ready["kv_events"], daemon.ready["kv_events_replay"]
    assert endpoint.startswith("tcp://127.0.0.1:") and not endpoint.endswith(":0")

    processes = [daemon]

    async def scenario() -> None:
        index = PrefixIndex(default_block_size=BLOCK_SIZE)
        address = daemon.address
        subscriber = KVEventSubscriber(index, EventSource(address, endpoint, replay))
        await subscriber.start()
        try:
            await asyncio.wait_for(subscriber.connected.wait(), 30)
            assert index.match(tokens) == {}
            await asyncio.to_thread(_generate, daemon, "first")
            await wait_until_async(
                _async(lambda: index.match(tokens) == {address: blocks}),
                lambda: f"the prompt's {blocks} blocks indexed (stats {index.stats()})",
            )
            assert index.mode(address) == "precise"
            # The engine restarts (an empty cache) on the same addresses.
            code = await asyncio.to_thread(daemon.terminate)
            assert code == 0 and exit_used_blocks(daemon) == 0
            restarted = await asyncio.to_thread(
                start_daemon, "prefill", tmp_path, *_events_flags(endpoint, replay), name="again"
            )
            processes.append(restarted)
            await wait_until_async(
                _async(lambda: subscriber.stream.num_restarts >= 1 and index.match(tokens) == {}),
                lambda: f"the old engine's blocks forgotten (stats {index.stats()})",
            )
            await asyncio.to_thread(_generate, restarted, "second")
            await wait_until_async(
                _async(lambda: index.match(tokens) == {address: blocks}),
                lambda: f"the new engine's blocks indexed (stats {index.stats()})",
            )
            assert subscriber.stream.num_unfilled == 0
        finally:
            await subscriber.close()

    try:
        asyncio.run(scenario())
    finally:
        codes = [process.terminate() for process in processes]
    assert codes == [0, 0] and exit_used_blocks(processes[-1]) == 0


def _async(predicate):
    async def check():
        return predicate()

    return check
