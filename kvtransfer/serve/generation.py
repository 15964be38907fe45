"""`GenerationService`: the gRPC ``Generation`` service of a daemon.

Each ``Generate`` call is one request: validated here (a bad field is INVALID_ARGUMENT before
the engine sees anything), queued on the engine thread, then streamed back as the engine
produces tokens. A cancelled call (the client went away) aborts the request, which frees its
blocks. ``ReleaseKV`` hands the connector's ``release_kv`` the params a finished prefill
returned, on the engine thread, so KV nobody will pull is freed now rather than at its lease's
end.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import time
from collections import OrderedDict
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

import grpc

from kvtransfer.clients.generation import spans_to_proto
from kvtransfer.engine.model.chat_template import ChatTemplate
from kvtransfer.engine.outputs import TokenLogprobs
from kvtransfer.engine.scheduler.request import (
    DuplicateRequestError,
    EngineCoreOutput,
    PromptTooLargeError,
)
from kvtransfer.serve.engine_thread import EngineThread, EngineUnavailable
from kvtransfer.serve.ledger import ServingLedger
from kvtransfer.serve.metrics import DaemonMetrics
from kvtransfer.serve.requests import (
    ParsedRequest,
    RequestError,
    parse_continue_tokens,
    parse_generate_request,
    parse_transfer_params,
)
from kvtransfer.serve.text_stream import TextStream
from kvtransfer.timeline import BOOK, now_ns
from kvtransfer.v1 import generation_pb2, generation_pb2_grpc

logger = logging.getLogger("kvtransfer.serve.requests")

# How long a request waits for the engine to take it (between two steps).
_ADMIT_TIMEOUT_S = 30.0
# A release is one connector call between two steps; a busy engine answers well within this.
_RELEASE_TIMEOUT_S = 10.0
# Continue calls kept for Generate calls that have not arrived yet.
_EARLY_CONTINUES = 1024


@dataclass(frozen=True)
class ServiceContext:
    """What the service needs from its daemon."""

    engine: EngineThread
    tokenizer: Any
    chat_template: ChatTemplate
    vocab_size: int
    ledger: ServingLedger
    metrics: DaemonMetrics
    bytes_per_block: int
    is_admitting: Callable[[], bool]


class GenerationService(generation_pb2_grpc.GenerationServicer):
    def __init__(self, ctx: ServiceContext) -> None:
        self._ctx = ctx
        # Requests started with await_generated_tokens, until continued: their text streams.
        self._awaiting: dict[str, TextStream] = {}
        # Continue calls that came before their Generate call (calls are not ordered).
        self._early: OrderedDict[str, tuple[int, ...]] = OrderedDict()

    async def Generate(
        self, request: generation_pb2.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[generation_pb2.GenerateResponse]:
        ctx = self._ctx
        received_ns = now_ns()
        if not ctx.is_admitting():
            ctx.ledger.count("requests_rejected")
            await context.abort(
                grpc.StatusCode.UNAVAILABLE, "the daemon is draining: not admitting new requests"
            )
        try:
            parsed = parse_generate_request(
                request, ctx.tokenizer, ctx.vocab_size, ctx.chat_template
            )
            early = self._early.pop(parsed.request_id, None)
            if early is not None and parsed.awaits_generated:
                # Continued already: an ordinary request with (or without) its first tokens.
                parsed = dataclasses.replace(
                    parsed, generated_token_ids=early, awaits_generated=False
                )
            text = _text_stream(parsed, ctx.tokenizer)
        except RequestError as exc:
            await self._reject(context, grpc.StatusCode.INVALID_ARGUMENT, str(exc), request)
        admitted = time.monotonic()
        outputs: asyncio.Queue[EngineCoreOutput] = asyncio.Queue()
        loop = asyncio.get_running_loop()

        def sink(output: EngineCoreOutput) -> None:
            loop.call_soon_threadsafe(outputs.put_nowait, output)

        try:
            # No thread of the pool in between: the engine thread completes the future and
            # the loop hears of it at once (a request's first hop on every daemon).
            taken = ctx.engine.add_request(
                parsed.request_id,
                parsed.prompt_token_ids,
                parsed.sampling_params,
                parsed.kv_transfer_params,
                sink,
                parsed.generated_token_ids,
                parsed.awaits_generated,
            )
        except EngineUnavailable as exc:
            await self._reject(context, grpc.StatusCode.UNAVAILABLE, str(exc), request)

        def abandon_once_taken() -> None:
            # Given up on while the engine thread admits it: the request may run all the same,
            # with nobody to read it or the KV it would hold, so it is aborted once admitted.
            if not taken.cancel():
                taken.add_done_callback(
                    lambda done: done.exception() is None and ctx.engine.abandon(rid)
                )

        rid = parsed.request_id
        waiter = asyncio.wrap_future(taken)
        try:
            # Not wait_for: on Python 3.11 it can swallow a cancellation that comes as the
            # future completes, and this call would then wait for tokens forever.
            await asyncio.wait({waiter}, timeout=_ADMIT_TIMEOUT_S)
        except asyncio.CancelledError:
            abandon_once_taken()
            raise
        try:
            if not waiter.done():
                abandon_once_taken()
                message = f"the engine did not take the request within {_ADMIT_TIMEOUT_S:g} s"
                raise TimeoutError(message)
            waiter.result()
        except DuplicateRequestError as exc:
            await self._reject(context, grpc.StatusCode.ALREADY_EXISTS, str(exc), request)
        except PromptTooLargeError as exc:
            await self._reject(context, grpc.StatusCode.RESOURCE_EXHAUSTED, str(exc), request)
        except ValueError as exc:
            await self._reject(context, grpc.StatusCode.INVALID_ARGUMENT, str(exc), request)
        except (EngineUnavailable, TimeoutError) as exc:
            await self._reject(context, grpc.StatusCode.UNAVAILABLE, str(exc), request)
        ctx.ledger.count("requests_started")
        BOOK.record(parsed.request_id, "admit", received_ns, now_ns())
        logger.info(
            "admitted: %d prompt tokens, max_tokens %d%s",
            len(parsed.prompt_token_ids),
            parsed.sampling_params.max_tokens,
            ", with kv_transfer_params" if parsed.kv_transfer_params else "",
            extra={"request_id": parsed.request_id},
        )

        def call_done(_: object) -> None:
            self._awaiting.pop(rid, None)
            # A final message written but the call cancelled all the same: the client may
            # never have read the params in it, so their KV is given back, not left to a lease.
            if context.cancelled():
                ctx.engine.abandon(rid)
            else:
                ctx.engine.delivered(rid)

        # Registered before anything else can wait: a call that ends from here on (also one
        # cancelled while the engine admitted the request) gives the request back.
        context.add_done_callback(call_done)
        finished = False
        try:
            if context.cancelled():
                return  # cancelled during admission, its done callbacks perhaps already run
            if parsed.awaits_generated:
                # A Continue that came while the engine admitted the request was kept: apply
                # it now (no await between this check and registering, so none can slip in).
                late = self._early.pop(rid, None)
                if late is None:
                    self._awaiting[rid] = text
                else:
                    problem = await self._continue(rid, text, late)
                    if problem is not None:
                        logger.info(
                            "kept Continue failed: %s", problem[1], extra={"request_id": rid}
                        )
            async for message in self._stream(parsed, text, outputs, admitted):
                finished = finished or message.finished
                yield message
        finally:
            if not finished:
                # Cancelled by the client, or the stream broke: nobody reads the rest, and KV
                # held for a consumer would reach none.
                self._awaiting.pop(rid, None)
                ctx.engine.abandon(rid)
                BOOK.take(rid)  # nobody will read them
                ctx.ledger.count("requests_aborted")
                ctx.metrics.request_finished("abort")
                logger.info("call cancelled: aborted", extra={"request_id": parsed.request_id})

    async def Continue(
        self, request: generation_pb2.ContinueRequest, context: grpc.aio.ServicerContext
    ) -> generation_pb2.ContinueResponse:
        ctx = self._ctx
        rid = request.request_id or "-"
        try:
            tokens = parse_continue_tokens(request, ctx.vocab_size)
        except RequestError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        text = self._awaiting.pop(rid, None)
        if text is None:
            # Its Generate call has not arrived yet, or is being admitted (it applies this then);
            # or it is gone: then this entry ages out.
            self._early[rid] = tokens
            while len(self._early) > _EARLY_CONTINUES:
                self._early.popitem(last=False)
            return generation_pb2.ContinueResponse()
        problem = await self._continue(rid, text, tokens)
        if problem is not None:
            await context.abort(*problem)
        return generation_pb2.ContinueResponse()

    async def _continue(
        self, rid: str, text: TextStream, tokens: tuple[int, ...]
    ) -> tuple[grpc.StatusCode, str] | None:
        """Give an admitted request awaiting its first tokens those tokens (none: it computes
        its first token itself); the gRPC status and message of a refusal, else None."""
        ctx = self._ctx
        if tokens and text.feed(tokens).stopped:
            ctx.engine.abandon(rid)
            message = "generated_token_ids complete a stop string: the request has ended"
            return grpc.StatusCode.INVALID_ARGUMENT, message
        try:
            await asyncio.to_thread(
                ctx.engine.call, lambda core: core.continue_request(rid, tokens), _RELEASE_TIMEOUT_S
            )
        except KeyError as exc:
            return grpc.StatusCode.NOT_FOUND, str(exc.args[0])
        except ValueError as exc:
            return grpc.StatusCode.INVALID_ARGUMENT, str(exc)
        except (EngineUnavailable, TimeoutError) as exc:
            return grpc.StatusCode.UNAVAILABLE, str(exc)
        logger.info("continued with %d generated tokens", len(tokens), extra={"request_id": rid})
        return None

    async def ReleaseKV(
        self, request: generation_pb2.ReleaseKVRequest, context: grpc.aio.ServicerContext
    ) -> generation_pb2.ReleaseKVResponse:
        ctx = self._ctx
        refuse = _Refusal(ctx.metrics, context, request.request_id or "-")
        if not request.request_id:
            await refuse(grpc.StatusCode.INVALID_ARGUMENT, "request_id must not be empty")
        try:
            params = parse_transfer_params(request.kv_transfer_params_json, required=True)
        except RequestError as exc:
            await refuse(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        try:
            released = await asyncio.to_thread(
                ctx.engine.call, lambda core: core.release_kv(params), _RELEASE_TIMEOUT_S
            )
        except PermissionError as exc:
            await refuse(grpc.StatusCode.PERMISSION_DENIED, str(exc))
        except ValueError as exc:
            await refuse(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        except (EngineUnavailable, TimeoutError) as exc:
            await refuse(grpc.StatusCode.UNAVAILABLE, str(exc))
        extra = {"request_id": request.request_id}
        ctx.metrics.kv_release("released" if released else "not_held")
        if released:
            ctx.ledger.count("kv_releases")
            logger.info("KV released on request: its blocks free at the next step", extra=extra)
        else:
            logger.info("release asked: no KV held (pulled, expired or never)", extra=extra)
        return generation_pb2.ReleaseKVResponse(released=bool(released))

    async def _stream(
        self,
        parsed: ParsedRequest,
        text: TextStream,
        outputs: asyncio.Queue[EngineCoreOutput],
        admitted: float,
    ) -> AsyncIterator[generation_pb2.GenerateResponse]:
        ctx = self._ctx
        rid = parsed.request_id
        first_token_at: float | None = None
        last_token_at = admitted
        sent_header = False
        # Log-probabilities of tokens the text stream has not let out yet (held-back text).
        pending: list[TokenLogprobs] = []
        while True:
            output = await outputs.get()
            # A prefill handing its request over keeps its text open: the decode daemon goes
            # on from the same state (an incomplete character, a partial stop string).
            delta = text.feed(
                output.new_token_ids, final=output.finished and not _hands_over(output)
            )
            now = time.monotonic()
            if output.new_token_ids:
                if first_token_at is None:
                    first_token_at = now
                    ctx.metrics.ttft.observe(now - admitted)
                    # The token's hop from the engine thread to this call's stream.
                    BOOK.record(rid, "first_token_out", now_ns(), now_ns())
                else:
                    ctx.metrics.itl.observe(now - last_token_at)
                last_token_at = now
            message = generation_pb2.GenerateResponse(
                request_id=rid, token_ids=delta.token_ids, text=delta.text
            )
            if output.logprobs or pending:
                pending.extend(output.logprobs)
                sent, pending = pending[: len(delta.token_ids)], pending[len(delta.token_ids) :]
                message.logprobs.extend(_logprobs_messages(sent, ctx.tokenizer))
            if not sent_header:
                message.num_prompt_tokens = len(parsed.prompt_token_ids)
                if parsed.from_chat:
                    # The decode daemon gets these, not the conversation: one rendering.
                    message.prompt_token_ids.extend(parsed.prompt_token_ids)
                sent_header = True
            if delta.stopped and not output.finished:
                ctx.engine.abandon(rid)
                output = EngineCoreOutput(req_id=rid, finished=True, finish_reason="stop")
            elif delta.stopped:
                # A stop string in the last token allowed: a stop, as a colocated run says.
                output = dataclasses.replace(output, finish_reason="stop")
            if not output.finished:
                if output.kv_transfer_params is not None:
                    # Announced before the prefill computed it: a decode may start now.
                    message.kv_transfer_params_json = json.dumps(output.kv_transfer_params)
                if delta.token_ids or delta.text or output.kv_transfer_params is not None:
                    yield message
                continue
            self._finish(message, parsed, output, admitted, first_token_at, len(text.token_ids))
            yield message
            return

    def _finish(
        self,
        message: generation_pb2.GenerateResponse,
        parsed: ParsedRequest,
        output: EngineCoreOutput,
        admitted: float,
        first_token_at: float | None,
        num_tokens: int,
    ) -> None:
        ctx = self._ctx
        reason = output.finish_reason or "error"
        message.finished = True
        message.finish_reason = reason
        if output.error:
            message.error = output.error
        if output.kv_transfer_params is not None:
            message.kv_transfer_params_json = json.dumps(output.kv_transfer_params)
            ctx.ledger.hold(parsed.request_id, output.kv_transfer_params, ctx.bytes_per_block)
        stats = output.kv_stats
        metrics = message.metrics
        metrics.ttft_s = (first_token_at or time.monotonic()) - admitted
        metrics.num_cached_tokens = output.num_cached_tokens
        if output.timings is not None:
            metrics.queue_s = output.timings.queue_s
            metrics.compute_s = output.timings.compute_s
            ctx.metrics.queue_seconds.observe(metrics.queue_s)
            if metrics.compute_s:
                ctx.metrics.compute_seconds.observe(metrics.compute_s)
        if stats is not None:
            metrics.kv_transfer_s = stats.load_wait_s
            metrics.kv_overlapped_s = stats.overlapped_s
            metrics.kv_blocks_received = stats.num_loaded_blocks
            metrics.kv_bytes_received = stats.num_loaded_blocks * ctx.bytes_per_block
            metrics.num_cached_tokens += stats.num_loaded_tokens
            metrics.num_recomputed_tokens = stats.num_recomputed_tokens
            if stats.num_loaded_blocks:
                ctx.metrics.kv_bytes.observe(metrics.kv_bytes_received)
                ctx.metrics.kv_seconds.observe(stats.load_wait_s)
            if stats.num_recomputed_tokens:
                ctx.metrics.failure("kv_load_recomputed")
        message.spans.extend(spans_to_proto(BOOK.take(parsed.request_id)))
        ctx.ledger.request_finished(output, ctx.bytes_per_block)
        ctx.ledger.record_load(parsed.kv_transfer_params, output)
        ctx.metrics.request_finished(reason)
        ctx.metrics.prompt_finished(
            len(parsed.prompt_token_ids),
            output.num_cached_tokens,
            stats.num_recomputed_tokens if stats is not None else 0,
        )
        if reason == "error":
            ctx.metrics.failure("kv_load_failed" if "KV load" in (output.error or "") else "error")
            logger.warning("failed: %s", output.error, extra={"request_id": parsed.request_id})
        else:
            logger.info(
                "finished (%s): %d tokens, %d KV blocks received in %.1f ms",
                reason,
                num_tokens,
                metrics.kv_blocks_received,
                metrics.kv_transfer_s * 1e3,
                extra={"request_id": parsed.request_id},
            )

    async def _reject(
        self,
        context: grpc.aio.ServicerContext,
        code: grpc.StatusCode,
        message: str,
        request: generation_pb2.GenerateRequest,
    ) -> None:
        self._ctx.ledger.count("requests_rejected")
        self._ctx.metrics.failure("rejected")
        logger.info("rejected: %s", message, extra={"request_id": request.request_id or "-"})
        await context.abort(code, message)


def _text_stream(parsed: ParsedRequest, tokenizer: Any) -> TextStream:
    """The request's text stream, past the tokens it was generated with (already sent by the
    daemon that produced them, so their text is not sent again)."""
    text = TextStream(tokenizer, parsed.stop)
    if parsed.generated_token_ids and text.feed(parsed.generated_token_ids).stopped:
        raise RequestError("generated_token_ids complete a stop string: the request has ended")
    return text


def _logprobs_messages(
    entries: list[TokenLogprobs], tokenizer: Any
) -> list[generation_pb2.OutputLogprobs]:
    def one(token_id: int, logprob: float) -> generation_pb2.TokenLogprob:
        # A checkpoint's vocabulary may be padded past its tokenizer's: such an id can be among
        # the most likely alternatives, has no text, and must not fail the whole stream.
        token = ""
        if token_id < tokenizer.vocab_size:
            token = tokenizer.decode([token_id], skip_special_tokens=False)
        return generation_pb2.TokenLogprob(token_id=token_id, token=token, logprob=logprob)

    return [
        generation_pb2.OutputLogprobs(
            sampled=one(entry.token_id, entry.logprob),
            top=[one(token_id, logprob) for token_id, logprob in entry.top],
        )
        for entry in entries
    ]


def _hands_over(output: EngineCoreOutput) -> bool:
    """A request cut at max_tokens whose KV is held for another engine to continue."""
    return output.finish_reason == "length" and output.kv_transfer_params is not None


@dataclass(frozen=True)
class _Refusal:
    """Ends a ReleaseKV call with ``code``: counted by outcome, logged, then aborted."""

    metrics: DaemonMetrics
    context: grpc.aio.ServicerContext
    request_id: str

    async def __call__(self, code: grpc.StatusCode, message: str) -> None:
        self.metrics.kv_release(_RELEASE_OUTCOMES.get(code, "error"))
        logger.info(
            "release refused (%s): %s", code.name, message, extra={"request_id": self.request_id}
        )
        await self.context.abort(code, message)


_RELEASE_OUTCOMES = {
    grpc.StatusCode.INVALID_ARGUMENT: "invalid",
    grpc.StatusCode.PERMISSION_DENIED: "denied",
    grpc.StatusCode.UNAVAILABLE: "unavailable",
}
