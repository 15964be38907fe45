"""The scheduler half of `UcxConnector`.

Producer:

1. at start-up (`set_handshake`) it checks the workers' payloads and serves them over
   `KVHandshake` on ``kv_ip:kv_port``, with the `notify` service on the same port;
2. a request finished with ``do_remote_decode`` keeps its blocks (``delay_free``) under a lease
   and returns the params a consumer pulls with (host and port of that server, block ids, TP x
   PP, handshake generation), a fresh secret (``remote_kv_secret``) without which nothing of
   that lease can be read, released or extended, and the digest of the prompt tokens computed
   (``remote_prompt_digest``); the next step grants the workers that lease (`Grant`);
3. each step hands the workers the requests whose consumer reported done (or whose KV was
   given back through `release_kv`), or whose lease ran out; the workers end their grants,
   report them in ``finished_sending``, and the engine frees the blocks.

Consumer:

1. a request with ``do_remote_prefill`` is offered the producer's prompt tokens beyond its local
   prefix hit, loaded asynchronously (malformed params, too few blocks for
   ``remote_num_tokens``, or a prompt whose digest differs from the one the producer computed
   raise `ValueError`: that request fails and its producer is told to free the KV);
2. the next step's metadata tells every worker which remote blocks go into which local blocks;
3. while the load is in flight a background notifier keeps the producer's lease alive; once
   the engine saw it received (or failed, or cancelled) it tells the producer to free it.
"""

from __future__ import annotations

import logging
import socket
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

from kvtransfer.connector.config import KVTransferConfig
from kvtransfer.connector.kv_groups import (
    FULL_ATTENTION,
    BlockIds,
    KVCacheGroup,
    for_group,
    state_block,
    transferable_blocks,
)
from kvtransfer.connector.metadata import (
    KVCacheLayout,
    KVConnectorHandshakeMetadata,
    KVRequest,
    PpTpRank,
)
from kvtransfer.connector.outputs import KVConnectorOutput
from kvtransfer.connector.serving import PROTOCOL_PREFIX, KVControlEndpoint, KVTransferTotals
from kvtransfer.connectors.ucx.config import UcxConfig
from kvtransfer.connectors.ucx.identity import UNSPECIFIED_MODEL, compat_from_layout, compat_info
from kvtransfer.connectors.ucx.leases import LeaseBook
from kvtransfer.connectors.ucx.metadata import (
    BlockRun,
    Grant,
    LoadSpec,
    RemotePrefill,
    UcxConnectorMetadata,
    UcxHandshakeMetadata,
    prompt_digest,
    wants_kv_stream,
    wants_remote_decode,
)
from kvtransfer.connectors.ucx.notify import Notifier, notify_handler
from kvtransfer.control import CompatibilityInfo, ControlServerThread, HandshakeBook
from kvtransfer.transport import new_secret, secret_digest

logger = logging.getLogger(__name__)

_WILDCARD_HOSTS = ("", "0.0.0.0", "::", "[::]")


@dataclass(frozen=True)
class EngineSplit:
    """This engine's TP x PP split and block size, from its workers' payloads."""

    tp_size: int
    pp_size: int
    block_size: int


def engine_split(
    engine_id: str, metadata: Mapping[PpTpRank, KVConnectorHandshakeMetadata]
) -> EngineSplit:
    """Raises `ValueError` unless every worker of a full TP x PP grid published consistent
    `UcxHandshakeMetadata` of this engine, each under its own rank."""
    if not metadata:
        raise ValueError("no worker published handshake metadata")
    payloads: dict[PpTpRank, UcxHandshakeMetadata] = {}
    for rank, md in sorted(metadata.items()):
        if not isinstance(md, UcxHandshakeMetadata):
            raise ValueError(
                f"worker {rank} published {type(md).__name__}, not UcxHandshakeMetadata"
            )
        if (md.pp_rank, md.tp_rank) != rank:
            raise ValueError(
                f"the payload filed under (pp_rank, tp_rank)={rank} is worker "
                f"({md.pp_rank}, {md.tp_rank})'s"
            )
        if md.engine_id != engine_id:
            raise ValueError(f"worker {rank} belongs to engine {md.engine_id!r}, not {engine_id!r}")
        payloads[rank] = md
    first = next(iter(payloads.values()))
    grid = {(p, t) for p in range(first.pp_size) for t in range(first.tp_size)}
    if set(payloads) != grid:
        raise ValueError(
            f"workers {sorted(payloads)} published, TP {first.tp_size} x PP {first.pp_size} "
            f"needs {sorted(grid)}"
        )
    shapes = {(md.tp_size, md.pp_size, md.block_size, md.dtype) for md in payloads.values()}
    if len(shapes) > 1:
        raise ValueError(f"workers disagree on (tp, pp, block_size, dtype): {sorted(shapes)}")
    return EngineSplit(first.tp_size, first.pp_size, first.block_size)


def _compat_from_payloads(metadata: Mapping[PpTpRank, UcxHandshakeMetadata]) -> CompatibilityInfo:
    """Compatibility facts of an engine that was not told its layout (tests, tools)."""
    first = next(iter(metadata.values()))
    layers = {la.index for md in metadata.values() for la in md.target_layers()}
    return compat_info(
        model=UNSPECIFIED_MODEL,
        dtype=first.dtype,
        total_kv_heads=first.total_kv_heads,
        head_dim=first.head_dim,
        num_layers=len(layers),
        block_size=first.block_size,
    )


class UcxScheduler:
    def __init__(
        self, config: KVTransferConfig, ucx: UcxConfig, layout: KVCacheLayout | None
    ) -> None:
        self._config = config
        self._ucx = ucx
        self._layout = layout
        self._leases = LeaseBook(ucx.lease_s)
        # The KV cache groups whose block lists the hooks get, in order (see `kv_groups`).
        self._groups = (layout.groups if layout is not None else ()) or (
            KVCacheGroup(FULL_ATTENTION, ()),
        )
        self._null_block = None if layout is None else layout.null_block_id
        self._split: EngineSplit | None = None
        self._book: HandshakeBook | None = None
        self._server: ControlServerThread | None = None
        self._advertised: tuple[str, int] | None = None
        self._serve_error = "no handshake metadata received from the workers yet"
        self._notifier: Notifier | None = None
        if config.is_kv_consumer:
            # Started now, not in the first hook that needs it: starting a thread waits for it
            # to run, and on a starved core that held a scheduler step for seconds (issue 34).
            self._notifier_for().start()
        # Answer of the latest get_num_new_matched_tokens, until update_state_after_alloc.
        self._matched: dict[str, tuple[RemotePrefill, int]] = {}
        # Requests whose remote prefill was used (or found useless) once: never again.
        self._consumed: set[str] = set()
        # Loads not yet reported by every worker: our request id -> (producer, blocks).
        self._loading: dict[str, tuple[RemotePrefill, int]] = {}
        self._loads: list[LoadSpec] = []
        self._grants: list[Grant] = []
        self._stats_totals: dict[str, float] = {}
        # Producer requests streaming their KV: their block table as known so far, until
        # the step that computes their last prompt token grants them (then their params).
        self._streams: dict[str, tuple[KVRequest, list[int]]] = {}
        self._streamed: dict[str, dict[str, Any]] = {}
        self._early: dict[str, dict[str, Any]] = {}

    # ------------------------------------------------------------------ start-up

    @property
    def address(self) -> str | None:
        """Where this engine serves its handshake (producers, once started)."""
        return self._server.address if self._server is not None else None

    @property
    def book(self) -> HandshakeBook | None:
        return self._book

    def control_endpoint(self) -> KVControlEndpoint | None:
        """The book a daemon serves on its own port too, once this producer serves it."""
        if self._book is None or self._server is None:
            return None
        return KVControlEndpoint(book=self._book, address=self._server.address)

    @property
    def leases(self) -> LeaseBook:
        return self._leases

    def set_completion_callback(self, callback: Callable[[], None]) -> bool:
        # What arrives between steps on this side: consumers done with held KV.
        self._leases.on_finish = callback
        return True

    def set_handshake(self, metadata: Mapping[PpTpRank, KVConnectorHandshakeMetadata]) -> None:
        # A second call (re-published workers) starts over with a new book and generation.
        self._stop_server()
        try:
            self._split = engine_split(self._config.engine_id, metadata)
        except ValueError as exc:
            # Not raising keeps an engine without transfers usable; request_finished raises
            # this message instead, failing just the requests that ask for a transfer.
            self._split = None
            self._serve_error = f"unusable handshake metadata: {exc}"
            logger.warning("UcxConnector: %s", self._serve_error)
            return
        if not self._config.is_kv_producer:
            return
        payloads = {
            rank: md for rank, md in metadata.items() if isinstance(md, UcxHandshakeMetadata)
        }
        compat = (
            compat_from_layout(self._layout)
            if self._layout is not None
            else _compat_from_payloads(payloads)
        )
        book = HandshakeBook(self._config.engine_id, compat)
        book.publish(payloads)
        server = ControlServerThread(
            self._ucx.host,
            self._ucx.port,
            book=book,
            handlers=[notify_handler(self._config.engine_id, book.generation, self._leases)],
            tls=self._ucx.server_tls,
            on_tick=self._leases.heard,
        )
        server.start()
        self._book, self._server = book, server
        host = self._ucx.host
        if host in _WILDCARD_HOSTS:
            host = socket.getfqdn()
        self._advertised = (host, server.server.port)
        logger.info(
            "UcxConnector engine %s serves its handshake on %s (generation %d)",
            self._config.engine_id,
            server.address,
            book.generation,
        )

    def _block_size(self) -> int:
        if self._layout is not None:
            return self._layout.block_size
        if self._split is not None:
            return self._split.block_size
        raise RuntimeError(f"UcxConnector: block size unknown: {self._serve_error}")

    # ------------------------------------------------------------------ consumer

    def validate_kv_transfer_params(self, params: Mapping[str, Any] | None) -> None:
        if self._config.is_kv_consumer:
            RemotePrefill.parse(params)
        if self._config.is_kv_producer:
            wants_kv_stream(params)

    def release_kv(self, kv_transfer_params: Mapping[str, Any]) -> bool:
        """Free a held request's blocks now; the params must carry its secret."""
        if not self._config.is_kv_producer:
            return False
        remote = RemotePrefill.parse(kv_transfer_params)
        if remote is None:
            raise ValueError("kv_transfer_params.do_remote_prefill must be true")
        if remote.engine_id != self._config.engine_id:
            raise ValueError(
                f"kv_transfer_params.remote_engine_id {remote.engine_id!r} is not this engine "
                f"({self._config.engine_id!r})"
            )
        if self._book is None or remote.generation not in (None, self._book.generation):
            return False  # another generation's request: its blocks are gone already
        return bool(self._leases.finish([(remote.request_id, 0, remote.secret)]))

    def get_num_new_matched_tokens(
        self, request: KVRequest, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        rid = request.request_id
        self._matched.pop(rid, None)
        if not self._config.is_kv_consumer:
            return 0, False
        remote = RemotePrefill.parse(request.kv_transfer_params)
        if remote is None or rid in self._consumed:
            return 0, False
        if remote.engine_id == self._config.engine_id:
            raise ValueError(
                f"kv_transfer_params.remote_engine_id {remote.engine_id!r} is this engine; "
                "an engine does not pull KV from itself"
            )
        block_size = self._block_size()
        # A producer that holds nothing (remote_num_tokens 0) lists no blocks, in any shape.
        if remote.num_tokens and len(remote.block_ids) != len(self._groups):
            raise ValueError(
                f"kv_transfer_params.remote_block_ids holds {len(remote.block_ids)} block "
                f"list(s); this engine has {len(self._groups)} KV cache group(s)"
            )
        for group, blocks in zip(self._groups, remote.block_ids, strict=False):
            needed = group.blocks_for(remote.num_tokens, block_size)
            if (
                not group.is_state
                and group.blocks_kept(block_size) is None
                and len(blocks) < needed
            ):
                # The exact count is checked against the producer's block size once its
                # handshake is known (`plan.check_request_blocks`).
                raise ValueError(
                    f"kv_transfer_params.remote_block_ids holds {len(blocks)} blocks"
                    f"{for_group(group, len(self._groups))}, remote_num_tokens "
                    f"{remote.num_tokens} needs {needed} of "
                    f"{group.tokens_per_block(block_size)} tokens"
                )
        prompt = request.prompt_token_ids
        if len(prompt) < remote.num_tokens or (
            prompt_digest(prompt[: remote.num_tokens]) != remote.prompt_digest
        ):
            raise ValueError(
                f"the prompt differs from the {remote.num_tokens} prompt tokens engine "
                f"{remote.engine_id!r} computed (kv_transfer_params.remote_prompt_digest "
                "mismatch): its KV would not be this prompt's"
            )
        count = remote.num_tokens - num_computed_tokens
        if count <= 0:
            # Everything is cached here already: the producer can free its blocks now.
            self._consumed.add(rid)
            self._notifier_for().release(remote, 0)
            return 0, False
        self._matched[rid] = (remote, num_computed_tokens)
        return count, True

    def update_state_after_alloc(
        self, request: KVRequest, block_ids: BlockIds, num_external_tokens: int
    ) -> None:
        rid = request.request_id
        if (
            self._config.is_kv_producer
            and len(self._groups) == 1
            and wants_kv_stream(request.kv_transfer_params)
            and len(request.prompt_token_ids) >= self._ucx.stream_min_tokens
        ):
            self._streams[rid] = (request, list(block_ids[0]))
        matched = self._matched.pop(rid, None)
        if matched is None or num_external_tokens == 0:
            return
        remote, start = matched
        block_size = self._block_size()
        runs = []
        lease_offset = 0
        refused = ""
        try:
            for index, (group, theirs, ours) in enumerate(
                zip(self._groups, remote.block_ids, block_ids, strict=True)
            ):
                # Each group counts its own blocks (DeepSeek-V4's differ in size).
                size = group.tokens_per_block(block_size)
                first, end = start // size, -(-(start + num_external_tokens) // size)
                remote_blocks = -(-remote.num_tokens // size)
                run = self._block_run(rid, index, group, theirs, ours, first, end, remote_blocks)
                if run.local_block_ids:
                    runs.append(replace(run, lease_offset=lease_offset + run.lease_offset))
                lease_offset += len(theirs)
        except ValueError as exc:
            # Lists that do not fit our groups most often come from a producer of another
            # model: let the worker's handshake say so (naming both models) before this.
            refused = str(exc)
            runs = self._blocks_to_invalidate(block_ids, start, start + num_external_tokens)
        self._loads.append(LoadSpec(rid, remote, tuple(runs), refused=refused))
        self._consumed.add(rid)
        self._loading[rid] = (remote, sum(len(run.local_block_ids) for run in runs))
        self._notifier_for().watch(rid, remote)

    def _blocks_to_invalidate(self, block_ids: BlockIds, start: int, stop: int) -> list[BlockRun]:
        """The blocks of tokens [start, stop) of each group a refused load would have written
        (a state group's state block), without remote blocks: what its failure reports
        invalid."""
        runs = []
        block_size = self._block_size()
        for index, (group, ours) in enumerate(zip(self._groups, block_ids, strict=True)):
            if group.is_state:
                local = state_block(group, ours, self._null_block)
            else:
                size = group.tokens_per_block(block_size)
                first, end = start // size, -(-stop // size)
                local = tuple(b for b in ours[first:end] if b != self._null_block)
            if local:
                runs.append(BlockRun(index, (), local))
        return runs

    def _block_run(
        self,
        rid: str,
        index: int,
        group: KVCacheGroup,
        theirs: Sequence[int],
        ours: Sequence[int],
        first: int,
        end: int,
        remote_blocks: int,
    ) -> BlockRun:
        """Which of group ``index``'s blocks [first, end) this engine needs, and from where in
        the producer's list (which ends at its block ``remote_blocks - 1``). A recurrent-state
        group: the producer's state block into this request's."""
        if group.is_state:
            if len(theirs) != 1:
                raise ValueError(
                    f"request {rid}: {group.describe()}: the producer lists {len(theirs)} state "
                    "blocks, not one"
                )
            return BlockRun(index, tuple(theirs), state_block(group, ours, self._null_block), 0)
        if len(ours) < end:
            raise ValueError(
                f"request {rid}: {group.describe()}: {end} blocks needed, {len(ours)} were "
                "allocated"
            )
        # Blocks before a sliding window are this engine's null block: nothing to write.
        lo = first
        while lo < end and self._null_block is not None and ours[lo] == self._null_block:
            lo += 1
        local = tuple(ours[lo:end])
        if self._null_block is not None and self._null_block in local:
            raise ValueError(f"request {rid}: {group.describe()}: a null block among {local}")
        remote_first = remote_blocks - len(theirs)
        if lo < remote_first:
            raise ValueError(
                f"request {rid}: {group.describe()}: this engine needs blocks from position "
                f"{lo}; the producer holds positions {remote_first} to {remote_blocks - 1} "
                "(its window is shorter than this engine's)"
            )
        remote = tuple(theirs[lo - remote_first : end - remote_first])
        return BlockRun(index, remote, local, lo - remote_first)

    @property
    def stats_totals(self) -> dict[str, float]:
        """The workers' `KVConnectorStats`, reduced and summed since start-up."""
        return dict(self._stats_totals)

    def transfer_totals(self) -> KVTransferTotals:
        totals = self._stats_totals
        return KVTransferTotals(
            blocks_sent=int(totals.get("blocks_consumed", 0)),
            bytes_sent=int(totals.get("bytes_sent", 0)),
            blocks_received=int(totals.get("blocks_loaded", 0)),
            bytes_received=int(totals.get("bytes_received", 0)),
            bytes_received_one_sided=int(totals.get("bytes_received_one_sided", 0)),
            bytes_received_pushed=int(totals.get("bytes_received_pushed", 0)),
            loads_failed=int(totals.get("loads_failed", 0)),
            leases_expired=int(totals.get("leases_expired", 0)),
            handshakes=int(totals.get("num_handshakes", 0)),
            handshake_s=totals.get("handshake_ms", 0.0) / 1e3,
            protocols={
                name: int(count)
                for name, count in totals.items()
                if name.startswith(PROTOCOL_PREFIX)
            },
        )

    def update_connector_output(self, output: KVConnectorOutput) -> None:
        stats = output.kv_connector_stats
        if stats is not None:
            for key, value in stats.reduce().items():
                self._add_total(key, value)
        failed = output.failed_recving or set()
        for rid in output.finished_recving or ():
            entry = self._loading.pop(rid, None)
            if entry is None:
                continue
            remote, num_blocks = entry
            # A load that finished on every worker read the blocks even if its request was
            # aborted meanwhile; cancelled loads are reported failed.
            read_nothing = rid in failed
            if read_nothing:
                self._add_total("loads_failed", 1)
            else:
                # Counted once per request whatever the TP x PP: the blocks the producer is
                # told were read (its blocks_consumed).
                self._add_total("blocks_loaded", num_blocks)
            notifier = self._notifier_for()
            notifier.unwatch(rid)
            notifier.release(remote, 0 if read_nothing else num_blocks)

    def _add_total(self, key: str, value: float) -> None:
        self._stats_totals[key] = self._stats_totals.get(key, 0.0) + value

    def _notifier_for(self) -> Notifier:
        if self._notifier is None:
            self._notifier = Notifier(timeout_s=self._ucx.handshake_timeout_s, tls=self._ucx.tls)
        return self._notifier

    # ------------------------------------------------------------------ both

    def request_finished(
        self, request: KVRequest, block_ids: BlockIds
    ) -> tuple[bool, dict[str, Any] | None]:
        rid = request.request_id
        self._matched.pop(rid, None)
        self._release_unused(request)
        self._consumed.discard(rid)
        if not self._config.is_kv_producer or not wants_remote_decode(request.kv_transfer_params):
            return False, None
        self._streams.pop(rid, None)
        self._early.pop(rid, None)
        streamed = self._streamed.pop(rid, None)
        if streamed is not None:
            # Granted and announced while computing: the blocks stay until the consumer (or
            # the lease) lets go. A request that did not complete its prompt holds nothing
            # worth reading: its lease ends now, and its blocks once no pull reads them.
            if _num_computed_prompt_tokens(request) < streamed["remote_num_tokens"]:
                self._leases.finish([(rid, 0, streamed["remote_kv_secret"])])
                return True, None
            return True, streamed
        params = self._hold(request, block_ids, streaming=False)
        return params["remote_num_tokens"] > 0, params

    def _hold(self, request: KVRequest, block_ids: BlockIds, *, streaming: bool) -> dict[str, Any]:
        """The params a consumer pulls ``request``'s computed prompt KV with; unless there is
        none, its blocks are held under a new lease and the next step grants them."""
        if self._book is None or self._advertised is None or self._split is None:
            raise RuntimeError(f"UcxConnector cannot serve KV: {self._serve_error}")
        rid = request.request_id
        num_tokens = _num_computed_prompt_tokens(request)
        host, port = self._advertised
        held = self._held_blocks(block_ids, num_tokens)
        params: dict[str, Any] = {
            "do_remote_prefill": True,
            "remote_engine_id": self._config.engine_id,
            "remote_request_id": rid,
            # NIXL's shape: one list per group; a model of one group keeps the flat list.
            "remote_block_ids": list(held[0]) if len(held) == 1 else [list(g) for g in held],
            "remote_host": host,
            "remote_port": port,
            "remote_generation": self._book.generation,
            "tp_size": self._split.tp_size,
            "pp_size": self._split.pp_size,
            "remote_num_tokens": num_tokens,
        }
        if num_tokens == 0 or not all(held):
            # Nothing is held: the consumer computes the prompt itself.
            num_tokens = 0
            held = ()
            params.update(
                remote_num_tokens=0,
                remote_block_ids=[] if len(self._groups) == 1 else [[] for _ in self._groups],
            )
        params["remote_kv_secret"] = secret = new_secret()
        params["remote_prompt_digest"] = digest = prompt_digest(
            request.prompt_token_ids[:num_tokens]
        )
        if num_tokens == 0:
            return params
        if streaming:
            params["remote_streaming"] = True
        self._leases.hold(rid, secret)
        blocks = tuple(b for group in held for b in group)
        self._grants.append(Grant(rid, secret_digest(secret), blocks, digest, streaming))
        return params

    def _held_blocks(self, block_ids: BlockIds, num_tokens: int) -> BlockIds:
        """Each group's blocks a consumer may read of ``num_tokens`` tokens (a sliding-window
        group: its tail); all empty when a group lacks blocks (a request that did not complete
        its prompt)."""
        if len(block_ids) != len(self._groups):
            raise ValueError(
                f"{len(block_ids)} block list(s) for an engine with {len(self._groups)} KV "
                "cache group(s)"
            )
        block_size = self._split.block_size
        short = any(
            len(ids) < g.blocks_for(num_tokens, block_size)
            for g, ids in zip(self._groups, block_ids, strict=True)
            if not g.is_state
        )
        if num_tokens == 0 or short:
            return tuple(() for _ in block_ids)
        return tuple(
            transferable_blocks(g, ids, num_tokens, block_size, self._null_block)
            for g, ids in zip(self._groups, block_ids, strict=True)
        )

    def _release_unused(self, request: KVRequest) -> None:
        """A consumer request that finished without loading (aborted while it waited):
        the producer need not keep its blocks for us."""
        rid = request.request_id
        if not self._config.is_kv_consumer or rid in self._consumed or rid in self._loading:
            return
        try:
            remote = RemotePrefill.parse(request.kv_transfer_params)
        except ValueError:
            return  # malformed params name no producer to tell
        if remote is not None and remote.engine_id != self._config.engine_id:
            self._notifier_for().release(remote, 0)

    def take_early_kv_transfer_params(self) -> dict[str, dict[str, Any]]:
        early, self._early = self._early, {}
        return early

    def _grant_streams(self, scheduler_output: Any) -> None:
        """Grant the streaming requests whose last prompt token this step computes, before
        it runs: each layer is served as soon as the workers computed it."""
        for rid in getattr(scheduler_output, "preempted_req_ids", ()):
            streamed = self._streamed.pop(rid, None)
            if streamed is not None:
                # Its blocks were just freed: the lease ends in this step's metadata, so the
                # workers stop serving them before the step writes anyone else's KV there.
                self._leases.finish([(rid, 0, streamed["remote_kv_secret"])])
        if not self._streams:
            return
        for cached in getattr(scheduler_output, "scheduled_cached_reqs", ()):
            entry = self._streams.get(cached.req_id)
            if entry is not None:
                entry[1].extend(cached.new_block_ids)
        scheduled = getattr(scheduler_output, "num_scheduled_tokens", {})
        for rid in [r for r in self._streams if r in scheduled]:
            request, blocks = self._streams[rid]
            if _num_computed_prompt_tokens(request) < len(request.prompt_token_ids):
                continue  # an earlier chunk: its blocks are not all known yet
            del self._streams[rid]
            if self._book is None or self._advertised is None or self._split is None:
                continue  # request_finished reports why nothing can be served
            params = self._hold(request, (tuple(blocks),), streaming=True)
            if params["remote_num_tokens"] > 0:
                self._streamed[rid] = params
                self._early[rid] = params

    def build_connector_meta(self, scheduler_output: Any) -> UcxConnectorMetadata:
        self._grant_streams(scheduler_output)
        releases = tuple(self._leases.take())
        # What consumers said they read: blocks of this engine, counted once whatever the TP.
        consumed = sum(r.num_blocks for r in releases if not r.expired)
        if consumed:
            self._add_total("blocks_consumed", consumed)
        expired = sum(1 for r in releases if r.expired)
        if expired:
            # Once per request (the workers' num_leases_expired counts once per worker).
            self._add_total("leases_expired", expired)
        metadata = UcxConnectorMetadata(
            loads=tuple(self._loads), grants=tuple(self._grants), releases=releases
        )
        self._loads = []
        self._grants = []
        return metadata

    def shutdown(self) -> None:
        self._stop_server()
        if self._notifier is not None:
            self._notifier.close()

    def _stop_server(self) -> None:
        server, self._server = self._server, None
        self._book = None
        self._advertised = None
        if server is not None:
            server.stop()


def _num_computed_prompt_tokens(request: KVRequest) -> int:
    """Prompt tokens whose KV is in the request's blocks (an aborted request may have computed
    only part of its prompt); requests without the counter count as prefilled."""
    prompt_len = len(request.prompt_token_ids)
    computed = getattr(request, "num_computed_tokens", None)
    if computed is None:
        return prompt_len
    return max(0, min(prompt_len, int(computed)))
