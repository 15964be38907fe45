"""The router's gRPC side: daemons picked round-robin, prefill then decode, errors typed.

`Upstream.completion` yields decode messages as they stream; everything that goes wrong
becomes an `UpstreamError` with the HTTP status to answer, the role and address of the daemon
at fault, and its reason.
"""

from __future__ import annotations

import itertools
import json
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kvtransfer.router.openai_api import CompletionRequest
from kvtransfer.v1 import generation_pb2, generation_pb2_grpc

_STATUS_FOR_CODE = {
    grpc.StatusCode.INVALID_ARGUMENT: 400,
    grpc.StatusCode.ALREADY_EXISTS: 409,
    grpc.StatusCode.RESOURCE_EXHAUSTED: 400,  # the prompt can never fit: the client must change
    grpc.StatusCode.UNAVAILABLE: 503,
    grpc.StatusCode.DEADLINE_EXCEEDED: 504,
}


class UpstreamError(RuntimeError):
    def __init__(self, status: int, role: str, address: str, reason: str) -> None:
        super().__init__(f"{role} daemon {address}: {reason}")
        self.status = status
        self.role = role
        self.address = address
        self.reason = reason


@dataclass
class Daemon:
    role: str
    address: str
    channel: grpc.aio.Channel
    stub: generation_pb2_grpc.GenerationStub


class DaemonPool:
    """One channel per daemon, reused; ``pick`` goes round-robin."""

    def __init__(
        self,
        role: str,
        addresses: Sequence[str],
        credentials: grpc.ChannelCredentials | None,
    ) -> None:
        if not addresses:
            raise ValueError(f"at least one --{role} daemon is required")
        self.daemons = []
        for address in addresses:
            channel = (
                grpc.aio.secure_channel(address, credentials)
                if credentials is not None
                else grpc.aio.insecure_channel(address)
            )
            self.daemons.append(
                Daemon(role, address, channel, generation_pb2_grpc.GenerationStub(channel))
            )
        self._next = itertools.cycle(self.daemons)

    def pick(self) -> Daemon:
        return next(self._next)

    async def health(self, timeout_s: float) -> dict[str, str]:
        status = {}
        for daemon in self.daemons:
            stub = health_pb2_grpc.HealthStub(daemon.channel)
            try:
                answer = await stub.Check(health_pb2.HealthCheckRequest(), timeout=timeout_s)
                status[daemon.address] = health_pb2.HealthCheckResponse.ServingStatus.Name(
                    answer.status
                )
            except grpc.aio.AioRpcError as exc:
                status[daemon.address] = f"UNREACHABLE ({exc.code().name})"
        return status

    async def close(self) -> None:
        for daemon in self.daemons:
            await daemon.channel.close()


@dataclass
class PrefillResult:
    daemon: Daemon
    kv_transfer_params_json: str


class Upstream:
    def __init__(self, prefill: DaemonPool, decode: DaemonPool, timeout_s: float) -> None:
        self.prefill = prefill
        self.decode = decode
        self.timeout_s = timeout_s

    async def run_prefill(
        self, request_id: str, request: CompletionRequest, deadline_s: float
    ) -> PrefillResult:
        daemon = self.prefill.pick()
        message = _generate_request(request_id, request, max_tokens=1)
        message.kv_transfer_params_json = json.dumps({"do_remote_decode": True})
        final = None
        async for reply in self._call(daemon, message, deadline_s):
            if reply.finished:
                final = reply
        if final is None:
            raise UpstreamError(502, "prefill", daemon.address, "the stream ended unfinished")
        if final.finish_reason == "error":
            raise UpstreamError(502, "prefill", daemon.address, final.error or "failed")
        if not final.kv_transfer_params_json:
            raise UpstreamError(
                502, "prefill", daemon.address, "no kv_transfer_params in its answer"
            )
        return PrefillResult(daemon, final.kv_transfer_params_json)

    def pick_decode(self) -> Daemon:
        return self.decode.pick()

    async def run_decode(
        self,
        daemon: Daemon,
        request_id: str,
        request: CompletionRequest,
        kv_transfer_params_json: str,
        deadline_s: float,
    ) -> AsyncIterator[generation_pb2.GenerateResponse]:
        message = _generate_request(request_id, request, max_tokens=request.max_tokens)
        message.kv_transfer_params_json = kv_transfer_params_json
        async for reply in self._call(daemon, message, deadline_s):
            yield reply

    async def _call(
        self, daemon: Daemon, message: generation_pb2.GenerateRequest, timeout_s: float
    ) -> AsyncIterator[generation_pb2.GenerateResponse]:
        call = daemon.stub.Generate(message, timeout=timeout_s)
        try:
            async for reply in call:
                yield reply
        except grpc.aio.AioRpcError as exc:
            status = _STATUS_FOR_CODE.get(exc.code(), 502)
            reason = f"{exc.code().name}: {exc.details()}"
            raise UpstreamError(status, daemon.role, daemon.address, reason) from None
        finally:
            # A client that went away cancels us here: the daemon aborts the request.
            call.cancel()

    async def close(self) -> None:
        await self.prefill.close()
        await self.decode.close()


def _generate_request(
    request_id: str, request: CompletionRequest, max_tokens: int
) -> generation_pb2.GenerateRequest:
    sampling = generation_pb2.SamplingOptions(
        max_tokens=max_tokens, temperature=request.temperature, top_p=request.top_p
    )
    sampling.stop.extend(request.stop)
    if request.seed is not None:
        sampling.seed = request.seed
    message = generation_pb2.GenerateRequest(request_id=request_id, sampling=sampling)
    if isinstance(request.prompt, str):
        message.text = request.prompt
    else:
        message.token_ids.ids.extend(request.prompt)
    return message
