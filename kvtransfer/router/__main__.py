"""``kvtransfer-router`` / ``python -m kvtransfer.router``: serve the OpenAI API over HTTP."""

from __future__ import annotations

import argparse
import asyncio
import signal
import sys
from collections.abc import Sequence

import grpc
from aiohttp import web

from kvtransfer.router.app import RouterApp
from kvtransfer.router.upstream import DaemonPool, Upstream
from kvtransfer.serve.logs import configure_logging


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvtransfer-router", description=__doc__)
    parser.add_argument("--prefill", action="append", required=True, metavar="HOST:PORT")
    parser.add_argument("--decode", action="append", required=True, metavar="HOST:PORT")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000, help="HTTP port (0: any free port)")
    parser.add_argument("--model-name", default="builtin", help="the name /v1/models lists")
    parser.add_argument("--request-timeout-s", type=float, default=300.0)
    parser.add_argument("--tls-ca", help="CA that verifies the daemons (enables TLS)")
    parser.add_argument("--tls-cert", help="client certificate for mTLS daemons")
    parser.add_argument("--tls-key", help="its private key")
    parser.add_argument("--log-level", default="INFO")
    return parser


def _credentials(args: argparse.Namespace) -> grpc.ChannelCredentials | None:
    if not (args.tls_ca or args.tls_cert or args.tls_key):
        return None
    if bool(args.tls_cert) != bool(args.tls_key):
        raise ValueError("--tls-cert and --tls-key go together")

    def read(path: str | None) -> bytes | None:
        if path is None:
            return None
        try:
            with open(path, "rb") as handle:
                return handle.read()
        except OSError as exc:
            raise ValueError(f"cannot read {path}: {exc.strerror}") from None

    return grpc.ssl_channel_credentials(
        root_certificates=read(args.tls_ca),
        private_key=read(args.tls_key),
        certificate_chain=read(args.tls_cert),
    )


async def serve(args: argparse.Namespace) -> int:
    credentials = _credentials(args)
    upstream = Upstream(
        DaemonPool("prefill", args.prefill, credentials),
        DaemonPool("decode", args.decode, credentials),
        args.request_timeout_s,
    )
    runner = web.AppRunner(RouterApp(upstream, args.model_name).build())
    await runner.setup()
    site = web.TCPSite(runner, args.host, args.port)
    await site.start()
    port = runner.addresses[0][1]
    print(f"router listening on http://{args.host}:{port}", flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)
    await stop.wait()
    # Stops accepting, then lets in-flight requests finish for the grace period.
    await runner.cleanup()
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    if not 0 <= args.port <= 65535:
        parser.error(f"--port must be in [0, 65535], got {args.port}")
    if args.request_timeout_s <= 0:
        parser.error("--request-timeout-s must be > 0")
    configure_logging(args.log_level.upper(), "text")
    try:
        return asyncio.run(serve(args))
    except (ValueError, OSError) as exc:
        print(f"kvtransfer-router: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
