"""Scripted Generation daemons: real grpc.aio servers on 127.0.0.1 that record what they get.

A behaviour is an async generator function ``(request, context) -> GenerateResponse...``; a
daemon runs ``behaviour`` for every call (swap it between requests). Every call is recorded in
``requests``; a call the client cancels (or whose deadline passes) is recorded in ``cancelled``
and sets ``cancelled_event``. ``ReleaseKV`` calls are recorded in ``releases`` (and set
``released``), then answered by ``release_behaviour`` (default: released=true). Health is
SERVING from the start (`set_health` changes it); `stop` then `restart` brings the daemon back
on the same address. KVAdmin ``GetStatus`` answers ``status`` (UNIMPLEMENTED while it is
``None``, as a daemon without KVAdmin). A decode called with ``await_generated_tokens`` sends
no token before its ``Continue``, as a real one (`continued`): the good behaviours wait for it,
failures (``fail``, an error finish without tokens) come at once. ``host`` is the loopback
address it listens on (fakes on 127.0.0.1, 127.0.0.2, ... can share a port: what one DNS name
with one port gives). Message limits are the real daemons' (`kvtransfer.clients.limits`).
"""

from __future__ import annotations

import asyncio
import contextvars
import json
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass, field

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from kvtransfer.clients.limits import DEFAULT_MAX_REQUEST_BYTES, grpc_message_options
from kvtransfer.v1 import admin_pb2, admin_pb2_grpc, generation_pb2, generation_pb2_grpc

Reply = generation_pb2.GenerateResponse
Behaviour = Callable[
    [generation_pb2.GenerateRequest, grpc.aio.ServicerContext], AsyncIterator[Reply]
]
ReleaseBehaviour = Callable[
    [generation_pb2.ReleaseKVRequest, grpc.aio.ServicerContext],
    Awaitable[generation_pb2.ReleaseKVResponse],
]

# The decode stream every test expects unless it says otherwise: text per message, and a
# message with a token but no text yet (a partial UTF-8 character), which SSE must skip.
DECODE_PIECES: tuple[tuple[list[int], str], ...] = (
    ([72, 101], "He"),
    ([108], ""),
    ([108, 111], "llo"),
    ([33], "!"),
)
DECODE_METRICS = generation_pb2.RequestMetrics(
    ttft_s=0.01,
    kv_transfer_s=0.25,
    kv_blocks_received=3,
    kv_bytes_received=3 * 4096,
    num_cached_tokens=5,
    num_recomputed_tokens=0,
)


# The first token every fake prefill samples (it goes out before the decode stream).
FIRST_PIECE: tuple[list[int], str] = ([62], ">")


def params_for(address: str, request_id: str) -> str:
    """The kv_transfer_params_json the fake prefill at ``address`` returns."""
    return json.dumps(
        {
            "do_remote_prefill": True,
            "remote_engine_id": f"fake@{address}",
            "remote_request_id": request_id,
            "remote_block_ids": [4, 7, 9],
        }
    )


# The fake serving the call a behaviour runs for (behaviours only get the request and context).
_SERVING: contextvars.ContextVar[FakeDaemon] = contextvars.ContextVar("fake_daemon")


async def continued(request: generation_pb2.GenerateRequest) -> None:
    """Returns once a decode called with await_generated_tokens got its Continue (at once for
    any other call)."""
    if request.await_generated_tokens:
        await _SERVING.get().continued_event(request.request_id).wait()


def prefill_ok(address: str, *, with_params: bool = True) -> Behaviour:
    async def behaviour(request, context):
        yield Reply(request_id=request.request_id, num_prompt_tokens=5)
        final = Reply(
            request_id=request.request_id,
            token_ids=FIRST_PIECE[0],
            text=FIRST_PIECE[1],
            finished=True,
            finish_reason="length",
        )
        if with_params:
            final.kv_transfer_params_json = params_for(address, request.request_id)
        yield final

    return behaviour


def prefill_streaming(address: str, finish_reason: str = "length") -> Behaviour:
    """A prefill that announces its params before its first token (its KV is being computed
    and served layer by layer), then finishes with ``finish_reason``."""

    async def behaviour(request, context):
        params = params_for(address, request.request_id)
        yield Reply(request_id=request.request_id, num_prompt_tokens=5)
        yield Reply(request_id=request.request_id, kv_transfer_params_json=params)
        ids, text = FIRST_PIECE if finish_reason == "length" else ([], "")
        yield Reply(
            request_id=request.request_id,
            token_ids=ids,
            text=text,
            finished=True,
            finish_reason=finish_reason,
            kv_transfer_params_json=params,
        )

    return behaviour


def prefill_announces_then_hangs(address: str) -> Behaviour:
    """A prefill that announces its params (a decode may start pulling), then never finishes:
    a wedged engine, a frozen host."""

    async def behaviour(request, context):
        params = params_for(address, request.request_id)
        yield Reply(request_id=request.request_id, num_prompt_tokens=5)
        yield Reply(request_id=request.request_id, kv_transfer_params_json=params)
        await asyncio.Event().wait()
        yield Reply()

    return behaviour


def decode_ok(
    pieces: Sequence[tuple[list[int], str]] = DECODE_PIECES,
    finish_reason: str = "length",
    num_prompt_tokens: int = 5,
) -> Behaviour:
    async def behaviour(request, context):
        await continued(request)
        for index, (ids, text) in enumerate(pieces):
            reply = Reply(request_id=request.request_id, token_ids=ids, text=text)
            if index == 0:
                reply.num_prompt_tokens = num_prompt_tokens
            if index == len(pieces) - 1:
                reply.finished = True
                reply.finish_reason = finish_reason
                reply.metrics.CopyFrom(DECODE_METRICS)
            yield reply

    return behaviour


def finish_error(error: str, pieces: Sequence[tuple[list[int], str]] = ()) -> Behaviour:
    """Sends ``pieces``, then a final message with finish_reason "error" (without pieces, at
    once: a KV load that failed before any token)."""

    async def behaviour(request, context):
        if pieces:
            await continued(request)
        for ids, text in pieces:
            yield Reply(request_id=request.request_id, token_ids=ids, text=text)
        yield Reply(
            request_id=request.request_id, finished=True, finish_reason="error", error=error
        )

    return behaviour


def fail(code: grpc.StatusCode, details: str) -> Behaviour:
    async def behaviour(request, context):
        await context.abort(code, details)
        yield Reply()  # never reached; makes this an async generator

    return behaviour


def hang(pieces: Sequence[tuple[list[int], str]] = ()) -> Behaviour:
    """Sends ``pieces``, then waits until the call is cancelled."""

    async def behaviour(request, context):
        if pieces:
            await continued(request)
        for ids, text in pieces:
            yield Reply(request_id=request.request_id, token_ids=ids, text=text)
        await asyncio.Event().wait()
        yield Reply()

    return behaviour


def gated(gate: asyncio.Event, then: Behaviour) -> Behaviour:
    """Waits for ``gate``, then behaves like ``then``."""

    async def behaviour(request, context):
        await gate.wait()
        async for reply in then(request, context):
            yield reply

    return behaviour


def release_answer(released: bool = True) -> ReleaseBehaviour:
    async def behaviour(request, context):
        return generation_pb2.ReleaseKVResponse(released=released)

    return behaviour


def release_fails(code: grpc.StatusCode, details: str) -> ReleaseBehaviour:
    async def behaviour(request, context):
        await context.abort(code, details)

    return behaviour


def release_gated(gate: asyncio.Event, then: ReleaseBehaviour) -> ReleaseBehaviour:
    """Waits for ``gate`` (or the caller's deadline), then answers like ``then``."""

    async def behaviour(request, context):
        await gate.wait()
        return await then(request, context)

    return behaviour


@dataclass
class FakeDaemon:
    role: str
    behaviour: Behaviour | None = None
    credentials: grpc.ServerCredentials | None = None
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES
    requests: list[generation_pb2.GenerateRequest] = field(default_factory=list)
    cancelled: list[str] = field(default_factory=list)
    releases: list[generation_pb2.ReleaseKVRequest] = field(default_factory=list)
    continues: list[generation_pb2.ContinueRequest] = field(default_factory=list)
    release_behaviour: ReleaseBehaviour = field(default_factory=release_answer)
    address: str = ""
    host: str = "127.0.0.1"
    status: admin_pb2.GetStatusResponse | None = None

    def __post_init__(self) -> None:
        self.received = asyncio.Event()
        self.cancelled_event = asyncio.Event()
        self.released = asyncio.Event()
        self._server: grpc.aio.Server | None = None
        self._continued: dict[str, asyncio.Event] = {}
        self._health = health.aio.HealthServicer()
        self._status: int = health_pb2.HealthCheckResponse.SERVING

    async def start(self, port: int = 0) -> FakeDaemon:
        server = grpc.aio.server(options=grpc_message_options(self.max_request_bytes))
        generation_pb2_grpc.add_GenerationServicer_to_server(_Servicer(self), server)
        admin_pb2_grpc.add_KVAdminServicer_to_server(_Admin(self), server)
        self._health = health.aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self._health, server)
        if self.credentials is None:
            port = server.add_insecure_port(f"{self.host}:{port}")
        else:
            port = server.add_secure_port(f"{self.host}:{port}", self.credentials)
        await server.start()
        await self.set_health(self._status)
        self._server = server
        self.address = f"{self.host}:{port}"
        if self.behaviour is None:
            self.behaviour = prefill_ok(self.address) if self.role == "prefill" else decode_ok()
        return self

    def continued_event(self, request_id: str) -> asyncio.Event:
        """Set once a Continue for ``request_id`` came."""
        return self._continued.setdefault(request_id, asyncio.Event())

    async def restart(self) -> FakeDaemon:
        """Serve again on the same address after `stop` (a daemon restarted in place)."""
        if self._server is not None:
            raise RuntimeError("restart() after stop()")
        return await self.start(int(self.address.rsplit(":", 1)[1]))

    async def set_health(self, status: int) -> None:
        self._status = status
        await self._health.set("", status)

    async def stop(self) -> None:
        if self._server is not None:
            await self._server.stop(grace=None)
            self._server = None


def load_status(running: int = 0, waiting: int = 0, used: int = 0, free: int = 64):
    """A KVAdmin status reporting that load."""
    return admin_pb2.GetStatusResponse(
        num_running_requests=running,
        num_waiting_requests=waiting,
        num_used_blocks=used,
        num_free_blocks=free,
    )


class _Admin(admin_pb2_grpc.KVAdminServicer):
    def __init__(self, daemon: FakeDaemon) -> None:
        self._daemon = daemon

    async def GetStatus(self, request, context):
        if self._daemon.status is None:
            await context.abort(grpc.StatusCode.UNIMPLEMENTED, "no KVAdmin here")
        return self._daemon.status


class _Servicer(generation_pb2_grpc.GenerationServicer):
    def __init__(self, daemon: FakeDaemon) -> None:
        self._daemon = daemon

    async def Continue(self, request, context):
        self._daemon.continues.append(request)
        self._daemon.continued_event(request.request_id).set()
        return generation_pb2.ContinueResponse()

    async def ReleaseKV(self, request, context):
        self._daemon.releases.append(request)
        self._daemon.released.set()
        return await self._daemon.release_behaviour(request, context)

    async def Generate(self, request, context):
        daemon = self._daemon
        daemon.requests.append(request)
        daemon.received.set()
        if daemon.behaviour is None:
            raise RuntimeError("FakeDaemon.start() sets a behaviour")
        # Cancellation is read off the call's end, not from `except CancelledError`: a cancel
        # that lands while grpc sends a message is raised in grpc's frame, not this one (and
        # grpc.aio's context.cancelled() stays False). A call cancelled or past its deadline
        # ends before the behaviour returned or raised (an abort raises).
        ended = False

        def on_done(_: grpc.aio.ServicerContext) -> None:
            if not ended:
                daemon.cancelled.append(request.request_id)
                daemon.cancelled_event.set()

        context.add_done_callback(on_done)
        _SERVING.set(daemon)
        try:
            async for reply in daemon.behaviour(request, context):
                yield reply
        except asyncio.CancelledError:
            raise
        except BaseException:
            ended = True
            raise
        ended = True
