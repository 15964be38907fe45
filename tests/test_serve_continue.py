"""``Generation.Continue`` against a `GenerationService` whose engine is a stand-in that admits
requests only when told: a Continue that arrives while its Generate call is being admitted is
applied once admitted (it used to be kept and never used: the decode waited for its deadline)."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

import grpc
import pytest

from kvtransfer.clients.generation import generate_request
from kvtransfer.engine.model.chat_template import ChatTemplate
from kvtransfer.engine.model.tokenizer import Tokenizer
from kvtransfer.engine.scheduler.request import EngineCoreOutput
from kvtransfer.serve.generation import GenerationService, ServiceContext
from kvtransfer.serve.ledger import ServingLedger
from kvtransfer.serve.metrics import DaemonMetrics
from kvtransfer.v1 import generation_pb2, generation_pb2_grpc

pytestmark = pytest.mark.integration


class GatedEngine:
    """Admits a request when ``admit`` is set; a continued request then finishes at once with
    the tokens it was given plus one more."""

    def __init__(self) -> None:
        self.admitting = threading.Event()
        self.admit = threading.Event()
        self.sinks: dict[str, Callable[[EngineCoreOutput], None]] = {}
        self.continued: dict[str, tuple[int, ...]] = {}

    def add_request(self, rid: str, *args: Any) -> Future[None]:
        """Like `EngineThread.add_request`: the future of the engine thread taking it."""
        self.sinks[rid] = args[3]
        taken: Future[None] = Future()

        def admit() -> None:
            self.admitting.set()
            if self.admit.wait(10):
                taken.set_result(None)
            else:
                taken.set_exception(TimeoutError("never admitted"))

        threading.Thread(target=admit, daemon=True).start()
        return taken

    def continue_request(self, rid: str, tokens: tuple[int, ...]) -> None:
        self.continued[rid] = tokens
        self.sinks[rid](EngineCoreOutput(rid, (65,), finished=True, finish_reason="length"))

    def call(self, fn: Callable[[Any], Any], timeout_s: float = 30.0) -> Any:
        return fn(self)

    def abandon(self, rid: str) -> None:
        pass

    def delivered(self, rid: str) -> None:
        pass


def test_a_continue_during_admission_is_applied_once_admitted():
    async def scenario():
        engine = GatedEngine()
        context = ServiceContext(
            engine=engine,  # type: ignore[arg-type]  # the methods the service calls
            tokenizer=Tokenizer.byte_level(),
            chat_template=ChatTemplate.for_model("builtin"),
            vocab_size=259,
            ledger=ServingLedger(),
            metrics=DaemonMetrics("decode", "d0"),
            bytes_per_block=1,
            is_admitting=lambda: True,
        )
        server = grpc.aio.server()
        generation_pb2_grpc.add_GenerationServicer_to_server(GenerationService(context), server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
        stub = generation_pb2_grpc.GenerationStub(channel)
        try:
            request = generate_request("r", "Hi", 4)
            request.await_generated_tokens = True
            call = stub.Generate(request, timeout=10)
            replies = asyncio.ensure_future(_collect(call))
            # The Generate call is being admitted (its engine add blocks) when Continue comes.
            await asyncio.to_thread(engine.admitting.wait, 10)
            continued = generation_pb2.ContinueRequest(request_id="r", generated_token_ids=[72])
            await stub.Continue(continued, timeout=5)
            engine.admit.set()
            messages = await asyncio.wait_for(replies, 10)
            assert engine.continued == {"r": (72,)}
            assert [list(m.token_ids) for m in messages if m.token_ids] == [[65]]
            assert messages[-1].finish_reason == "length"
        finally:
            await channel.close()
            await server.stop(None)

    asyncio.run(scenario())


async def _collect(call: Any) -> list[generation_pb2.GenerateResponse]:
    return [message async for message in call]
