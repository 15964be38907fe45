"""``kvtransfer admin ...``: operate a running engine or daemon over `KVAdmin`.

Human-readable tables by default, one JSON object with ``--json``. Exit status: 0 on success,
1 when the call fails (unreachable, refused, rejected), 2 for bad arguments; errors are one
``error: ...`` line on stderr, never a traceback, and every call is bounded by ``--timeout-s``.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import enum
import json
import logging
import os
import sys
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, NoReturn

from kvtransfer.cli.admin_timeline import add_timeline_parser, run_timeline

if TYPE_CHECKING:
    from kvtransfer.clients.control import AdminClient
    from kvtransfer.control import EngineStatus, PeerInfo, TransferInfo
    from kvtransfer.control.security import TLSFiles

TOKEN_ENV = "KVTRANSFER_ADMIN_TOKEN"
DEFAULT_TIMEOUT_S = 5.0
ACTIONS = ("status", "peers", "transfers", "drain", "abort", "log-level", "timeline")
_TLS_FLAGS = {
    "cert_file": "--tls-cert",
    "key_file": "--tls-key",
    "ca_file": "--tls-ca",
    "server_name": "--tls-server-name",
}


class UsageError(ValueError):
    """Arguments that parse but cannot be used; exit status 2."""


class _AdminParser(argparse.ArgumentParser):
    """argparse with ``error: ...`` as the last line, like every other admin error."""

    def error(self, message: str) -> NoReturn:
        self.print_usage(sys.stderr)
        self.exit(2, f"error: {message}\n")


# ------------------------------------------------------------------ arguments


def add_admin_parser(subparsers: argparse._SubParsersAction) -> None:
    """Register ``admin`` and its actions on the ``kvtransfer`` sub-command parsers."""
    admin = subparsers.add_parser(
        "admin",
        help="operate a running engine or daemon (KVAdmin over gRPC)",
        description="Operate a running engine or daemon over KVAdmin (gRPC).",
        epilog=(
            f"The admin token comes from --token, else ${TOKEN_ENV}. Exit status: 0 ok, "
            "1 the call failed, 2 bad arguments."
        ),
    )
    # Not required=True: a missing action is reported by run_admin, as "error: ..." like the rest.
    actions = admin.add_subparsers(
        dest="admin_command",
        metavar="{" + ",".join(ACTIONS) + "}",
        parser_class=_AdminParser,
    )
    common = _common_options()
    add = actions.add_parser
    add("status", parents=[common], help="role, engine id, model, TP x PP, blocks, counters")
    add("peers", parents=[common], help="engines this one has handshaken with")
    add("transfers", parents=[common], help="KV transfers in flight")
    add("drain", parents=[common], help="stop admitting new transfers; in-flight ones finish")
    abort = add("abort", parents=[common], help="abort one request's transfers")
    abort.add_argument("request_id", metavar="REQ_ID")
    level = add("log-level", parents=[common], help="set a logger's level on the server")
    level.add_argument("level", metavar="LEVEL", help="DEBUG, INFO, WARNING, ERROR, CRITICAL")
    level.add_argument("--logger", default="", metavar="NAME", help="default: the server's")
    add_timeline_parser(actions)


def _common_options() -> argparse.ArgumentParser:
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--target", required=True, metavar="HOST:PORT", help="its gRPC port")
    common.add_argument("--json", action="store_true", help="print one JSON object")
    common.add_argument("--token", help=f"admin token (default: ${TOKEN_ENV})")
    common.add_argument("--tls-ca", metavar="F", help="CA that verifies the server (TLS)")
    common.add_argument("--tls-cert", metavar="F", help="client certificate (mTLS)")
    common.add_argument("--tls-key", metavar="F", help="its private key")
    common.add_argument("--tls-server-name", metavar="N", help="name on the server's cert")
    common.add_argument(
        "--timeout-s",
        type=_positive_seconds,
        default=DEFAULT_TIMEOUT_S,
        metavar="S",
        help=f"deadline of the call (default {DEFAULT_TIMEOUT_S:g})",
    )
    return common


def _positive_seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number of seconds: {text!r}") from None
    if not 0 < value < float("inf"):
        raise argparse.ArgumentTypeError(f"must be > 0, got {text!r}")
    return value


def _check_target(target: str) -> str:
    host, sep, port = target.rpartition(":")
    if not sep or not host.strip("[]") or not port.isdigit() or not 0 < int(port) < 65536:
        raise UsageError(f"--target must be HOST:PORT with a port in [1, 65535], got {target!r}")
    return target


def _tls_files(args: argparse.Namespace) -> TLSFiles | None:
    from kvtransfer.control.security import TLSFiles

    given = (args.tls_cert, args.tls_key, args.tls_ca, args.tls_server_name)
    if all(value is None for value in given):
        return None
    try:
        return TLSFiles(*given)
    except ValueError as exc:
        raise UsageError(_flag_names(str(exc))) from None


def _flag_names(message: str) -> str:
    """`TLSFiles` messages in terms of this command's flags (paths in quotes left alone)."""
    for field, flag in _TLS_FLAGS.items():
        message = message.replace(f"TLSFiles.{field}", flag)
        message = message.replace(f"when {field} is set", f"when {flag} is set")
        message = message.replace(f"and {field} are", f"and {flag} are")
    return message


def _token(args: argparse.Namespace) -> str | None:
    # An empty variable means "no token", as shells make unsetting awkward.
    return args.token if args.token is not None else os.environ.get(TOKEN_ENV) or None


def _client(args: argparse.Namespace) -> AdminClient:
    from kvtransfer.clients.control import AdminClient, RetryPolicy

    tls = _tls_files(args)
    try:
        # One attempt: --timeout-s is the whole deadline, not one of several tries.
        return AdminClient(
            _check_target(args.target),
            token=_token(args),
            tls=tls,
            timeout_s=args.timeout_s,
            retry=RetryPolicy(max_attempts=1),
        )
    except UsageError:
        raise
    except ValueError as exc:
        raise UsageError(f"--token/${TOKEN_ENV}: {exc}") from None


def _check_action_args(args: argparse.Namespace) -> None:
    if args.admin_command == "abort" and not args.request_id.strip():
        raise UsageError("REQ_ID must not be empty")
    if args.admin_command == "log-level":
        levels = logging.getLevelNamesMapping()
        if args.level.strip().upper() not in levels:
            raise UsageError(
                f"unknown log level {args.level!r}; expected one of "
                "DEBUG, INFO, WARNING, ERROR, CRITICAL, NOTSET"
            )


# ------------------------------------------------------------------ running


def run_admin(args: argparse.Namespace) -> int:
    """Run the parsed ``kvtransfer admin`` command; returns the exit status."""
    if "grpc" not in sys.modules:
        # The message below says what failed; gRPC's own C-core lines would only repeat it.
        os.environ.setdefault("GRPC_VERBOSITY", "NONE")
    from kvtransfer.control import ControlPlaneError

    if getattr(args, "admin_command", None) is None:
        return _fail(f"kvtransfer admin needs an action: one of {', '.join(ACTIONS)}", 2)
    if args.admin_command == "timeline":  # a saved answer: no server to call
        return run_timeline(args)
    try:
        _check_action_args(args)
        client = _client(args)
    except UsageError as exc:
        return _fail(str(exc), 2)
    try:
        result = asyncio.run(_call(client, args))
    except ControlPlaneError as exc:
        return _fail(str(exc), 1)
    except (OSError, RuntimeError, ValueError) as exc:  # anything gRPC raises before a status
        return _fail(f"{args.admin_command} to {args.target}: {exc}", 1)
    print(_render(args, result))
    return 0


async def _call(client: AdminClient, args: argparse.Namespace) -> Any:
    try:
        command = args.admin_command
        if command == "abort":
            return await client.abort(args.request_id)
        if command == "log-level":
            return await client.set_log_level(args.level.strip().upper(), args.logger)
        calls: dict[str, Callable[[], Any]] = {
            "status": client.status,
            "peers": client.peers,
            "transfers": client.transfers,
            "drain": client.drain,
        }
        return await calls[command]()
    finally:
        await client.close()


def _fail(message: str, code: int) -> int:
    print(f"error: {message}", file=sys.stderr)
    return code


# ------------------------------------------------------------------ rendering


def _render(args: argparse.Namespace, result: Any) -> str:
    data = _as_json(args, result)
    if args.json:
        return json.dumps(data)
    return _HUMAN[args.admin_command](args, result)


def _as_json(args: argparse.Namespace, result: Any) -> dict[str, Any]:
    command = args.admin_command
    if command == "status":
        return _record(result)
    if command in ("peers", "transfers"):
        return {command: [_record(item) for item in result]}
    if command == "drain":
        return {"draining": True, "num_in_flight_transfers": result}
    if command == "abort":
        return {"request_id": args.request_id, "found": result}
    return {"logger": args.logger, "level": args.level.strip().upper(), "previous_level": result}


def _record(record: Any) -> dict[str, Any]:
    data = dataclasses.asdict(record)
    for key, value in data.items():
        if isinstance(value, enum.Enum):
            data[key] = value.name.lower()
        elif isinstance(value, dict):
            data[key] = dict(sorted(value.items()))
    return data


def _status_text(args: argparse.Namespace, status: EngineStatus) -> str:
    rows = [
        ("role", status.role or "-"),
        ("engine id", status.engine_id or "-"),
        ("model", status.model or "-"),
        ("TP x PP", f"{status.tp_size} x {status.pp_size}"),
        ("blocks free", str(status.num_free_blocks)),
        ("blocks used", str(status.num_used_blocks)),
        ("uptime", _duration(status.uptime_s)),
        ("requests running", str(status.num_running_requests)),
        ("requests waiting", str(status.num_waiting_requests)),
    ]
    rows += [(f"counters.{name}", str(value)) for name, value in sorted(status.counters.items())]
    width = max(len(key) for key, _ in rows)
    return "\n".join(f"{key:<{width}}  {value}" for key, value in rows)


def _peers_text(args: argparse.Namespace, peers: Sequence[PeerInfo]) -> str:
    header = ("ENGINE ID", "ADDRESS", "STATE", "GENERATION", "LAST HANDSHAKE MS")
    rows = [
        (
            peer.engine_id,
            peer.address,
            peer.state.name.lower(),
            str(peer.generation),
            f"{peer.last_handshake_latency_ms:.1f}",
        )
        for peer in peers
    ]
    return _table(header, rows)


def _transfers_text(args: argparse.Namespace, transfers: Sequence[TransferInfo]) -> str:
    header = ("REQUEST ID", "PEER", "DIRECTION", "BLOCKS", "BYTES", "AGE")
    rows = [
        (
            transfer.request_id,
            transfer.peer_engine_id,
            transfer.direction.name.lower(),
            str(transfer.num_blocks),
            str(transfer.num_bytes),
            _duration(transfer.age_s),
        )
        for transfer in transfers
    ]
    return _table(header, rows)


def _drain_text(args: argparse.Namespace, in_flight: int) -> str:
    return f"draining: {in_flight} transfer(s) still in flight"


def _abort_text(args: argparse.Namespace, found: bool) -> str:
    if found:
        return f"aborted request {args.request_id!r}"
    return f"request {args.request_id!r} not found: nothing aborted"


def _log_level_text(args: argparse.Namespace, previous: str) -> str:
    logger = repr(args.logger) if args.logger else "the server's default logger"
    return f"log level of {logger} set to {args.level.strip().upper()} (was {previous})"


_HUMAN: dict[str, Callable[[argparse.Namespace, Any], str]] = {
    "status": _status_text,
    "peers": _peers_text,
    "transfers": _transfers_text,
    "drain": _drain_text,
    "abort": _abort_text,
    "log-level": _log_level_text,
}


def _table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    widths = [max(len(row[i]) for row in (header, *rows)) for i in range(len(header))]

    def line(cells: Sequence[str]) -> str:
        return "  ".join(cell.ljust(w) for cell, w in zip(cells, widths, strict=True)).rstrip()

    lines = [line(header), *(line(row) for row in rows)]
    if not rows:
        lines.append("(none)")
    return "\n".join(lines)


def _duration(seconds: float) -> str:
    if seconds < 60:
        return f"{seconds:.1f}s"
    whole = int(seconds)
    minutes, secs = divmod(whole, 60)
    hours, minutes = divmod(minutes, 60)
    days, hours = divmod(hours, 24)
    if days:
        return f"{days}d {hours:02d}h {minutes:02d}m"
    if hours:
        return f"{hours}h {minutes:02d}m {secs:02d}s"
    return f"{minutes}m {secs:02d}s"
