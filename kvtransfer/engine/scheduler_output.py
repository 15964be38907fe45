"""`SchedulerOutput`: the plain description of one step the scheduler hands every worker.

It is the only thing that crosses from the scheduler process to the workers each step. Workers
never count tokens on their own: ``num_computed_tokens`` here is authoritative and overwrites
the worker's mirror every step (so speculative rejections cannot make it drift), and every token
a worker needs arrives here (prompt with the request, later tokens in ``new_token_ids``).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

from kvtransfer.connector.metadata import KVConnectorMetadata
from kvtransfer.engine.sampling_params import SamplingParams

_EMPTY: Mapping = MappingProxyType({})


@dataclass(frozen=True)
class NewRequestData:
    """A request the workers have not seen (or must rebuild after preemption).

    ``token_ids`` is every known token (prompt then outputs so far); ``block_ids`` the whole
    block table (of KV cache group 0, the full-attention layers); ``window_block_ids`` one
    table per further group (a hybrid model's sliding-window layers), null blocks included.
    """

    req_id: str
    prompt_len: int
    token_ids: tuple[int, ...]
    sampling_params: SamplingParams
    seed: int
    block_ids: tuple[int, ...]
    num_computed_tokens: int
    window_block_ids: tuple[tuple[int, ...], ...] = ()


@dataclass(frozen=True)
class CachedRequestData:
    """A request the workers already hold: what changed since they last saw it.

    Entries a window gave back are not repeated: a sliding-window layer never reads them."""

    req_id: str
    new_token_ids: tuple[int, ...]
    new_block_ids: tuple[int, ...]
    num_computed_tokens: int
    new_window_block_ids: tuple[tuple[int, ...], ...] = ()


@dataclass(frozen=True)
class SchedulerOutput:
    scheduled_new_reqs: tuple[NewRequestData, ...] = ()
    scheduled_cached_reqs: tuple[CachedRequestData, ...] = ()
    # Tokens to compute this step per request, draft tokens included.
    num_scheduled_tokens: Mapping[str, int] = field(default_factory=lambda: _EMPTY)
    # Draft tokens to verify per request (their count is part of num_scheduled_tokens).
    scheduled_spec_decode_tokens: Mapping[str, tuple[int, ...]] = field(
        default_factory=lambda: _EMPTY
    )
    # Requests that finished (or were aborted) since the last step: workers drop their state.
    finished_req_ids: frozenset[str] = frozenset()
    # Requests preempted this step: workers drop their state; they come back as new requests.
    preempted_req_ids: frozenset[str] = frozenset()
    kv_connector_metadata: KVConnectorMetadata | None = None

    @property
    def total_num_scheduled_tokens(self) -> int:
        return sum(self.num_scheduled_tokens.values())
