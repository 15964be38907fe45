"""`KVTransferConfig`: the ``--kv-transfer-config`` JSON, with vLLM's keys, checked at the door."""

from __future__ import annotations

import json
import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

KVRole = Literal["kv_producer", "kv_consumer", "kv_both"]
KVLoadFailurePolicy = Literal["fail", "recompute"]


# Keys of ``kv_connector_extra_config`` that vLLM's adapter reads itself (never a hosted
# connector's): which kvtransfer connector to host, how vLLM's backend lays K and V in a block,
# the hook watchdog's bound and metrics port, a CPU set for our threads.
VLLM_ADAPTER_KEYS = (
    "kvtransfer_connector",
    "vllm_kv_split",
    "hook_bound_s",
    "step_bound_s",
    "watchdog_metrics_port",
    "thread_cpus",
)


class KVTransferConfigError(ValueError):
    """A ``kv_transfer_config`` that cannot be used; the message names every offending key."""


class KVTransferConfig(BaseModel):
    """Which connector to run and how; accepts the JSON a vLLM user passes.

    Keys vLLM defines but kvtransfer has no use for (``kv_buffer_size``, ``kv_rank``,
    ``kv_parallel_size``, ``kv_ip``, ``kv_port``, ``enable_permute_local_kv``) are accepted and
    kept so existing configurations parse unchanged; anything else is rejected.
    """

    model_config = ConfigDict(extra="forbid", frozen=True, validate_default=True)

    kv_connector: str | None = None
    engine_id: str = Field(default_factory=lambda: str(uuid.uuid4()))
    kv_role: KVRole | None = None
    kv_buffer_device: Literal["cpu", "cuda"] | None = None
    kv_connector_extra_config: dict[str, Any] = Field(default_factory=dict)
    kv_connector_module_path: str | None = None
    kv_load_failure_policy: KVLoadFailurePolicy = "fail"

    kv_buffer_size: float = Field(default=1e9, gt=0)
    kv_rank: int | None = None
    kv_parallel_size: int = Field(default=1, ge=1)
    kv_ip: str | None = None
    kv_port: int | None = Field(default=None, ge=0, le=65535)
    enable_permute_local_kv: bool = False

    @field_validator("kv_connector", "engine_id", "kv_connector_module_path")
    @classmethod
    def _non_blank(cls, value: str | None) -> str | None:
        if value is not None and not value.strip():
            raise ValueError("must not be blank")
        return value

    @classmethod
    def from_json(cls, text: str | bytes) -> KVTransferConfig:
        """Parse ``--kv-transfer-config`` text; errors name the offending key."""
        try:
            raw = json.loads(text)
        except json.JSONDecodeError as exc:
            raise KVTransferConfigError(f"kv_transfer_config is not valid JSON: {exc}") from exc
        if not isinstance(raw, dict):
            raise KVTransferConfigError(
                f"kv_transfer_config must be a JSON object, got {type(raw).__name__}"
            )
        return cls.from_dict(raw)

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> KVTransferConfig:
        try:
            return cls.model_validate(raw)
        except ValidationError as exc:
            raise KVTransferConfigError(_describe(exc)) from exc

    @classmethod
    def from_vllm(cls, vllm_config: Any, kv_connector: str) -> KVTransferConfig:
        """Our config for the kvtransfer connector ``kv_connector`` hosted in vLLM, from vLLM's
        ``KVTransferConfig`` (read by attribute; vLLM is not imported).

        vLLM refuses a top-level ``kv_ip``, so the handshake host comes from
        ``kv_connector_extra_config.kv_ip``; the adapter's own keys there
        (`VLLM_ADAPTER_KEYS`: the generic adapter's choice of connector, how vLLM's backend
        lays K and V in a block, the hook watchdog's and our threads' settings) are dropped.
        """
        extra = dict(getattr(vllm_config, "kv_connector_extra_config", None) or {})
        kv_ip = extra.pop("kv_ip", None)
        for key in VLLM_ADAPTER_KEYS:
            extra.pop(key, None)
        device = getattr(vllm_config, "kv_buffer_device", None)
        return cls.from_dict(
            {
                "kv_connector": kv_connector,
                "engine_id": vllm_config.engine_id,
                "kv_role": vllm_config.kv_role,
                "kv_buffer_device": device if device in ("cpu", "cuda") else None,
                "kv_connector_extra_config": extra,
                "kv_load_failure_policy": getattr(vllm_config, "kv_load_failure_policy", "fail"),
                "kv_ip": kv_ip,
                "kv_port": getattr(vllm_config, "kv_port", None),
            }
        )

    @property
    def is_kv_transfer_instance(self) -> bool:
        return self.kv_connector is not None

    @property
    def is_kv_producer(self) -> bool:
        return self.kv_role in ("kv_producer", "kv_both")

    @property
    def is_kv_consumer(self) -> bool:
        return self.kv_role in ("kv_consumer", "kv_both")

    def get_from_extra_config(self, key: str, default: Any = None) -> Any:
        return self.kv_connector_extra_config.get(key, default)


def _describe(exc: ValidationError) -> str:
    problems = []
    for error in exc.errors():
        key = ".".join(str(part) for part in error["loc"]) or "<root>"
        if error["type"] == "extra_forbidden":
            problems.append(f"{key}: unknown key")
        else:
            problems.append(f"{key}: {error['msg']} (got {error.get('input')!r})")
    return "invalid kv_transfer_config: " + "; ".join(problems)
