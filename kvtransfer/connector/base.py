"""`KVConnectorBase_V1`: the contract every KV connector implements.

One connector class is instantiated twice: once with `KVConnectorRole.SCHEDULER` inside the
engine's scheduler process and once with `KVConnectorRole.WORKER` inside every worker (one per
``(pp_rank, tp_rank)``). The two halves never share memory; they talk only through

* `KVConnectorMetadata`, built by the scheduler half once per step and bound on every worker;
* `KVConnectorOutput`, returned by every worker after a step and merged by `KVOutputAggregator`
  before the scheduler half sees it in `update_connector_output`;
* `KVConnectorHandshakeMetadata`, published once by every worker and handed, merged and keyed by
  ``(pp_rank, tp_rank)``, to the scheduler half's `set_xfer_handshake_metadata_pp_aware`.

Ownership of KV blocks: the engine's block pool owns every block. A connector never frees a
block itself. It *borrows* blocks in two ways, and the engine keeps them allocated for as long as
the borrow lasts:

* load borrow: `get_num_new_matched_tokens` returned ``load_kv_async=True``; the blocks given to
  `update_state_after_alloc` stay allocated (even if the request is aborted) until a worker
  reports the request in ``finished_recving`` from `get_finished`/`get_transfer_results`;
* save borrow: `request_finished` returned ``delay_free=True``; the blocks stay allocated until
  the request is reported in ``finished_sending`` (aggregated over all workers).

Hooks are called from one thread per process (the step loop); a connector that does work in the
background must hand results back through these hooks.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, ClassVar

from kvtransfer.connector.kv_groups import BlockIds
from kvtransfer.connector.metadata import (
    KVConnectorHandshakeMetadata,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorStats,
    KVRequest,
    PpTpRank,
)

if TYPE_CHECKING:
    import torch

    from kvtransfer.connector.config import KVTransferConfig
    from kvtransfer.connector.outputs import KVConnectorOutput
    from kvtransfer.connector.serving import KVControlEndpoint, KVTransferTotals

FinishedIds = tuple[set[str] | None, set[str] | None]
TransferResults = tuple[set[str] | None, set[str] | None, set[str] | None]


class KVConnectorBase_V1:
    """Base class of all KV connectors; see the module docstring for the ownership rules.

    Subclasses override the hooks they need. Every hook has a safe default, so a connector that
    only saves (or only loads) stays small. Raising from a worker hook fails the step; connectors
    report per-request failures through `get_transfer_results` instead.
    """

    # The class remote payloads are decoded with (never chosen by the remote side).
    handshake_metadata_cls: ClassVar[type[KVConnectorHandshakeMetadata]] = (
        KVConnectorHandshakeMetadata
    )

    def __init__(
        self,
        config: KVTransferConfig,
        role: KVConnectorRole,
        kv_cache_config: Any | None = None,
    ) -> None:
        self._config = config
        self._role = KVConnectorRole(role)
        self._kv_cache_config = kv_cache_config
        self._connector_metadata: KVConnectorMetadata | None = None

    @property
    def role(self) -> KVConnectorRole:
        return self._role

    @property
    def kv_transfer_config(self) -> KVTransferConfig:
        return self._config

    # ------------------------------------------------------------------ worker side

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        """Hand the connector every KV layer tensor this worker owns, keyed by layer name.

        Runs once per worker after the KV cache is allocated and before the first step; it is
        not repeated. The dict includes draft-model layers under speculative decoding. Layout is
        ``[num_blocks, 2, num_kv_heads, block_size, head_dim]`` (heads outer within a block).
        The connector may keep references and register the memory with a transport; it must not
        resize or reallocate the tensors.
        """

    @classmethod
    def supports_sleep_mode(cls, kv_transfer_config: KVTransferConfig) -> bool:
        """Whether this connector follows the engine's sleep and wake-up (the KV pool freed,
        then mapped again, possibly at other physical memory): asked once, before any instance
        exists; an engine with sleep mode refuses to start with a connector answering False.

        Default False, unlike vLLM's default True: a connector that registered the caches with
        a transport and kept the no-op `unregister_kv_caches` / `restore_kv_caches` would serve
        freed memory after a sleep. Answer True once both hooks do what they say (a connector
        that keeps no registration may answer True with the no-op hooks)."""
        return False

    def unregister_kv_caches(self) -> None:
        """Drop every registration of the caches (transport memory registrations, remote keys
        handed out, serving threads reading them) before the engine frees the KV pool.

        Worker side. Runs when the engine sleeps (or discards its KV cache), after the engine
        drained transfers: no load or save is in flight and no block is borrowed. May repeat
        (idempotent). After it returns, nothing may read or write the cache tensors; a load
        started before `restore_kv_caches` fails that request. Default: nothing (a connector
        that keeps no registration)."""

    def restore_kv_caches(self) -> None:
        """Register the caches again after the engine mapped the KV pool back (the same
        tensors, whose memory may now be other physical pages), as `register_kv_caches` did.

        Worker side. Runs at wake-up, before the next step; idempotent. The worker's
        `get_handshake_metadata` may change (new transport address, new keys): the engine then
        calls the scheduler half's `set_xfer_handshake_metadata_pp_aware` again, and a
        consumer that holds the old registration must get a typed error and handshake again,
        never read the new memory with old keys. Default: nothing."""

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        """Bind this step's metadata before the forward; runs once per step, `no_forward` steps
        included. The metadata object is shared by all workers of the step: do not mutate it.
        """
        self._connector_metadata = connector_metadata

    def clear_connector_metadata(self) -> None:
        """Drop this step's metadata; runs once per step after `get_finished`, always, even when
        the forward raised. Calling it with nothing bound is allowed.
        """
        self._connector_metadata = None

    def has_connector_metadata(self) -> bool:
        """Whether metadata is bound right now (between bind and clear of this step)."""
        return self._connector_metadata is not None

    def _get_connector_metadata(self) -> KVConnectorMetadata:
        if self._connector_metadata is None:
            raise RuntimeError(f"{type(self).__name__}: no connector metadata bound this step")
        return self._connector_metadata

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        """Start loading the KV the bound metadata asks for into the paged cache.

        Runs once per step, before the first layer's forward. Asynchronous connectors start
        transfers here and return; layer-wise connectors make `wait_for_layer_load` block.
        Writes only into blocks the scheduler handed over in `update_state_after_alloc`.
        """

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Block until ``layer_name``'s KV for this step is in place; runs just before that
        attention layer computes, once per attention layer per step (drafter layers included).
        """

    def save_kv_layer(
        self,
        layer_name: str,
        kv_layer: torch.Tensor,
        attn_metadata: Any,
        **kwargs: Any,
    ) -> None:
        """Start saving ``layer_name``'s freshly written KV; runs right after that attention
        layer wrote the paged cache, once per layer per step. Under speculative decoding it also
        runs for the drafter's layers, after the target model's and before `wait_for_save`.
        ``kv_layer`` is the live cache tensor: read it, never write it.
        """

    def wait_for_save(self) -> None:
        """Block until every save started this step no longer reads the paged cache (so the
        blocks may be reused). Runs once per step after the drafter ran; skipped on
        `no_forward` steps, which wrote no KV. In vLLM 0.32's order (ours by default) it runs
        before `get_finished`; in vLLM 0.33's deferred order (Model Runner V2 with a
        speculator, ``SpeculativeConfig.defer_kv_finalize``) it runs after this step's
        `get_finished`, which so sees none of this step's saves end: a connector must report a
        save finished only once `wait_for_save` returned for every step that wrote its KV (a
        send completing during this call is reported at the next step's `get_finished`).
        """

    def get_finished(self, finished_req_ids: set[str]) -> FinishedIds:
        """Report requests whose asynchronous transfers completed on *this worker*.

        Runs once per step: after `wait_for_save` in vLLM 0.32's order, right after the
        target's forward (before the drafter and `wait_for_save`) in 0.33's deferred order,
        and on `no_forward` steps. The metadata stays bound until the step is finalized. Returns
        ``(finished_sending, finished_recving)``, each ``None`` when empty. ``finished_req_ids``
        are requests the scheduler finished since the last step. Each request id is reported at
        most once per direction; the aggregator counts reports across workers.
        """
        return None, None

    def get_transfer_results(self, finished_req_ids: set[str]) -> TransferResults:
        """`get_finished` plus receives that failed on this worker.

        Returns ``(finished_sending, finished_recving, failed_recving)``. A failed receive is
        also a finished receive (it no longer writes into its blocks), so every id in
        ``failed_recving`` is in ``finished_recving`` too. The model runner calls this, not
        `get_finished`; the default reports no failures.
        """
        sending, recving = self.get_finished(finished_req_ids)
        return sending, recving, None

    def set_completion_callback(self, callback: Callable[[], None]) -> bool:
        """Offer a callback that wakes the engine; True if this connector will call it.

        Called once per instance: on workers after `register_kv_caches`, on the scheduler after
        `set_xfer_handshake_metadata`. A connector that returns True calls ``callback`` (from
        any thread, as often as it likes) whenever something happened that the next step must
        act on: on a worker, a load or save it will report in `get_transfer_results` finished;
        on the scheduler, e.g. a consumer gave back KV that `build_connector_meta` will free.
        An engine whose connector instances all returned True sleeps between idle steps until
        called instead of polling. The default returns False: the engine polls every idle step.
        """
        return False

    def get_load_failure_reasons(self) -> dict[str, str]:
        """Why each receive this worker reported failed failed, by request id, for the error the
        request ends with under ``kv_load_failure_policy=fail`` (and the log under recompute).

        Runs once per step right after `get_transfer_results`; drained by the call. Requests
        without a reason get a generic message. The default gives none.
        """
        return {}

    def get_block_ids_with_load_errors(self) -> set[int]:
        """Block ids whose load failed since the last call (their content is garbage).

        Runs once per step after `get_transfer_results`. The scheduler applies the
        ``kv_load_failure_policy`` to the requests holding them. The set is drained by the call.
        """
        return set()

    def get_handshake_metadata(self) -> KVConnectorHandshakeMetadata | None:
        """What this worker publishes to remote engines; ``None`` if it publishes nothing.

        Called once per worker after `register_kv_caches`. The worker keys it by its
        ``(pp_rank, tp_rank)``.
        """
        return None

    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        """Stats gathered since the last call (the call resets them); ``None`` if none."""
        return None

    def shutdown(self) -> None:
        """Release transports, threads and registrations. May be called more than once; must
        not raise for a connector that was never fully started. Borrowed blocks are the
        engine's to free after shutdown."""

    # --------------------------------------------------------------- scheduler side

    def validate_kv_transfer_params(self, params: Mapping[str, Any] | None) -> None:
        """Check a new request's ``kv_transfer_params`` before the engine queues it.

        Runs once per request, in `EngineCore.add_request`, before any block is allocated.
        Raise `ValueError` naming the key to reject the request up front (the caller gets the
        error and nothing was held); the default accepts anything. Must not keep state: a
        request that passes may still be aborted before it is ever scheduled.
        """

    def release_kv(self, kv_transfer_params: Mapping[str, Any]) -> bool:
        """A consumer gives up the KV this producer holds for a finished request, now.

        ``kv_transfer_params`` are the params `request_finished` returned for it, as the
        consumer (or the router on its behalf) holds them; a connector that hands out access
        secrets must check them here. Runs on the scheduler side, on the engine's thread, at any
        time after the request finished, and may repeat: releasing twice, or releasing KV
        already freed (pulled, expired), is not an error and returns False. Returns True when
        this call released held KV; the blocks are freed through ``finished_sending`` as for
        any other release. Raise `ValueError` naming the key for params that cannot describe
        KV of this engine, `PermissionError` when they do but their secret does not match.
        The default holds nothing and returns False.
        """
        return False

    def get_num_new_matched_tokens(
        self, request: KVRequest, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        """How many tokens beyond ``num_computed_tokens`` the connector can provide.

        Runs for a waiting request each time the scheduler considers admitting it (so it may
        repeat for the same request across steps). Returns ``(num_external_tokens,
        load_kv_async)``; ``num_external_tokens=None`` means "not known yet, ask again next
        step" (the request keeps waiting). With ``load_kv_async=True`` the request parks in
        ``WAITING_FOR_REMOTE_KVS`` until a worker reports it received. Must not mutate
        ``request``.
        """
        return 0, False

    def update_state_after_alloc(
        self, request: KVRequest, block_ids: Sequence[int], num_external_tokens: int
    ) -> None:
        """Blocks were allocated for ``request``; runs once per admission right after
        `get_num_new_matched_tokens`, also with ``num_external_tokens=0``. A load borrow of
        ``block_ids`` starts here when the connector answered ``load_kv_async=True``.

        A `SupportsHMA` connector gets `BlockIds` (one tuple per KV cache group, in the
        layout's group order; a sliding-window group's out-of-window blocks are the engine's
        null block); any other connector gets the one group's list.
        """

    def build_connector_meta(self, scheduler_output: Any) -> KVConnectorMetadata:
        """Build this step's metadata for the workers; runs exactly once per scheduled step
        (zero-token steps included) and must reset the per-step state it consumed.
        """
        return KVConnectorMetadata()

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        """See the aggregated output of a step before the scheduler acts on it.

        Runs once per step, before the engine acts on the output (it may be edited in place).
        May remove ids from ``finished_sending`` when the connector knows the request is still
        being saved elsewhere, and a failed load's id (from ``finished_recving``,
        ``failed_recving`` and ``load_failure_reasons``, with its blocks from
        ``invalid_block_ids``) when it loads the request again into the same blocks, which
        keeps the load borrow running until that load is reported (see `MultiConnector`).
        Must not add ids other than invalid blocks it removed from an earlier step's output.
        """

    def request_finished(
        self, request: KVRequest, block_ids: Sequence[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        """A request finished (stopped, aborted or preempted for good); runs once per request.

        Returns ``(delay_free, kv_transfer_params)``. ``delay_free=True`` starts a save borrow:
        the engine keeps ``block_ids`` allocated until the request is reported in
        ``finished_sending``. ``kv_transfer_params`` goes back to the client with the result
        (e.g. where a decode engine can pull the KV).
        """
        return False, None

    def take_early_kv_transfer_params(self) -> dict[str, dict[str, Any]]:
        """Params a consumer may use *before* their request finished, by request id.

        Scheduler role; runs once per step right after `build_connector_meta`, before the step
        runs on the workers. A producer that streams KV while computing it returns here the
        params of requests whose blocks are all known and whose KV this step completes (they
        are what `request_finished` will return too); the engine hands each to its request's
        caller at once, so a consumer can start before the prefill ends. Drained by the call.
        The default streams nothing.
        """
        return {}

    # ------------------------------------------------------------ what a host reads

    def get_control_endpoint(self) -> KVControlEndpoint | None:
        """The handshake payloads this connector publishes and where it serves them, for a
        host (a daemon) to serve as ``KVHandshake`` on its own port as well; ``None`` when the
        connector serves no handshake (a consumer, or a connector that needs none).

        Scheduler role (a worker-role instance returns ``None``); read-only, never raises. A
        host calls it after `set_xfer_handshake_metadata_pp_aware` ran (start-up) and may call
        it again at any time; it returns the same endpoint until the handshake is published
        anew. The default serves nothing.
        """
        return None

    def get_transfer_totals(self) -> KVTransferTotals | None:
        """Cumulative transfer counters since start-up (`KVTransferTotals`); ``None`` when the
        connector keeps none, and the host counts what it can see itself.

        Scheduler role (a worker-role instance returns ``None``); read-only, never raises, and
        cheap: a host calls it after every step and for every status query, from the thread
        that steps the engine. Counters only grow. The default keeps none.
        """
        return None

    def take_events(self) -> Iterable[Any]:
        """Drain KV cache events (stored/removed blocks) the connector wants published."""
        return ()

    def get_finished_count(self) -> int | None:
        """How many workers must report a request finished before it is finished; ``None``
        means every worker of the engine (the usual case)."""
        return None

    def set_xfer_handshake_metadata(
        self, metadata: dict[int, KVConnectorHandshakeMetadata]
    ) -> None:
        """Receive the handshake metadata of a non-pipelined engine, keyed by ``tp_rank``.

        Called by the default `set_xfer_handshake_metadata_pp_aware` (at start-up and after
        each wake-up; the last call wins). Default: ignore it (connectors that need no
        handshake).
        """

    def set_xfer_handshake_metadata_pp_aware(
        self, metadata: Mapping[PpTpRank, KVConnectorHandshakeMetadata]
    ) -> None:
        """Receive every worker's handshake metadata keyed by ``(pp_rank, tp_rank)``.

        The engine calls this at start-up with the result of `merge_handshake_metadata`, and
        again after each wake-up from sleep (`restore_kv_caches`): it may repeat, and the last
        call wins (what an earlier call published must no longer be served).
        Connectors that support pipeline-parallel transfer override it. The default accepts only
        ``pp_rank == 0`` and forwards ``{tp_rank: metadata}`` to `set_xfer_handshake_metadata`;
        it reads no instance state, so it works on subclasses that skipped ``super().__init__``.
        """
        pipelined = sorted({pp for pp, _ in metadata if pp != 0})
        if pipelined:
            raise ValueError(
                f"{type(self).__name__} does not support PP-disaggregated KV transfer: "
                f"handshake metadata arrived for pp_rank(s) {pipelined}; use a connector that "
                "overrides set_xfer_handshake_metadata_pp_aware or run with pipeline parallel "
                "size 1"
            )
        self.set_xfer_handshake_metadata({tp: md for (_, tp), md in metadata.items()})


class SupportsHMA:
    """Mixin of a connector that follows hybrid KV caches (vLLM's name: its "hybrid memory
    allocator"): several KV cache groups, one block list per group (`kv_groups`).

    An engine whose layout has more than one group refuses, at start-up, a connector that is
    not one. For one that is, the scheduler calls `request_finished_all_groups` instead of
    `request_finished` and hands `update_state_after_alloc` one block list per group.
    """

    def request_finished_all_groups(
        self, request: KVRequest, block_ids: BlockIds
    ) -> tuple[bool, dict[str, Any] | None]:
        """`request_finished` with every group's blocks (``block_ids[g]`` for group ``g``);
        runs once per request, before any of its blocks is freed. ``delay_free=True`` keeps
        every group's blocks allocated until the request is reported in ``finished_sending``."""
        raise NotImplementedError


def supports_hma(connector: object) -> bool:
    """Whether a connector (class or instance) follows hybrid KV caches."""
    if isinstance(connector, type):
        return issubclass(connector, SupportsHMA)
    answer = getattr(connector, "follows_kv_groups", None)
    if callable(answer):
        return bool(answer())
    return isinstance(connector, SupportsHMA)
