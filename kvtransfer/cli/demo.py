"""`kvtransfer demo`: a real prefill/decode run on this machine, checked token for token.

1. start a prefill daemon, a decode daemon and the router on 127.0.0.1 (free ports), showing
   progress while the engines load;
2. send a few prompts through the router's OpenAI API (one of them streamed): prefill computes
   the prompt's KV, decode pulls it over UCX and generates. The default model, ``demo``
   (``kvtransfer/models/demo-llama``), memorised this project's docs and the prompts start
   sentences of them, so the completions read as the docs go on;
3. print each completion with its time to first token, the KV blocks and bytes decode received
   and how long it waited for them, and draw the longest prompt's timeline (``handover.png``,
   ``handover.svg``: what each side did when, layer by layer);
4. run the same prompts colocated (one engine, no transfer) and compare the token ids;
5. check the decode daemon's counters (KV received, nothing recomputed), stop everything with
   SIGTERM and require exit code 0 and no KV block in use at exit.

Exits 1 on any mismatch or failure, 0 when everything matched.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from kvtransfer.models import DEMO_MODEL, resolve_model

BUILTIN = "builtin"

# Sentence starts from the docs the demo model memorised (README.md, docs/connectors.md,
# docs/architecture.md): it goes on as they do. The longest (two KV blocks) is not the first
# request, so the picture shows a handover after the first request's handshake.
DEFAULT_PROMPTS = (
    "kvtransfer splits LLM inference into",
    "The production path: the decode engine reads the prefill engine's KV blocks over UCX,",
    "Sampling is greedy",
)
_REQUEST_TIMEOUT_S = 120.0


class DemoFailure(RuntimeError):
    """Something the demo checks did not hold; the message says what."""


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvtransfer demo", description=__doc__.splitlines()[0])
    parser.add_argument(
        "--model",
        default=DEMO_MODEL,
        help="demo (the small Llama trained on this project's docs, shipped in the package), "
        "builtin[:preset] (random weights) or a Hugging Face directory",
    )
    parser.add_argument("--prefill-tp", type=int, default=1)
    parser.add_argument("--prefill-pp", type=int, default=1)
    parser.add_argument("--decode-tp", type=int, default=1)
    parser.add_argument("--decode-pp", type=int, default=1)
    parser.add_argument("--speculative", choices=("draft", "ngram"), default=None)
    parser.add_argument(
        "--draft-model",
        help="the drafter of --speculative draft (default: builtin:tiny-draft for a built-in "
        "model, else the model itself: the built-in drafters' byte vocabulary fits no other)",
    )
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--prompt", action="append", help="a prompt (repeatable)")
    parser.add_argument("--log-dir", help="where the daemons' logs go (default: a temp dir)")
    parser.add_argument(
        "--picture-dir",
        help="where handover.png and handover.svg go, the timeline of the longest prompt's "
        "request (default: the log dir)",
    )
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    prompts = tuple(args.prompt or DEFAULT_PROMPTS)
    log_dir = Path(args.log_dir or tempfile.mkdtemp(prefix="kvtransfer-demo-"))
    try:
        _run(args, prompts, log_dir)
    except DemoFailure as exc:
        print(f"\ndemo FAILED: {exc}\n(logs: {log_dir})")
        return 1
    print(f"\ndemo OK (logs: {log_dir})")
    return 0


def _run(args: argparse.Namespace, prompts: Sequence[str], log_dir: Path) -> None:
    from kvtransfer.serve.launcher import (
        ServiceProcess,
        ServiceStartError,
        daemon_command,
        router_command,
    )

    started = time.monotonic()
    services: list[ServiceProcess] = []

    def launch(name: str, argv: list[str]) -> ServiceProcess:
        print(f"[{time.monotonic() - started:5.1f}s] starting {name} ...", flush=True)
        try:
            service = ServiceProcess.start(name, argv, log_dir / f"{name}.log")
        except ServiceStartError as exc:
            raise DemoFailure(str(exc)) from None
        services.append(service)
        print(f"[{time.monotonic() - started:5.1f}s] {name} ready at {service.address}")
        return service

    common = ["--model", resolve_model(args.model), "--port", "0"]
    if args.speculative:
        common += ["--speculative", args.speculative]
    draft_model = _draft_model(args)
    if draft_model is not None:
        common += ["--draft-model", draft_model]
    kv = json.dumps({"kv_port": 0})
    try:
        prefill = launch(
            "prefill daemon",
            daemon_command(
                "prefill",
                *common,
                "--tp",
                str(args.prefill_tp),
                "--pp",
                str(args.prefill_pp),
                "--engine-id",
                "demo-prefill",
                "--kv-transfer-config",
                kv,
            ),
        )
        decode = launch(
            "decode daemon",
            daemon_command(
                "decode",
                *common,
                "--tp",
                str(args.decode_tp),
                "--pp",
                str(args.decode_pp),
                "--engine-id",
                "demo-decode",
                "--kv-transfer-config",
                kv,
            ),
        )
        router = launch(
            "router",
            router_command("--port", "0", "--prefill", prefill.address, "--decode", decode.address),
        )
        print(
            f"\nP/D: prefill TP{args.prefill_tp}xPP{args.prefill_pp} -> decode "
            f"TP{args.decode_tp}xPP{args.decode_pp}, model {args.model}"
            + (f", speculative {args.speculative}" if args.speculative else "")
        )
        results = [
            _complete(router.address, prompt, args.max_tokens, stream=index == 0)
            for index, prompt in enumerate(prompts)
        ]
        for prompt, result in zip(prompts, results, strict=True):
            _show(prompt, result)
        _draw_handover(prompts, results, Path(args.picture_dir or log_dir))
        _compare_with_colocated(args, prompts, results)
        _check_counters(decode.address)
    finally:
        print("\nstopping ...")
        codes = [(service.name, service.terminate()) for service in reversed(services)]
    for name, code in codes:
        print(f"  {name}: exit code {code}")
        if code != 0:
            raise DemoFailure(f"{name} exited with code {code}")
    for service in services:
        if service.name.endswith("daemon"):
            _check_exit_blocks(service)


def _draft_model(args: argparse.Namespace) -> str | None:
    """The drafter to name, or ``None`` for the engine's default (builtin:tiny-draft)."""
    if args.speculative != "draft":
        return None
    if args.draft_model is not None:
        return resolve_model(args.draft_model)
    if args.model == BUILTIN or args.model.startswith(BUILTIN + ":"):
        return None
    return resolve_model(args.model)


def _complete(base_url: str, prompt: str, max_tokens: int, stream: bool) -> dict[str, Any]:
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": stream}
    request = urllib.request.Request(
        f"{base_url}/v1/completions",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    try:
        with urllib.request.urlopen(request, timeout=_REQUEST_TIMEOUT_S) as response:
            raw = response.read().decode()
    except urllib.error.HTTPError as exc:
        raise DemoFailure(f"HTTP {exc.code} from the router: {exc.read().decode()}") from None
    except OSError as exc:
        raise DemoFailure(f"the router did not answer: {exc}") from None
    if not stream:
        return json.loads(raw)
    text, last = "", None
    for line in raw.splitlines():
        if not line.startswith("data: ") or line == "data: [DONE]":
            continue
        chunk = json.loads(line[len("data: ") :])
        if "error" in chunk:
            raise DemoFailure(f"streamed error: {chunk['error']}")
        text += chunk["choices"][0]["text"]
        last = chunk
    if last is None:
        raise DemoFailure("the stream carried no completion")
    last["choices"][0]["text"] = text
    return last


def _show(prompt: str, result: dict[str, Any]) -> None:
    info = result["kvtransfer"]
    completion = result["choices"][0]["text"]
    print(f"\n> {prompt!r}")
    print(f"  completion: {completion!r}")
    print(
        f"  TTFT {info['ttft_s'] * 1e3:.1f} ms | KV received: {info['kv_blocks_received']} "
        f"blocks, {info['kv_bytes_received'] / 1024:.1f} KiB in "
        f"{info['kv_transfer_s'] * 1e3:.1f} ms | recomputed tokens: "
        f"{info['num_recomputed_tokens']}"
    )


def _draw_handover(
    prompts: Sequence[str], results: Sequence[dict[str, Any]], picture_dir: Path
) -> None:
    """The longest prompt's request as a picture of its timeline: with the default prompts,
    one after the first request's handshake, as a P/D handover usually runs."""
    from kvtransfer.timeline_picture import TimelineError, draw, handover

    index = max(range(len(prompts)), key=lambda i: len(prompts[i]))
    png, svg = picture_dir / "handover.png", picture_dir / "handover.svg"
    try:
        draw(handover([results[index]["kvtransfer"]]), png, svg)
    except TimelineError as exc:
        raise DemoFailure(f"the timeline of prompt {index} cannot be drawn: {exc}") from None
    print(f"\nprompt {index}'s handover, drawn from its timeline: {png} and {svg}")


def _compare_with_colocated(
    args: argparse.Namespace, prompts: Sequence[str], results: Sequence[dict[str, Any]]
) -> None:
    from kvtransfer.engine.config import EngineConfig, SpeculativeConfig
    from kvtransfer.engine.llm import LLM
    from kvtransfer.engine.sampling_params import SamplingParams

    speculative = None
    if args.speculative:
        draft_model = _draft_model(args)
        named = {} if draft_model is None else {"draft_model": draft_model}
        speculative = SpeculativeConfig(method=args.speculative, **named)
    with LLM(EngineConfig(model=resolve_model(args.model), speculative=speculative)) as llm:
        outputs = llm.generate(list(prompts), SamplingParams(max_tokens=args.max_tokens))
    print("\ncolocated check (same prompts on one engine, no transfer):")
    mismatches = 0
    for index, (output, result) in enumerate(zip(outputs, results, strict=True)):
        same = output.token_ids == result["kvtransfer"]["token_ids"]
        mismatches += not same
        print(f"  prompt {index}: {'tokens identical' if same else 'MISMATCH'}")
    if mismatches:
        raise DemoFailure(f"{mismatches} completion(s) differ from the colocated run")


def _check_counters(decode_address: str) -> None:
    import asyncio

    from kvtransfer.clients.control import AdminClient

    async def status() -> Any:
        client = AdminClient(decode_address)
        try:
            return await client.status()
        finally:
            await client.close()

    counters = asyncio.run(status()).counters
    print(
        f"\ndecode daemon counters: kv_blocks_received={counters['kv_blocks_received']} "
        f"kv_bytes_received={counters['kv_bytes_received']} "
        f"kv_tokens_recomputed={counters['kv_tokens_recomputed']}"
    )
    if counters["kv_blocks_received"] == 0 or counters["kv_tokens_recomputed"] != 0:
        raise DemoFailure("decode did not receive the KV (it recomputed the prompts)")


def _check_exit_blocks(service: Any) -> None:
    used = service.blocks_in_use_at_exit()
    if used is None:
        raise DemoFailure(f"{service.name} did not report its blocks at exit")
    if used != 0:
        raise DemoFailure(f"{service.name}: {used} KV blocks in use at exit")


if __name__ == "__main__":
    sys.exit(main())
