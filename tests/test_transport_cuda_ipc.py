"""GPU tier: one-sided pulls and pushes of CUDA caches between two processes of one host go
through the peer's CUDA IPC handles (`cuda_ipc`), byte for byte, and through UCX's cuda_ipc
when the peer publishes none."""

from __future__ import annotations

import multiprocessing as mp
from typing import Any

import pytest
import torch

from kvtransfer.transport import (
    KVTransferAgent,
    LeaseAccess,
    LeaseGrants,
    PullSpec,
    TransportConfig,
    secret_digest,
)

pytestmark = [
    pytest.mark.integration,
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]

LAYERS = tuple(f"model.layers.{i}.self_attn" for i in range(4))
SHAPE = (64, 2, 4, 16, 64)
LEASE, SECRET = "gpu-push", "gpu-push-secret"


def _caches(seed: int | None) -> dict[str, torch.Tensor]:
    if seed is None:
        return {name: torch.zeros(SHAPE, dtype=torch.bfloat16, device="cuda") for name in LAYERS}
    generator = torch.Generator(device="cuda").manual_seed(seed)
    return {
        name: torch.randn(SHAPE, generator=generator, device="cuda").to(torch.bfloat16)
        for name in LAYERS
    }


def _peer(ready: Any, commands: Any, answers: Any, cuda_ipc: bool, takes_pushes: bool) -> None:
    caches = _caches(None if takes_pushes else 5)
    torch.cuda.synchronize()
    agent = KVTransferAgent(TransportConfig(data_plane="rma", cuda_ipc=cuda_ipc))
    agent.register_kv_caches(caches)
    push_grants = LeaseGrants() if takes_pushes else None
    agent.start_server(None, push_grants)
    ready.put((agent.address, agent.kv_layouts()))
    while (command := commands.get()) is not None:
        kind, blocks = command
        if kind == "grant":
            push_grants.grant_push(LEASE, secret_digest(SECRET), blocks, LAYERS)
            answers.put(True)
        else:
            answers.put({name: caches[name][list(blocks)].cpu() for name in LAYERS})
    agent.close()


class _Peer:
    def __init__(self, cuda_ipc: bool, takes_pushes: bool) -> None:
        ctx = mp.get_context("spawn")
        ready, self.commands, self.answers = ctx.Queue(), ctx.Queue(), ctx.Queue()
        self.process = ctx.Process(
            target=_peer, args=(ready, self.commands, self.answers, cuda_ipc, takes_pushes)
        )
        self.process.start()
        self.address, self.layouts = ready.get(timeout=300)

    def ask(self, kind: str, blocks: list[int]) -> Any:
        self.commands.put((kind, blocks))
        return self.answers.get(timeout=120)

    def close(self) -> None:
        self.commands.put(None)
        self.process.join(60)


REMOTE = [3, 9, 10, 11, 40, 63]
LOCAL = [0, 1, 2, 50, 20, 7]


def _same_blocks_by_path(
    ours: dict[str, torch.Tensor],
    theirs: dict[str, torch.Tensor],
    ipc_and_ucx: tuple[int, int],
    cuda_ipc: bool,
) -> None:
    """Our blocks LOCAL equal the peer's REMOTE bit for bit, moved in one operation by the
    path the peer allowed: (IPC copies, UCX operations)."""
    for name in LAYERS:
        assert torch.equal(
            ours[name][LOCAL].cpu().view(torch.int16), theirs[name].view(torch.int16)
        )
    assert ipc_and_ucx == ((1, 0) if cuda_ipc else (0, 1))


@pytest.mark.parametrize("cuda_ipc", [True, False], ids=["ipc", "ucx"])
def test_a_gpu_pull_copies_the_blocks_through_the_path_the_peer_allows(cuda_ipc):
    peer = _Peer(cuda_ipc, takes_pushes=False)
    agent = KVTransferAgent(TransportConfig(data_plane="rma"))
    try:
        local = _caches(None)
        agent.register_kv_caches(local)
        target = agent.connect(peer.address, layouts=peer.layouts, one_sided=True)
        agent.pull(target, PullSpec("gpu-pull", LAYERS, REMOTE, LOCAL)).result(120)
        theirs = peer.ask("blocks", REMOTE)
        counters = agent.one_sided_counters
    finally:
        agent.close()
        peer.close()
    _same_blocks_by_path(local, theirs, (counters.direct_reads, counters.ucx_reads), cuda_ipc)


@pytest.mark.parametrize("cuda_ipc", [True, False], ids=["ipc", "ucx"])
def test_a_gpu_push_writes_the_granted_blocks_through_the_path_the_peer_allows(cuda_ipc):
    peer = _Peer(cuda_ipc, takes_pushes=True)
    agent = KVTransferAgent(TransportConfig(data_plane="rma"))
    try:
        mine = _caches(8)
        agent.register_kv_caches(mine)
        writer = agent.connect(peer.address, layouts=peer.layouts)
        peer.ask("grant", REMOTE)
        lease = LeaseAccess(LEASE, SECRET, "", 0, tuple(REMOTE))
        agent.push(writer, PullSpec("gpu-push", LAYERS, REMOTE, LOCAL, lease=lease)).result(120)
        theirs = peer.ask("blocks", REMOTE)
        counters = agent.one_sided_counters
    finally:
        agent.close()
        peer.close()
    _same_blocks_by_path(mine, theirs, (counters.direct_writes, counters.ucx_writes), cuda_ipc)
