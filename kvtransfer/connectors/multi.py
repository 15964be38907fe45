"""`MultiConnector`: several connectors behind one, e.g. UCX transfer plus a storage tier.

Configuration: ``kv_connector_extra_config = {"connectors": [child_config, ...]}`` where each
child is a ``kv_transfer_config`` object; a child inherits ``engine_id``, ``kv_role``,
``kv_buffer_device`` and ``kv_load_failure_policy`` from the parent unless it sets them.

Loads come from the first child (in order) that reports a hit; saves go to every child. A
request finishes sending only after the last child that is still saving it reports it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from kvtransfer.connector.base import FinishedIds, KVConnectorBase_V1, TransferResults
from kvtransfer.connector.config import KVTransferConfig
from kvtransfer.connector.factory import KVConnectorFactory
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

    from kvtransfer.connector.outputs import KVConnectorOutput

_INHERITED_KEYS = ("engine_id", "kv_role", "kv_buffer_device", "kv_load_failure_policy")


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


class MultiConnector(KVConnectorBase_V1):
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
        except BaseException:
            self.shutdown()
            raise
        # Scheduler side: which child serves each request's load.
        self._load_child: dict[str, int] = {}
        # Scheduler side: extra saves decided since the last build_connector_meta.
        self._new_extra_saves: dict[str, int] = {}
        # Worker side: extra finished_sending reports still to absorb.
        self._extra_async_saves: dict[str, int] = {}

    @property
    def connectors(self) -> tuple[KVConnectorBase_V1, ...]:
        return tuple(self._connectors)

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
        for child in self._connectors:
            child.validate_kv_transfer_params(params)

    def release_kv(self, kv_transfer_params: Mapping[str, Any]) -> bool:
        # Every child is asked: the KV may be held by any of them, or by several.
        released = [child.release_kv(kv_transfer_params) for child in self._connectors]
        return any(released)

    def get_num_new_matched_tokens(
        self, request: KVRequest, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        answer: tuple[int | None, bool] = (0, False)
        chosen: int | None = None
        for index, child in enumerate(self._connectors):
            num_tokens, load_async = child.get_num_new_matched_tokens(request, num_computed_tokens)
            if num_tokens is None:
                # One child still looking means the whole answer is not known yet.
                return None, False
            if chosen is None and num_tokens > 0:
                chosen, answer = index, (num_tokens, load_async)
        if chosen is None:
            self._load_child.pop(request.request_id, None)
        else:
            self._load_child[request.request_id] = chosen
        return answer

    def update_state_after_alloc(
        self, request: KVRequest, block_ids: Sequence[int], num_external_tokens: int
    ) -> None:
        chosen = self._load_child.get(request.request_id)
        for index, child in enumerate(self._connectors):
            if index == chosen:
                child.update_state_after_alloc(request, block_ids, num_external_tokens)
            else:
                child.update_state_after_alloc(request, (), 0)

    def build_connector_meta(self, scheduler_output: Any) -> KVConnectorMetadata:
        metadata = MultiKVConnectorMetadata(
            per_child=tuple(c.build_connector_meta(scheduler_output) for c in self._connectors),
            extra_async_saves=self._new_extra_saves,
        )
        self._new_extra_saves = {}
        return metadata

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        # Extra saves were already absorbed on every worker, before the reports were counted.
        for child in self._connectors:
            child.update_connector_output(connector_output)

    def request_finished(
        self, request: KVRequest, block_ids: Sequence[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        self._load_child.pop(request.request_id, None)
        num_saving = 0
        params: dict[str, Any] = {}
        owner: dict[str, str] = {}
        for child in self._connectors:
            delay_free, child_params = child.request_finished(request, block_ids)
            num_saving += bool(delay_free)
            for key, value in (child_params or {}).items():
                if key in params:
                    raise ValueError(
                        f"MultiConnector: kv_transfer_params key {key!r} returned by both "
                        f"{owner[key]} and {type(child).__name__}"
                    )
                params[key], owner[key] = value, type(child).__name__
        if num_saving > 1:
            self._new_extra_saves[request.request_id] = num_saving - 1
        return num_saving > 0, params or None

    def take_early_kv_transfer_params(self) -> dict[str, dict[str, Any]]:
        # The first child to stream a request gives its params (as for request_finished).
        early: dict[str, dict[str, Any]] = {}
        for child in self._connectors:
            for req_id, params in child.take_early_kv_transfer_params().items():
                early.setdefault(req_id, params)
        return early

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
