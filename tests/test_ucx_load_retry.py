"""`LoadJob` reads a request's KV once more when its connection was reset by another read from
the same producer (`EndpointReset`: after a partition healed, a read on the broken connection
times out and resets it for every read in flight), and only then: any other failure is the
load's. The agent and the producer's handshake are stand-ins; what is under test is the job's
decision, the pulls it starts and what it reports."""

from __future__ import annotations

from concurrent.futures import Future
from types import SimpleNamespace
from typing import Any

import pytest

from kvtransfer.connectors.ucx.loads import LoadJob
from kvtransfer.connectors.ucx.metadata import LoadSpec, RemotePrefill
from kvtransfer.transport import EndpointReset, PullHandle, TransferTimeoutError
from kvtransfer.transport.client import PullResult

pytestmark = pytest.mark.unit

LAYERS = ("model.layers.0.self_attn", "model.layers.1.self_attn")
BLOCK_BYTES = 4096


class _Agent:
    """Answers each pull with the next outcome: an exception, or success."""

    def __init__(self, *outcomes: BaseException | None) -> None:
        self.outcomes = list(outcomes)
        self.pulls: list[Any] = []

    def pull(self, peer: Any, spec: Any, **_: Any) -> PullHandle:
        self.pulls.append(spec)
        outcome = self.outcomes.pop(0)
        if outcome is not None:
            return PullHandle.failed(spec.request_id, peer, outcome)
        done: Future[PullResult] = Future()
        done.set_result(
            PullResult(
                spec.request_id,
                len(spec.local_block_ids),
                len(spec.layer_names),
                1,
                BLOCK_BYTES * len(spec.local_block_ids),
                0.001,
                one_sided=True,
            )
        )
        return PullHandle(spec.request_id, peer, done)


class _Engines:
    def __init__(self) -> None:
        self.invalidated = 0
        self.engine = SimpleNamespace(
            metadata={0: SimpleNamespace(block_size=16)},
            plan=[
                SimpleNamespace(
                    layer_names=LAYERS, remote_rank=0, remote_heads=None, local_heads=None, group=0
                )
            ],
            peers={0: "peer"},
        )

    def get(self, remote: RemotePrefill, request_id: str | None = None) -> Any:
        return self.engine

    def invalidate(self, engine: Any) -> None:
        self.invalidated += 1


def _job(agent: _Agent, engines: _Engines) -> LoadJob:
    remote = RemotePrefill(
        engine_id="p0",
        request_id="r0",
        block_ids=((5, 6),),
        host="127.0.0.1",
        port=9,
        tp_size=1,
        pp_size=1,
        num_tokens=32,
        secret="s" * 64,
        prompt_digest="d" * 64,
    )
    spec = LoadSpec.one_group("r0", remote, (5, 6), (1, 2))
    return LoadJob(spec, engines, agent, transfer_timeout_s=5.0)  # type: ignore[arg-type]


def _reset() -> EndpointReset:
    return EndpointReset("pull 'other': connection to peer was reset")


def test_a_load_whose_connection_another_read_reset_is_read_once_more():
    agent, engines = _Agent(_reset(), None), _Engines()
    outcome = _job(agent, engines).run()
    assert len(agent.pulls) == 2
    assert [p.remote_block_ids for p in agent.pulls] == [(5, 6), (5, 6)]
    assert (outcome.num_blocks, outcome.num_bytes, outcome.one_sided_bytes) == (
        2,
        2 * BLOCK_BYTES,
        2 * BLOCK_BYTES,
    )
    assert engines.invalidated == 0  # the producer did nothing wrong: no new handshake


def test_a_second_reset_fails_the_load():
    agent, engines = _Agent(_reset(), _reset()), _Engines()
    with pytest.raises(EndpointReset, match="was reset"):
        _job(agent, engines).run()
    assert len(agent.pulls) == 2
    assert engines.invalidated == 1


def test_other_failures_are_not_retried():
    timeout = TransferTimeoutError("pull 'r0' from peer timed out after 5.0 s")
    agent, engines = _Agent(timeout), _Engines()
    with pytest.raises(TransferTimeoutError, match="timed out"):
        _job(agent, engines).run()
    assert len(agent.pulls) == 1
    assert engines.invalidated == 1
