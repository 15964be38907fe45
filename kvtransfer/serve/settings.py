"""`DaemonSettings`: a daemon's flags, also read from a config file and ``KVTRANSFER_*`` variables.

Precedence, lowest first: defaults, ``--config FILE`` (JSON or TOML, keys are the flag names with
underscores), environment variables (``KVTRANSFER_PORT``, ``KVTRANSFER_KV_TRANSFER_CONFIG``...),
command-line flags. Everything is validated by one pydantic model, so a bad value from any
source gets the same message naming the setting.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import tomllib
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    field_validator,
    model_validator,
)

from kvtransfer.clients.limits import DEFAULT_MAX_REQUEST_BYTES
from kvtransfer.connector.config import KVTransferConfig
from kvtransfer.engine.config import EngineConfig, SpeculativeConfig
from kvtransfer.engine.model.chat_template import ChatTemplate

Role = Literal["prefill", "decode"]

DEFAULT_PORTS: dict[str, int] = {"prefill": 50051, "decode": 50061}
KV_ROLES: dict[str, str] = {"prefill": "kv_producer", "decode": "kv_consumer"}
ENV_PREFIX = "KVTRANSFER_"


class SettingsError(ValueError):
    """A setting is missing, malformed or out of range; the message names it."""


class DaemonSettings(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    role: Role
    model: str = "builtin"
    # A Jinja file rendering chat prompts (default: the model's own template).
    chat_template: str | None = None
    host: str = "127.0.0.1"
    port: int = Field(ge=0, le=65535)
    tp: int = Field(default=1, ge=1)
    pp: int = Field(default=1, ge=1)
    speculative: Literal["draft", "ngram"] | None = None
    num_speculative_tokens: int = Field(default=3, ge=1)
    draft_model: str = "builtin:tiny-draft"
    kv_transfer_config: dict[str, Any] | None = None
    engine_id: str | None = None
    block_size: int = Field(default=16, ge=1)
    num_kv_blocks: int | None = Field(default=None, ge=1)
    max_model_len: int | None = Field(default=None, ge=1)
    device: Literal["cpu", "cuda"] = "cpu"
    metrics_host: str | None = None
    metrics_port: int | None = Field(default=None, ge=0, le=65535)
    tls_cert: str | None = None
    tls_key: str | None = None
    tls_ca: str | None = None
    admin_token: str | None = None
    drain_timeout_s: float = Field(default=60.0, gt=0)
    # How long a thread computing in Python may keep the others (the gRPC loop that streams a
    # token, the UCX thread) from the interpreter: CPython's default is 5 ms.
    switch_interval_ms: float = Field(default=0.5, gt=0, le=100)
    # The same setting as the router's: the gRPC server accepts messages of this size plus
    # headroom (`kvtransfer.clients.limits`), so anything the router accepted fits.
    max_request_bytes: int = Field(default=DEFAULT_MAX_REQUEST_BYTES, ge=1)
    log_level: Literal["DEBUG", "INFO", "WARNING", "ERROR"] = "INFO"
    log_format: Literal["text", "json"] = "text"
    # KV cache events in vLLM's format (`kvtransfer.serve.kv_events`); off when unset.
    kv_events_endpoint: str | None = None
    kv_events_replay_endpoint: str | None = None
    kv_events_topic: str = ""

    @field_validator("kv_events_endpoint", "kv_events_replay_endpoint")
    @classmethod
    def _zmq_endpoint(cls, value: str | None) -> str | None:
        if value is not None and not value.startswith(("tcp://", "ipc://", "inproc://")):
            raise ValueError(f"{value!r} is not a ZeroMQ endpoint (tcp://HOST:PORT, ipc://PATH)")
        return value

    @model_validator(mode="after")
    def _replay_needs_events(self) -> DaemonSettings:
        if self.kv_events_replay_endpoint is not None and self.kv_events_endpoint is None:
            raise ValueError("--kv-events-replay-endpoint needs --kv-events-endpoint")
        return self

    @field_validator("kv_transfer_config", mode="before")
    @classmethod
    def _json_object(cls, value: Any) -> Any:
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as exc:
                raise ValueError(f"not valid JSON: {exc}") from None
        return value

    @field_validator("chat_template")
    @classmethod
    def _template_file(cls, value: str | None) -> str | None:
        # Read and compiled now, so a bad file fails the start naming it, before any engine.
        if value is not None:
            ChatTemplate.for_model("builtin", value)
        return value

    @field_validator("log_level", mode="before")
    @classmethod
    def _upper(cls, value: Any) -> Any:
        return value.upper() if isinstance(value, str) else value

    def tls_files(self) -> Any:
        """The server's `TLSFiles`, or ``None`` for plaintext."""
        if self.tls_cert is None and self.tls_key is None and self.tls_ca is None:
            return None
        from kvtransfer.control.security import TLSFiles

        if self.tls_cert is None or self.tls_key is None:
            raise SettingsError("--tls-cert and --tls-key are required to serve TLS")
        try:
            return TLSFiles(cert_file=self.tls_cert, key_file=self.tls_key, ca_file=self.tls_ca)
        except ValueError as exc:
            raise SettingsError(f"--tls-*: {exc}") from None

    def check_security(self) -> None:
        """Fail at start-up, not at bind time, on unusable TLS files or admin token."""
        self.tls_files()
        if self.admin_token is not None:
            from kvtransfer.control.security import admin_token_metadata

            try:
                admin_token_metadata(self.admin_token)
            except ValueError as exc:
                raise SettingsError(f"--admin-token: {exc}") from None

    def resolved_engine_id(self) -> str:
        if self.engine_id:
            return self.engine_id
        configured = (self.kv_transfer_config or {}).get("engine_id")
        if configured:
            return str(configured)
        return f"{self.role}-{socket.gethostname()}-{os.getpid()}"

    def transfer_config(self) -> KVTransferConfig:
        """The kv_transfer_config with this daemon's defaults: UcxConnector, the role's kv_role,
        this daemon's engine id."""
        raw = dict(self.kv_transfer_config or {})
        raw.setdefault("kv_connector", "UcxConnector")
        raw.setdefault("kv_role", KV_ROLES[self.role])
        raw["engine_id"] = self.resolved_engine_id()
        return KVTransferConfig.model_validate(raw)

    def engine_config(self) -> EngineConfig:
        speculative = None
        if self.speculative is not None:
            speculative = SpeculativeConfig(
                method=self.speculative,
                num_speculative_tokens=self.num_speculative_tokens,
                draft_model=self.draft_model,
            )
        return EngineConfig(
            model=self.model,
            device=self.device,
            block_size=self.block_size,
            num_kv_blocks=self.num_kv_blocks,
            max_model_len=self.max_model_len,
            tensor_parallel_size=self.tp,
            pipeline_parallel_size=self.pp,
            speculative=speculative,
            kv_transfer_config=self.transfer_config(),
        )


def build_parser(role: Role) -> argparse.ArgumentParser:
    """Every flag defaults to ``None`` so that only what the user typed overrides lower layers."""
    parser = argparse.ArgumentParser(
        prog=f"kvtransfer-{role}",
        description=f"The {role} daemon (gRPC Generation, KVAdmin, health, reflection).",
        argument_default=None,
    )
    add = parser.add_argument
    add("--config", help="JSON or TOML file with the same keys as the flags")
    add("--model", help="builtin[:preset] or a Hugging Face model directory")
    add("--chat-template", metavar="FILE", help="Jinja chat template (default: the model's)")
    add("--host", help="gRPC bind address (default 127.0.0.1)")
    add("--port", type=int, help=f"gRPC port (default {DEFAULT_PORTS[role]}; 0 = any free port)")
    add("--tp", type=int, help="tensor-parallel size")
    add("--pp", type=int, help="pipeline-parallel size")
    add("--speculative", help="draft | ngram")
    add("--num-speculative-tokens", type=int)
    add("--draft-model")
    add("--kv-transfer-config", help="JSON with vLLM's keys (kv_connector, kv_ip, kv_port...)")
    add("--engine-id", help="this engine's id in kv_transfer_params and handshakes")
    add("--block-size", type=int)
    add("--num-kv-blocks", type=int)
    add("--max-model-len", type=int)
    add("--device", help="cpu | cuda")
    add("--metrics-host", help="Prometheus /metrics bind address (default: --host)")
    add("--metrics-port", type=int, help="Prometheus /metrics port (unset: off; 0: any free)")
    add("--tls-cert", help="server certificate chain (PEM); enables TLS")
    add("--tls-key", help="its private key (PEM)")
    add("--tls-ca", help="CA that client certificates must chain to (enables mTLS)")
    add("--admin-token", help="shared token KVAdmin calls must carry (prefer the env variable)")
    add("--drain-timeout-s", type=float, help="SIGTERM/Drain: longest wait for in-flight work")
    add(
        "--switch-interval-ms",
        type=float,
        help="the interpreter's thread switch interval (default 0.5; CPython's own is 5): "
        "how long the engine thread may hold back a token on its way out",
    )
    add(
        "--max-request-bytes",
        type=int,
        help=f"largest request, as the router's flag (default {DEFAULT_MAX_REQUEST_BYTES}); "
        "the gRPC server accepts it plus 1 MiB of headroom",
    )
    add(
        "--kv-events-endpoint",
        help="publish KV cache events (vLLM's format) on this ZeroMQ PUB address, bound: "
        "tcp://*:5557, tcp://127.0.0.1:0 (any free port); unset: off",
    )
    add(
        "--kv-events-replay-endpoint",
        help="ZeroMQ ROUTER address answering replay requests for missed events (bound)",
    )
    add("--kv-events-topic", help="topic of the KV event messages (default empty, as vLLM's)")
    add("--log-level", help="DEBUG | INFO | WARNING | ERROR")
    add("--log-format", help="text | json")
    return parser


def load_settings(
    role: Role, argv: Sequence[str] | None = None, environ: Mapping[str, str] | None = None
) -> DaemonSettings:
    """Merge the layers and validate; raises `SettingsError` (or exits 2 on unknown flags)."""
    args = vars(build_parser(role).parse_args(argv))
    environ = os.environ if environ is None else environ
    keys = [name for name in DaemonSettings.model_fields if name != "role"]
    merged: dict[str, Any] = {"port": DEFAULT_PORTS[role]}
    config_file = args.pop("config") or environ.get(f"{ENV_PREFIX}CONFIG")
    if config_file:
        merged.update(_read_config_file(Path(config_file), keys))
    for key in keys:
        value = environ.get(ENV_PREFIX + key.upper())
        if value is not None and value != "":
            merged[key] = value
    merged.update({k: v for k, v in args.items() if v is not None})
    try:
        settings = DaemonSettings(role=role, **merged)
    except ValidationError as exc:
        raise SettingsError(_describe(exc)) from None
    settings.check_security()
    return settings


def _read_config_file(path: Path, keys: Sequence[str]) -> dict[str, Any]:
    try:
        text = path.read_text()
    except OSError as exc:
        raise SettingsError(f"--config: cannot read {path}: {exc.strerror}") from None
    try:
        data = tomllib.loads(text) if path.suffix == ".toml" else json.loads(text)
    except (tomllib.TOMLDecodeError, json.JSONDecodeError) as exc:
        kind = path.suffix[1:] or "JSON"
        raise SettingsError(f"--config: {path} is not valid {kind}: {exc}") from None
    if not isinstance(data, dict):
        raise SettingsError(f"--config: {path} must hold an object of settings")
    data = {str(k).replace("-", "_"): v for k, v in data.items()}
    unknown = sorted(set(data) - set(keys))
    if unknown:
        raise SettingsError(f"--config: unknown setting(s) {unknown} in {path}")
    return data


def _describe(exc: ValidationError) -> str:
    parts = []
    for error in exc.errors():
        name = "--" + "-".join(str(loc) for loc in error["loc"][:1]).replace("_", "-")
        parts.append(f"{name}: {error['msg']}")
    return "; ".join(parts)
