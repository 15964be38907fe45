"""``Generation.ReleaseKV`` of the daemons' `GenerationService`, over real gRPC, with the engine
thread and the connector replaced by stand-ins: every status code of the proto's table, the
params reaching ``EngineCore.release_kv`` exactly, the ledger and metrics counting each outcome.
The same call against real daemons is in tests/test_daemons.py and tests/test_router_e2e.py."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Callable, Mapping
from contextlib import asynccontextmanager
from typing import Any, TypeVar

import grpc
import pytest
from prometheus_client import generate_latest

from kvtransfer.engine.engine_core import EngineCore
from kvtransfer.engine.model.chat_template import ChatTemplate
from kvtransfer.serve.engine_thread import EngineUnavailable
from kvtransfer.serve.generation import GenerationService, ServiceContext
from kvtransfer.serve.ledger import ServingLedger
from kvtransfer.serve.metrics import DaemonMetrics
from kvtransfer.v1 import generation_pb2, generation_pb2_grpc

pytestmark = pytest.mark.integration

T = TypeVar("T")
SECRET = "s3cret"
HELD = {"remote_engine_id": "p0", "remote_request_id": "r1", "remote_kv_secret": SECRET}


class SecretConnector:
    """Holds KV for ``r1`` of engine ``p0``, released once with the right secret."""

    def __init__(self) -> None:
        self.calls: list[dict[str, Any]] = []
        self.held = {"r1"}

    def release_kv(self, params: Mapping[str, Any]) -> bool:
        self.calls.append(dict(params))
        if params.get("remote_engine_id") != "p0":
            raise ValueError("kv_transfer_params.remote_engine_id names another engine")
        if params.get("remote_request_id") not in self.held:
            return False
        if params.get("remote_kv_secret") != SECRET:
            raise PermissionError("kv_transfer_params.remote_kv_secret does not match")
        self.held.discard(params["remote_request_id"])
        return True


class StubCore:
    """Just enough of an engine: the real `EngineCore.release_kv` over a stand-in connector."""

    release_kv = EngineCore.release_kv

    def __init__(self, connector: SecretConnector | None) -> None:
        self.connector = connector


class StubEngine:
    """`EngineThread.call` on the caller's thread, or failing like a stopped engine."""

    def __init__(self, core: StubCore) -> None:
        self.core = core
        self.failure: Exception | None = None

    def call(self, fn: Callable[[Any], T], timeout_s: float = 30.0) -> T:
        if self.failure is not None:
            raise self.failure
        return fn(self.core)


@asynccontextmanager
async def served(connector: SecretConnector | None) -> AsyncIterator[tuple[Any, StubEngine, Any]]:
    engine = StubEngine(StubCore(connector))
    ledger = ServingLedger()
    metrics = DaemonMetrics("prefill", "p0")
    context = ServiceContext(
        engine=engine,  # type: ignore[arg-type]  # the one method the service calls
        tokenizer=None,
        chat_template=ChatTemplate.for_model("builtin"),
        vocab_size=256,
        ledger=ledger,
        metrics=metrics,
        bytes_per_block=1,
        is_admitting=lambda: False,  # releases are taken while draining too
    )
    server = grpc.aio.server()
    generation_pb2_grpc.add_GenerationServicer_to_server(GenerationService(context), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
    try:
        yield generation_pb2_grpc.GenerationStub(channel), engine, (ledger, metrics)
    finally:
        await channel.close()
        await server.stop(None)


def release(request_id: str, params: Any) -> generation_pb2.ReleaseKVRequest:
    text = params if isinstance(params, str) else json.dumps(params)
    return generation_pb2.ReleaseKVRequest(request_id=request_id, kv_transfer_params_json=text)


def releases_metric(metrics: DaemonMetrics, outcome: str) -> float:
    needle = f'kvtransfer_kv_releases_total{{engine_id="p0",outcome="{outcome}",role="prefill"}}'
    for line in generate_latest(metrics.registry).decode().splitlines():
        if line.startswith(needle + " "):
            return float(line.split()[-1])
    return 0.0


def test_release_kv_frees_once_then_answers_not_held():
    async def scenario():
        connector = SecretConnector()
        async with served(connector) as (stub, _, (ledger, metrics)):
            first = await stub.ReleaseKV(release("r1", HELD), timeout=5)
            again = await stub.ReleaseKV(release("r1", HELD), timeout=5)
            assert (first.released, again.released) == (True, False)
            assert connector.calls == [HELD, HELD]  # the params exactly as sent
            assert ledger.counters()["kv_releases"] == 1
            assert releases_metric(metrics, "released") == 1
            assert releases_metric(metrics, "not_held") == 1

    asyncio.run(scenario())


@pytest.mark.parametrize(
    ("request_id", "params", "code", "message", "outcome"),
    [
        ("", HELD, "INVALID_ARGUMENT", "request_id must not be empty", "invalid"),
        ("r1", "", "INVALID_ARGUMENT", "kv_transfer_params_json must not be empty", "invalid"),
        ("r1", "{nope", "INVALID_ARGUMENT", "kv_transfer_params_json is not valid JSON", "invalid"),
        ("r1", "[1]", "INVALID_ARGUMENT", "must be a JSON object, got list", "invalid"),
        ("r1", "[" * 5000 + "]" * 5000, "INVALID_ARGUMENT", "nested too deeply", "invalid"),
        (
            "r1",
            {**HELD, "remote_engine_id": "p9"},
            "INVALID_ARGUMENT",
            "kv_transfer_params.remote_engine_id names another engine",
            "invalid",
        ),
        (
            "r1",
            {**HELD, "remote_kv_secret": "guess"},
            "PERMISSION_DENIED",
            "kv_transfer_params.remote_kv_secret does not match",
            "denied",
        ),
    ],
)
def test_release_kv_refusals_name_the_problem(request_id, params, code, message, outcome):
    async def scenario():
        connector = SecretConnector()
        async with served(connector) as (stub, _, (ledger, metrics)):
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await stub.ReleaseKV(release(request_id, params), timeout=5)
            assert refused.value.code().name == code
            assert message in refused.value.details()
            assert connector.held == {"r1"}  # nothing given back
            assert ledger.counters()["kv_releases"] == 0
            assert releases_metric(metrics, outcome) == 1

    asyncio.run(scenario())


def test_release_kv_without_a_connector_or_a_running_engine():
    async def scenario():
        async with served(None) as (stub, engine, _):
            assert (await stub.ReleaseKV(release("r1", HELD), timeout=5)).released is False
            for failure in (EngineUnavailable("the engine stopped"), TimeoutError("slow")):
                engine.failure = failure
                with pytest.raises(grpc.aio.AioRpcError) as refused:
                    await stub.ReleaseKV(release("r1", HELD), timeout=5)
                assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
                assert refused.value.details() == str(failure)

    asyncio.run(scenario())
