"""The router's gRPC side: daemons picked round-robin, prefill then decode, errors typed.

Everything that goes wrong upstream becomes an `UpstreamError` carrying the HTTP status to
answer, the role and address of the daemon at fault, and a short ``reason`` label (metrics):

============================================  ======  ============================================
upstream outcome                              HTTP    why
============================================  ======  ============================================
INVALID_ARGUMENT                              400     the daemon refused the input (its message
                                                      names the field and is passed through)
RESOURCE_EXHAUSTED                            400     the prompt can never fit the daemon's block
                                                      pool: retrying (what 429 invites) won't help
UNAVAILABLE (draining, down, unreachable)     503     another daemon or a later retry may work
DEADLINE_EXCEEDED (``request_timeout_s``)     503     same; the message names the daemon
prefill ended with finish_reason "error",     502     the daemon answered, but not usably
or without kv_transfer_params
decode ended with finish_reason "error"       502     (SSE error event if bytes were already sent)
a stream that ended without a final message   502
any other gRPC status (INTERNAL, ...)         502
============================================  ======  ============================================
"""

from __future__ import annotations

import asyncio
import itertools
import json
import time
from collections.abc import AsyncGenerator, Sequence
from dataclasses import dataclass

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kvtransfer.router.openai_api import CompletionRequest
from kvtransfer.serve.client import generate_request as build_generate_request
from kvtransfer.v1 import generation_pb2, generation_pb2_grpc

PREFILL_PARAMS_JSON = json.dumps({"do_remote_decode": True})

_STATUS_FOR_CODE = {
    grpc.StatusCode.INVALID_ARGUMENT: 400,
    grpc.StatusCode.RESOURCE_EXHAUSTED: 400,
    grpc.StatusCode.UNAVAILABLE: 503,
    grpc.StatusCode.DEADLINE_EXCEEDED: 503,
}


class UpstreamError(RuntimeError):
    """A daemon failed the request: ``status`` is the HTTP status to answer with."""

    def __init__(
        self, status: int, message: str, role: str, address: str, reason: str = "error"
    ) -> None:
        super().__init__(f"{role} daemon {address}: {message}")
        self.status = status
        self.message = message
        self.role = role
        self.address = address
        self.reason = reason


@dataclass(frozen=True)
class Daemon:
    role: str
    address: str
    channel: grpc.aio.Channel
    stub: generation_pb2_grpc.GenerationStub


class DaemonPool:
    """The daemons of one role: one channel each, reused by every request; ``pick`` is
    round-robin (one asyncio loop, so the shared cycle needs no lock)."""

    def __init__(
        self, role: str, addresses: Sequence[str], credentials: grpc.ChannelCredentials | None
    ) -> None:
        if not addresses:
            raise ValueError(f"at least one {role} daemon is required")
        self.role = role
        self.daemons = tuple(_connect(role, address, credentials) for address in addresses)
        self._turns = itertools.cycle(self.daemons)

    def pick(self) -> Daemon:
        return next(self._turns)

    async def health(self, timeout_s: float) -> dict[str, str]:
        """address -> serving status name, or ``UNREACHABLE (<code>)``; checked concurrently."""
        states = await asyncio.gather(*(_check(d, timeout_s) for d in self.daemons))
        return {d.address: state for d, state in zip(self.daemons, states, strict=True)}

    async def close(self) -> None:
        await asyncio.gather(*(d.channel.close() for d in self.daemons))


def _connect(role: str, address: str, credentials: grpc.ChannelCredentials | None) -> Daemon:
    if credentials is None:
        channel = grpc.aio.insecure_channel(address)
    else:
        channel = grpc.aio.secure_channel(address, credentials)
    return Daemon(role, address, channel, generation_pb2_grpc.GenerationStub(channel))


async def _check(daemon: Daemon, timeout_s: float) -> str:
    stub = health_pb2_grpc.HealthStub(daemon.channel)
    try:
        answer = await stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=timeout_s)
    except grpc.aio.AioRpcError as exc:
        return f"UNREACHABLE ({exc.code().name})"
    return health_pb2.HealthCheckResponse.ServingStatus.Name(answer.status)


@dataclass(frozen=True)
class PrefillResult:
    daemon: Daemon
    kv_transfer_params_json: str


class Upstream:
    """Prefill then decode for one request, on daemons it picks; every call has a deadline."""

    def __init__(self, prefill: DaemonPool, decode: DaemonPool) -> None:
        self.prefill = prefill
        self.decode = decode

    async def run_prefill(
        self, request_id: str, request: CompletionRequest, deadline: float
    ) -> PrefillResult:
        """One token on the next prefill daemon; returns the params its final message carries.

        ``deadline`` is a `time.monotonic` instant. Stop strings stay off the prefill: a stop
        matched in its one token would end the request before the KV is handed over.
        """
        daemon = self.prefill.pick()
        message = generate_request(request_id, request, max_tokens=1, stop=False)
        message.kv_transfer_params_json = PREFILL_PARAMS_JSON
        final: generation_pb2.GenerateResponse | None = None
        async for reply in _call(daemon, message, deadline):
            if reply.finished:
                final = reply
        if final is None:
            raise _fault(daemon, "the stream ended without a final message", "incomplete_stream")
        if final.finish_reason == "error":
            raise _fault(daemon, final.error or "finished with an error", "finish_error")
        if not final.kv_transfer_params_json:
            raise _fault(daemon, "no kv_transfer_params in its final message", "no_kv_params")
        return PrefillResult(daemon, final.kv_transfer_params_json)

    def pick_decode(self) -> Daemon:
        return self.decode.pick()

    def run_decode(
        self,
        daemon: Daemon,
        request_id: str,
        request: CompletionRequest,
        kv_transfer_params_json: str,
        deadline: float,
    ) -> AsyncGenerator[generation_pb2.GenerateResponse, None]:
        """Decode messages as they arrive; close the iterator to cancel the call."""
        message = generate_request(request_id, request, max_tokens=request.max_tokens)
        message.kv_transfer_params_json = kv_transfer_params_json
        return _call(daemon, message, deadline)

    async def close(self) -> None:
        await asyncio.gather(self.prefill.close(), self.decode.close())


async def _call(
    daemon: Daemon, message: generation_pb2.GenerateRequest, deadline: float
) -> AsyncGenerator[generation_pb2.GenerateResponse, None]:
    timeout_s = deadline - time.monotonic()
    if timeout_s <= 0:
        reason = grpc.StatusCode.DEADLINE_EXCEEDED.name
        message = f"{reason}: the request timeout ran out before this call"
        raise UpstreamError(503, message, daemon.role, daemon.address, reason)
    call = daemon.stub.Generate(message, timeout=timeout_s)
    try:
        async for reply in call:
            yield reply
    except grpc.aio.AioRpcError as exc:
        code = exc.code()
        status = _STATUS_FOR_CODE.get(code, 502)
        raise UpstreamError(
            status, f"{code.name}: {exc.details()}", daemon.role, daemon.address, code.name
        ) from None
    finally:
        # Reached on cancellation (the HTTP client went away) and on early close: cancelling
        # the call makes the daemon abort the request and free its blocks.
        call.cancel()


def _fault(daemon: Daemon, message: str, reason: str) -> UpstreamError:
    return UpstreamError(502, message, daemon.role, daemon.address, reason)


def generate_request(
    request_id: str, request: CompletionRequest, *, max_tokens: int, stop: bool = True
) -> generation_pb2.GenerateRequest:
    """The Generate message for ``request``; ``stop=False`` leaves the stop strings out."""
    return build_generate_request(
        request_id,
        request.prompt,
        max_tokens,
        temperature=request.temperature,
        top_p=request.top_p,
        seed=request.seed,
        stop=request.stop if stop else (),
    )
