"""``kvtransfer-router`` / ``python -m kvtransfer.router``: the OpenAI API over prefill and decode
daemons.

Prints ``router listening on http://HOST:PORT`` once serving (the real port when ``--port 0``).
SIGTERM or SIGINT: stop accepting, let in-flight requests finish (``--shutdown-timeout-s``),
exit 0. Bad flags or files: ``error: ...`` on stderr, exit 2.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import sys
from collections.abc import Sequence

from kvtransfer.clients.limits import DEFAULT_MAX_REQUEST_BYTES
from kvtransfer.logs import configure_logging
from kvtransfer.router.config import RouterConfig, check_address
from kvtransfer.router.server import RouterServer

logger = logging.getLogger("kvtransfer.router")


def _address(value: str) -> str:
    try:
        return check_address(value)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kvtransfer-router",
        description="OpenAI-compatible HTTP router over prefill and decode daemons: "
        "/v1/completions (JSON and SSE), /v1/models, /health, /metrics.",
    )
    daemons = "HOST:PORT of a %s daemon's gRPC server; repeat for more (round-robin over the "
    daemons += "healthy ones)"
    for role in ("prefill", "decode"):
        parser.add_argument(
            f"--{role}",
            action="append",
            required=True,
            type=_address,
            metavar="HOST:PORT",
            help=daemons % role,
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
        action=argparse.BooleanOptionalAction,
        default=True,
        help="call the decode daemon while the prefill computes, its KV streamed layer by "
        "layer (default on; --no-kv-stream: only once the prefill returned)",
    )
    parser.add_argument("--tls-ca", metavar="FILE", help="CA that verifies the daemons (TLS)")
    parser.add_argument("--tls-cert", metavar="FILE", help="client certificate (mTLS daemons)")
    parser.add_argument("--tls-key", metavar="FILE", help="its private key")
    parser.add_argument(
        "--log-level", default="INFO", choices=("DEBUG", "INFO", "WARNING", "ERROR"), type=str.upper
    )
    parser.add_argument("--log-format", default="text", choices=("text", "json"))
    return parser


def config_from_args(args: argparse.Namespace) -> RouterConfig:
    """Raises ``ValueError`` for values argparse cannot check alone (ranges, files)."""
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
    )


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
            "routing to prefill %s, decode %s (%s)",
            ", ".join(config.prefill),
            ", ".join(config.decode),
            "TLS" if config.uses_tls else "plaintext",
        )
        await stop.wait()
        logger.info("stopping: no new requests, in-flight ones may finish")
    finally:
        await server.stop()
    logger.info("stopped")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    try:
        config = config_from_args(args)
    except ValueError as exc:
        parser.error(str(exc))
    configure_logging(args.log_level, args.log_format)
    try:
        return asyncio.run(serve(config))
    except OSError as exc:  # e.g. the port is taken
        print(f"{parser.prog}: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
