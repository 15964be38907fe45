"""`PDPair`: a prefill engine and a decode engine, each in its own process, joined by
`UcxConnector` (the prefill side serves its handshake on 127.0.0.1, any free port).

`generate` prefills every prompt with ``max_tokens=1`` and ``{"do_remote_decode": True}``,
then decodes with the caller's sampling params and the ``kv_transfer_params`` prefill returned.
Both sides name each request the same (``"<name>-<n>"``), so logs of the two engines line up.
The prefill process keeps stepping between calls: it frees its blocks once decode has pulled
them, or when their lease runs out.
"""

from __future__ import annotations

import itertools
import uuid
from collections.abc import Mapping, Sequence
from typing import Any

from kvtransfer.connector.config import KVTransferConfig
from kvtransfer.engine.config import EngineConfig, SpeculativeConfig
from kvtransfer.engine.llm import RequestOutput
from kvtransfer.engine.sampling_params import SamplingParams
from pd_harness.engine_process import STARTUP_TIMEOUT_S, EngineProcess, PromptInput
from pd_harness.errors import KVTransferFailed

PREFILL_PARAMS = SamplingParams(max_tokens=1, ignore_eos=True)
REMOTE_DECODE: Mapping[str, Any] = {"do_remote_decode": True}
_POLICIES = ("fail", "recompute")
_OWN_FIELDS = {
    "model",
    "tensor_parallel_size",
    "pipeline_parallel_size",
    "speculative",
    "kv_transfer_config",
}


def ucx_engine_config(
    role: str,
    engine_id: str,
    *,
    model: str = "builtin",
    tp: int = 1,
    pp: int = 1,
    speculative: SpeculativeConfig | None = None,
    kv_load_failure_policy: str = "fail",
    extra_config: Mapping[str, Any] | None = None,
    engine_overrides: Mapping[str, Any] | None = None,
) -> EngineConfig:
    """The `EngineConfig` of one side of a pair (``role`` ``kv_producer``/``kv_consumer``)."""
    if kv_load_failure_policy not in _POLICIES:
        raise ValueError(
            f"kv_load_failure_policy must be one of {list(_POLICIES)}, got "
            f"{kv_load_failure_policy!r}"
        )
    kv = KVTransferConfig(
        kv_connector="UcxConnector",
        kv_role=role,
        engine_id=engine_id,
        kv_load_failure_policy=kv_load_failure_policy,
        kv_connector_extra_config=dict(extra_config or {}),
    )
    fields: dict[str, Any] = dict(engine_overrides or {})
    reserved = sorted(set(fields) & _OWN_FIELDS)
    if reserved:
        raise ValueError(f"engine_overrides must not set {reserved}; use PDPair's own arguments")
    return EngineConfig(
        model=model,
        tensor_parallel_size=tp,
        pipeline_parallel_size=pp,
        speculative=speculative,
        kv_transfer_config=kv,
        **fields,
    )


class PDPair:
    """A started prefill/decode pair; a context manager that shuts both down.

    ``extra_config`` goes to both sides' ``kv_connector_extra_config`` (e.g. ``kv_lease_s``,
    ``handshake_timeout_s``); ``engine_overrides`` to both `EngineConfig`s (``block_size``,
    ``num_kv_blocks``, ``device``...). ``kv_load_failure_policy`` is the decode side's.
    """

    def __init__(
        self,
        model: str = "builtin",
        prefill_tp: int = 1,
        prefill_pp: int = 1,
        decode_tp: int = 1,
        decode_pp: int = 1,
        speculative: SpeculativeConfig | None = None,
        kv_load_failure_policy: str = "fail",
        extra_config: Mapping[str, Any] | None = None,
        *,
        engine_overrides: Mapping[str, Any] | None = None,
        name: str = "pd",
        startup_timeout_s: float = STARTUP_TIMEOUT_S,
    ) -> None:
        suffix = uuid.uuid4().hex[:8]
        self.name = name
        common: dict[str, Any] = {
            "model": model,
            "speculative": speculative,
            "extra_config": extra_config,
            "engine_overrides": engine_overrides,
        }
        self.prefill_config = ucx_engine_config(
            "kv_producer", f"{name}-prefill-{suffix}", tp=prefill_tp, pp=prefill_pp, **common
        )
        self.decode_config = ucx_engine_config(
            "kv_consumer",
            f"{name}-decode-{suffix}",
            tp=decode_tp,
            pp=decode_pp,
            kv_load_failure_policy=kv_load_failure_policy,
            **common,
        )
        self._ids = itertools.count()
        self.prefill_engine: EngineProcess | None = None
        self.decode_engine: EngineProcess | None = None
        try:
            # Both start at once (model load and worker spawn overlap), then both are awaited.
            self.prefill_engine = EngineProcess(
                self.prefill_config,
                name=f"{name}-prefill",
                startup_timeout_s=startup_timeout_s,
                wait_ready=False,
            )
            self.decode_engine = EngineProcess(
                self.decode_config,
                name=f"{name}-decode",
                startup_timeout_s=startup_timeout_s,
                wait_ready=False,
            )
            self.prefill_engine.wait_ready()
            self.decode_engine.wait_ready()
        except BaseException:
            self.shutdown()
            raise

    @property
    def prefill(self) -> EngineProcess:
        if self.prefill_engine is None:
            raise RuntimeError("the prefill engine did not start")
        return self.prefill_engine

    @property
    def decode(self) -> EngineProcess:
        if self.decode_engine is None:
            raise RuntimeError("the decode engine did not start")
        return self.decode_engine

    def new_request_ids(self, n: int) -> list[str]:
        return [f"{self.name}-{next(self._ids)}" for _ in range(n)]

    def run_prefill(
        self,
        prompts: Sequence[PromptInput],
        request_ids: Sequence[str] | None = None,
        timeout_s: float = 120.0,
    ) -> list[RequestOutput]:
        """Prefill only: one token per prompt; the prompts' blocks stay for the decode side."""
        request_ids = list(request_ids) if request_ids is not None else None
        if request_ids is None:
            request_ids = self.new_request_ids(len(prompts))
        return self.prefill.generate(
            list(prompts),
            PREFILL_PARAMS,
            [REMOTE_DECODE] * len(prompts),
            timeout_s,
            request_ids=request_ids,
        )

    def run_decode(
        self,
        prompts: Sequence[PromptInput],
        sampling_params: SamplingParams | Sequence[SamplingParams],
        kv_transfer_params: Sequence[Mapping[str, Any] | None],
        request_ids: Sequence[str] | None = None,
        timeout_s: float = 120.0,
        *,
        raise_on_error: bool = False,
    ) -> list[RequestOutput]:
        """Decode with the params prefill returned. A request ending in error comes back with
        ``finish_reason == "error"``, or raises `KVTransferFailed` with ``raise_on_error``."""
        outputs = self.decode.generate(
            list(prompts), sampling_params, kv_transfer_params, timeout_s, request_ids=request_ids
        )
        if raise_on_error and any(o.finish_reason == "error" for o in outputs):
            raise KVTransferFailed(outputs)
        return outputs

    def generate(
        self,
        prompts: Sequence[PromptInput],
        sampling_params: SamplingParams | Sequence[SamplingParams],
        *,
        raise_on_error: bool = True,
        timeout_s: float = 120.0,
    ) -> list[RequestOutput]:
        """Prefill on one engine, decode on the other; outputs in prompt order. With
        ``raise_on_error``, a decode request ending in error raises `KVTransferFailed`."""
        prompts = list(prompts)
        request_ids = self.new_request_ids(len(prompts))
        prefilled = self.run_prefill(prompts, request_ids, timeout_s)
        params = [output.kv_transfer_params for output in prefilled]
        return self.run_decode(
            prompts, sampling_params, params, request_ids, timeout_s, raise_on_error=raise_on_error
        )

    def check_no_leaks(self, drain_timeout_s: float = 30.0) -> None:
        """Both sides drained and leak-free (decode first: its pulls release prefill's
        blocks)."""
        self.decode.check_no_leaks(drain_timeout_s)
        self.prefill.check_no_leaks(drain_timeout_s)

    def shutdown(self) -> None:
        """Stop both engines; idempotent."""
        for engine in (self.decode_engine, self.prefill_engine):
            if engine is not None:
                engine.shutdown()

    def __enter__(self) -> PDPair:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()
