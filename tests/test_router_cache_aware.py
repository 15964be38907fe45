"""The router's cache-aware choice from the command line, end to end: two prefill daemons on
their own loopback addresses publish KV events on one port number (as pods of one Deployment
do), the router (``--prefill-policy cache_aware --tokenizer ... --kv-events-port ...``)
subscribes to both, and a prompt one prefill computed outside the router, so that only its
events can tell, is sent there; tokens equal a colocated run."""

from __future__ import annotations

import json
import re
import socket
import urllib.request

import pytest
from serve_helpers.daemons import colocated, exit_used_blocks, running, start_daemon, start_router
from serve_helpers.probes import post
from waiting import wait_until

from kvtransfer.clients.generation import GenerationClient, generate_request

pytestmark = pytest.mark.integration

MODEL = "builtin"
HOSTS = ("127.0.0.21", "127.0.0.22")
BLOCK_SIZE = 16  # the daemons' default, and the router's --kv-block-size default
TEXT = "Cache-aware routing sends a prompt where its prefix blocks already are. " * 4
MAX_TOKENS = 4


def _port_free_on_all(hosts: tuple[str, ...]) -> int:
    """A port number free on every one of ``hosts`` (the OS picks it on the first)."""
    for _ in range(50):
        with socket.socket() as first:
            first.bind((hosts[0], 0))
            port = first.getsockname()[1]
            others = []
            try:
                for host in hosts[1:]:
                    other = socket.socket()
                    others.append(other)
                    other.bind((host, port))
            except OSError:
                continue
            finally:
                for other in others:
                    other.close()
        return port
    raise RuntimeError(f"no port free on all of {hosts}")


def _prefill(tmp_path, host: str, events: int, replay: int, name: str):
    return start_daemon(
        "prefill",
        tmp_path,
        "--host", host,
        "--model", MODEL,
        "--kv-events-endpoint", f"tcp://{host}:{events}",
        "--kv-events-replay-endpoint", f"tcp://{host}:{replay}",
        name=name,
    )  # fmt: skip


def _metric(url: str, pattern: str) -> float:
    """The first sample of the router's /metrics that ``pattern`` matches, 0 when none does."""
    with urllib.request.urlopen(f"{url}/metrics", timeout=10) as response:
        text = response.read().decode()
    match = re.search(pattern + r" (\S+)", text)
    return float(match.group(1)) if match else 0.0


def _indexed_blocks(url: str, address: str, source: str) -> float:
    """The router's index size for ``address`` (its /metrics), 0 before it is listed."""
    return _metric(
        url,
        r'kvtransfer_router_index_blocks\{address="' + re.escape(address) + r'",role="prefill",'
        r'source="' + source + r'"\}',
    )


def _complete(url: str, prompt: str) -> dict:
    status, text = post(url, {"prompt": prompt, "max_tokens": MAX_TOKENS})
    assert status == 200, text
    return json.loads(text)


def test_cache_aware_choice_follows_kv_events_from_the_command_line(tmp_path):
    events, replay = _port_free_on_all(HOSTS), _port_free_on_all(HOSTS)
    prefills = [_prefill(tmp_path, h, events, replay, f"prefill-{i}") for i, h in enumerate(HOSTS)]
    decode = start_daemon("decode", tmp_path, "--model", MODEL)
    router = start_router(
        tmp_path,
        prefills,
        [decode],
        "--prefill-policy", "cache_aware",
        "--tokenizer", MODEL,
        "--kv-events-port", str(events),
        "--kv-events-replay-port", str(replay),
    )  # fmt: skip
    expected = colocated([TEXT], MAX_TOKENS, model=MODEL)[0]
    with running(router, decode, *prefills):
        # Only the second prefill has the prompt cached, and the router never saw it go there.
        holder = prefills[1]
        with GenerationClient(holder.address) as client:
            result = client.generate(generate_request("outside", TEXT, 1))
        assert result.finish_reason in ("length", "stop"), result.error

        # The router learns it from the holder's KV events alone.
        wait_until(
            lambda: _indexed_blocks(router.address, holder.address, "events") >= 4,
            "the holder's KV events indexed by the router",
            30,
        )
        assert _indexed_blocks(router.address, prefills[0].address, "events") == 0
        for suffix in ("", " And a new question?", " Another one."):
            answer = _complete(router.address, TEXT + suffix)
            if not suffix:
                assert answer["kvtransfer"]["token_ids"] == expected
            assert answer["kvtransfer"]["prefill"] == holder.address
            # The router's prediction at the pick is what the engine then found cached.
            cached = answer["usage"]["prompt_tokens_details"]["cached_tokens"]
            assert cached >= 4 * BLOCK_SIZE
            assert answer["kvtransfer"]["predicted_cached_tokens"] == cached
        # The other prefill never computed it: its routed (approximate) side learned nothing.
        assert _indexed_blocks(router.address, prefills[0].address, "routed") == 0
        predictions = r'kvtransfer_router_cache_predictions_total\{outcome="(\w+)",role="prefill"\}'
        assert _metric(router.address, predictions.replace(r"(\w+)", "exact")) == 3
        assert _metric(router.address, predictions.replace(r"(\w+)", "over")) == 0
    for daemon in (*prefills, decode):
        assert exit_used_blocks(daemon) == 0
