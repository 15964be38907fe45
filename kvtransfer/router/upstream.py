"""The router's gRPC side: healthy daemons picked round-robin, prefill then decode, errors typed.

Health. Each role's daemons form a `DaemonPool`. A daemon is picked only while healthy: its last
grpc.health.v1 ``Check`` answered SERVING and no call failed at the transport level since. A
call that fails with UNAVAILABLE (refused, reset, draining), or a ``Generate`` call that fails
with DEADLINE_EXCEEDED before the daemon sent anything, ejects the daemon at once; a background
task checks every daemon each ``health_interval_s`` (deadline ``health_timeout_s``) and
re-admits it once it answers SERVING; while any daemon is out, checks run every
``RECOVERY_INTERVAL_S`` (0.2 s) instead, so a false ejection, a restart or a resumed daemon costs
a fraction of a second once the daemon is ready. NOT_SERVING
(draining) daemons are not picked. A daemon's state is ``SERVING``, ``NOT_SERVING``,
``SERVICE_UNKNOWN`` or ``UNREACHABLE (<code>)`` (its last check or call failed with that gRPC
code); ``NOT_CHECKED`` only before the first check, which runs before the router serves.
Ejections and re-admissions are logged and counted.

Everything that goes wrong upstream becomes an `UpstreamError` carrying the HTTP status to
answer, the role and address of the daemon at fault, and a short ``reason`` label (metrics):

============================================  ======  ============================================
upstream outcome                              HTTP    why
============================================  ======  ============================================
INVALID_ARGUMENT                              400     the daemon refused the input (its message
                                                      names the field and is passed through)
RESOURCE_EXHAUSTED                            400     the prompt can never fit the daemon's block
                                                      pool: retrying (what 429 invites) won't help
a message over a gRPC size limit              413     the daemons take less than the router's
                                                      ``max_request_bytes``: set both the same
no healthy daemon of a role                   503     `NoHealthyDaemon`, naming each one's state;
                                                      raised before anything is sent
UNAVAILABLE (draining, down, unreachable)     503     another daemon or a later retry may work
DEADLINE_EXCEEDED (``request_timeout_s``)     503     same; the message names the daemon
prefill ended with finish_reason "error",     502     the daemon answered, but not usably
or without kv_transfer_params
decode ended with finish_reason "error"       502     (SSE error event if bytes were already sent)
a stream that ended without a final message   502
any other gRPC status (INTERNAL, ...)         502
============================================  ======  ============================================

``Upstream.release_kv`` gives a prefill's KV back (``Generation.ReleaseKV``) when no decode will
pull it; it answers an outcome label and never raises.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import AsyncGenerator, Callable, Mapping, Sequence
from dataclasses import dataclass, field

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kvtransfer.clients.generation import generate_request as build_generate_request
from kvtransfer.router.openai_api import ChatMessages, Choice
from kvtransfer.v1 import generation_pb2, generation_pb2_grpc

logger = logging.getLogger("kvtransfer.router.upstream")

# kv_stream: announce the params as soon as the blocks are known and serve each layer once
# computed, so the decode daemon is called while the prefill still computes.
PREFILL_PARAMS_JSON = json.dumps({"do_remote_decode": True, "kv_stream": True})
PREFILL_PARAMS_NO_STREAM_JSON = json.dumps({"do_remote_decode": True})
SERVING = "SERVING"
NOT_CHECKED = "NOT_CHECKED"

_STATUS_FOR_CODE = {
    grpc.StatusCode.INVALID_ARGUMENT: 400,
    grpc.StatusCode.RESOURCE_EXHAUSTED: 400,
    grpc.StatusCode.UNAVAILABLE: 503,
    grpc.StatusCode.DEADLINE_EXCEEDED: 503,
}
# gRPC's own words when a message exceeds max_send/receive_message_length (either side).
_SIZE_LIMIT_DETAILS = "message larger than max"

HealthListener = Callable[["Daemon", bool, str, bool], None]
"""``(daemon, healthy, state, first)``: called when a daemon's health is first known and each
time it flips; ``first`` marks the start-up check."""

# Health-check pace while some daemon is out of the pool (at most the configured interval).
RECOVERY_INTERVAL_S = 0.2


class UpstreamError(RuntimeError):
    """A daemon failed the request: ``status`` is the HTTP status to answer with."""

    def __init__(
        self,
        status: int,
        message: str,
        role: str,
        address: str,
        reason: str = "error",
        *,
        text: str | None = None,
    ) -> None:
        super().__init__(text or f"{role} daemon {address}: {message}")
        self.status = status
        self.message = message
        self.role = role
        self.address = address
        self.reason = reason


class NoHealthyDaemon(UpstreamError):
    """No daemon of ``role`` is healthy: 503 at once, naming each daemon and its state."""

    def __init__(self, role: str, states: Mapping[str, str]) -> None:
        listed = "; ".join(f"{address}: {state}" for address, state in states.items())
        message = f"no {role} daemon is healthy ({listed})"
        super().__init__(503, message, role, ", ".join(states), "no_healthy_daemon", text=message)


@dataclass(frozen=True)
class Daemon:
    role: str
    address: str
    channel: grpc.aio.Channel
    stub: generation_pb2_grpc.GenerationStub


@dataclass
class _Health:
    state: str = NOT_CHECKED
    healthy: bool = False
    # time.monotonic() of the last ejection by a failed call: a check that began before it
    # saw the daemon earlier and must not re-admit it.
    ejected_at: float = float("-inf")


class DaemonPool:
    """The daemons of one role: one channel each, reused by every request; ``pick`` is
    round-robin over the healthy ones (one asyncio loop, so no lock)."""

    def __init__(
        self,
        role: str,
        addresses: Sequence[str],
        credentials: grpc.ChannelCredentials | None,
        *,
        options: Sequence[tuple[str, int | str]] = (),
        on_health: HealthListener | None = None,
    ) -> None:
        if not addresses:
            raise ValueError(f"at least one {role} daemon is required")
        self.role = role
        self.daemons = tuple(_connect(role, a, credentials, options) for a in addresses)
        self._health = {d.address: _Health() for d in self.daemons}
        self._on_health = on_health
        self._next = 0
        self._probing: asyncio.Task[None] | None = None

    def pick(self) -> Daemon:
        """The next healthy daemon in turn; `NoHealthyDaemon` when there is none."""
        for _ in self.daemons:
            daemon = self.daemons[self._next]
            self._next = (self._next + 1) % len(self.daemons)
            if self._health[daemon.address].healthy:
                return daemon
        raise NoHealthyDaemon(self.role, self.states())

    def require_healthy(self) -> None:
        """Raises `NoHealthyDaemon` unless some daemon may be picked."""
        if not self.any_healthy():
            raise NoHealthyDaemon(self.role, self.states())

    def any_healthy(self) -> bool:
        return any(h.healthy for h in self._health.values())

    def states(self) -> dict[str, str]:
        """address -> state (see the module docstring), as last seen; no call is made."""
        return {address: health.state for address, health in self._health.items()}

    def eject(self, daemon: Daemon, code: grpc.StatusCode, details: str) -> None:
        """A call to ``daemon`` failed at the transport level: stop picking it now."""
        self._health[daemon.address].ejected_at = time.monotonic()
        self._set(daemon, False, f"UNREACHABLE ({code.name})", f"a call failed: {details}")

    async def check(self, timeout_s: float) -> None:
        """Health-check every daemon concurrently and apply the answers."""
        started = time.monotonic()
        states = await asyncio.gather(*(_check(d, timeout_s) for d in self.daemons))
        for daemon, state in zip(self.daemons, states, strict=True):
            if state == SERVING and self._health[daemon.address].ejected_at >= started:
                continue
            self._set(daemon, state == SERVING, state, "health check")

    def start_checking(self, interval_s: float, timeout_s: float) -> None:
        """Check every ``interval_s`` in the background, until `close`."""
        if self._probing is None:
            self._probing = asyncio.create_task(self._check_forever(interval_s, timeout_s))

    async def close(self) -> None:
        probing, self._probing = self._probing, None
        if probing is not None:
            probing.cancel()
            await asyncio.gather(probing, return_exceptions=True)
        await asyncio.gather(*(d.channel.close() for d in self.daemons))

    async def _check_forever(self, interval_s: float, timeout_s: float) -> None:
        while True:
            # A daemon out of the pool is looked at more often, so one that restarted or
            # resumed serves again within a fraction of a second of being ready.
            healthy = all(h.healthy for h in self._health.values())
            await asyncio.sleep(interval_s if healthy else min(interval_s, RECOVERY_INTERVAL_S))
            try:
                await self.check(timeout_s)
            except Exception:  # a bug here must not silently end health checking
                logger.exception("%s health check failed", self.role)

    def _set(self, daemon: Daemon, healthy: bool, state: str, why: str) -> None:
        health = self._health[daemon.address]
        first = health.state == NOT_CHECKED
        flipped = health.healthy != healthy
        health.state, health.healthy = state, healthy
        name = f"{self.role} daemon {daemon.address}"
        if first:
            if healthy:
                logger.info("%s: %s at start-up", name, state)
            else:
                logger.warning("%s: %s at start-up, not picked until SERVING", name, state)
        elif flipped and healthy:
            logger.info("%s re-admitted: %s", name, state)
        elif flipped:
            logger.warning("%s ejected: %s (%s)", name, state, why)
        if (first or flipped) and self._on_health is not None:
            self._on_health(daemon, healthy, state, first)


def _connect(
    role: str,
    address: str,
    credentials: grpc.ChannelCredentials | None,
    options: Sequence[tuple[str, int | str]],
) -> Daemon:
    if credentials is None:
        channel = grpc.aio.insecure_channel(address, options=list(options))
    else:
        channel = grpc.aio.secure_channel(address, credentials, options=list(options))
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
    """A prefill call's outcome: its final message holds the request's first token."""

    daemon: Daemon
    final: generation_pb2.GenerateResponse

    @property
    def kv_transfer_params_json(self) -> str:
        """The params its KV is pulled (or released) with; empty when none is held."""
        return self.final.kv_transfer_params_json

    @property
    def continues(self) -> bool:
        """Whether a decode daemon goes on: the first token was cut by max_tokens 1 of the
        prefill (a stop or end of sequence ends the request here)."""
        return self.final.finish_reason == "length" and bool(self.kv_transfer_params_json)


@dataclass
class Upstream:
    """Prefill then decode for one request, on daemons it picks; every call has a deadline."""

    prefill: DaemonPool
    decode: DaemonPool
    _pools: dict[str, DaemonPool] = field(init=False)

    def __post_init__(self) -> None:
        self._pools = {self.prefill.role: self.prefill, self.decode.role: self.decode}

    async def start(self, interval_s: float, timeout_s: float) -> None:
        """Check every daemon once (so the first request sees real health), then keep
        checking in the background."""
        await asyncio.gather(self.prefill.check(timeout_s), self.decode.check(timeout_s))
        self.prefill.start_checking(interval_s, timeout_s)
        self.decode.start_checking(interval_s, timeout_s)

    async def run_prefill(
        self,
        request_id: str,
        request: Choice,
        deadline: float,
        on_params: Callable[[generation_pb2.GenerateResponse], None] | None = None,
    ) -> PrefillResult:
        """The prompt and the request's first token on the next prefill daemon.

        ``deadline`` is a `time.monotonic` instant. The prefill samples with every option of
        the request (stop strings included: a stop in the first token ends the request, as it
        would colocated). Its KV is held for a decode daemon unless ``max_tokens`` is 1.
        ``on_params`` gets, once, the stream so far (header included: the prompt's tokens of
        a chat) when the daemon announces its params before its final message (its KV is
        being computed).
        """
        daemon = self.prefill.pick()
        message = generate_request(request_id, request, request.prompt, max_tokens=1)
        if request.max_tokens > 1:
            message.kv_transfer_params_json = (
                PREFILL_PARAMS_JSON if on_params is not None else PREFILL_PARAMS_NO_STREAM_JSON
            )
        final: generation_pb2.GenerateResponse | None = None
        first = generation_pb2.GenerateResponse()
        async with contextlib.aclosing(_call(self.prefill, daemon, message, deadline)) as replies:
            async for reply in replies:
                if final is not None:
                    continue
                # One message of the whole stream: the header and any tokens before the end.
                first.token_ids.extend(reply.token_ids)
                first.text += reply.text
                first.logprobs.extend(reply.logprobs)
                first.prompt_token_ids.extend(reply.prompt_token_ids)
                first.num_prompt_tokens = reply.num_prompt_tokens or first.num_prompt_tokens
                if not reply.finished and reply.kv_transfer_params_json and on_params:
                    first.kv_transfer_params_json = reply.kv_transfer_params_json
                    on_params(first)
                    on_params = None
                if reply.finished:
                    final = reply
        if final is None:
            raise _fault(daemon, "the stream ended without a final message", "incomplete_stream")
        if final.finish_reason == "error":
            raise _fault(daemon, final.error or "finished with an error", "finish_error")
        for name in ("request_id", "finished", "finish_reason", "kv_transfer_params_json"):
            setattr(first, name, getattr(final, name))
        first.metrics.CopyFrom(final.metrics)
        result = PrefillResult(daemon, first)
        if request.max_tokens > 1 and final.finish_reason == "length" and not result.continues:
            raise _fault(daemon, "no kv_transfer_params in its final message", "no_kv_params")
        if isinstance(request.prompt, ChatMessages) and not first.prompt_token_ids:
            message = "no prompt_token_ids for a chat prompt (a daemon older than the router?)"
            raise _fault(daemon, message, "no_prompt_tokens")
        return result

    def pick_decode(self) -> Daemon:
        return self.decode.pick()

    def run_decode(
        self,
        daemon: Daemon,
        request_id: str,
        request: Choice,
        prefill: generation_pb2.GenerateResponse,
        deadline: float,
        generated_token_ids: Sequence[int] | None,
    ) -> CallStream:
        """Decode messages as they arrive; close the iterator to cancel the call.

        The decode daemon continues after the prefill's first token, with the KV params of
        ``prefill`` (its stream so far); a chat prompt is given as the tokens the prefill
        rendered, so both engines hold the same prompt. ``generated_token_ids`` None: the
        token is not known yet (the prefill still runs), it comes through `continue_decode`."""
        prompt: str | Sequence[int] | ChatMessages = request.prompt
        if isinstance(prompt, ChatMessages):
            prompt = tuple(prefill.prompt_token_ids)
        kv_transfer_params_json = prefill.kv_transfer_params_json
        message = generate_request(request_id, request, prompt, max_tokens=request.max_tokens)
        message.kv_transfer_params_json = kv_transfer_params_json
        if generated_token_ids is None:
            message.await_generated_tokens = True
        else:
            message.generated_token_ids.extend(generated_token_ids)
        return _call(self.decode, daemon, message, deadline)

    async def continue_decode(
        self, daemon: Daemon, request_id: str, token_ids: Sequence[int], deadline: float
    ) -> str | None:
        """Give a decode started early its first token(s); None on success, else why not
        (the decode stream then says what happened to the request)."""
        message = generation_pb2.ContinueRequest(
            request_id=request_id, generated_token_ids=list(token_ids)
        )
        try:
            await daemon.stub.Continue(message, timeout=max(0.001, deadline - time.monotonic()))
        except grpc.aio.AioRpcError as exc:
            return f"{exc.code().name}: {exc.details()}"
        return None

    async def release_kv(self, prefill: PrefillResult, request_id: str, timeout_s: float) -> str:
        """``ReleaseKV`` on the prefill daemon that returned ``prefill``'s params, verbatim.

        Returns the outcome: "released", "not_held" (already pulled, released or expired), or
        the gRPC code's name. Never raises: nobody waits for it but the metrics.
        """
        daemon = prefill.daemon
        message = generation_pb2.ReleaseKVRequest(
            request_id=request_id, kv_transfer_params_json=prefill.kv_transfer_params_json
        )
        try:
            answer = await daemon.stub.ReleaseKV(message, timeout=timeout_s)
        except grpc.aio.AioRpcError as exc:
            # Not DEADLINE_EXCEEDED: the release waits for the engine's current step, which may
            # outlast release_timeout_s on a healthy daemon; the health checks judge liveness.
            if exc.code() == grpc.StatusCode.UNAVAILABLE:
                self._pools[daemon.role].eject(daemon, exc.code(), exc.details() or "")
            return exc.code().name
        return "released" if answer.released else "not_held"

    async def close(self) -> None:
        await asyncio.gather(self.prefill.close(), self.decode.close())


def _call(
    pool: DaemonPool, daemon: Daemon, message: generation_pb2.GenerateRequest, deadline: float
) -> CallStream:
    """Start the call now (it is sent as soon as the event loop runs, even before the first
    message is awaited) and stream its answer."""
    timeout_s = deadline - time.monotonic()
    if timeout_s <= 0:
        reason = grpc.StatusCode.DEADLINE_EXCEEDED.name
        text = f"{reason}: the request timeout ran out before this call"
        raise UpstreamError(503, text, daemon.role, daemon.address, reason)
    return CallStream(pool, daemon, daemon.stub.Generate(message, timeout=timeout_s))


class CallStream:
    """A started Generate call's messages; `aclose` (e.g. through ``contextlib.aclosing``)
    cancels the call, also when it was never iterated."""

    def __init__(self, pool: DaemonPool, daemon: Daemon, call: grpc.aio.UnaryStreamCall) -> None:
        self._call = call
        self._messages = _stream(pool, daemon, call)

    def __aiter__(self) -> CallStream:
        return self

    async def __anext__(self) -> generation_pb2.GenerateResponse:
        return await self._messages.__anext__()

    async def aclose(self) -> None:
        await self._messages.aclose()
        self._call.cancel()


async def _stream(
    pool: DaemonPool, daemon: Daemon, call: grpc.aio.UnaryStreamCall
) -> AsyncGenerator[generation_pb2.GenerateResponse, None]:
    answered = False
    try:
        async for reply in call:
            answered = True
            yield reply
    except grpc.aio.AioRpcError as exc:
        raise _call_failed(pool, daemon, exc, answered) from None
    finally:
        # Reached on cancellation (the HTTP client went away) and on early close: cancelling
        # the call makes the daemon abort the request and free its blocks.
        call.cancel()


def _call_failed(
    pool: DaemonPool, daemon: Daemon, exc: grpc.aio.AioRpcError, answered: bool
) -> UpstreamError:
    code, details = exc.code(), exc.details() or ""
    # A deadline hit while the daemon was streaming is the request's length, not a dead daemon.
    if code == grpc.StatusCode.UNAVAILABLE or (
        code == grpc.StatusCode.DEADLINE_EXCEEDED and not answered
    ):
        pool.eject(daemon, code, details)
    if code == grpc.StatusCode.RESOURCE_EXHAUSTED and _SIZE_LIMIT_DETAILS in details.lower():
        message = (
            f"{code.name}: the request is larger than this daemon's gRPC message limit "
            f"({details}); give the router and every daemon the same --max-request-bytes"
        )
        return UpstreamError(413, message, daemon.role, daemon.address, "message_too_large")
    status = _STATUS_FOR_CODE.get(code, 502)
    return UpstreamError(status, f"{code.name}: {details}", daemon.role, daemon.address, code.name)


def _fault(daemon: Daemon, message: str, reason: str) -> UpstreamError:
    return UpstreamError(502, message, daemon.role, daemon.address, reason)


def generate_request(
    request_id: str,
    request: Choice,
    prompt: str | Sequence[int] | ChatMessages,
    *,
    max_tokens: int,
) -> generation_pb2.GenerateRequest:
    """The Generate message for ``request`` with ``prompt``, capped at ``max_tokens``."""
    if isinstance(prompt, ChatMessages):
        prompt = generation_pb2.ChatPrompt(
            messages_json=prompt.messages_json,
            add_generation_prompt=prompt.add_generation_prompt,
        )
    return build_generate_request(
        request_id,
        prompt,
        max_tokens,
        temperature=request.temperature,
        top_p=request.top_p,
        seed=request.seed,
        stop=request.stop,
        ignore_eos=request.ignore_eos,
        logprobs=request.logprobs,
    )
