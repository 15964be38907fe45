"""`KVTransferState`: the scheduler's record of KV transfers in flight, and what their results
do to requests and blocks.

It tracks two things the rest of the scheduler need not know about:

* loads in flight: requests parked WAITING_FOR_REMOTE_KVS while a connector loads their KV
  asynchronously into blocks they already hold;
* borrows: blocks of *finished* requests that a load (``recv``) or a delayed-free save
  (``send``) still uses. They stay allocated, keyed by the request id, until the matching
  ``finished_recving``/``finished_sending`` report.

`apply_connector_output` turns one step's `KVConnectorOutput` into request state: it applies
``kv_load_failure_policy`` to invalid blocks and failed loads, and hands finished loads back
for scheduling. Finishing a request stays the scheduler's job, so failures go through the
``fail`` callback the scheduler passes in, in report order.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

from kvtransfer.connector.config import KVLoadFailurePolicy
from kvtransfer.connector.outputs import KVConnectorOutput
from kvtransfer.engine.scheduler.block_manager import BlockManager
from kvtransfer.engine.scheduler.request import EngineCoreOutput, KVLoad, Request, RequestStatus
from kvtransfer.timeline import BOOK, wall_clock

_RECV = "recv"
_SEND = "send"

# Finishes ``request`` with ``error`` as FINISHED_ERROR and returns its final output.
FailRequest = Callable[[Request, str], EngineCoreOutput]


@dataclass
class ConnectorResults:
    """What one step's connector output did, for the scheduler to act on."""

    # Final outputs of the requests the "fail" policy finished, in the order they failed.
    outputs: list[EngineCoreOutput] = field(default_factory=list)
    # Running requests reset for recompute: their KV is garbage, so this step's sample is too.
    reset_ids: set[str] = field(default_factory=set)
    # Requests whose load ended (WAITING again, holding blocks), in arrival order.
    resumed: list[Request] = field(default_factory=list)


class KVTransferState:
    """Loads in flight and block borrows of one scheduler (see the module docstring)."""

    def __init__(
        self, block_manager: BlockManager, load_failure_policy: KVLoadFailurePolicy
    ) -> None:
        self.block_manager = block_manager
        self.load_failure_policy = load_failure_policy
        self._loading: dict[str, Request] = {}
        # Finished request id -> borrows ("recv"/"send") still keeping its blocks.
        self._borrows: dict[str, set[str]] = {}

    def has_borrows(self) -> bool:
        return bool(self._borrows)

    def is_borrowed(self, request_id: str) -> bool:
        """Whether a finished request's blocks are still lent to the connector."""
        return request_id in self._borrows

    # ------------------------------------------------------------------ request lifecycle

    def start_load(self, request: Request, num_external: int) -> None:
        """Park ``request``, which holds its blocks, while ``num_external`` tokens load."""
        request.kv_load = KVLoad(num_external, time.monotonic(), request.awaits_generated)
        request.status = RequestStatus.WAITING_FOR_REMOTE_KVS
        self._loading[request.request_id] = request

    def forget_load(self, request_id: str) -> None:
        """The loading request finished early; its blocks wait for `release_finished`."""
        self._loading.pop(request_id, None)

    def release_finished(self, request_id: str, *, loading: bool, saving: bool) -> None:
        """Free a finished request's blocks, or lend them while its load (``loading``) or its
        delayed-free save (``saving``) still uses them."""
        borrows = set()
        if loading:
            borrows.add(_RECV)
        if saving:
            borrows.add(_SEND)
        if borrows and self.block_manager.holds_blocks(request_id):
            self._borrows[request_id] = borrows
        else:
            self.block_manager.free(request_id)

    # ------------------------------------------------------------------ connector output

    def apply_connector_output(
        self, kv_out: KVConnectorOutput, running: Sequence[Request], fail: FailRequest
    ) -> ConnectorResults:
        """Act on invalid blocks, finished/failed loads and finished saves, in that order."""
        results = ConnectorResults()
        self._apply_invalid_blocks(kv_out.invalid_block_ids or set(), running, fail, results)
        self._apply_finished_recving(
            kv_out.finished_recving or set(),
            kv_out.failed_recving or set(),
            kv_out.load_failure_reasons or {},
            fail,
            results,
        )
        for rid in kv_out.finished_sending or ():
            self._release_borrow(rid, _SEND)
        return results

    def _apply_invalid_blocks(
        self,
        invalid: set[int],
        running: Sequence[Request],
        fail: FailRequest,
        results: ConnectorResults,
    ) -> None:
        """Apply the load-failure policy to running requests holding invalid blocks; flag
        in-flight loads, which act on it when they finish."""
        if not invalid:
            return
        bm = self.block_manager
        bm.evict_blocks(sorted(invalid))
        for request in self._loading.values():
            if request.kv_load is not None and invalid.intersection(
                bm.get_block_ids(request.request_id)
            ):
                request.kv_load.failed = True
        # A copy: failing a request removes it from the scheduler's running list.
        for request in list(running):
            table = bm.get_block_ids(request.request_id)
            bad = [i for i, b in enumerate(table) if b in invalid]
            if not bad:
                continue
            if self.load_failure_policy == "fail":
                results.outputs.append(self._fail_load(request, fail))
                continue
            recomputed = bm.rewind(
                request.request_id, min(request.num_cached_tokens, bad[0] * bm.block_size)
            )
            if recomputed is None:
                results.outputs.append(
                    fail(request, f"no KV blocks left to recompute request {request.request_id}")
                )
                continue
            if bm.extra_groups:
                # Window entries may be real blocks again: the workers get every table anew.
                request.known_to_workers = False
            request.kv_stats.num_recomputed_tokens += request.num_computed_tokens - recomputed
            request.num_computed_tokens = recomputed
            request.spec_token_ids.clear()
            request.skip_connector = True
            results.reset_ids.add(request.request_id)

    def _apply_finished_recving(
        self,
        finished: set[str],
        failed: set[str],
        reasons: Mapping[str, str],
        fail: FailRequest,
        results: ConnectorResults,
    ) -> None:
        bm = self.block_manager
        resumed: list[Request] = []
        for rid in sorted(finished):
            if rid in self._borrows:
                self._release_borrow(rid, _RECV)
                continue
            request = self._loading.pop(rid, None)
            if request is None:
                continue  # a report about a request this scheduler is not loading
            # The load borrow ends here, whatever happens to the request next.
            load, request.kv_load = request.kv_load, None
            request.status = RequestStatus.WAITING_WITH_KV
            stats = request.kv_stats
            now = time.monotonic()
            stats.load_wait_s += now - load.started_at
            to_wall = wall_clock()
            BOOK.record(
                rid,
                "engine.kv_wait",
                to_wall(load.started_at),
                to_wall(now),
                tokens=load.num_external_tokens,
                failed=rid in failed or load.failed,
            )
            if load.overlaps_prefill:
                # Loading while the prefill computed: until its first token came.
                end = min(now, request.continued_at or now)
                stats.overlapped_s += max(0.0, end - load.started_at)
            reason = reasons.get(rid)
            limit = request.num_tokens - (0 if request.awaits_generated else 1)
            loaded_past_limit = request.num_cached_tokens + load.num_external_tokens > limit
            if None in bm.extra_groups and loaded_past_limit and rid not in failed:
                # A state already holds the last token, whose logits this engine needs.
                load.failed = True
                reason = reason or (
                    "a recurrent state cannot be rewound: a loaded state continues only after "
                    "the prompt's last token (a decode given the prefill's first token)"
                )
            if rid in failed or load.failed:
                if self.load_failure_policy == "fail":
                    results.outputs.append(self._fail_load(request, fail, reason))
                    continue
                table = bm.get_block_ids(rid)
                local_blocks = request.num_cached_tokens // bm.block_size
                bm.evict_blocks(table[local_blocks:])
                restart = bm.rewind(rid, request.num_cached_tokens)
                if restart is None:
                    results.outputs.append(
                        fail(request, f"no KV blocks left to recompute request {rid}")
                    )
                    continue
                # A window's prefix hit may be unusable without what the load would have
                # brought: then the prompt is recomputed from its start.
                stats.num_recomputed_tokens += request.num_cached_tokens - restart
                request.num_cached_tokens = restart
                request.num_computed_tokens = restart
                request.skip_connector = True
                stats.num_recomputed_tokens += load.num_external_tokens
            else:
                loaded = request.num_cached_tokens + load.num_external_tokens
                # The last token is computed here for its logits, unless the next token comes
                # from elsewhere (a prefill's first token, `Scheduler.continue_request`).
                request.num_computed_tokens = min(loaded, limit)
                bm.cache_full_blocks(request, request.num_computed_tokens)
                bm.release_out_of_window(rid, request.num_computed_tokens)
                stats.num_loaded_tokens += load.num_external_tokens
                stats.num_loaded_blocks += bm.num_blocks_holding(
                    rid, request.num_cached_tokens, loaded
                )
            resumed.append(request)
        resumed.sort(key=lambda r: r.arrival_order)
        results.resumed.extend(resumed)

    def _fail_load(
        self, request: Request, fail: FailRequest, reason: str | None = None
    ) -> EngineCoreOutput:
        message = f"KV load failed for request {request.request_id} (kv_load_failure_policy=fail)"
        return fail(request, message if reason is None else f"{message}: {reason}")

    def _release_borrow(self, rid: str, kind: str) -> None:
        borrows = self._borrows.get(rid)
        if borrows is None or kind not in borrows:
            return
        borrows.discard(kind)
        if not borrows:
            del self._borrows[rid]
            self.block_manager.free(rid)
