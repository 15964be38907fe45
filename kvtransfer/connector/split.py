"""`RoleSplitConnector`: the facade in front of a connector's scheduler half and worker half.

`KVConnectorBase_V1` is one class instantiated in two roles whose instances never share memory,
so a connector whose two roles share no code reads best as two plain classes, a scheduler half
and a worker half, behind a thin `KVConnectorBase_V1` subclass. That facade is the same for every
such connector (`SharedStorageConnector`, `UcxConnector`), so it lives here once:

* it builds exactly one half, chosen by role (`_build_half`);
* it forwards every hook to that half; a hook of the other role raises `RuntimeError` naming
  the connector, the hook and this instance's role;
* it accepts only the connector's own `metadata_cls` in `bind_connector_metadata` (or the plain
  `KVConnectorMetadata` the engine binds when the scheduler built none, which the worker half
  then sees as an empty `metadata_cls()`);
* `get_finished` is `get_transfer_results` without the failures (a failed receive is a finished
  one; its blocks still go to the load-error list);
* the handshake is PP-aware: every ``(pp_rank, tp_rank)`` payload goes to the scheduler half;
* what a host reads (`get_control_endpoint`, `get_transfer_totals`) comes from the scheduler
  half, and is ``None`` on a worker-role instance.

Whole requests are loaded before they are scheduled and saved (or served) after they finished,
so nothing happens per layer: `wait_for_layer_load`, `save_kv_layer` and `wait_for_save` keep the
base class's no-ops.

A subclass sets `connector_name`, `metadata_cls` and `handshake_metadata_cls`, validates its
configuration in ``__init__`` after ``super().__init__``, and then calls `_build_half`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, ClassVar, Generic, Protocol, TypeVar

from kvtransfer.connector.base import FinishedIds, KVConnectorBase_V1, TransferResults
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


class SchedulerHalf(Protocol):
    """What `RoleSplitConnector` calls on the scheduler-role half."""

    def set_handshake(self, metadata: Mapping[PpTpRank, KVConnectorHandshakeMetadata]) -> None: ...

    def validate_kv_transfer_params(self, params: Mapping[str, Any] | None) -> None: ...

    def release_kv(self, kv_transfer_params: Mapping[str, Any]) -> bool: ...

    def get_num_new_matched_tokens(
        self, request: KVRequest, num_computed_tokens: int
    ) -> tuple[int | None, bool]: ...

    def update_state_after_alloc(
        self, request: KVRequest, block_ids: Sequence[int], num_external_tokens: int
    ) -> None: ...

    def build_connector_meta(self, scheduler_output: Any) -> KVConnectorMetadata: ...

    def update_connector_output(self, output: KVConnectorOutput) -> None: ...

    def request_finished(
        self, request: KVRequest, block_ids: Sequence[int]
    ) -> tuple[bool, dict[str, Any] | None]: ...

    def set_completion_callback(self, callback: Callable[[], None]) -> bool: ...

    def take_early_kv_transfer_params(self) -> dict[str, dict[str, Any]]: ...

    def control_endpoint(self) -> KVControlEndpoint | None: ...

    def transfer_totals(self) -> KVTransferTotals | None: ...


class WorkerHalf(Protocol):
    """What `RoleSplitConnector` calls on the worker-role half."""

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None: ...

    # ``metadata`` is always an instance of the connector's `metadata_cls`.
    def start_load_kv(self, metadata: Any) -> None: ...

    def transfer_results(self, finished_req_ids: Iterable[str]) -> TransferResults: ...

    def load_failure_reasons(self) -> dict[str, str]: ...

    def set_completion_callback(self, callback: Callable[[], None]) -> bool: ...

    def block_ids_with_load_errors(self) -> set[int]: ...

    def handshake_metadata(self) -> KVConnectorHandshakeMetadata | None: ...

    def stats(self) -> KVConnectorStats | None: ...

    def shutdown(self) -> None: ...


S = TypeVar("S", bound=SchedulerHalf)
W = TypeVar("W", bound=WorkerHalf)


class RoleSplitConnector(KVConnectorBase_V1, Generic[S, W]):
    """A connector that is a scheduler half ``S`` or a worker half ``W``, by role."""

    # Used in error messages ("<connector_name>.<hook> is a worker hook; ...").
    connector_name: ClassVar[str]
    # The metadata the scheduler half builds and the worker half reads.
    metadata_cls: ClassVar[type[KVConnectorMetadata]]

    def __init__(
        self,
        config: KVTransferConfig,
        role: KVConnectorRole,
        kv_cache_config: Any | None = None,
    ) -> None:
        super().__init__(config, role, kv_cache_config)
        self._scheduler: S | None = None
        self._worker: W | None = None
        self._empty_metadata = self.metadata_cls()

    def _build_half(self, scheduler: Callable[[], S], worker: Callable[[], W]) -> None:
        """Build the half of this instance's role (only that factory is called)."""
        if self.role is KVConnectorRole.SCHEDULER:
            self._scheduler = scheduler()
        else:
            self._worker = worker()

    @property
    def scheduler_half(self) -> S:
        return self._scheduler_half("scheduler_half")

    @property
    def worker_half(self) -> W:
        return self._worker_half("worker_half")

    def _worker_half(self, hook: str) -> W:
        if self._worker is None:
            raise RuntimeError(
                f"{self.connector_name}.{hook} is a worker hook; this instance is the "
                f"{self.role.name} half"
            )
        return self._worker

    def _scheduler_half(self, hook: str) -> S:
        if self._scheduler is None:
            raise RuntimeError(
                f"{self.connector_name}.{hook} is a scheduler hook; this instance is the "
                f"{self.role.name} half"
            )
        return self._scheduler

    # ------------------------------------------------------------------ worker side

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self._worker_half("register_kv_caches").register_kv_caches(kv_caches)

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        # The engine binds a plain KVConnectorMetadata when the scheduler built none.
        if type(connector_metadata) is not KVConnectorMetadata and not isinstance(
            connector_metadata, self.metadata_cls
        ):
            raise TypeError(
                f"{self.connector_name} expects {self.metadata_cls.__name__}, got "
                f"{type(connector_metadata).__name__}"
            )
        super().bind_connector_metadata(connector_metadata)

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        metadata = self._get_connector_metadata()
        if not isinstance(metadata, self.metadata_cls):
            metadata = self._empty_metadata
        self._worker_half("start_load_kv").start_load_kv(metadata)

    def get_finished(self, finished_req_ids: set[str]) -> FinishedIds:
        sending, recving, _ = self.get_transfer_results(finished_req_ids)
        return sending, recving

    def get_transfer_results(self, finished_req_ids: set[str]) -> TransferResults:
        return self._worker_half("get_transfer_results").transfer_results(finished_req_ids)

    def get_load_failure_reasons(self) -> dict[str, str]:
        return self._worker_half("get_load_failure_reasons").load_failure_reasons()

    def set_completion_callback(self, callback: Callable[[], None]) -> bool:
        half: SchedulerHalf | WorkerHalf | None = self._worker or self._scheduler
        if half is None:
            raise RuntimeError(f"{type(self).__name__} has no half built")
        return half.set_completion_callback(callback)

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self._worker_half("get_block_ids_with_load_errors").block_ids_with_load_errors()

    def get_handshake_metadata(self) -> KVConnectorHandshakeMetadata | None:
        return self._worker_half("get_handshake_metadata").handshake_metadata()

    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        # An observing hook: hosts (vLLM) call it on the scheduler instance too, every step.
        return None if self._worker is None else self._worker.stats()

    def shutdown(self) -> None:
        if self._worker is not None:
            self._worker.shutdown()

    # --------------------------------------------------------------- scheduler side

    def validate_kv_transfer_params(self, params: Mapping[str, Any] | None) -> None:
        self._scheduler_half("validate_kv_transfer_params").validate_kv_transfer_params(params)

    def release_kv(self, kv_transfer_params: Mapping[str, Any]) -> bool:
        return self._scheduler_half("release_kv").release_kv(kv_transfer_params)

    def get_num_new_matched_tokens(
        self, request: KVRequest, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        half = self._scheduler_half("get_num_new_matched_tokens")
        return half.get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(
        self, request: KVRequest, block_ids: Sequence[int], num_external_tokens: int
    ) -> None:
        half = self._scheduler_half("update_state_after_alloc")
        half.update_state_after_alloc(request, block_ids, num_external_tokens)

    def build_connector_meta(self, scheduler_output: Any) -> KVConnectorMetadata:
        return self._scheduler_half("build_connector_meta").build_connector_meta(scheduler_output)

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        self._scheduler_half("update_connector_output").update_connector_output(connector_output)

    def take_early_kv_transfer_params(self) -> dict[str, dict[str, Any]]:
        half = self._scheduler_half("take_early_kv_transfer_params")
        return half.take_early_kv_transfer_params()

    def request_finished(
        self, request: KVRequest, block_ids: Sequence[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        return self._scheduler_half("request_finished").request_finished(request, block_ids)

    # Observing hooks: a host may ask either role; only the scheduler half has answers.

    def get_control_endpoint(self) -> KVControlEndpoint | None:
        return None if self._scheduler is None else self._scheduler.control_endpoint()

    def get_transfer_totals(self) -> KVTransferTotals | None:
        return None if self._scheduler is None else self._scheduler.transfer_totals()

    def set_xfer_handshake_metadata(
        self, metadata: dict[int, KVConnectorHandshakeMetadata]
    ) -> None:
        self.set_xfer_handshake_metadata_pp_aware({(0, tp): md for tp, md in metadata.items()})

    def set_xfer_handshake_metadata_pp_aware(
        self, metadata: Mapping[PpTpRank, KVConnectorHandshakeMetadata]
    ) -> None:
        """Hand every ``(pp_rank, tp_rank)`` worker's payload to the scheduler half (PP
        supported)."""
        self._scheduler_half("set_xfer_handshake_metadata_pp_aware").set_handshake(metadata)
