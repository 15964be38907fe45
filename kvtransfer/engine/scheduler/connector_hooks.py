"""`ConnectorHooks`: the scheduler's checked calls into a scheduler-role KV connector.

A connector is third-party code running inside the scheduler's step. A hook that raises, or
answers something impossible for a request, must fail only that request, not the engine: every
call here turns such a problem into `KVConnectorHookError` naming the connector, the hook and
the request, and the scheduler finishes that request with the message as its error.
`kvtransfer.engine.scheduler.scheduler` re-exports `KVConnectorHookError`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, TypeVar

from kvtransfer.connector.base import KVConnectorBase_V1, supports_hma
from kvtransfer.engine.scheduler.request import Request

T = TypeVar("T")


class KVConnectorHookError(RuntimeError):
    """A scheduler-role connector hook raised or answered something impossible for a request;
    only that request fails."""


class ConnectorHooks:
    """Wraps one scheduler-role connector; each method raises `KVConnectorHookError`."""

    def __init__(self, connector: KVConnectorBase_V1) -> None:
        self.connector = connector
        self._name = type(connector).__name__

    def get_num_new_matched_tokens(
        self, request: Request, num_local: int
    ) -> tuple[int | None, bool]:
        """``(num_external_tokens, load_kv_async)``; ``None`` tokens mean "ask again later"."""
        answer = self._guard(request, self.connector.get_num_new_matched_tokens, request, num_local)
        if not (isinstance(answer, tuple) and len(answer) == 2):
            raise KVConnectorHookError(
                f"KV connector {self._name}.get_num_new_matched_tokens returned {answer!r} for "
                f"request {request.request_id}, expected (num_external_tokens, load_kv_async)"
            )
        num_external, load_async = answer
        if num_external is None:
            return None, bool(load_async)
        allowed = request.num_tokens - num_local
        if isinstance(num_external, bool) or not isinstance(num_external, int):
            raise KVConnectorHookError(
                f"KV connector {self._name}.get_num_new_matched_tokens returned non-int "
                f"{num_external!r} external tokens for request {request.request_id}"
            )
        if not 0 <= num_external <= allowed:
            raise KVConnectorHookError(
                f"KV connector {self._name} offered {num_external} external tokens for request "
                f"{request.request_id}, but only {allowed} of its {request.num_tokens} tokens "
                f"are not cached locally ({num_local} are)"
            )
        return num_external, bool(load_async)

    def update_state_after_alloc(
        self, request: Request, block_ids: Sequence[Sequence[int]], num_external: int
    ) -> None:
        """``block_ids``: one table per KV cache group; a `SupportsHMA` connector gets them
        all, any other only group 0's (the engine refuses such a connector for a hybrid
        model)."""
        self._guard(
            request,
            self.connector.update_state_after_alloc,
            request,
            self._as_connector_sees(block_ids),
            num_external,
        )

    def request_finished(
        self, request: Request, block_ids: Sequence[Sequence[int]]
    ) -> tuple[bool, Any]:
        """``(delay_free, kv_transfer_params)``. A `SupportsHMA` connector is asked through
        `request_finished_all_groups` with every group's table, as vLLM does."""
        if supports_hma(self.connector):
            hook = self.connector.request_finished_all_groups
            answer = self._guard(request, hook, request, self._as_connector_sees(block_ids))
        else:
            answer = self._guard(
                request, self.connector.request_finished, request, list(block_ids[0])
            )
        if not (isinstance(answer, tuple) and len(answer) == 2):
            raise KVConnectorHookError(
                f"KV connector {self._name}.request_finished returned {answer!r} for request "
                f"{request.request_id}, expected (delay_free, kv_transfer_params)"
            )
        return bool(answer[0]), answer[1]

    def _as_connector_sees(self, block_ids: Sequence[Sequence[int]]) -> Any:
        if supports_hma(self.connector):
            return tuple(tuple(group) for group in block_ids)
        return list(block_ids[0])

    def _guard(self, request: Request, hook: Callable[..., T], *args: Any) -> T:
        """Call ``hook`` (a bound method of the connector) for ``request``."""
        try:
            return hook(*args)
        except Exception as exc:
            raise KVConnectorHookError(
                f"KV connector {self._name}.{hook.__name__} raised for request "
                f"{request.request_id}: {type(exc).__name__}: {exc}"
            ) from exc
