"""The router's gRPC calls to the daemons: prefill, decode, decode alone, Continue, ReleaseKV;
every call has a deadline and every failure is typed.

Which daemon runs a call is the caller's pick from the `fleet.Fleet` (health, breaker, policy
are there). A call that fails at the transport level (UNAVAILABLE, or DEADLINE_EXCEEDED before
the daemon sent anything) ejects its instance from the pool (`Fleet.eject`); every failure of
the daemon's own (any 5xx below) counts against its circuit breaker, and a usable answer for
it.

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

A 5xx other than a deadline is `UpstreamError.retryable`: the caller may ask another instance
(`kvtransfer.router.daemon_flow.choice`). ``Upstream.release_kv`` gives a prefill's KV back
(``Generation.ReleaseKV``) when no decode will pull it; it answers an outcome label and never
raises.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import AsyncGenerator, Callable, Sequence
from dataclasses import dataclass, field

import grpc

from kvtransfer.clients.generation import generate_request as build_generate_request
from kvtransfer.router.errors import UpstreamError
from kvtransfer.router.fleet.fleet import Fleet
from kvtransfer.router.fleet.instance import Instance
from kvtransfer.router.openai.requests import ChatMessages, Choice
from kvtransfer.v1 import generation_pb2

logger = logging.getLogger("kvtransfer.router.upstream")

# kv_stream: announce the params as soon as the blocks are known and serve each layer once
# computed, so the decode daemon is called while the prefill still computes.
PREFILL_PARAMS_JSON = json.dumps({"do_remote_decode": True, "kv_stream": True})
PREFILL_PARAMS_NO_STREAM_JSON = json.dumps({"do_remote_decode": True})

_STATUS_FOR_CODE = {
    grpc.StatusCode.INVALID_ARGUMENT: 400,
    grpc.StatusCode.RESOURCE_EXHAUSTED: 400,
    grpc.StatusCode.UNAVAILABLE: 503,
    grpc.StatusCode.DEADLINE_EXCEEDED: 503,
}
# gRPC's own words when a message exceeds max_send/receive_message_length (either side).
_SIZE_LIMIT_DETAILS = "message larger than max"


@dataclass(frozen=True)
class PrefillResult:
    """A prefill call's outcome: its final message holds the request's first token."""

    daemon: Instance
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
    """The calls of a request, on instances of ``fleet`` the caller picked."""

    fleet: Fleet
    # Prefill calls past their final message, read to their end (`_drain`).
    _draining: set[asyncio.Task[None]] = field(default_factory=set)

    async def close(self) -> None:
        """Wait for the prefill calls still being read to their end (each has a deadline)."""
        await asyncio.gather(*self._draining, return_exceptions=True)

    def _drain(self, replies: CallStream) -> None:
        task = asyncio.get_running_loop().create_task(_read_to_end(replies))
        self._draining.add(task)
        task.add_done_callback(self._draining.discard)

    async def run_prefill(
        self,
        daemon: Instance,
        request_id: str,
        request: Choice,
        deadline: float,
        on_params: Callable[[generation_pb2.GenerateResponse], None] | None = None,
    ) -> PrefillResult:
        """The prompt and the request's first token on ``daemon``.

        ``deadline`` is a `time.monotonic` instant. The prefill samples with every option of
        the request (stop strings included: a stop in the first token ends the request, as it
        would colocated). Its KV is held for a decode daemon unless ``max_tokens`` is 1.
        ``on_params`` gets, once, the stream so far (header included: the prompt's tokens of
        a chat) when the daemon announces its params before its final message (its KV is
        being computed).
        """
        message = generate_request(request_id, request, request.prompt, max_tokens=1)
        if request.max_tokens > 1:
            message.kv_transfer_params_json = (
                PREFILL_PARAMS_JSON if on_params is not None else PREFILL_PARAMS_NO_STREAM_JSON
            )
        final: generation_pb2.GenerateResponse | None = None
        first = generation_pb2.GenerateResponse()
        replies = _call(self.fleet, daemon, message, deadline)
        try:
            async for reply in replies:
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
                    break
        except BaseException:
            await replies.aclose()
            raise
        if final is None:
            await replies.aclose()
        else:
            # The first token goes on now; the call's end (its status, a millisecond later)
            # is read in the background, so the call ends on its own: cancelled, the daemon
            # would take it for a client that left and give the KV back.
            self._drain(replies)
        if final is None:
            raise _fault(daemon, "the stream ended without a final message", "incomplete_stream")
        if final.finish_reason == "error":
            raise _fault(daemon, final.error or "finished with an error", "finish_error")
        for name in ("request_id", "finished", "finish_reason", "kv_transfer_params_json"):
            setattr(first, name, getattr(final, name))
        first.metrics.CopyFrom(final.metrics)
        first.spans.extend(final.spans)
        result = PrefillResult(daemon, first)
        if request.max_tokens > 1 and final.finish_reason == "length" and not result.continues:
            raise _fault(daemon, "no kv_transfer_params in its final message", "no_kv_params")
        if isinstance(request.prompt, ChatMessages) and not first.prompt_token_ids:
            message = "no prompt_token_ids for a chat prompt (a daemon older than the router?)"
            raise _fault(daemon, message, "no_prompt_tokens")
        daemon.succeeded()
        return result

    def run_decode(
        self,
        daemon: Instance,
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
        return _call(self.fleet, daemon, message, deadline)

    def run_alone(
        self, daemon: Instance, request_id: str, request: Choice, deadline: float
    ) -> CallStream:
        """The whole request on one (decode) daemon: no kv_transfer_params, so it computes the
        prompt itself, as a colocated engine would."""
        message = generate_request(
            request_id, request, request.prompt, max_tokens=request.max_tokens
        )
        return _call(self.fleet, daemon, message, deadline)

    async def continue_decode(
        self, daemon: Instance, request_id: str, token_ids: Sequence[int], deadline: float
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
        the gRPC code's name. Never raises: nobody waits for it but the metrics. The caller
        holds the daemon's channel open around it (`Fleet.call_started`).
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
                self.fleet.eject(daemon, exc.code(), exc.details() or "")
            return exc.code().name
        return "released" if answer.released else "not_held"


async def _read_to_end(replies: CallStream) -> None:
    try:
        async for _ in replies:
            pass  # nothing follows a final message
    except UpstreamError:
        pass  # the answer is in already; the daemon's own log says what ended the call
    finally:
        await replies.aclose()


def _call(
    fleet: Fleet, daemon: Instance, message: generation_pb2.GenerateRequest, deadline: float
) -> CallStream:
    """Start the call now (it is sent as soon as the event loop runs, even before the first
    message is awaited) and stream its answer."""
    timeout_s = deadline - time.monotonic()
    if timeout_s <= 0:
        reason = grpc.StatusCode.DEADLINE_EXCEEDED.name
        text = f"{reason}: the request timeout ran out before this call"
        raise UpstreamError(503, text, daemon.role, daemon.address, reason)
    return CallStream(fleet, daemon, daemon.stub.Generate(message, timeout=timeout_s))


class CallStream:
    """A started Generate call's messages; `aclose` (e.g. through ``contextlib.aclosing``)
    cancels the call, also when it was never iterated. ``answered``: a message came."""

    def __init__(self, fleet: Fleet, daemon: Instance, call: grpc.aio.UnaryStreamCall) -> None:
        self.daemon = daemon
        self.answered = False
        self._call = call
        self._messages = self._stream(fleet)

    def __aiter__(self) -> CallStream:
        return self

    async def __anext__(self) -> generation_pb2.GenerateResponse:
        return await self._messages.__anext__()

    async def aclose(self) -> None:
        await self._messages.aclose()
        self._call.cancel()

    def cancel(self) -> None:
        """Cancel the call now (its daemon aborts the request); whoever iterates the messages
        gets the end."""
        self._call.cancel()

    async def _stream(self, fleet: Fleet) -> AsyncGenerator[generation_pb2.GenerateResponse, None]:
        call = self._call
        try:
            async for reply in call:
                self.answered = True
                yield reply
        except grpc.aio.AioRpcError as exc:
            raise _call_failed(fleet, self.daemon, exc, self.answered) from None
        finally:
            # Reached on cancellation (the HTTP client went away) and on early close:
            # cancelling the call makes the daemon abort the request and free its blocks.
            call.cancel()


def _call_failed(
    fleet: Fleet, daemon: Instance, exc: grpc.aio.AioRpcError, answered: bool
) -> UpstreamError:
    code, details = exc.code(), exc.details() or ""
    # A deadline hit while the daemon was streaming is the request's length, not a dead daemon.
    dead = code == grpc.StatusCode.UNAVAILABLE or (
        code == grpc.StatusCode.DEADLINE_EXCEEDED and not answered
    )
    if dead:
        fleet.eject(daemon, code, details)
    if code == grpc.StatusCode.RESOURCE_EXHAUSTED and _SIZE_LIMIT_DETAILS in details.lower():
        message = (
            f"{code.name}: the request is larger than this daemon's gRPC message limit "
            f"({details}); give the router and every daemon the same --max-request-bytes"
        )
        return UpstreamError(413, message, daemon.role, daemon.address, "message_too_large")
    status = _STATUS_FOR_CODE.get(code, 502)
    if status >= 500 and (dead or code != grpc.StatusCode.DEADLINE_EXCEEDED):
        daemon.failed(unreachable=dead)
    return UpstreamError(status, f"{code.name}: {details}", daemon.role, daemon.address, code.name)


def _fault(daemon: Instance, message: str, reason: str) -> UpstreamError:
    daemon.failed()
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
