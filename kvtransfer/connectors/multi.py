"""`MultiConnector`: several connectors behind one, e.g. UCX transfer plus a storage tier.

Configuration: ``kv_connector_extra_config = {"connectors": [child_config, ...]}`` where each
child is a ``kv_transfer_config`` object; a child inherits ``engine_id``, ``kv_role``,
``kv_buffer_device`` and ``kv_load_failure_policy`` from the parent unless it sets them. Both
ends of a transfer must run the same children in the same order.

What the children do together:

* Loads: every child is asked; the first child (in order) reporting a hit loads the request.
  The later children that report at least as many tokens, asynchronously, are its fallbacks:
  when the load fails (the engine saw it in ``failed_recving``), the next fallback loads the
  request again into the same blocks, and the engine sees only the last attempt's outcome
  (the blocks stay lent to the connector in between). A request aborted while loading gets no
  second attempt, and one preempted after its load recomputes (as with a single connector).
  Loads that are not asynchronous have no fallback.
* Saves: every child saves; a request finishes sending only after its last saving child
  reported it (counted on each worker before aggregation).
* ``kv_transfer_params``: children never see each other's. The first child owns the top level;
  every other child's params travel under the reserved key ``"multi_connector"``, keyed
  ``"<index>:<class name>"`` (``{"do_remote_prefill": true, ..., "multi_connector":
  {"1:SharedStorageConnector": {...}}}``). Params carrying that key are split the same way
  on the way in: each child sees only its own (``None`` when its slot is absent or empty).
  Params without it (a client's ``{"do_remote_decode": true}``) are shared: every child sees
  them all. The first child returning the reserved key itself, or a slot that is not an object,
  is a `ValueError` naming the key, which fails that request alone.
* What a host reads: the control endpoint of the first child that serves one (the others keep
  serving on their own addresses); transfer totals summed over the children.

UCX plus a storage tier, ``connectors = [{"kv_connector": "UcxConnector", ...},
{"kv_connector": "SharedStorageConnector", "kv_connector_extra_config":
{"shared_storage_path": ...}}]`` on both daemons: the prefill holds each request's KV for UCX
pulls under a lease and also writes it to the shared directory; the decode pulls over UCX, and
when that pull fails (the producer died, is unreachable, or its lease expired) it loads the
same tokens from the directory instead, waiting up to the storage child's ``load_timeout_s``
for files still being written. Limits: the files outlive the request (``delete_after_load``
removes them only after a load from them); a request announced before it finished
(``kv_stream``) carries the storage child's params only if that child announces early too,
which `SharedStorageConnector` does not, so such a decode has no tier to fall back to; a
producer killed before its workers wrote the files leaves nothing to fall back on.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

from kvtransfer.connector.base import (
    FinishedIds,
    KVConnectorBase_V1,
    SupportsHMA,
    TransferResults,
    supports_hma,
)
from kvtransfer.connector.config import KVTransferConfig
from kvtransfer.connector.factory import KVConnectorFactory
from kvtransfer.connector.kv_groups import BlockIds, as_block_ids
from kvtransfer.connector.metadata import (
    KVCacheLayout,
    KVConnectorHandshakeMetadata,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorStats,
    KVRequest,
    PpTpRank,
)
from kvtransfer.connector.serving import KVControlEndpoint, KVTransferTotals

if TYPE_CHECKING:
    import torch

    from kvtransfer.connector.outputs import KVConnectorOutput

logger = logging.getLogger(__name__)

_INHERITED_KEYS = ("engine_id", "kv_role", "kv_buffer_device", "kv_load_failure_policy")

# The kv_transfer_params key under which every child but the first keeps its params.
CHILD_PARAMS_KEY = "multi_connector"


@dataclass
class MultiKVConnectorMetadata(KVConnectorMetadata):
    per_child: tuple[KVConnectorMetadata, ...]
    # Requests saved by more than one child: how many extra finished_sending reports to absorb.
    extra_async_saves: dict[str, int] = field(default_factory=dict)


class MultiKVConnectorHandshakeMetadata(KVConnectorHandshakeMetadata):
    """One worker's payloads, one slot per child (``None`` where a child publishes nothing)."""

    per_child: tuple[dict[str, Any] | None, ...]


class MultiKVConnectorStats(KVConnectorStats):
    """Children's stats, keyed by child index and class name (``"0:UcxConnector"``)."""

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        merged = dict(self.data)
        for key, value in other.data.items():
            merged[key] = (
                KVConnectorStats(data=merged[key]).aggregate(KVConnectorStats(data=value)).data
                if key in merged
                else value
            )
        return MultiKVConnectorStats(data=merged)

    def reduce(self) -> dict[str, float]:
        return {
            f"{child}.{name}": number
            for child, data in self.data.items()
            for name, number in KVConnectorStats(data=data).reduce().items()
        }


def child_slot(index: int, child: KVConnectorBase_V1) -> str:
    """A child's key in params and stats: its position and class, so that an engine whose
    children differ from its peer's ignores params it cannot read."""
    return f"{index}:{type(child).__name__}"


class _ChildRequest:
    """A request as one child sees it: its own ``kv_transfer_params``; everything else is read
    live from the engine's request (connectors may keep it and read its progress later)."""

    def __init__(self, request: KVRequest, params: Mapping[str, Any] | None) -> None:
        self._request = request
        self.kv_transfer_params = params

    @property
    def request_id(self) -> str:
        return self._request.request_id

    @property
    def prompt_token_ids(self) -> Sequence[int]:
        return self._request.prompt_token_ids

    @property
    def num_tokens(self) -> int:
        return self._request.num_tokens

    def __getattr__(self, name: str) -> Any:
        # Attributes beyond `KVRequest` (num_computed_tokens...) are the engine request's.
        return getattr(self._request, name)


@dataclass(frozen=True)
class _Admission:
    """What the latest `get_num_new_matched_tokens` of a request decided."""

    chosen: int
    num_computed_tokens: int
    # Children that could load the same tokens asynchronously too, in order.
    fallbacks: tuple[int, ...]


@dataclass
class _Load:
    """An asynchronous load with fallbacks left, until its report reaches the scheduler."""

    request: KVRequest
    block_ids: tuple[int, ...]
    num_computed_tokens: int
    num_external_tokens: int
    child: int
    fallbacks: tuple[int, ...]
    # The request finished (aborted) while loading: its outcome goes to the engine as is.
    request_finished: bool = False
    # Load errors reported for its blocks, held back until the load's outcome is known.
    withheld_block_ids: set[int] = field(default_factory=set)


class MultiConnector(KVConnectorBase_V1, SupportsHMA):
    """Follows hybrid KV caches (`SupportsHMA`) exactly when every child does: an engine
    whose layout has several KV cache groups refuses it, naming the child, otherwise."""

    handshake_metadata_cls = MultiKVConnectorHandshakeMetadata

    def __init__(
        self,
        config: KVTransferConfig,
        role: KVConnectorRole,
        kv_cache_config: Any | None = None,
    ) -> None:
        super().__init__(config, role, kv_cache_config)
        children = config.get_from_extra_config("connectors")
        if not isinstance(children, list) or not children:
            raise ValueError(
                "MultiConnector needs kv_connector_extra_config.connectors: a non-empty list of "
                f"kv_transfer_config objects, got {children!r}"
            )
        self._connectors: list[KVConnectorBase_V1] = []
        try:
            for index, raw in enumerate(children):
                if not isinstance(raw, dict):
                    raise ValueError(
                        f"kv_connector_extra_config.connectors[{index}] must be an object, "
                        f"got {type(raw).__name__}"
                    )
                inherited = {k: getattr(config, k) for k in _INHERITED_KEYS if k not in raw}
                child_config = KVTransferConfig.from_dict({**raw, **inherited})
                self._connectors.append(
                    KVConnectorFactory.create_connector(child_config, role, kv_cache_config)
                )
            self._num_groups = (
                kv_cache_config.num_groups if isinstance(kv_cache_config, KVCacheLayout) else 1
            )
            unfit = [
                child_slot(i, c) for i, c in enumerate(self._connectors) if not supports_hma(c)
            ]
            if self._num_groups > 1 and unfit:
                raise ValueError(
                    f"MultiConnector child {', '.join(unfit)} follows one KV cache group (it "
                    f"is not SupportsHMA); this model has {self._num_groups}"
                )
        except BaseException:
            self.shutdown()
            raise
        # Scheduler side: the child chosen to load each request, until its blocks come.
        self._admissions: dict[str, _Admission] = {}
        # Scheduler side: loads in flight that another child could redo if they fail.
        self._loads: dict[str, _Load] = {}
        # Scheduler side: requests a child was chosen to load, until they finish.
        self._loaded: set[str] = set()
        self._wake: Callable[[], None] | None = None
        # Scheduler side: extra saves decided since the last build_connector_meta.
        self._new_extra_saves: dict[str, int] = {}
        # Worker side: extra finished_sending reports still to absorb.
        self._extra_async_saves: dict[str, int] = {}

    @property
    def connectors(self) -> tuple[KVConnectorBase_V1, ...]:
        return tuple(self._connectors)

    def follows_kv_groups(self) -> bool:
        return all(supports_hma(child) for child in self._connectors)

    def _blocks_for(self, child: KVConnectorBase_V1, block_ids: Sequence[Any]) -> Any:
        """``block_ids`` (a flat list, or one list per group) as ``child`` takes them: a child
        that follows one group gets that group's flat list."""
        if supports_hma(child):
            return block_ids
        return list(as_block_ids(block_ids, 1)[0])

    def _no_blocks(self, child: KVConnectorBase_V1) -> Any:
        return tuple(() for _ in range(self._num_groups)) if supports_hma(child) else ()

    @classmethod
    def supports_sleep_mode(cls, kv_transfer_config: KVTransferConfig) -> bool:
        # Only if every child follows a sleep; a malformed child list is refused at creation.
        children = kv_transfer_config.get_from_extra_config("connectors")
        if not isinstance(children, list) or not children:
            return False
        for raw in children:
            if not isinstance(raw, dict):
                return False
            inherited = {k: getattr(kv_transfer_config, k) for k in _INHERITED_KEYS if k not in raw}
            child = KVTransferConfig.from_dict({**raw, **inherited})
            if not KVConnectorFactory.get_connector_class(child).supports_sleep_mode(child):
                return False
        return True

    def unregister_kv_caches(self) -> None:
        self._sleep_hook("unregister_kv_caches")

    def restore_kv_caches(self) -> None:
        self._sleep_hook("restore_kv_caches")

    def _sleep_hook(self, hook: str) -> None:
        """``hook`` on every child in order, even after one raised: a child skipped by
        `unregister_kv_caches` would keep serving memory a host may free next, and one skipped
        by `restore_kv_caches` would stay unregistered. Both hooks are idempotent, so the host
        may call them again; the first child's error is raised once all were asked."""
        errors: list[Exception] = []
        for index, child in enumerate(self._connectors):
            try:
                getattr(child, hook)()
            except Exception as exc:
                if errors:  # only the first is raised: the others are logged
                    logger.error(
                        "MultiConnector: %s of child %s failed too: %s: %s",
                        hook,
                        child_slot(index, child),
                        type(exc).__name__,
                        exc,
                    )
                errors.append(exc)
        if errors:
            raise errors[0]

    # ------------------------------------------------------------------ worker side

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        for child in self._connectors:
            child.register_kv_caches(kv_caches)

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        if not isinstance(connector_metadata, MultiKVConnectorMetadata):
            raise TypeError(
                f"MultiConnector expects MultiKVConnectorMetadata, got {type(connector_metadata)}"
            )
        super().bind_connector_metadata(connector_metadata)
        for name, count in connector_metadata.extra_async_saves.items():
            self._extra_async_saves[name] = self._extra_async_saves.get(name, 0) + count
        for child, child_metadata in zip(
            self._connectors, connector_metadata.per_child, strict=True
        ):
            child.bind_connector_metadata(child_metadata)

    def clear_connector_metadata(self) -> None:
        super().clear_connector_metadata()
        for child in self._connectors:
            child.clear_connector_metadata()

    def has_connector_metadata(self) -> bool:
        return super().has_connector_metadata()

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        for child in self._connectors:
            child.start_load_kv(forward_context, **kwargs)

    def wait_for_layer_load(self, layer_name: str) -> None:
        for child in self._connectors:
            child.wait_for_layer_load(layer_name)

    def save_kv_layer(
        self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any
    ) -> None:
        for child in self._connectors:
            child.save_kv_layer(layer_name, kv_layer, attn_metadata, **kwargs)

    def wait_for_save(self) -> None:
        for child in self._connectors:
            child.wait_for_save()

    def get_finished(self, finished_req_ids: set[str]) -> FinishedIds:
        sending, recving, _ = self.get_transfer_results(finished_req_ids)
        return sending, recving

    def get_transfer_results(self, finished_req_ids: set[str]) -> TransferResults:
        sending: set[str] = set()
        recving: set[str] = set()
        failed: set[str] = set()
        for child in self._connectors:
            child_sending, child_recving, child_failed = child.get_transfer_results(
                finished_req_ids
            )
            sending |= self._absorb_extra_saves(child_sending or ())
            recving |= child_recving or set()
            failed |= child_failed or set()
        return sending or None, (recving | failed) or None, failed or None

    def set_completion_callback(self, callback: Callable[[], None]) -> bool:
        # A fallback load is started between steps' reports: the next step must send it.
        self._wake = callback
        # Every child is asked (each may call it); polling is needed if any child would not.
        answers = [child.set_completion_callback(callback) for child in self._connectors]
        return all(answers)

    def get_load_failure_reasons(self) -> dict[str, str]:
        reasons: dict[str, str] = {}
        for child in self._connectors:
            for req_id, reason in child.get_load_failure_reasons().items():
                reasons.setdefault(req_id, reason)
        return reasons

    def get_block_ids_with_load_errors(self) -> set[int]:
        errors: set[int] = set()
        for child in self._connectors:
            errors |= child.get_block_ids_with_load_errors()
        return errors

    def get_handshake_metadata(self) -> KVConnectorHandshakeMetadata | None:
        per_child = [child.get_handshake_metadata() for child in self._connectors]
        if all(md is None for md in per_child):
            return None
        return MultiKVConnectorHandshakeMetadata(
            per_child=tuple(None if md is None else md.model_dump(mode="json") for md in per_child)
        )

    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        data = {}
        for index, child in enumerate(self._connectors):
            stats = child.get_kv_connector_stats()
            if stats is not None and not stats.is_empty():
                data[f"{index}:{type(child).__name__}"] = stats.data
        return MultiKVConnectorStats(data=data) if data else None

    def shutdown(self) -> None:
        errors = []
        for child in self._connectors:
            try:
                child.shutdown()
            except Exception as exc:  # one child's failure must not leak the others
                errors.append(exc)
        if errors:
            raise errors[0]

    # --------------------------------------------------------------- scheduler side

    def validate_kv_transfer_params(self, params: Mapping[str, Any] | None) -> None:
        for index, child in enumerate(self._connectors):
            child.validate_kv_transfer_params(self._child_params(params, index))

    def release_kv(self, kv_transfer_params: Mapping[str, Any]) -> bool:
        # Every child with params is asked: the KV may be held by any of them, or by several.
        released = False
        for index, child in enumerate(self._connectors):
            params = self._child_params(kv_transfer_params, index)
            if params is not None:
                released |= child.release_kv(params)
        return released

    def get_num_new_matched_tokens(
        self, request: KVRequest, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        rid = request.request_id
        self._admissions.pop(rid, None)
        answers: list[tuple[int, bool]] = []
        for index, child in enumerate(self._connectors):
            view = self._child_request(request, index)
            num_tokens, load_async = child.get_num_new_matched_tokens(view, num_computed_tokens)
            if num_tokens is None:
                # One child still looking means the whole answer is not known yet.
                return None, False
            answers.append((num_tokens, load_async))
        chosen = next((i for i, (num, _) in enumerate(answers) if num > 0), None)
        if chosen is None or rid in self._loaded:
            # Loaded once already (now preempted): it recomputes, as with one connector,
            # rather than trying a child that did not load it the first time.
            return 0, False
        num_tokens, load_async = answers[chosen]
        fallbacks = tuple(
            index
            for index, (num, is_async) in enumerate(answers)
            if index > chosen and load_async and is_async and num >= num_tokens
        )
        self._admissions[rid] = _Admission(chosen, num_computed_tokens, fallbacks)
        return num_tokens, load_async

    def update_state_after_alloc(
        self, request: KVRequest, block_ids: Sequence[int], num_external_tokens: int
    ) -> None:
        admission = self._admissions.pop(request.request_id, None)
        chosen = admission.chosen if admission is not None else None
        for index, child in enumerate(self._connectors):
            view = self._child_request(request, index)
            if index == chosen:
                blocks = self._blocks_for(child, block_ids)
                child.update_state_after_alloc(view, blocks, num_external_tokens)
            else:
                child.update_state_after_alloc(view, self._no_blocks(child), 0)
        if chosen is not None and num_external_tokens > 0:
            self._loaded.add(request.request_id)
        if admission is not None and admission.fallbacks and num_external_tokens > 0:
            self._loads[request.request_id] = _Load(
                request=request,
                block_ids=tuple(block_ids),
                num_computed_tokens=admission.num_computed_tokens,
                num_external_tokens=num_external_tokens,
                child=admission.chosen,
                fallbacks=admission.fallbacks,
            )

    def build_connector_meta(self, scheduler_output: Any) -> KVConnectorMetadata:
        metadata = MultiKVConnectorMetadata(
            per_child=tuple(c.build_connector_meta(scheduler_output) for c in self._connectors),
            extra_async_saves=self._new_extra_saves,
        )
        self._new_extra_saves = {}
        return metadata

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        # Extra saves were already absorbed on every worker, before the reports were counted.
        # Each child sees its own stats and every id (a failed load included: it must learn
        # its load ended); then failed loads with a fallback are taken out for the engine.
        for index, child in enumerate(self._connectors):
            child.update_connector_output(self._child_output(connector_output, index))
        self._retry_failed_loads(connector_output)

    def request_finished(
        self, request: KVRequest, block_ids: Sequence[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        return self.request_finished_all_groups(request, as_block_ids(block_ids, 1))

    def request_finished_all_groups(
        self, request: KVRequest, block_ids: BlockIds
    ) -> tuple[bool, dict[str, Any] | None]:
        rid = request.request_id
        self._admissions.pop(rid, None)
        self._loaded.discard(rid)
        load = self._loads.get(rid)
        if load is not None:
            load.request_finished = True
        num_saving = 0
        per_child: list[dict[str, Any] | None] = []
        for index, child in enumerate(self._connectors):
            view = self._child_request(request, index)
            if supports_hma(child):
                delay_free, child_params = child.request_finished_all_groups(view, block_ids)
            else:
                delay_free, child_params = child.request_finished(view, list(block_ids[0]))
            num_saving += bool(delay_free)
            per_child.append(child_params)
        if num_saving > 1:
            self._new_extra_saves[rid] = num_saving - 1
        return num_saving > 0, self._merge_params(per_child)

    def take_early_kv_transfer_params(self) -> dict[str, dict[str, Any]]:
        # Announced when the first child announces: its params decide where a consumer
        # starts; other children's early params for the same request join them.
        per_child = [child.take_early_kv_transfer_params() for child in self._connectors]
        early: dict[str, dict[str, Any]] = {}
        for rid in per_child[0]:
            merged = self._merge_params([params.get(rid) for params in per_child])
            if merged is not None:
                early[rid] = merged
        return early

    # ------------------------------------------------------------ what a host reads

    def get_control_endpoint(self) -> KVControlEndpoint | None:
        # A daemon port serves one engine's book: the first child's that has one.
        for child in self._connectors:
            endpoint = child.get_control_endpoint()
            if endpoint is not None:
                return endpoint
        return None

    def get_transfer_totals(self) -> KVTransferTotals | None:
        return KVTransferTotals.sum([child.get_transfer_totals() for child in self._connectors])

    def take_events(self) -> Iterable[Any]:
        for child in self._connectors:
            yield from child.take_events()

    def get_finished_count(self) -> int | None:
        counts = {c.get_finished_count() for c in self._connectors} - {None}
        if len(counts) > 1:
            raise ValueError(
                f"MultiConnector children disagree on get_finished_count(): {sorted(counts)}"
            )
        return counts.pop() if counts else None

    def set_xfer_handshake_metadata(
        self, metadata: dict[int, KVConnectorHandshakeMetadata]
    ) -> None:
        self.set_xfer_handshake_metadata_pp_aware({(0, tp): md for tp, md in metadata.items()})

    def set_xfer_handshake_metadata_pp_aware(
        self, metadata: Mapping[PpTpRank, KVConnectorHandshakeMetadata]
    ) -> None:
        """Every child gets the full ``(pp, tp)`` key set; each applies its own default (and so
        rejects PP if it cannot do it) or override. Payloads published by this class are split
        back into each child's own."""
        for index, child in enumerate(self._connectors):
            child.set_xfer_handshake_metadata_pp_aware(
                {rank: _child_payload(md, index, child) for rank, md in metadata.items()}
            )

    # ------------------------------------------------------------------ helpers

    def _child_params(
        self, params: Mapping[str, Any] | None, index: int
    ) -> Mapping[str, Any] | None:
        """Child ``index``'s share of ``params`` (see the module docstring); `ValueError`
        naming the key when the reserved key does not hold objects."""
        if params is None or CHILD_PARAMS_KEY not in params:
            return params
        if index == 0:
            own = {key: value for key, value in params.items() if key != CHILD_PARAMS_KEY}
            return own or None
        nested = params[CHILD_PARAMS_KEY]
        if not isinstance(nested, Mapping):
            raise ValueError(
                f"kv_transfer_params.{CHILD_PARAMS_KEY} must be an object, got "
                f"{type(nested).__name__}"
            )
        slot = child_slot(index, self._connectors[index])
        child_params = nested.get(slot)
        if child_params is not None and not isinstance(child_params, Mapping):
            raise ValueError(
                f"kv_transfer_params.{CHILD_PARAMS_KEY}.{slot} must be an object, got "
                f"{type(child_params).__name__}"
            )
        return child_params or None

    def _child_request(self, request: KVRequest, index: int) -> KVRequest:
        params = request.kv_transfer_params
        if params is None or CHILD_PARAMS_KEY not in params:
            return request  # shared params: every child sees the request itself
        return _ChildRequest(request, self._child_params(params, index))

    def _merge_params(self, per_child: Sequence[dict[str, Any] | None]) -> dict[str, Any] | None:
        """The first child's params at the top level, the others' under `CHILD_PARAMS_KEY`."""
        if all(params is None for params in per_child):
            return None
        first = dict(per_child[0] or {})
        if CHILD_PARAMS_KEY in first:
            raise ValueError(
                f"MultiConnector: {type(self._connectors[0]).__name__} returned "
                f"kv_transfer_params key {CHILD_PARAMS_KEY!r}, which MultiConnector reserves "
                "for its other children's params"
            )
        first[CHILD_PARAMS_KEY] = {
            child_slot(index, self._connectors[index]): params
            for index, params in enumerate(per_child)
            if index > 0 and params is not None
        }
        return first

    def _child_output(self, output: KVConnectorOutput, index: int) -> KVConnectorOutput:
        """``output`` with child ``index``'s own stats (the id sets are shared, not copied)."""
        stats = output.kv_connector_stats
        if not isinstance(stats, MultiKVConnectorStats):
            return output
        data = stats.data.get(child_slot(index, self._connectors[index]))
        own = None if data is None else KVConnectorStats(data=data)
        return replace(output, kv_connector_stats=own)

    def _retry_failed_loads(self, output: KVConnectorOutput) -> None:
        """Start the next fallback of every failed load that has one, and hide that failure
        from the engine (its blocks stay lent until the new load is reported)."""
        if not self._loads:
            return
        invalid = set(output.invalid_block_ids or ())
        for load in self._loads.values():
            # Settled with the load's outcome: dropped if another child loads them again.
            held = invalid.intersection(load.block_ids)
            load.withheld_block_ids |= held
            invalid -= held
        finished = set(output.finished_recving or ())
        failed = set(output.failed_recving or ())
        reasons = dict(output.load_failure_reasons or {})
        retried = False
        for rid in sorted(finished.intersection(self._loads)):
            load = self._loads.pop(rid)
            retry = None
            if rid in failed and not load.request_finished:
                retry = self._start_fallback(load, reasons.get(rid))
            if retry is None:
                invalid |= load.withheld_block_ids
                continue
            self._loads[rid] = retry
            finished.discard(rid)
            failed.discard(rid)
            reasons.pop(rid, None)
            retried = True
        output.invalid_block_ids = invalid or None
        output.finished_recving = finished or None
        output.failed_recving = failed or None
        output.load_failure_reasons = reasons or None
        if retried and self._wake is not None:
            self._wake()

    def _start_fallback(self, load: _Load, reason: str | None) -> _Load | None:
        """Have the next fallback child that still can load ``load``'s tokens into its blocks;
        the new load, or ``None`` when no child can."""
        failed_child = type(self._connectors[load.child]).__name__
        for position, index in enumerate(load.fallbacks):
            child = self._connectors[index]
            view = self._child_request(load.request, index)
            try:
                num_tokens, load_async = child.get_num_new_matched_tokens(
                    view, load.num_computed_tokens
                )
                if num_tokens is None or num_tokens < load.num_external_tokens or not load_async:
                    continue
                blocks = self._blocks_for(child, load.block_ids)
                child.update_state_after_alloc(view, blocks, load.num_external_tokens)
            except (ValueError, RuntimeError, OSError) as exc:
                logger.warning(
                    "request %s: %s cannot load it after %s failed: %s",
                    load.request.request_id,
                    type(child).__name__,
                    failed_child,
                    exc,
                )
                continue
            logger.warning(
                "request %s: loading its KV through %s failed (%s); loading it from %s",
                load.request.request_id,
                failed_child,
                reason or "no reason given",
                type(child).__name__,
            )
            return replace(
                load,
                child=index,
                fallbacks=load.fallbacks[position + 1 :],
                withheld_block_ids=set(),
            )
        return None

    def _absorb_extra_saves(self, req_ids: Iterable[str]) -> set[str]:
        """Drop reports that are not the last one expected for a request saved by several
        children; the last report passes through."""
        passed = set()
        for req_id in req_ids:
            extra = self._extra_async_saves.get(req_id, 0)
            if extra == 0:
                passed.add(req_id)
            elif extra == 1:
                del self._extra_async_saves[req_id]
            else:
                self._extra_async_saves[req_id] = extra - 1
        return passed


def _child_payload(
    md: KVConnectorHandshakeMetadata, index: int, child: KVConnectorBase_V1
) -> KVConnectorHandshakeMetadata:
    if not isinstance(md, MultiKVConnectorHandshakeMetadata):
        return md
    raw = md.per_child[index]
    if raw is None:
        return KVConnectorHandshakeMetadata()
    return child.handshake_metadata_cls.model_validate(raw)
