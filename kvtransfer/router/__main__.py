"""``kvtransfer-router`` / ``python -m kvtransfer.router``: the OpenAI API over prefill and decode
daemons.

Prints ``router listening on http://HOST:PORT`` once serving (the real port when ``--port 0``).
SIGTERM or SIGINT: stop accepting, let in-flight requests finish (``--shutdown-timeout-s``),
exit 0. Bad flags or files: ``error: ...`` on stderr, exit 2. The admin token comes from
``--admin-token-file`` or ``KVTRANSFER_ROUTER_ADMIN_TOKEN``, the daemons' (to read their load)
from ``--daemon-admin-token-file`` or ``KVTRANSFER_ADMIN_TOKEN``: never from a flag's value,
which any local user could read in the process list.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import sys
from collections.abc import Coroutine, Mapping, Sequence
from pathlib import Path
from typing import Any

from kvtransfer.clients.limits import DEFAULT_MAX_REQUEST_BYTES
from kvtransfer.logs import configure_logging
from kvtransfer.router.config import KV_STREAM_MODES, RouterConfig, check_target
from kvtransfer.router.names import ENGINES, KVTRANSFER, LEAST_LOAD, POLICY_NAMES
from kvtransfer.router.server import RouterServer

logger = logging.getLogger("kvtransfer.router")

ADMIN_TOKEN_ENV = "KVTRANSFER_ROUTER_ADMIN_TOKEN"
DAEMON_ADMIN_TOKEN_ENV = "KVTRANSFER_ADMIN_TOKEN"
VLLM_API_KEY_ENV = "KVTRANSFER_VLLM_API_KEY"


def _target(value: str) -> str:
    try:
        return check_target(value)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kvtransfer-router",
        description="OpenAI-compatible HTTP router over a fleet of prefill and decode daemons: "
        "/v1/completions and /v1/chat/completions (JSON and SSE), /v1/models, /health, "
        "/metrics, the admin API /workers and the fleet page /dashboard.",
    )
    daemons = (
        "a %s daemon's gRPC address, HOST:PORT, or dns:NAME:PORT for one per address NAME "
        "resolves to (re-resolved every --dns-interval-s: a headless Kubernetes Service); "
        "repeat for more. None: the admin API adds them (POST /workers)"
    )
    for role in ("prefill", "decode"):
        parser.add_argument(
            f"--{role}",
            action="append",
            default=[],
            type=_target,
            metavar="HOST:PORT|dns:NAME:PORT",
            help=daemons % role,
        )
    parser.add_argument(
        "--aggregated",
        action="append",
        default=[],
        type=_target,
        metavar="HOST:PORT|dns:NAME:PORT",
        help="a daemon that runs whole requests itself (a colocated engine, e.g. a decode "
        "daemon without a connector): the decode policy weighs it with the decode daemons, "
        "and it never gets KV from a prefill; repeat for more",
    )
    parser.add_argument(
        "--engine",
        choices=ENGINES,
        default=KVTRANSFER,
        help="what the instances are: kvtransfer daemons (gRPC addresses) or vLLM OpenAI "
        "servers (HTTP addresses; vLLM's kv_transfer_params flow). Default kvtransfer",
    )
    parser.add_argument("--host", default="127.0.0.1", help="HTTP bind address")
    parser.add_argument("--port", type=int, default=8000, help="HTTP port (0: any free port)")
    parser.add_argument("--model-name", default="builtin", help="the model /v1/models lists")
    parser.add_argument(
        "--request-timeout-s",
        type=float,
        default=300.0,
        help="deadline of a whole request, prefill and decode together (default 300)",
    )
    parser.add_argument(
        "--health-interval-s",
        type=float,
        default=1.0,
        help="how often every daemon's health is checked; an ejected daemon is picked again "
        "once a check finds it SERVING (default 1)",
    )
    parser.add_argument(
        "--health-timeout-s",
        type=float,
        default=1.0,
        help="deadline of one health check (default 1)",
    )
    parser.add_argument(
        "--max-request-bytes",
        type=int,
        default=DEFAULT_MAX_REQUEST_BYTES,
        help="largest request body; larger ones get 413. Give the daemons the same value "
        f"(default {DEFAULT_MAX_REQUEST_BYTES})",
    )
    parser.add_argument(
        "--shutdown-timeout-s",
        type=float,
        default=60.0,
        help="on SIGTERM, how long in-flight requests may still run (default 60)",
    )
    parser.add_argument(
        "--kv-stream",
        choices=KV_STREAM_MODES,
        default="auto",
        help="call the decode daemon while the prefill computes, its KV streamed layer by "
        "layer: always, never (only once the prefill returned), or auto (default: unless "
        "both daemons compute on the same cores of one host, where it slows the prefill)",
    )
    parser.add_argument(
        "--no-kv-stream",
        dest="kv_stream",
        action="store_const",
        const="never",
        help="the same as --kv-stream never",
    )
    parser.add_argument(
        "--policy",
        choices=POLICY_NAMES,
        default=LEAST_LOAD,
        help=f"how an instance of either role is picked (default {LEAST_LOAD})",
    )
    for role in ("prefill", "decode"):
        parser.add_argument(
            f"--{role}-policy",
            choices=POLICY_NAMES,
            help=f"the {role} role's policy, overriding --policy",
        )
    parser.add_argument(
        "--max-retries",
        type=int,
        default=2,
        help="a prefill or decode that failed having sent nothing is retried on up to this "
        "many other instances (default 2)",
    )
    parser.add_argument(
        "--breaker-failures",
        type=int,
        default=5,
        help="consecutive failed calls that open an instance's circuit breaker (0: never; "
        "default 5)",
    )
    parser.add_argument(
        "--breaker-cooldown-s",
        type=float,
        default=30.0,
        help="how long an open breaker keeps its instance out before one trial call (default 30)",
    )
    parser.add_argument(
        "--max-concurrent-requests",
        type=int,
        default=1024,
        help="requests run at once; more wait for a slot (0: no limit; default 1024)",
    )
    parser.add_argument(
        "--max-queued-requests",
        type=int,
        default=1024,
        help="requests waiting for a slot; the next gets 429 (default 1024)",
    )
    parser.add_argument(
        "--dns-interval-s",
        type=float,
        default=5.0,
        help="how often dns:NAME:PORT names are resolved again (default 5)",
    )
    parser.add_argument(
        "--disagg-min-prompt-tokens",
        type=int,
        default=0,
        help="a prompt whose token ids are known and with fewer uncached tokens runs on a "
        "decode daemon alone (0: always prefill then decode; default 0)",
    )
    parser.add_argument(
        "--slo-ttft-ms",
        type=float,
        default=0.0,
        help="time-to-first-token target; with --slo-itl-ms the router routes each request P/D, "
        "to a decode alone or to a prefill alone, whichever it predicts meets both (needs the "
        "prompt's token ids; default 0: none)",
    )
    parser.add_argument(
        "--slo-itl-ms",
        type=float,
        default=0.0,
        help="mean inter-token latency target, with --slo-ttft-ms (default 0: none)",
    )
    parser.add_argument(
        "--tokenizer",
        metavar="MODEL",
        help="the daemons' --model (builtin[:preset] or a model directory): the router then "
        "knows a text prompt's token ids (cache_aware, --disagg-min-prompt-tokens)",
    )
    parser.add_argument(
        "--chat-template", metavar="FILE", help="the daemons' --chat-template, with --tokenizer"
    )
    parser.add_argument(
        "--kv-events-port",
        type=int,
        metavar="PORT",
        help="every instance publishes KV events on this port of its host "
        "(--kv-events-endpoint tcp://*:PORT): cache_aware policies index them",
    )
    parser.add_argument(
        "--kv-events-replay-port",
        type=int,
        metavar="PORT",
        help="their replay port (--kv-events-replay-endpoint), to fill gaps",
    )
    parser.add_argument(
        "--kv-block-size",
        type=int,
        default=16,
        help="the daemons' --block-size, the prefix index's unit (default 16)",
    )
    parser.add_argument(
        "--otlp-traces-endpoint",
        metavar="URL",
        help="send each request's timeline as an OpenTelemetry trace to this OTLP/gRPC "
        "collector (e.g. http://otel-collector:4317), as vLLM's flag of the same name does",
    )
    parser.add_argument(
        "--no-dashboard",
        dest="dashboard",
        action="store_false",
        help="do not serve the fleet page (/dashboard: instances, last requests, timelines)",
    )
    parser.add_argument(
        "--admin-token-file",
        metavar="FILE",
        help=f"turns on the admin API (/workers) with this bearer token (or {ADMIN_TOKEN_ENV})",
    )
    parser.add_argument(
        "--daemon-admin-token-file",
        metavar="FILE",
        help="the daemons' admin token, to read their load when they require one (or "
        f"{DAEMON_ADMIN_TOKEN_ENV})",
    )
    parser.add_argument(
        "--vllm-api-key-file",
        metavar="FILE",
        help="with --engine vllm: the API key the vLLM servers were started with (--api-key), "
        f"sent on every completion call (or {VLLM_API_KEY_ENV})",
    )
    parser.add_argument("--tls-ca", metavar="FILE", help="CA that verifies the daemons (TLS)")
    parser.add_argument("--tls-cert", metavar="FILE", help="client certificate (mTLS daemons)")
    parser.add_argument("--tls-key", metavar="FILE", help="its private key")
    parser.add_argument(
        "--event-loop",
        choices=("uvloop", "asyncio"),
        default="uvloop",
        help="uvloop (default, where installed) or asyncio's own loop",
    )
    parser.add_argument(
        "--switch-interval-ms",
        type=float,
        default=0.5,
        help="the interpreter's thread switch interval (default 0.5; CPython's own is 5)",
    )
    parser.add_argument(
        "--log-level", default="INFO", choices=("DEBUG", "INFO", "WARNING", "ERROR"), type=str.upper
    )
    parser.add_argument("--log-format", default="text", choices=("text", "json"))
    return parser


def config_from_args(
    args: argparse.Namespace, environ: Mapping[str, str] | None = None
) -> RouterConfig:
    """Raises ``ValueError`` for values argparse cannot check alone (ranges, files)."""
    environ = os.environ if environ is None else environ
    return RouterConfig(
        prefill=tuple(args.prefill),
        decode=tuple(args.decode),
        host=args.host,
        port=args.port,
        model_name=args.model_name,
        request_timeout_s=args.request_timeout_s,
        health_interval_s=args.health_interval_s,
        health_timeout_s=args.health_timeout_s,
        max_request_bytes=args.max_request_bytes,
        shutdown_timeout_s=args.shutdown_timeout_s,
        tls_ca=args.tls_ca,
        tls_cert=args.tls_cert,
        tls_key=args.tls_key,
        kv_stream=args.kv_stream,
        policy=args.policy,
        prefill_policy=args.prefill_policy,
        decode_policy=args.decode_policy,
        max_retries=args.max_retries,
        breaker_failures=args.breaker_failures,
        breaker_cooldown_s=args.breaker_cooldown_s,
        max_concurrent_requests=args.max_concurrent_requests,
        max_queued_requests=args.max_queued_requests,
        dns_interval_s=args.dns_interval_s,
        disagg_min_prompt_tokens=args.disagg_min_prompt_tokens,
        slo_ttft_ms=args.slo_ttft_ms,
        slo_itl_ms=args.slo_itl_ms,
        tokenizer=args.tokenizer,
        chat_template=args.chat_template,
        kv_events_port=args.kv_events_port,
        kv_events_replay_port=args.kv_events_replay_port,
        kv_block_size=args.kv_block_size,
        otlp_traces_endpoint=args.otlp_traces_endpoint,
        engine=args.engine,
        aggregated=args.aggregated,
        dashboard=args.dashboard,
        admin_token=_token(args.admin_token_file, environ.get(ADMIN_TOKEN_ENV)),
        daemon_admin_token=_token(
            args.daemon_admin_token_file, environ.get(DAEMON_ADMIN_TOKEN_ENV)
        ),
        vllm_api_key=_token(args.vllm_api_key_file, environ.get(VLLM_API_KEY_ENV)),
    )


def _token(path: str | None, from_env: str | None) -> str | None:
    """The token in the file at ``path`` (trailing newline dropped), else ``from_env``."""
    if path is None:
        return from_env or None
    try:
        token = Path(path).read_text().strip()
    except (OSError, UnicodeDecodeError) as exc:
        raise ValueError(f"cannot read the token file {path}: {exc}") from None
    if not token:
        raise ValueError(f"the token file {path} is empty")
    return token


async def serve(config: RouterConfig) -> int:
    """Serve until SIGTERM/SIGINT, then stop gracefully; returns the exit code."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)
    server = RouterServer(config)
    await server.start()
    try:
        print(f"router listening on {server.url}", flush=True)
        logger.info(
            "routing to prefill %s, decode %s%s (%s; policies: prefill %s, decode %s; "
            "admin API %s)",
            ", ".join(config.prefill) or "(none yet)",
            ", ".join(config.decode) or "(none yet)",
            f", aggregated {', '.join(config.aggregated)}" if config.aggregated else "",
            "TLS" if config.uses_tls else "plaintext",
            config.policy_for("prefill"),
            config.policy_for("decode"),
            "on" if config.admin_token is not None else "off",
        )
        await stop.wait()
        logger.info("stopping: no new requests, in-flight ones may finish")
    finally:
        await server.stop()
    logger.info("stopped")
    return 0


def _run(main_coroutine: Coroutine[Any, Any, int], event_loop: str) -> int:
    if event_loop == "uvloop":
        try:
            import uvloop
        except ImportError:
            logger.warning("uvloop is not installed: running on asyncio's own loop")
        else:
            return uvloop.run(main_coroutine)
    return asyncio.run(main_coroutine)


def main(argv: Sequence[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    try:
        config = config_from_args(args)
    except ValueError as exc:
        parser.error(str(exc))
    if not 0 < args.switch_interval_ms <= 100:
        parser.error(f"--switch-interval-ms must be in (0, 100], got {args.switch_interval_ms}")
    configure_logging(args.log_level, args.log_format)
    # The loop's own cost is on every request's path twice (HTTP in, gRPC out): uvloop's is
    # about half of asyncio's (pd_latency: 0.3 ms of the client's hop). The interval bounds
    # how long the gRPC poller thread keeps the loop from the interpreter (CPython: 5 ms).
    sys.setswitchinterval(args.switch_interval_ms / 1e3)
    try:
        return _run(serve(config), args.event_loop)
    except OSError as exc:  # e.g. the port is taken
        print(f"{parser.prog}: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
