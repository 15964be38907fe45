"""The answer to a request on the daemons: one JSON body once every choice ended (`collect`),
or server-sent events as the choices' deltas come (`stream`): each choice's pieces, its last
chunk with the finish reason and its ``kvtransfer`` object, a last ``usage`` chunk when asked,
then ``data: [DONE]``. Once SSE bytes are out, an error is an SSE error event."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import aclosing
from dataclasses import dataclass
from typing import Any

from aiohttp import web

from kvtransfer.router.daemon_flow.choice import ChoiceRunner
from kvtransfer.router.daemon_flow.exchange import Delta, Exchange
from kvtransfer.router.errors import FAILED_ANSWER, ClientGone, FailedAnswer, UpstreamError
from kvtransfer.router.metrics import RouterMetrics
from kvtransfer.router.openai.requests import Choice, CompletionRequest, SamplingRequest, error_body
from kvtransfer.router.openai.responses import CHAT, ChoiceOutput, ResponseFormat, usage
from kvtransfer.router.web.http_errors import count_failure, error_kind
from kvtransfer.router.web.recent import HookFailures
from kvtransfer.timeline import BOOK, now_ns

SSE_HEADERS = {
    "Content-Type": "text/event-stream",
    "Cache-Control": "no-cache",
    # Reverse proxies (nginx) would otherwise buffer the stream and defeat it.
    "X-Accel-Buffering": "no",
}
SSE_DONE = b"data: [DONE]\n\n"


@dataclass(frozen=True)
class Answer:
    """What the response to one HTTP request is made of, besides its choices' deltas."""

    format: ResponseFormat
    request_id: str
    created: int
    model: str
    request: SamplingRequest
    choices: tuple[Choice, ...]
    started: float

    @property
    def wants_logprobs(self) -> bool:
        return self.choices[0].logprobs is not None

    def echoed(self, choice: Choice) -> str:
        """The prompt text a completion with ``echo`` starts with."""
        request = self.request
        if isinstance(request, CompletionRequest) and request.echo:
            return str(choice.prompt)
        return ""


class AnswerWriter:
    """Writes the answers of requests whose choices one `ChoiceRunner` runs."""

    def __init__(
        self,
        metrics: RouterMetrics,
        runner: Callable[[], ChoiceRunner],
        choice_ended: Callable[[str, Delta], None] | None = None,
    ) -> None:
        self.metrics = metrics
        self._runner = runner
        # Told each choice's last delta (its kvtransfer object), with the request's id.
        self._choice_ended = choice_ended
        self._hook_failures = HookFailures("a choice's summary")

    async def deltas(self, answer: Answer, exchanges: Sequence[Exchange]) -> AsyncIterator[Delta]:
        """Every choice's deltas as they come; the first failure ends them all (raised)."""
        first_token = True
        async with aclosing(merged_deltas(self._runner(), exchanges)) as deltas:
            async for delta in deltas:
                if first_token and delta.token_ids:
                    first_token = False
                    self.metrics.first_token(time.monotonic() - answer.started)
                if delta.finish_reason is not None and self._choice_ended is not None:
                    try:
                        self._choice_ended(answer.request_id, delta)
                    except Exception:  # the fleet page's bookkeeping; the answer goes on
                        self._hook_failures.record()
                yield delta

    async def collect(self, answer: Answer, exchanges: Sequence[Exchange]) -> web.Response:
        outputs = [ChoiceOutput(c.index, [answer.echoed(c)]) for c in answer.choices]
        tokens = TokenCount(answer.choices)
        async with aclosing(self.deltas(answer, exchanges)) as deltas:
            async for delta in deltas:
                tokens.add(delta)
                output = outputs[delta.index]
                output.texts.append(delta.text)
                output.logprobs.extend(delta.logprobs)
                if delta.finish_reason is not None:
                    output.finish_reason = delta.finish_reason
                    output.kvtransfer = delta.info
        fmt = answer.format
        # One choice keeps its kvtransfer object at the top level, where it always was.
        single = outputs[0].kvtransfer if len(outputs) == 1 else None
        if single is not None:
            outputs[0].kvtransfer = None
        body = fmt.body(
            answer.request_id,
            answer.created,
            answer.model,
            [fmt.choice(output, answer.wants_logprobs) for output in outputs],
            usage=tokens.usage(),
            kvtransfer=single,
        )
        return web.json_response(body, headers={"x-request-id": answer.request_id})

    async def stream(
        self, request: web.Request, answer: Answer, exchanges: Sequence[Exchange]
    ) -> web.StreamResponse:
        sse = SseWriter(request, answer.request_id)
        try:
            await self._stream_into(sse, answer, exchanges)
        except ConnectionResetError:
            if sse.response is None:
                raise
            raise ClientGone(sse.response) from None
        if sse.response is None:  # _stream_into always writes: narrows the type
            raise RuntimeError("unreachable: a stream that wrote nothing")
        return sse.response

    async def _stream_into(
        self, sse: SseWriter, answer: Answer, exchanges: Sequence[Exchange]
    ) -> None:
        # The response opens at the first byte to send (`SseWriter`): an error before that
        # is still a plain HTTP error with its status; after it, an SSE error event.
        fmt = answer.format
        tokens = TokenCount(answer.choices)
        offsets = [0] * len(answer.choices)  # text sent so far per choice (logprobs offsets)
        opened: set[int] = set()  # choices whose first chunk went out
        include_usage = answer.request.include_usage
        try:
            async with aclosing(self.deltas(answer, exchanges)) as deltas:
                async for delta in deltas:
                    arrived = now_ns()
                    tokens.add(delta)
                    first = delta.index not in opened
                    opened.add(delta.index)
                    text = (
                        answer.echoed(answer.choices[delta.index]) if first else ""
                    ) + delta.text
                    if not (
                        text or delta.logprobs or delta.finish_reason or (first and fmt is CHAT)
                    ):
                        continue
                    choice = fmt.chunk_choice(
                        delta.index,
                        text,
                        delta.finish_reason,
                        delta.logprobs if answer.wants_logprobs else None,
                        first=first,
                        text_offset=offsets[delta.index],
                    )
                    offsets[delta.index] += len(text)
                    chunk = fmt.chunk(
                        answer.request_id,
                        answer.created,
                        answer.model,
                        [choice],
                        kvtransfer=delta.info,
                    )
                    if include_usage:
                        chunk["usage"] = None
                    await sse.send(chunk)
                    if first and delta.token_ids:
                        rid = exchanges[delta.index].request_id
                        BOOK.record(rid, "first_token_out", arrived, now_ns())
        except UpstreamError as exc:
            if sse.response is None:
                raise
            count_failure(self.metrics, answer.request_id, exc)
            sse.response[FAILED_ANSWER] = FailedAnswer(str(exc), mid_stream=True)
            await sse.send(error_body(str(exc), error_kind(exc.status)))
            await sse.done()
            return
        if include_usage:
            last = fmt.chunk(
                answer.request_id, answer.created, answer.model, [], usage=tokens.usage()
            )
            await sse.send(last)
        await sse.done()


class TokenCount:
    """``usage``: completion tokens of every choice, prompt tokens once per prompt."""

    def __init__(self, choices: Sequence[Choice]) -> None:
        self._choices = choices
        self.prompt_tokens = 0
        self.cached_tokens = 0
        self.completion_tokens = 0

    def add(self, delta: Delta) -> None:
        self.completion_tokens += len(delta.token_ids)
        if delta.finish_reason is not None and self._choices[delta.index].sample == 0:
            self.prompt_tokens += delta.num_prompt_tokens
            self.cached_tokens += delta.num_cached_tokens

    def usage(self) -> dict[str, Any]:
        return usage(self.prompt_tokens, self.completion_tokens, self.cached_tokens)


async def merged_deltas(
    runner: ChoiceRunner, exchanges: Sequence[Exchange]
) -> AsyncIterator[Delta]:
    """The deltas of every choice, interleaved as they come. A single choice runs in the
    caller's task (cancelling the handler cancels its calls directly); several run in tasks of
    their own, all cancelled when the first one fails or the consumer stops reading."""
    if len(exchanges) == 1:
        async with aclosing(runner.run(exchanges[0])) as deltas:
            async for delta in deltas:
                yield delta
        return
    queue: asyncio.Queue[Delta | Exception | None] = asyncio.Queue()

    async def pump(exchange: Exchange) -> None:
        try:
            async with aclosing(runner.run(exchange)) as deltas:
                async for delta in deltas:
                    queue.put_nowait(delta)
        except Exception as exc:  # the request fails with it (an UpstreamError, or a bug)
            queue.put_nowait(exc)
        else:
            queue.put_nowait(None)

    tasks = [asyncio.create_task(pump(exchange)) for exchange in exchanges]
    try:
        running = len(tasks)
        while running:
            item = await queue.get()
            if item is None:
                running -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


class SseWriter:
    """Server-sent events, the response prepared at the first event."""

    def __init__(self, request: web.Request, request_id: str) -> None:
        self._request = request
        self._request_id = request_id
        self.response: web.StreamResponse | None = None

    async def send(self, payload: dict[str, Any]) -> None:
        if self.response is None:
            headers = {**SSE_HEADERS, "x-request-id": self._request_id}
            self.response = web.StreamResponse(status=200, headers=headers)
            await self.response.prepare(self._request)
        await self.response.write(f"data: {json.dumps(payload)}\n\n".encode())

    async def done(self) -> None:
        if self.response is None:
            raise RuntimeError("done() before any event")
        await self.response.write(SSE_DONE)
        await self.response.write_eof()
