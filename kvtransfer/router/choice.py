"""One choice of a request, from its prefill to its decode's last token: `ChoiceRunner.run`.

Life cycle of a choice (steps 3 to 6 and 9 of a request, see `kvtransfer.router.app`):

1. Pick daemons, healthy ones only (`upstream.DaemonPool`). With no healthy decode daemon the
   choice fails 503 naming each decode daemon's state, before any prefill: KV prefilled for
   nobody would only be held until its lease ran out. Then the next healthy prefill daemon in
   turn; the decode daemon is the next healthy one in turn (two round-robin counters).
2. Prefill: ``Generate`` with the prompt (a chat is rendered there, by the daemon's template),
   ``max_tokens=1``, every sampling option (stop strings included) and, unless the client asked
   for one token, ``kv_transfer_params={"do_remote_decode": true, "kv_stream": true}``. A
   prefill that streams announces its params in a message before it computes the prompt's last
   part: the decode daemon is called at once with them and ``await_generated_tokens``, and
   pulls each layer as it is computed (`_EarlyDecode`). Its final message holds the first token.
3. First token: it is the choice's first `Delta` (SSE: sent at once, before the decode answers).
   When it ended the choice (``max_tokens`` 1, a stop string, the end of sequence) the choice
   ends here; KV held anyway is released (step 5). A final ``finish_reason`` "error", or a
   "length" finish without ``kv_transfer_params_json``, is a 502.
4. Decode: called early, it gets the first token through ``Continue``; otherwise ``Generate``
   on the decode daemon now, with the same id, the prompt (a chat as the tokens the prefill
   rendered), every sampling option, the prefill's params verbatim and its first token as
   ``generated_token_ids``. It holds the KV of every prompt token and continues after that
   token; each of its messages becomes a `Delta`, the last with the finish reason and the
   ``kvtransfer`` object. A prefill that fails after announcing its params leaves the decode to
   its load-failure policy (``Continue`` without a token: it computes the first token itself).
5. Release: once the prefill returned its params, a decode that does not finish with "length"
   or "stop" (no healthy decode left, the call failed, an error or abort finish, the client
   went away, a sibling choice failed) makes the router call ``ReleaseKV`` on that prefill
   daemon with exactly those params, so the KV is freed now rather than at the end of its
   lease. The call runs in a task of its own with ``release_timeout_s``: nobody waits for it
   and cancellation does not reach it; ``kvtransfer_router_kv_releases_total`` counts the
   outcomes. A choice abandoned during its prefill gives that call ``PREFILL_GRACE_S`` to
   deliver a final message already on its way (then its KV is released the same way); a
   prefill still computing after that is cancelled, and the daemon gives back its KV itself.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable
from contextlib import aclosing
from dataclasses import dataclass, field
from typing import Any

from kvtransfer.router.config import RouterConfig
from kvtransfer.router.metrics import RouterMetrics
from kvtransfer.router.openai_api import Choice
from kvtransfer.router.upstream import (
    CallStream,
    Daemon,
    PrefillResult,
    Upstream,
    UpstreamError,
)
from kvtransfer.v1 import generation_pb2

# How long a prefill call whose client left may take to deliver a final message already sent.
PREFILL_GRACE_S = 0.5
# Decode outcomes after which the decode engine has pulled, or let go of, the prefill's KV.
_CLEAN_FINISHES = frozenset({"length", "stop"})


@dataclass(frozen=True)
class Delta:
    """What one choice adds to the answer: text, its tokens and their log-probabilities; the
    choice's last delta has a ``finish_reason``, the ``kvtransfer`` object and the prompt's
    token count."""

    index: int
    text: str = ""
    token_ids: tuple[int, ...] = ()
    logprobs: tuple[generation_pb2.OutputLogprobs, ...] = ()
    finish_reason: str | None = None
    info: dict[str, Any] | None = None
    num_prompt_tokens: int = 0


@dataclass
class Exchange:
    """One choice's state: ``request_id`` is the id both daemons know it by."""

    request_id: str
    choice: Choice
    started: float
    deadline: float
    log: logging.LoggerAdapter[logging.Logger]
    route: dict[str, str] = field(default_factory=dict)
    # Set once the decode stream ended with "length" or "stop": its KV load is settled.
    decoded: bool = False


@dataclass
class _Decoded:
    """The choice's token stream, accumulated."""

    token_ids: list[int] = field(default_factory=list)
    texts: list[str] = field(default_factory=list)
    num_prompt_tokens: int = 0
    first_token_at: float | None = None
    second_token_at: float | None = None
    final: generation_pb2.GenerateResponse | None = None
    # The prefill's final message (its metrics are the prefill's phases).
    prefill: generation_pb2.GenerateResponse | None = None

    def seed(self, first: generation_pb2.GenerateResponse) -> None:
        """Start from the prefill's final message: the first token, its text, the prompt size
        (a decode stream then continues it; when the first token ended the request, it is
        also the final message)."""
        self.prefill = first
        self.first_token_at = time.monotonic() if first.token_ids else None
        self.token_ids.extend(first.token_ids)
        self.texts.append(first.text)
        self.num_prompt_tokens = first.num_prompt_tokens

    def absorb(self, reply: generation_pb2.GenerateResponse) -> bool:
        """Adds ``reply``; False when it came after the final message (ignored: streams are
        read to their end rather than left at the final message, so the call ends on its own
        instead of being cancelled)."""
        if self.final is not None:
            return False
        if reply.token_ids and self.first_token_at is None:
            self.first_token_at = time.monotonic()
        elif reply.token_ids and self.second_token_at is None:
            self.second_token_at = time.monotonic()
        self.token_ids.extend(reply.token_ids)
        self.texts.append(reply.text)
        if reply.num_prompt_tokens:
            self.num_prompt_tokens = reply.num_prompt_tokens
        if reply.finished:
            self.final = reply
        return True

    def phases(self) -> dict[str, float]:
        """Where the time went, in seconds: each daemon's own measurements, joined, plus the
        first-to-second token gap this router saw (absent phases are left out)."""
        phases: dict[str, float] = {}
        if self.prefill is not None and self.prefill.HasField("metrics"):
            phases["prefill_queue_s"] = self.prefill.metrics.queue_s
            phases["prefill_compute_s"] = self.prefill.metrics.compute_s
        final = self.final
        if final is not None and final is not self.prefill and final.HasField("metrics"):
            phases["decode_queue_s"] = final.metrics.queue_s
            phases["kv_transfer_s"] = final.metrics.kv_transfer_s
            phases["kv_overlapped_s"] = final.metrics.kv_overlapped_s
            phases["decode_first_step_s"] = final.metrics.compute_s
        if self.first_token_at is not None and self.second_token_at is not None:
            phases["second_token_s"] = self.second_token_at - self.first_token_at
        return phases

    @property
    def clean(self) -> bool:
        return self.final is not None and self.final.finish_reason in _CLEAN_FINISHES

    def failure(self, address: str) -> UpstreamError | None:
        if self.final is None:
            message = "the stream ended without a final message"
            return UpstreamError(502, message, "decode", address, "incomplete_stream")
        if self.final.finish_reason == "error":
            message = self.final.error or "finished with an error"
            return UpstreamError(502, message, "decode", address, "finish_error")
        return None


class ChoiceRunner:
    """Runs choices on one `Upstream`, releasing KV nobody decoded (tasks it keeps)."""

    def __init__(self, config: RouterConfig, metrics: RouterMetrics, upstream: Upstream) -> None:
        self.config = config
        self.metrics = metrics
        self.upstream: Upstream | None = upstream
        # ReleaseKV calls in flight: they outlive their choices, not the channels.
        self.releases: set[asyncio.Task[None]] = set()

    async def close(self) -> None:
        """Wait for the releases in flight (each has a deadline), then stop releasing."""
        await asyncio.gather(*self.releases, return_exceptions=True)
        self.upstream = None

    async def run(self, exchange: Exchange) -> AsyncIterator[Delta]:
        """The choice's deltas; raises `UpstreamError` when it fails. Closing the iterator
        early (the client left, a sibling failed) cancels its calls and releases its KV."""
        upstream = self._require_upstream()
        decode: Daemon | None = None
        if exchange.choice.max_tokens > 1:
            # KV prefilled for no decode daemon would only wait out its lease.
            upstream.decode.require_healthy()
            decode = upstream.pick_decode()
        early = _EarlyDecode(upstream, decode, exchange)
        try:
            streams = decode is not None and self.config.kv_stream
            prefill = await self._prefill(upstream, exchange, early.start if streams else None)
        except UpstreamError as exc:
            if decode is None or early.replies is None:
                raise
            # The prefill failed after announcing its KV: the decode, already loading it, goes
            # on under its kv_load_failure_policy and computes the first token itself.
            exchange.log.warning("prefill failed mid-stream (%s); decode goes on alone", exc)
            self.metrics.upstream_error(exc.role, exc.reason)
            exchange.route = {"prefill": exc.address, "decode": decode.address}
            replies = await early.continue_with(None)
            async with (
                aclosing(replies),
                aclosing(self._follow(exchange, _Decoded(), replies)) as deltas,
            ):
                async for delta in deltas:
                    yield delta
            return
        except BaseException:
            await early.close()
            raise
        exchange.route = {"prefill": prefill.daemon.address}
        decoded = _Decoded()
        decoded.seed(prefill.final)
        if not prefill.continues or decode is None:
            # The first token ended the choice (max_tokens 1, a stop, the end of sequence).
            await early.close()
            decoded.final = prefill.final
            exchange.decoded = True
            if prefill.kv_transfer_params_json:
                self._release_soon(exchange, prefill, "ended_at_first_token")
            yield self._last(exchange, decoded, prefill.final, prefill.final.text)
            return
        try:
            exchange.route["decode"] = decode.address
            # The first token goes out now, before the decode daemon answers.
            yield _delta(exchange, prefill.final)
            replies = await early.continue_with(prefill)
            exchange.log.info(
                "prefilled on %s; decoding on %s%s",
                prefill.daemon.address,
                decode.address,
                " (called while the prefill computed)" if early.started_early else "",
            )
            # aclosing: leaving early (error, client gone) closes the stream, cancelling it.
            async with (
                aclosing(replies),
                aclosing(self._follow(exchange, decoded, replies)) as deltas,
            ):
                async for delta in deltas:
                    yield delta
        except BaseException as exc:
            self._release_unless_decoded(exchange, prefill, _release_trigger(exc))
            raise
        # A decode that failed after its first message ends here too.
        self._release_unless_decoded(exchange, prefill, "decode_failed")

    async def _follow(
        self, exchange: Exchange, decoded: _Decoded, replies: CallStream
    ) -> AsyncIterator[Delta]:
        """The decode stream's deltas, the last one with the finish reason."""
        async for reply in replies:
            if not decoded.absorb(reply):
                continue
            if decoded.final is None and (reply.text or reply.token_ids):
                yield _delta(exchange, reply)
        failure = decoded.failure(exchange.route.get("decode", exchange.route["prefill"]))
        if failure is not None:
            raise failure
        final = decoded.final
        if final is None:  # failure() above rules this out; narrows the type
            raise RuntimeError("unreachable: a decode stream without a final message")
        exchange.decoded = decoded.clean
        yield self._last(exchange, decoded, final, final.text)

    def _last(
        self,
        exchange: Exchange,
        decoded: _Decoded,
        final: generation_pb2.GenerateResponse,
        text: str,
    ) -> Delta:
        self.metrics.phases(decoded.phases())
        exchange.log.info(
            "done (%s): %d tokens, %d KV blocks received, %.1f ms",
            final.finish_reason,
            len(decoded.token_ids),
            final.metrics.kv_blocks_received,
            (time.monotonic() - exchange.started) * 1e3,
        )
        return Delta(
            index=exchange.choice.index,
            text=text,
            token_ids=tuple(final.token_ids),
            logprobs=tuple(final.logprobs),
            finish_reason=final.finish_reason,
            info=_kvtransfer_info(exchange, decoded),
            num_prompt_tokens=decoded.num_prompt_tokens,
        )

    def _require_upstream(self) -> Upstream:
        if self.upstream is None:
            raise RuntimeError("the router is closed (no gRPC channels)")
        return self.upstream

    # ------------------------------------------------------------------ releasing KV

    async def _prefill(
        self,
        upstream: Upstream,
        exchange: Exchange,
        on_params: Callable[[generation_pb2.GenerateResponse], None] | None = None,
    ) -> PrefillResult:
        """The prefill call, shielded from the client leaving at the very moment it ends.

        If the choice is cancelled, the call gets `PREFILL_GRACE_S` more to deliver a final
        message that may already be on its way (the daemon finished, the RPC completed, only
        this side has not read it yet), and that KV is released; a prefill still computing is
        cancelled, and the daemon then gives its KV back itself.
        """
        call = asyncio.ensure_future(
            upstream.run_prefill(exchange.request_id, exchange.choice, exchange.deadline, on_params)
        )
        try:
            return await asyncio.shield(call)
        except asyncio.CancelledError:
            self._spawn(self._release_late(exchange, call))
            raise

    async def _release_late(self, exchange: Exchange, call: asyncio.Future[PrefillResult]) -> None:
        try:
            prefill = await asyncio.wait_for(call, PREFILL_GRACE_S)
        except (TimeoutError, asyncio.CancelledError, UpstreamError):
            return  # cancelled while computing (the daemon releases), or failed: nothing held
        upstream = self.upstream
        if upstream is not None:
            await self._release(upstream, exchange, prefill, "client_gone")

    def _release_unless_decoded(
        self, exchange: Exchange, prefill: PrefillResult, trigger: str
    ) -> None:
        """Unless the decode stream finished cleanly, give the prefill's KV back now."""
        if not exchange.decoded:
            self._release_soon(exchange, prefill, trigger)

    def _release_soon(self, exchange: Exchange, prefill: PrefillResult, trigger: str) -> None:
        """``ReleaseKV`` in a task of its own: nobody waits for it, and cancelling the choice
        (the client went away) does not cancel it."""
        upstream = self.upstream
        if upstream is None:  # closed: the lease frees the KV instead
            return
        self._spawn(self._release(upstream, exchange, prefill, trigger))

    def _spawn(self, release: Any) -> None:
        task = asyncio.get_running_loop().create_task(release)
        self.releases.add(task)
        task.add_done_callback(self.releases.discard)

    async def _release(
        self, upstream: Upstream, exchange: Exchange, prefill: PrefillResult, trigger: str
    ) -> None:
        outcome = await upstream.release_kv(
            prefill, exchange.request_id, self.config.release_timeout_s
        )
        self.metrics.kv_release(trigger, outcome)
        log = exchange.log.info if outcome in ("released", "not_held") else exchange.log.warning
        log("KV release on %s (%s): %s", prefill.daemon.address, trigger, outcome)


def _delta(exchange: Exchange, message: generation_pb2.GenerateResponse) -> Delta:
    return Delta(
        index=exchange.choice.index,
        text=message.text,
        token_ids=tuple(message.token_ids),
        logprobs=tuple(message.logprobs),
    )


def _release_trigger(exc: BaseException) -> str:
    # GeneratorExit: the consumer closed the choice (its client left, or a sibling failed).
    if isinstance(exc, asyncio.CancelledError | GeneratorExit | ConnectionResetError):
        return "client_gone"
    return "decode_failed" if isinstance(exc, UpstreamError) else "error"


def _kvtransfer_info(exchange: Exchange, decoded: _Decoded) -> dict[str, Any]:
    metrics = decoded.final.metrics if decoded.final is not None else None
    first = decoded.first_token_at
    return {
        "request_id": exchange.request_id,
        **exchange.route,
        "token_ids": list(decoded.token_ids),
        "ttft_s": None if first is None else first - exchange.started,
        "kv_transfer_s": metrics.kv_transfer_s if metrics is not None else 0.0,
        "kv_blocks_received": metrics.kv_blocks_received if metrics is not None else 0,
        "kv_bytes_received": metrics.kv_bytes_received if metrics is not None else 0,
        "num_recomputed_tokens": metrics.num_recomputed_tokens if metrics is not None else 0,
        "phases": decoded.phases(),
    }


class _EarlyDecode:
    """The decode call of one choice, started as soon as the prefill announces its params
    (its KV is being computed and streamed), before the first token is known; or, if the
    prefill announced none, started once the prefill returned."""

    def __init__(self, upstream: Upstream, decode: Daemon | None, exchange: Exchange) -> None:
        self._upstream = upstream
        self._decode = decode
        self._exchange = exchange
        self.replies: CallStream | None = None
        self.started_early = False

    def start(self, prefill_so_far: generation_pb2.GenerateResponse) -> None:
        if self._decode is None or self.replies is not None:
            return
        exchange = self._exchange
        try:
            self.replies = self._upstream.run_decode(
                self._decode,
                exchange.request_id,
                exchange.choice,
                prefill_so_far,
                exchange.deadline,
                None,
            )
            self.started_early = True
        except UpstreamError as exc:  # the deadline ran out: the sequential path reports it
            exchange.log.info("decode not started early: %s", exc)

    async def continue_with(self, prefill: PrefillResult | None) -> CallStream:
        """The decode stream, continuing after the prefill's first token (``None``: the
        prefill failed after the decode was called; it computes its first token itself)."""
        if self._decode is None:
            raise RuntimeError("no decode daemon was picked")
        exchange = self._exchange
        if self.replies is None:
            if prefill is None:
                raise RuntimeError("no decode call was started early")
            return self._upstream.run_decode(
                self._decode,
                exchange.request_id,
                exchange.choice,
                prefill.final,
                exchange.deadline,
                prefill.final.token_ids,
            )
        tokens = () if prefill is None else prefill.final.token_ids
        problem = await self._upstream.continue_decode(
            self._decode, exchange.request_id, tokens, exchange.deadline
        )
        if problem is not None:
            # The decode stream says what became of the request (e.g. its load failed).
            exchange.log.info("Continue on %s: %s", self._decode.address, problem)
        return self.replies

    async def close(self) -> None:
        """Cancel a decode started early that will not be continued (its daemon aborts it and
        lets go of the producer's KV)."""
        replies, self.replies = self.replies, None
        if replies is not None:
            await replies.aclose()
