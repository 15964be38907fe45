"""`PushedLoad`: one attempt at a request's KV load on the push data plane (``data_plane:
"push"``), run by `LoadJob` on its loader thread when the producer offers pushes.

1. per planned pull (a producer rank, its layers and head slice, a KV cache group's blocks):
   grant that producer a push lease of exactly this worker's blocks for it (`LeaseGrants.
   grant_push`: a fresh lease id and secret, writes of those layers only);
2. ask the producer rank to write them (`KVTransferAgent.ask_push`), presenting the request's
   lease there, as a pull would: the producer checks it, then writes each layer as soon as its
   KV is computed (a layer computed before the ask is written at once);
3. wait until every lease landed (each layer written and flushed, said by the producer once its
   flush returned), probing the producer meanwhile as a pull does, within the transfer
   timeout; a producer that stopped writing fails the load typed (`WritesStopped`);
4. whatever the outcome, end the push leases before the load reports: `revoke` returns once
   no producer counts as writing them (or its bound passed, for a writer that never answers),
   so the blocks are never handed back while a write of this load may land.

No block is read before its lease landed: the engine learns of the load only after step 3.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch

from kvtransfer.connectors.ucx.liveness import PROBE_INTERVAL_S, ProducerWatch
from kvtransfer.connectors.ucx.metadata import BlockRun, LoadSpec
from kvtransfer.connectors.ucx.plan import PlannedPull
from kvtransfer.connectors.ucx.remote import RemoteEngine
from kvtransfer.transport import (
    EndpointReset,
    KVTransferAgent,
    LeaseAccess,
    LeaseGrants,
    PeerHandle,
    PeerUnreachable,
    TransferTimeoutError,
    new_secret,
    secret_digest,
)

logger = logging.getLogger(__name__)

# How often the wait for landed writes looks at the stop flag.
_POLL_S = 0.02


@dataclass(frozen=True)
class _Asked:
    lease_id: str
    num_bytes: int
    group: int


class PushedLoad:
    """The push leases of one load attempt (see the module docstring)."""

    def __init__(
        self,
        spec: LoadSpec,
        agent: KVTransferAgent,
        grants: LeaseGrants,
        timeout_s: float,
        stopped: Callable[[], bool],
        begin: Callable[[], None],
    ) -> None:
        self._spec = spec
        self._agent = agent
        self._grants = grants
        self._timeout_s = timeout_s
        # The load was asked to stop (`LoadJob.stop_nowait`); ``begin`` counts one ask sent
        # (raising `LoadCancelled` if the load was stopped before it).
        self._stopped = stopped
        self._begin = begin
        self._asked: list[_Asked] = []

    def run(self, engine: RemoteEngine, watch: ProducerWatch) -> tuple[int, dict[int, int]]:
        """Ask, then wait for every write to land; (bytes written, bytes per group). The
        leases are ended before this returns or raises."""
        try:
            self._ask_all(engine, watch)
            self._wait_landed(watch)
            by_group: dict[int, int] = {}
            for asked in self._asked:
                by_group[asked.group] = by_group.get(asked.group, 0) + asked.num_bytes
            return sum(by_group.values()), by_group
        finally:
            self.end()

    def end(self) -> None:
        """End this attempt's push leases (idempotent); returns once no write of them runs,
        or a transfer timeout passed: by then a producer configured as this engine (the same
        ``transfer_timeout_s``) gave its writes up, as its own push deadline passed."""
        lease_ids = [asked.lease_id for asked in self._asked]
        self._asked = []
        if lease_ids:
            self._grants.revoke(
                lease_ids, "has ended (the load finished or gave up)", wait_s=self._timeout_s
            )

    def _ask_all(self, engine: RemoteEngine, watch: ProducerWatch) -> None:
        spec = self._spec
        runs = {run.group: run for run in spec.runs}
        caches = self._agent.kv_caches
        for index, pull in enumerate(engine.plan):
            run = runs.get(pull.group)
            if run is None or not run.local_block_ids:
                continue  # nothing of this group's layers to move (e.g. all out of window)
            local = spec.kernel_ids(run.local_block_ids)
            secret = new_secret()
            lease_id = f"{spec.req_id}/push/{index}/{secret[:8]}"
            self._begin()
            self._grants.grant_push(lease_id, secret_digest(secret), local, pull.layer_names)
            self._asked.append(
                _Asked(lease_id, _pushed_bytes(pull, caches, len(local)), pull.group)
            )
            peer = engine.peers[pull.remote_rank]
            try:
                self._ask(peer, spec, run, pull, LeaseAccess(lease_id, secret, "", 0), local, watch)
            except EndpointReset:
                raise
            except PeerUnreachable as exc:
                # The endpoint asks go on may be one the producer reset since (its writes to
                # this worker timed out, say): the load runs once more on a new one.
                self._agent.disconnect(peer)
                raise EndpointReset(f"{exc} (asking again on a new connection)") from exc

    def _ask(
        self,
        peer: PeerHandle,
        spec: LoadSpec,
        run: BlockRun,
        pull: PlannedPull,
        push_lease: LeaseAccess,
        local: tuple[int, ...],
        watch: ProducerWatch,
    ) -> None:
        """Ask the producer rank at ``peer`` to write ``pull``'s layers of ``run``."""
        self._agent.ask_push(
            peer,
            request_id=spec.req_id,
            lease=spec.lease_at(run),
            push_lease=push_lease,
            layer_names=pull.layer_names,
            block_ids=spec.kernel_ids(run.remote_block_ids),
            dest_block_ids=local,
            heads=pull.remote_heads,
            dest_heads=pull.local_heads,
            timeout_s=self._timeout_s,
            on_wait=watch.check,
            should_stop=self._stopped,
        )

    def _wait_landed(self, watch: ProducerWatch) -> None:
        deadline = time.monotonic() + self._timeout_s
        next_probe = time.monotonic() + PROBE_INTERVAL_S
        for asked in self._asked:
            while not self._grants.wait_landed(asked.lease_id, _POLL_S):
                if self._stopped():
                    return  # the caller raises LoadCancelled; `end` keeps the blocks safe
                now = time.monotonic()
                if now >= deadline:
                    raise TransferTimeoutError(
                        f"push of request {self._spec.req_id!r}: the producer's writes did "
                        f"not land within {self._timeout_s:g} s"
                    )
                if now >= next_probe:
                    watch.check()
                    next_probe = now + PROBE_INTERVAL_S


def _pushed_bytes(pull: PlannedPull, caches: Mapping[str, torch.Tensor], num_blocks: int) -> int:
    """What the producer writes for ``pull``: its head slice of each layer's blocks."""
    total = 0
    for name in pull.layer_names:
        block = caches[name][0, :, pull.local_heads.start : pull.local_heads.stop]
        total += block.numel() * block.element_size() * num_blocks
    return total


def producer_pushes(engine: RemoteEngine) -> bool:
    """Whether every rank of ``engine`` offered pushes in its handshake."""
    return bool(engine.metadata) and all(md.data_plane == "push" for md in engine.metadata.values())
