"""The model runner's view of the worker-side KV connector.

The runner always holds a `KVConnector`: the base class is a null object that does nothing, and
`ActiveKVConnector` drives a real `KVConnectorBase_V1` worker instance. The runner therefore has
no "is KV transfer configured?" branches, and the hook order of a step lives in one place:

forward step:    pre_forward -> (per layer: before_attention, after_attention) -> post_forward
no-forward step: no_forward (bind, start_load_kv, get_transfer_results, clear; no wait_for_save)
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from kvtransfer.connector.factory import KVConnectorFactory
from kvtransfer.connector.metadata import (
    KVCacheLayout,
    KVConnectorHandshakeMetadata,
    KVConnectorMetadata,
    KVConnectorRole,
)
from kvtransfer.connector.outputs import KVConnectorOutput
from kvtransfer.engine.model.forward_context import NoLayerHooks
from kvtransfer.engine.outputs import EMPTY_MODEL_RUNNER_OUTPUT, ModelRunnerOutput
from kvtransfer.timeline import BOOK, Span, now_ns

if TYPE_CHECKING:
    import torch

    from kvtransfer.connector.base import KVConnectorBase_V1
    from kvtransfer.connector.config import KVTransferConfig
    from kvtransfer.engine.model.forward_context import AttentionMetadata
    from kvtransfer.engine.scheduler_output import SchedulerOutput

# A layer's wait for its KV shorter than this is not worth a span (no load was behind it).
_NOTABLE_WAIT_NS = 20_000


class KVConnector(NoLayerHooks):
    """No KV transfer configured: every hook is a no-op and nothing is ever reported.

    Its layer hooks (`LayerHooks`) are the no-op ones, so the runner hands it to the model as is.
    """

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        pass

    def unregister_kv_caches(self) -> None:
        pass

    def restore_kv_caches(self) -> None:
        pass

    def handshake_metadata(self) -> KVConnectorHandshakeMetadata | None:
        return None

    def set_completion_callback(self, callback: Callable[[], None]) -> bool:
        """Whether ``callback`` will be called when a transfer finishes (so an idle engine
        may sleep until then); nothing ever finishes here."""
        return True

    def pre_forward(self, scheduler_output: SchedulerOutput) -> None:
        pass

    def post_forward(
        self,
        finished_req_ids: frozenset[str] | set[str],
        wait_for_save: bool = True,
        defer_finalize: bool = False,
    ) -> KVConnectorOutput | None:
        return None

    def finalize_step(self) -> None:
        pass

    def no_forward(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        return EMPTY_MODEL_RUNNER_OUTPUT

    def shutdown(self) -> None:
        pass


class ActiveKVConnector(KVConnector):
    """Drives a worker-role connector through one step's hooks in the contract's order."""

    def __init__(self, connector: KVConnectorBase_V1) -> None:
        if connector.role != KVConnectorRole.WORKER:
            raise ValueError(
                f"ActiveKVConnector needs a WORKER-role connector, got {connector.role.name} "
                f"({type(connector).__name__})"
            )
        self.connector = connector
        # Requests computing prompt tokens this step, whose timelines get a span per layer
        # (computed, then saved: a streaming prefill publishes it there); `_mark` is where
        # the next layer's computation began.
        self._timeline_ids: tuple[str, ...] = ()
        self._mark = 0

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self.connector.register_kv_caches(kv_caches)

    def unregister_kv_caches(self) -> None:
        self.connector.unregister_kv_caches()

    def restore_kv_caches(self) -> None:
        self.connector.restore_kv_caches()

    def handshake_metadata(self) -> KVConnectorHandshakeMetadata | None:
        return self.connector.get_handshake_metadata()

    def set_completion_callback(self, callback: Callable[[], None]) -> bool:
        return self.connector.set_completion_callback(callback)

    def pre_forward(self, scheduler_output: SchedulerOutput) -> None:
        # A connector may read its bound metadata unconditionally, so a step whose scheduler
        # built none still binds an empty one.
        metadata = scheduler_output.kv_connector_metadata
        self.connector.bind_connector_metadata(
            metadata if metadata is not None else KVConnectorMetadata()
        )
        self.connector.start_load_kv(forward_context=None)
        scheduled = scheduler_output.num_scheduled_tokens
        self._timeline_ids = tuple(rid for rid, n in scheduled.items() if n > 1)
        self._mark = now_ns()

    def before_attention(self, layer_name: str) -> None:
        if not self._timeline_ids:
            self.connector.wait_for_layer_load(layer_name)
            return
        start = now_ns()
        self.connector.wait_for_layer_load(layer_name)
        end = now_ns()
        if end - start > _NOTABLE_WAIT_NS:
            BOOK.add_many(
                self._timeline_ids, Span("kv.wait_layer", start, end, {"layer": layer_name})
            )

    def after_attention(
        self, layer_name: str, kv_cache: torch.Tensor, attn_metadata: AttentionMetadata
    ) -> None:
        if not self._timeline_ids:
            self.connector.save_kv_layer(layer_name, kv_cache, attn_metadata)
            return
        computed = now_ns()
        self.connector.save_kv_layer(layer_name, kv_cache, attn_metadata)
        saved = now_ns()
        ids = self._timeline_ids
        BOOK.add_many(ids, Span("model.layer", self._mark, computed, {"layer": layer_name}))
        BOOK.add_many(ids, Span("kv.save_layer", computed, saved, {"layer": layer_name}))
        self._mark = saved

    def post_forward(
        self,
        finished_req_ids: frozenset[str] | set[str],
        wait_for_save: bool = True,
        defer_finalize: bool = False,
    ) -> KVConnectorOutput | None:
        """Finish the step: wait for saves (if any were started), collect what completed.

        The step's metadata is cleared whatever happens, so a failed step cannot leak its
        metadata into the next one. ``defer_finalize`` (vLLM 0.33's order under a speculator):
        collect only; `finalize_step` waits for the saves and clears, after the drafter ran.
        """
        try:
            if wait_for_save and not defer_finalize:
                self.connector.wait_for_save()
            sending, recving, failed = self.connector.get_transfer_results(set(finished_req_ids))
            reasons = self.connector.get_load_failure_reasons()
            invalid = self.connector.get_block_ids_with_load_errors()
            stats = self.connector.get_kv_connector_stats()
        finally:
            if not defer_finalize:
                self.connector.clear_connector_metadata()
        # A failed receive no longer writes into its blocks, so it is a finished one too; a
        # connector that forgot to say so must not leave the scheduler waiting forever.
        finished_recving = set(recving or ()) | set(failed or ())
        output = KVConnectorOutput(
            finished_sending=set(sending) if sending else None,
            finished_recving=finished_recving or None,
            failed_recving=set(failed) if failed else None,
            invalid_block_ids=set(invalid) if invalid else None,
            kv_connector_stats=stats if stats is not None and not stats.is_empty() else None,
            load_failure_reasons=dict(reasons) if reasons else None,
        )
        return None if output.is_empty() else output

    def finalize_step(self) -> None:
        """End a step whose `post_forward` deferred it: wait for this step's saves (the
        drafter's included), then clear the metadata, whatever happens."""
        try:
            self.connector.wait_for_save()
        finally:
            self.connector.clear_connector_metadata()

    def no_forward(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        """A step that runs no model: the connector still binds, loads and reports."""
        self.pre_forward(scheduler_output)
        output = self.post_forward(scheduler_output.finished_req_ids, wait_for_save=False)
        return ModelRunnerOutput.with_kv_conn_output_only(output)

    def shutdown(self) -> None:
        self.connector.shutdown()


def make_kv_connector(
    kv_transfer_config: KVTransferConfig | None, layout: KVCacheLayout | None = None
) -> KVConnector:
    """The null connector when no transfer is configured, else an active one around a freshly
    created worker-role instance of the configured connector (given ``layout`` as its
    ``kv_cache_config``)."""
    if kv_transfer_config is None or kv_transfer_config.kv_connector is None:
        return KVConnector()
    return ActiveKVConnector(
        KVConnectorFactory.create_connector(kv_transfer_config, KVConnectorRole.WORKER, layout)
    )
