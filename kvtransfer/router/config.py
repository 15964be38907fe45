"""`RouterConfig`: what the router serves and routes to, checked once (flags or code alike)."""

from __future__ import annotations

import ipaddress
import re
from dataclasses import dataclass, field
from pathlib import Path

import grpc

from kvtransfer.clients.limits import (
    DEFAULT_MAX_REQUEST_BYTES,
    check_max_request_bytes,
    grpc_message_options,
)
from kvtransfer.router.echo import echo
from kvtransfer.router.names import (
    AGGREGATED,
    ENGINES,
    KVTRANSFER,
    LEAST_LOAD,
    VLLM,
    WORKER_ROLES,
    check_policy_name,
)

_MAX_PORT = 65535
# gRPC waits 1 s, then up to 120 s, between reconnection attempts to a daemon that went away;
# a restarted daemon would stay unreachable that long whatever the health checks say.
_MIN_RECONNECT_BACKOFF_MS = 100
# A partition leaves the channel's TCP connection open with its unacknowledged data in
# retransmission back-off: after a 20 s cut, the first retransmission came seconds after the
# heal, and a healed prefill stayed out of the pool for 15 s (health checks queued behind it).
# Keep-alive pings unanswered within the timeout close that connection (gRPC also sets
# TCP_USER_TIMEOUT to it), so the channel reconnects on a fresh one; each connection attempt
# then lasts at most the health timeout (gRPC's default: 20 s, SYNs sent into a partition
# waited out the kernel's back-off after the heal). Never below these floors, so that a
# slow but healthy network or daemon is not cut off.
_MIN_KEEPALIVE_MS = 1000
_MIN_KEEPALIVE_TIMEOUT_MS = 2000
_MIN_CONNECT_TIMEOUT_MS = 1000
DNS_PREFIX = "dns:"
# A DNS name's longest (RFC 1035); any IPv6 address in brackets is shorter.
MAX_HOST_CHARS = 253
_HOST_NAME = re.compile(r"[A-Za-z0-9._-]+")


class InvalidAddress(ValueError):
    """An instance's address that is not ``HOST:PORT`` (or ``dns:NAME:PORT``); the message
    names what is wrong with it, quoting at most `echo.ECHO_CHARS` of it."""


def check_address(address: str) -> str:
    """``HOST:PORT`` (``[v6]:PORT`` too); returns it unchanged or raises `InvalidAddress`.

    HOST is a name or an IPv4 address (letters, digits, ``.``, ``-``, ``_``; at most
    `MAX_HOST_CHARS`) or an IPv6 address in brackets: an address travels to DNS, into gRPC's
    and aiohttp's targets, the logs, the metrics' labels and the fleet page, so nothing else
    is taken."""
    problem = _address_problem(address)
    if problem is not None:
        raise InvalidAddress(f"{echo(address)} is not HOST:PORT{problem}")
    return address


def check_target(target: str) -> str:
    """``HOST:PORT`` or ``dns:NAME:PORT``; returns it unchanged or raises `InvalidAddress`."""
    if target.startswith(DNS_PREFIX):
        parse_dns(target)
        return target
    problem = _address_problem(target)
    if problem is not None:
        raise InvalidAddress(f"{echo(target)} is not HOST:PORT or dns:NAME:PORT{problem}")
    return target


def parse_dns(target: str) -> tuple[str, int]:
    """``dns:NAME:PORT`` -> (NAME, PORT); raises `InvalidAddress`."""
    name, sep, port = target.removeprefix(DNS_PREFIX).rpartition(":")
    if not sep or not name or not _is_port(port):
        raise InvalidAddress(f"{echo(target)} is not dns:NAME:PORT")
    problem = host_problem(name, "name", brackets=False)
    if problem is not None:
        raise InvalidAddress(f"{echo(target)} is not dns:NAME:PORT: {problem}")
    return name, int(port)


def host_problem(host: str, what: str = "host", *, brackets: bool = True) -> str | None:
    """What is wrong with ``host`` as an instance's host, called ``what`` (None: nothing);
    ``brackets``: an IPv6 address in brackets is one."""
    if len(host) > MAX_HOST_CHARS:
        return f"its {what} is {len(host)} characters long, over {MAX_HOST_CHARS}"
    if brackets and host.startswith("[") and host.endswith("]"):
        try:
            ipaddress.IPv6Address(host[1:-1])
        except ValueError:
            return f"its {what} in brackets is not an IPv6 address"
        return None
    if _HOST_NAME.fullmatch(host) is None:
        also = ", or be an IPv6 address in brackets" if brackets else ""
        return f"its {what} may hold only letters, digits, '.', '-' and '_'{also}"
    return None


def _address_problem(address: str) -> str | None:
    """None for a good ``HOST:PORT``; else what follows "is not HOST:PORT" in its error:
    nothing when its shape is wrong, ": why" when its host is."""
    host, sep, port = address.rpartition(":")
    if not sep or not host or not _is_port(port):
        return ""
    problem = host_problem(host)
    return None if problem is None else f": {problem}"


def _is_port(text: str) -> bool:
    # isdigit() alone takes other scripts' digits (and superscripts, which int() refuses).
    return 0 < len(text) <= 5 and text.isascii() and text.isdigit() and 0 < int(text) <= _MAX_PORT


def check_token(token: str, what: str) -> str:
    """A bearer token: printable ASCII, no spaces (it travels in a header)."""
    if not token or not all("!" <= char <= "~" for char in token):
        raise ValueError(f"{what} must be non-empty printable ASCII without spaces")
    return token


# When the router asks a prefill to stream its KV layer by layer to a decode called at once:
# "auto" unless both report they compute on the same cores of one host (`Placement`), where the
# decode's work would slow the prefill down by more than streaming hides.
KV_STREAM_MODES = ("auto", "always", "never")


@dataclass(frozen=True)
class RouterConfig:
    """The daemons to route to, how to pick among them and how to serve HTTP.

    ``prefill``/``decode``: each entry ``HOST:PORT`` (one instance) or ``dns:NAME:PORT`` (an
    instance per address NAME resolves to, re-resolved every ``dns_interval_s``). A role may be
    empty only when the admin API is on (``admin_token``), which adds instances at run time.
    ``policy`` picks instances of both roles, ``prefill_policy``/``decode_policy`` override it
    per role (`kvtransfer.router.routing.policy`). ``port`` 0 binds a free port (`RouterServer.port`
    tells which). ``request_timeout_s`` bounds a whole request, prefill and decode together (and
    any wait for admission): it becomes the gRPC deadlines. ``health_interval_s`` is how often
    every daemon's health and load are read (each check's deadline ``health_timeout_s``); an
    ejected daemon is re-admitted at the first check that finds it SERVING.
    ``daemon_admin_token`` reads the daemons' load when they guard KVAdmin with a token.
    ``max_retries``: how many other instances a phase that failed having sent nothing may be
    retried on. ``breaker_failures`` consecutive failed calls open an instance's circuit
    breaker (0: never) for ``breaker_cooldown_s``. At most ``max_concurrent_requests``
    requests run at once (0: no limit), ``max_queued_requests`` more wait for a slot; beyond
    that, 429. ``disagg_min_prompt_tokens``: a prompt whose token ids are known and whose
    uncached part is shorter runs on a decode daemon alone (0: always disaggregate).
    ``slo_ttft_ms`` and ``slo_itl_ms`` (both or neither; 0: none): per-request targets; with
    them the router picks P/D, a decode alone or a prefill alone per request, the route
    predicted to meet both (`kvtransfer.router.routing.disagg`).
    ``admin_token`` turns on the admin API (``/workers``). ``release_timeout_s`` is the
    deadline of a ``ReleaseKV`` call. ``max_request_bytes`` is the largest HTTP body accepted
    (413 above it); give the daemons the same value (`kvtransfer.clients.limits`).
    ``shutdown_timeout_s`` is how long in-flight requests may run on after a stop.
    ``tls_ca``/``tls_cert``/``tls_key`` are PEM files; none of them means plaintext gRPC.
    ``kv_stream``: ``always`` asks prefills to announce their KV while computing it and calls the
    decode then, ``never`` only once the prefill returned, ``auto`` streams unless both daemons
    report computing on the same cores of one host (`KV_STREAM_MODES`). ``tokenizer``: the
    daemons' ``--model`` (and ``chat_template`` their ``--chat-template``), so the router knows
    a text prompt's token ids (cache-aware choice, ``disagg_min_prompt_tokens``).
    ``kv_events_port`` (and ``kv_events_replay_port``): every instance publishes KV events on
    that port of its host; cache-aware policies subscribe (`cache_wiring`). ``kv_block_size``:
    the daemons' block size, the unit of the prefix index. ``engine``: what every instance is,
    kvtransfer daemons (``kvtransfer``: their gRPC address) or vLLM OpenAI servers (``vllm``:
    their HTTP address; `vllm_flow`); ``vllm_api_key``: the key they were started with
    (``--api-key``), sent as a bearer token on every completion call (the client's own
    credentials are never forwarded). ``otlp_traces_endpoint``: an OTLP/gRPC collector that
    gets every choice's timeline as a trace (`kvtransfer.router.tracing`). ``dashboard``: serve
    the fleet page (``/dashboard``, `kvtransfer.router.web.fleet_page`).
    """

    prefill: tuple[str, ...]
    decode: tuple[str, ...]
    aggregated: tuple[str, ...] = ()
    host: str = "127.0.0.1"
    port: int = 0
    model_name: str = "builtin"
    request_timeout_s: float = 300.0
    health_timeout_s: float = 1.0
    health_interval_s: float = 1.0
    release_timeout_s: float = 2.0
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES
    shutdown_timeout_s: float = 60.0
    tls_ca: str | None = None
    tls_cert: str | None = None
    tls_key: str | None = None
    kv_stream: str = "auto"
    policy: str = LEAST_LOAD
    prefill_policy: str | None = None
    decode_policy: str | None = None
    max_retries: int = 2
    breaker_failures: int = 5
    breaker_cooldown_s: float = 30.0
    max_concurrent_requests: int = 1024
    max_queued_requests: int = 1024
    dns_interval_s: float = 5.0
    disagg_min_prompt_tokens: int = 0
    slo_ttft_ms: float = 0.0
    slo_itl_ms: float = 0.0
    tokenizer: str | None = None
    chat_template: str | None = None
    kv_events_port: int | None = None
    kv_events_replay_port: int | None = None
    kv_block_size: int = 16
    otlp_traces_endpoint: str | None = None
    engine: str = KVTRANSFER
    dashboard: bool = True
    admin_token: str | None = field(default=None, repr=False)
    daemon_admin_token: str | None = field(default=None, repr=False)
    vllm_api_key: str | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        if isinstance(self.kv_stream, bool):  # the flag's old on/off form
            object.__setattr__(self, "kv_stream", "always" if self.kv_stream else "never")
        if self.kv_stream not in KV_STREAM_MODES:
            raise ValueError(f"kv_stream must be one of {KV_STREAM_MODES}, got {self.kv_stream!r}")
        # Lists from callers become tuples so the config stays hashable and immutable.
        for role in WORKER_ROLES:
            object.__setattr__(self, role, tuple(getattr(self, role)))
        for role in WORKER_ROLES:
            targets = getattr(self, role)
            if not targets and not self.aggregated and self.admin_token is None:
                if role == AGGREGATED:
                    continue
                raise ValueError(
                    f"at least one {role} daemon is required (HOST:PORT or dns:NAME:PORT), "
                    "unless aggregated daemons serve whole requests (--aggregated) or the "
                    "admin API adds them (an admin token: --admin-token-file)"
                )
            for target in targets:
                check_target(target)
            if len(set(targets)) != len(targets):
                raise ValueError(f"{role}: a daemon is listed twice")
        if not 0 <= self.port <= _MAX_PORT:
            raise ValueError(f"port must be in [0, {_MAX_PORT}], got {self.port}")
        if not self.model_name:
            raise ValueError("model_name must not be empty")
        for name in (
            "request_timeout_s",
            "health_timeout_s",
            "health_interval_s",
            "release_timeout_s",
            "shutdown_timeout_s",
            "breaker_cooldown_s",
            "dns_interval_s",
        ):
            value = getattr(self, name)
            if not value > 0:
                raise ValueError(f"{name} must be > 0, got {value}")
        for name in (
            "max_retries",
            "breaker_failures",
            "max_concurrent_requests",
            "max_queued_requests",
            "disagg_min_prompt_tokens",
        ):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"{name} must be an integer >= 0, got {value!r}")
        for name in ("slo_ttft_ms", "slo_itl_ms"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int | float) or not value >= 0:
                raise ValueError(f"{name} must be a number >= 0 (0: none), got {value!r}")
        if (self.slo_ttft_ms > 0) != (self.slo_itl_ms > 0):
            raise ValueError(
                "the SLO targets go together: give both --slo-ttft-ms and --slo-itl-ms, or neither"
            )
        for role in ("prefill", "decode"):
            check_policy_name(self.policy_for(role))
        check_max_request_bytes(self.max_request_bytes)
        if self.admin_token is not None:
            check_token(self.admin_token, "the router's admin token")
        if self.daemon_admin_token is not None:
            check_token(self.daemon_admin_token, "the daemons' admin token")
        if (self.tls_cert is None) != (self.tls_key is None):
            raise ValueError("the TLS certificate and key go together (--tls-cert, --tls-key)")
        for path in (self.tls_ca, self.tls_cert, self.tls_key):
            if path is not None:
                _read_pem(path)
        if self.tokenizer == "":
            raise ValueError("tokenizer must name a model (the daemons' --model) or be unset")
        if self.chat_template is not None and self.tokenizer is None:
            raise ValueError("a chat template goes with a tokenizer (--tokenizer)")
        for name in ("kv_events_port", "kv_events_replay_port"):
            value = getattr(self, name)
            if value is not None and not 0 < value <= _MAX_PORT:
                raise ValueError(f"{name} must be in [1, {_MAX_PORT}], got {value}")
        if self.kv_events_replay_port is not None and self.kv_events_port is None:
            raise ValueError("kv_events_replay_port needs kv_events_port")
        if isinstance(self.kv_block_size, bool) or self.kv_block_size < 1:
            raise ValueError(f"kv_block_size must be >= 1, got {self.kv_block_size!r}")
        if self.engine not in ENGINES:
            raise ValueError(f"engine must be one of {', '.join(ENGINES)}, got {self.engine!r}")
        if self.vllm_api_key is not None:
            if self.engine != VLLM:
                raise ValueError("a vLLM API key goes with --engine vllm")
            check_token(self.vllm_api_key, "the vLLM servers' API key")
        if self.engine == VLLM and self.uses_tls:
            raise ValueError(
                "TLS (--tls-ca/--tls-cert/--tls-key) is for kvtransfer daemons' gRPC; the "
                "router calls vLLM servers over plain HTTP (put them on a private network)"
            )
        for i, role in enumerate(WORKER_ROLES):
            for other in WORKER_ROLES[i + 1 :]:
                both = sorted(set(getattr(self, role)) & set(getattr(self, other)))
                if both:
                    raise ValueError(
                        f"{', '.join(both)}: listed as both a {role} and an {other} daemon"
                        if other == AGGREGATED
                        else f"{', '.join(both)}: listed as both a {role} and a {other} daemon"
                    )

    def policy_for(self, role: str) -> str:
        """The policy name of ``role``: its own override, else ``policy``."""
        override = self.prefill_policy if role == "prefill" else self.decode_policy
        return override or self.policy

    def addresses(self, role: str) -> tuple[str, ...]:
        """The fixed ``HOST:PORT`` instances of ``role``."""
        return tuple(t for t in getattr(self, role) if not t.startswith(DNS_PREFIX))

    def dns_names(self, role: str) -> tuple[tuple[str, int], ...]:
        """The ``(NAME, PORT)`` of each ``dns:`` entry of ``role``."""
        return tuple(parse_dns(t) for t in getattr(self, role) if t.startswith(DNS_PREFIX))

    @property
    def uses_tls(self) -> bool:
        return any(p is not None for p in (self.tls_ca, self.tls_cert, self.tls_key))

    def channel_options(self) -> list[tuple[str, int]]:
        """Options of the daemon channels: message limits that fit any accepted body,
        reconnection attempts at least as often as health checks, each bounded by the health
        timeout, and keep-alive pings that replace a connection a partition left hanging."""
        interval_ms = int(self.health_interval_s * 1000)
        timeout_ms = int(self.health_timeout_s * 1000)
        return [
            *grpc_message_options(self.max_request_bytes),
            ("grpc.initial_reconnect_backoff_ms", _MIN_RECONNECT_BACKOFF_MS),
            ("grpc.max_reconnect_backoff_ms", max(_MIN_RECONNECT_BACKOFF_MS, interval_ms)),
            # gRPC's name for the shortest connection attempt (its deadline), not a back-off.
            ("grpc.min_reconnect_backoff_ms", max(_MIN_CONNECT_TIMEOUT_MS, timeout_ms)),
            ("grpc.keepalive_time_ms", max(_MIN_KEEPALIVE_MS, interval_ms)),
            ("grpc.keepalive_timeout_ms", max(_MIN_KEEPALIVE_TIMEOUT_MS, 2 * timeout_ms)),
            ("grpc.keepalive_permit_without_calls", 1),
            ("grpc.http2.max_pings_without_data", 0),
        ]

    def channel_credentials(self) -> grpc.ChannelCredentials | None:
        """TLS credentials for the daemon channels, ``None`` for plaintext."""
        if not self.uses_tls:
            return None
        return grpc.ssl_channel_credentials(
            root_certificates=_read_pem(self.tls_ca) if self.tls_ca else None,
            private_key=_read_pem(self.tls_key) if self.tls_key else None,
            certificate_chain=_read_pem(self.tls_cert) if self.tls_cert else None,
        )


def _read_pem(path: str) -> bytes:
    # grpc reports a bad file only at the first handshake, as an opaque SSL error: name it now.
    try:
        data = Path(path).read_bytes()
    except OSError as exc:
        raise ValueError(f"cannot read {path}: {exc.strerror or exc}") from None
    if b"-----BEGIN " not in data:
        raise ValueError(f"{path} is not a PEM file (no '-----BEGIN' line)")
    return data
