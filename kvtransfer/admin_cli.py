"""``kvtransfer admin ...``: operate a running daemon over KVAdmin (tables, or ``--json``)."""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import os
import sys
from collections.abc import Sequence
from typing import Any

TOKEN_ENV = "KVTRANSFER_ADMIN_TOKEN"


def add_admin_parser(commands: argparse._SubParsersAction) -> None:
    admin = commands.add_parser("admin", help="operate a running daemon (KVAdmin over gRPC)")
    actions = admin.add_subparsers(dest="admin_command", required=True)
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--target", required=True, metavar="HOST:PORT", help="daemon gRPC port")
    common.add_argument("--json", action="store_true", help="one JSON object, for scripts")
    common.add_argument("--token", help=f"admin token (default: ${TOKEN_ENV})")
    common.add_argument("--tls-ca", help="CA that verifies the daemon (enables TLS)")
    common.add_argument("--tls-cert", help="client certificate (mTLS)")
    common.add_argument("--tls-key", help="its private key")
    common.add_argument("--tls-server-name", help="name on the daemon's certificate")
    common.add_argument("--timeout-s", type=float, default=5.0)
    actions.add_parser("status", parents=[common], help="role, model, blocks, counters")
    actions.add_parser("peers", parents=[common], help="engines this one pulled KV from")
    actions.add_parser("transfers", parents=[common], help="KV held or loading right now")
    actions.add_parser("drain", parents=[common], help="stop admitting; in-flight work finishes")
    abort = actions.add_parser("abort", parents=[common], help="abort one request")
    abort.add_argument("request_id")
    level = actions.add_parser("log-level", parents=[common], help="change a logger's level")
    level.add_argument("level")
    level.add_argument("--logger", default="", help="logger name (default: kvtransfer)")


def run_admin(args: argparse.Namespace) -> int:
    from kvtransfer.control import AdminClient, ControlPlaneError, RetryPolicy
    from kvtransfer.control.security import TLSFiles

    try:
        tls = None
        if args.tls_ca or args.tls_cert or args.tls_key:
            tls = TLSFiles(args.tls_cert, args.tls_key, args.tls_ca, args.tls_server_name)
        client = AdminClient(
            args.target,
            token=args.token or os.environ.get(TOKEN_ENV) or None,
            tls=tls,
            timeout_s=args.timeout_s,
            retry=RetryPolicy(max_attempts=1),
        )
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2

    async def call() -> Any:
        try:
            if args.admin_command == "abort":
                return await client.abort(args.request_id)
            if args.admin_command == "log-level":
                return await client.set_log_level(args.level, args.logger)
            return await getattr(client, args.admin_command)()
        finally:
            await client.close()

    try:
        result = asyncio.run(call())
    except (ControlPlaneError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    print(_render(args.admin_command, result, as_json=args.json))
    return 0


def _render(command: str, result: Any, *, as_json: bool) -> str:
    if command == "status":
        data = _plain(result)
        if as_json:
            return json.dumps(data)
        counters = data.pop("counters")
        data["tp x pp"] = f"{data.pop('tp_size')} x {data.pop('pp_size')}"
        data["uptime_s"] = f"{data['uptime_s']:.1f}"
        return _pairs({**data, **{f"counters.{k}": v for k, v in sorted(counters.items())}})
    if command in ("peers", "transfers"):
        rows = [_plain(item) for item in result]
        if as_json:
            return json.dumps({command: rows})
        return _table(rows, _COLUMNS[command])
    value = {"drain": "num_in_flight_transfers", "abort": "found", "log-level": "previous_level"}
    if as_json:
        return json.dumps({value[command]: result})
    return f"{value[command]}: {result}"


_COLUMNS = {
    "peers": ("engine_id", "address", "state", "generation", "last_handshake_latency_ms"),
    "transfers": ("request_id", "peer_engine_id", "direction", "num_blocks", "num_bytes", "age_s"),
}


def _plain(record: Any) -> dict[str, Any]:
    data = dataclasses.asdict(record)
    for key, value in data.items():
        if hasattr(value, "name") and isinstance(value, int):
            data[key] = value.name.lower()
        elif isinstance(value, dict):
            data[key] = dict(value)
    return data


def _pairs(data: dict[str, Any]) -> str:
    width = max(len(k) for k in data)
    return "\n".join(f"{key:<{width}}  {value}" for key, value in data.items())


def _table(rows: Sequence[dict[str, Any]], columns: Sequence[str]) -> str:
    def cell(value: Any) -> str:
        return f"{value:.1f}" if isinstance(value, float) else str(value)

    cells = [[cell(row[c]) for c in columns] for row in rows]
    widths = [max([len(c), *(len(r[i]) for r in cells)]) for i, c in enumerate(columns)]
    lines = ["  ".join(c.ljust(w) for c, w in zip(columns, widths, strict=True))]
    lines += ["  ".join(v.ljust(w) for v, w in zip(r, widths, strict=True)) for r in cells]
    if not rows:
        lines.append("(none)")
    return "\n".join(line.rstrip() for line in lines)
