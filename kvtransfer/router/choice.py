"""One choice of a request, from its prefill to its decode's last token: `ChoiceRunner.run`.

Life cycle of a choice (step 4 of a request, see `kvtransfer.router.app`):

1. Route: the choice's `RouteContext` holds its id and, when the router knows them, its
   prompt's token ids. With ``disagg_min_prompt_tokens`` N > 0 and the token ids known, a
   prompt whose uncached part is below N (the decode policy's estimate when it makes one,
   `policy.UncachedEstimator`; else the whole prompt) runs on a decode instance alone (step 7).
2. Pick (`fleet.Fleet.pick`, each role's policy over its healthy instances whose breaker lets
   calls through): the decode instance first, among the decode daemons and the aggregated
   instances (only the latter when no prefill may be picked). With none the choice fails 503
   before any prefill: KV prefilled for nobody would only be held until its lease ran out. An
   aggregated instance runs the choice alone (step 7). Then the prefill instance. Each is
   leased (counted in flight) until its part is over.
3. Prefill: ``Generate`` with the prompt (a chat is rendered there, by the daemon's template),
   ``max_tokens=1``, every sampling option (stop strings included) and, unless the client asked
   for one token, ``kv_transfer_params={"do_remote_decode": true, "kv_stream": true}``
   (``kv_stream`` left out where `streams_kv` says the two daemons share cores). A
   prefill that streams announces its params in a message before it computes the prompt's last
   part: the decode instance is called at once with them and ``await_generated_tokens``, and
   pulls each layer as it is computed (`_DecodeLeg`, its messages read as they come). Its final
   message holds the first token. A prefill that fails before announcing anything (nothing of
   it reached the client or a decode) is retried on another prefill instance, up to
   ``max_retries`` times with a growing back-off. While the prefill computes, the early decode
   is watched: when it ends first (its KV load failed, its daemon died), the prefill is
   abandoned (step 6) and the choice ends with the decode's outcome, unless the decode failed
   before answering anything and another decode instance takes over with the same params.
4. First token: it is the choice's first `Delta` (SSE: sent at once, before the decode answers).
   When it ended the choice (``max_tokens`` 1, a stop string, the end of sequence) the choice
   ends here; KV held anyway is released (step 6). A final ``finish_reason`` "error", or a
   "length" finish without ``kv_transfer_params_json``, is a 502.
5. Decode: called early, it gets the first token through ``Continue``; otherwise ``Generate``
   on the decode instance now, with the same id, the prompt (a chat as the tokens the prefill
   rendered), every sampling option, the prefill's params verbatim and its first token as
   ``generated_token_ids``. It holds the KV of every prompt token and continues after that
   token; each of its messages becomes a `Delta`, the last with the finish reason and the
   ``kvtransfer`` object. A decode call that fails before its first message is retried on
   another decode instance with the same params and first token (the prefill still holds the
   KV; never an aggregated instance), within the same ``max_retries``. A prefill that fails
   after announcing its params leaves the decode to its load-failure policy (``Continue``
   without a token: it computes the first token itself).
6. Release: once the prefill returned its params, a decode that does not finish with "length"
   or "stop" (no healthy decode left, the call failed, an error or abort finish, the client
   went away, a sibling choice failed) makes the router call ``ReleaseKV`` on that prefill
   daemon with exactly those params, so the KV is freed now rather than at the end of its
   lease. The call runs in a task of its own with ``release_timeout_s``: nobody waits for it
   and cancellation does not reach it; ``kvtransfer_router_kv_releases_total`` counts the
   outcomes. A prefill abandoned while it runs (the client left, a sibling failed, its early
   decode ended) gets ``PREFILL_GRACE_S`` to deliver a final message already on its way (then
   its KV is released the same way); a prefill still computing after that is cancelled, and
   the daemon gives back its KV itself. Either way the other leg is cancelled too: its daemon
   aborts the request and lets go of what it held.
7. Decode alone: ``Generate`` on the decode instance with the prompt, every sampling option and
   no ``kv_transfer_params``: it computes the prompt as a colocated engine would. Retried like
   a decode (step 5); nothing to release.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections.abc import AsyncIterator, Sequence
from contextlib import aclosing
from dataclasses import dataclass, field, replace
from typing import Any

from kvtransfer.clients.generation import spans_from_proto
from kvtransfer.router.config import RouterConfig
from kvtransfer.router.errors import NoHealthyDaemon, UpstreamError
from kvtransfer.router.fleet.fleet import Fleet
from kvtransfer.router.fleet.instance import Instance
from kvtransfer.router.metrics import RouterMetrics
from kvtransfer.router.names import AGGREGATED
from kvtransfer.router.openai.requests import Choice
from kvtransfer.router.routing.policy import RouteContext, UncachedEstimator, whole_prompt_uncached
from kvtransfer.router.tracing import RequestTrace, TraceExporter
from kvtransfer.router.upstream import CallStream, PrefillResult, Upstream
from kvtransfer.timeline import BOOK, Span, now_ns, relative, wall_ns
from kvtransfer.v1 import generation_pb2

# How long a prefill call whose client left may take to deliver a final message already sent.
PREFILL_GRACE_S = 0.5
# Decode outcomes after which the decode engine has pulled, or let go of, the prefill's KV.
_CLEAN_FINISHES = frozenset({"length", "stop"})
# Back-off before retry n: RETRY_BACKOFF_S * 2**(n-1), at most RETRY_MAX_BACKOFF_S, +-20%.
RETRY_BACKOFF_S = 0.05
RETRY_MAX_BACKOFF_S = 1.0


def goes_alone(fleet: Fleet, threshold: int, route: RouteContext) -> bool:
    """Conditional disaggregation: a known prompt with fewer uncached tokens than
    ``threshold`` (``disagg_min_prompt_tokens``; 0: never) is not worth a prefill and a KV
    transfer."""
    if threshold <= 0 or route.token_ids is None:
        return False
    candidates = [i for i in fleet.instances("decode") if i.pickable()]
    policy = fleet.policies["decode"]
    if isinstance(policy, UncachedEstimator):
        uncached = policy.uncached_tokens(candidates, route)
    else:
        uncached = whole_prompt_uncached(candidates, route)
    return uncached < threshold


def streams_kv(mode: str, prefill: Instance, decode: Instance) -> bool:
    """Whether ``prefill`` streams its KV to ``decode``, called while it computes (step 3).
    ``auto``: unless both said they compute on the same cores of one host: there the decode's
    work (its admission, each layer's read) takes CPU from the prefill's compute, measured to
    cost it more than the transfer that streaming hides (docs/operations.md)."""
    if mode != "auto":
        return mode == "always"
    here, there = prefill.placement, decode.placement
    return here is None or there is None or not here.shares_cores(there)


async def retry_pause(attempt: int, deadline: float) -> None:
    """The back-off before retry ``attempt`` (1, 2, ...), never past ``deadline``."""
    delay = min(RETRY_MAX_BACKOFF_S, RETRY_BACKOFF_S * 2 ** (attempt - 1))
    delay *= random.uniform(0.8, 1.2)
    await asyncio.sleep(max(0.0, min(delay, deadline - time.monotonic())))


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
    # On the last delta: prompt tokens no engine computed for this request (a prefix-cache hit).
    num_cached_tokens: int = 0


@dataclass
class Exchange:
    """One choice's state: ``request_id`` is the id both daemons know it by."""

    request_id: str
    choice: Choice
    started: float
    deadline: float
    log: logging.LoggerAdapter[logging.Logger]
    # What the policies see of it: its id, and its prompt's token ids when known.
    context: RouteContext
    route: dict[str, str] = field(default_factory=dict)
    # Set once the decode stream ended with "length" or "stop": its KV load is settled.
    decoded: bool = False
    # The client's W3C trace context (its ``traceparent`` header): the trace's parent.
    traceparent: str | None = None


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

    def cached_prompt_tokens(self) -> int:
        """Prompt tokens served from a prefix cache instead of computed: the prefill's hit when
        a prefill computed the prompt (the KV a decode then pulls was computed, not cached),
        else the decode's own (a request that skipped the prefill hop)."""
        for message in (self.prefill, self.final):
            if message is not None and message.HasField("metrics"):
                return int(message.metrics.num_cached_tokens)
        return 0

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

    def __init__(
        self,
        config: RouterConfig,
        metrics: RouterMetrics,
        upstream: Upstream,
        traces: TraceExporter | None = None,
    ) -> None:
        self.config = config
        self.metrics = metrics
        self.traces = traces
        self.upstream: Upstream | None = upstream
        # ReleaseKV calls and abandoned prefills in flight: they outlive their choices, not
        # the channels.
        self.releases: set[asyncio.Task[None]] = set()

    async def close(self) -> None:
        """Wait for the releases in flight (each has a deadline), then stop releasing."""
        await asyncio.gather(*self.releases, return_exceptions=True)
        if self.upstream is not None:
            await self.upstream.close()
        self.upstream = None

    async def run(self, exchange: Exchange) -> AsyncIterator[Delta]:
        """The choice's deltas; raises `UpstreamError` when it fails. Closing the iterator
        early (the client left, a sibling failed) cancels its calls and releases its KV."""
        upstream = self._require_upstream()
        fleet = upstream.fleet
        alone = self._goes_alone(upstream, exchange)
        lease: _Lease | None = None
        can_prefill = fleet.any_pickable("prefill")
        if not alone and (exchange.choice.max_tokens > 1 or not can_prefill):
            if not can_prefill and not fleet.any_pickable(AGGREGATED):
                fleet.require_pickable("decode")  # with neither role up, name the decode
                fleet.require_pickable("prefill")
            # The decode first: KV prefilled for no decode daemon would only wait out its
            # lease. Its policy weighs aggregated instances with the others; with no prefill
            # to pick, only they can serve.
            lease = self._lease(
                upstream, "decode", exchange, aggregated=None if can_prefill else True
            )
            alone = lease.instance.aggregated
        if alone:
            mode = "aggregated" if lease is not None else "decode_only"
            self.metrics.route_mode(mode)
            async with aclosing(self._run_alone(upstream, exchange, lease)) as deltas:
                async for delta in deltas:
                    yield delta
            return
        self.metrics.route_mode("disaggregated")
        leg = None if lease is None else _DecodeLeg(upstream, exchange, lease)
        try:
            async with aclosing(self._run_legs(upstream, exchange, leg)) as deltas:
                async for delta in deltas:
                    yield delta
        finally:
            if leg is not None:
                await leg.close()

    async def _run_legs(
        self, upstream: Upstream, exchange: Exchange, leg: _DecodeLeg | None
    ) -> AsyncIterator[Delta]:
        try:
            prefill = await self._prefill(upstream, exchange, leg)
        except _DecodeEndedFirst as ended:
            # The early decode ended while the prefill computed: its outcome is the choice's.
            exchange.log.warning("decode ended before the prefill returned; prefill abandoned")
            if leg is None:  # only a started leg ends first; narrows the type
                raise RuntimeError("unreachable: no decode leg") from None
            exchange.route = {"prefill": ended.prefill_address, "decode": leg.address}
            async with aclosing(self._follow(exchange, _Decoded(), leg)) as deltas:
                async for delta in deltas:
                    yield delta
            return
        except UpstreamError as exc:
            if leg is None or not leg.started_early:
                raise
            # The prefill failed after announcing its KV: the decode, already loading it, goes
            # on under its kv_load_failure_policy and computes the first token itself.
            exchange.log.warning("prefill failed mid-stream (%s); decode goes on alone", exc)
            self.metrics.upstream_error(exc.role, exc.reason)
            exchange.route = {"prefill": exc.address, "decode": leg.address}
            await leg.continue_with(None)
            async with aclosing(self._follow(exchange, _Decoded(), leg)) as deltas:
                async for delta in deltas:
                    yield delta
            return
        exchange.route = {"prefill": prefill.daemon.address}
        decoded = _Decoded()
        decoded.seed(prefill.final)
        if not prefill.continues or leg is None:
            # The first token ended the choice (max_tokens 1, a stop, the end of sequence).
            if leg is not None:
                await leg.close()
            decoded.final = prefill.final
            exchange.decoded = True
            if prefill.kv_transfer_params_json:
                self._release_soon(exchange, prefill, "ended_at_first_token")
            yield self._last(exchange, decoded, prefill.final, prefill.final.text)
            return
        try:
            exchange.route["decode"] = leg.address
            # The first token goes out now, before the decode daemon answers.
            yield _delta(exchange, prefill.final)
            await leg.continue_with(prefill)
            exchange.log.info(
                "prefilled on %s; decoding on %s%s",
                prefill.daemon.address,
                leg.address,
                " (called while the prefill computed)" if leg.started_early else "",
            )
            while True:
                try:
                    async with aclosing(self._follow(exchange, decoded, leg)) as deltas:
                        async for delta in deltas:
                            yield delta
                    break
                except UpstreamError as exc:
                    if leg.answered:
                        raise
                    # Nothing of this decode reached anyone: another instance takes over,
                    # with the same params and first token (the prefill still holds the KV).
                    lease = await self._retry_lease(
                        upstream, exchange, leg.tried, exc, aggregated=False
                    )
                    leg.restart(lease, prefill)
                    exchange.route["decode"] = leg.address
        except BaseException as exc:
            self._release_unless_decoded(exchange, prefill, _release_trigger(exc))
            raise
        # A decode that failed after its first message ends here too.
        self._release_unless_decoded(exchange, prefill, "decode_failed")

    async def _run_alone(
        self, upstream: Upstream, exchange: Exchange, lease: _Lease | None = None
    ) -> AsyncIterator[Delta]:
        """Step 7: the whole choice on one decode instance (``lease``'s, else one picked now),
        retried before its first message."""
        leg = _DecodeLeg(upstream, exchange, lease or self._lease(upstream, "decode", exchange))
        try:
            leg.start_alone()
            exchange.route = {"decode": leg.address}
            why = "an aggregated instance" if leg.instance.aggregated else "short uncached prompt"
            exchange.log.info("decoding alone on %s (%s)", leg.address, why)
            while True:
                try:
                    async with aclosing(self._follow(exchange, _Decoded(), leg)) as deltas:
                        async for delta in deltas:
                            yield delta
                    return
                except UpstreamError as exc:
                    if leg.answered:
                        raise
                    leg.restart(await self._retry_lease(upstream, exchange, leg.tried, exc))
                    exchange.route = {"decode": leg.address}
        finally:
            await leg.close()

    async def _follow(
        self, exchange: Exchange, decoded: _Decoded, leg: _DecodeLeg
    ) -> AsyncIterator[Delta]:
        """The decode stream's deltas, the last one with the finish reason."""
        async for reply in leg.messages():
            if not decoded.absorb(reply):
                continue
            if decoded.final is None and (reply.text or reply.token_ids):
                yield _delta(exchange, reply)
        failure = decoded.failure(leg.address)
        if failure is not None:
            # An error finish on a P/D decode is mostly its KV load failing (the producer's
            # doing): only a decode that computed everything itself is blamed for one.
            if failure.reason != "finish_error" or leg.alone:
                leg.instance.failed()
            raise failure
        final = decoded.final
        if final is None:  # failure() above rules this out; narrows the type
            raise RuntimeError("unreachable: a decode stream without a final message")
        leg.instance.succeeded()
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
        spans = self._timeline(exchange, decoded)
        cached = decoded.cached_prompt_tokens()
        role = "decode" if decoded.prefill is None else "prefill"
        predicted = exchange.context.predicted_cached_tokens.get(role)
        if predicted is not None:
            self.metrics.cache_prediction(role, predicted, cached)
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
            info=_kvtransfer_info(exchange, decoded, spans),
            num_prompt_tokens=decoded.num_prompt_tokens,
            num_cached_tokens=cached,
        )

    def _timeline(self, exchange: Exchange, decoded: _Decoded) -> list[Span]:
        """The choice's spans, this router's and its daemons', as the answer, the span
        histograms and the trace exporter get them."""
        spans = [replace(span, process="router") for span in BOOK.take(exchange.request_id)]
        if decoded.prefill is not None:
            spans += spans_from_proto(decoded.prefill.spans, "prefill")
        if decoded.final is not None and decoded.final is not decoded.prefill:
            spans += spans_from_proto(decoded.final.spans, "decode")
        self.metrics.spans(spans)
        if self.traces is not None:
            trace = RequestTrace(
                exchange.request_id,
                wall_ns(exchange.started),
                now_ns(),
                spans,
                _trace_attributes(exchange, decoded),
                exchange.traceparent,
            )
            # After this delta is written: the SDK's span objects cost the loop some time.
            asyncio.get_running_loop().call_soon(self.traces.export, trace)
        return spans

    def _require_upstream(self) -> Upstream:
        if self.upstream is None:
            raise RuntimeError("the router is closed (no gRPC channels)")
        return self.upstream

    # ------------------------------------------------------------------ routing

    def _goes_alone(self, upstream: Upstream, exchange: Exchange) -> bool:
        return goes_alone(upstream.fleet, self.config.disagg_min_prompt_tokens, exchange.context)

    def _lease(
        self,
        upstream: Upstream,
        role: str,
        exchange: Exchange,
        tried: Sequence[Instance] = (),
        aggregated: bool | None = None,
    ) -> _Lease:
        fleet = upstream.fleet
        started = now_ns()
        instance = fleet.pick(role, exchange.context, exclude=tried, aggregated=aggregated)
        BOOK.record(exchange.request_id, "pick", started, now_ns(), role=role)
        return _Lease(upstream, instance)

    async def _retry_lease(
        self,
        upstream: Upstream,
        exchange: Exchange,
        tried: list[Instance],
        exc: UpstreamError,
        aggregated: bool | None = None,
    ) -> _Lease:
        """Another instance of ``exc``'s role for a phase that failed having sent nothing, after
        a back-off; raises ``exc`` when it is not retryable, the retries are spent, or no
        untried instance is available. A decode that takes over KV from a prefill must not
        be an aggregated instance (``aggregated`` False)."""
        attempt = len(tried)
        if not exc.retryable or attempt > self.config.max_retries:
            raise exc
        await retry_pause(attempt, exchange.deadline)
        try:
            lease = self._lease(upstream, exc.role, exchange, tried, aggregated)
        except NoHealthyDaemon:
            raise exc from None
        exchange.log.warning(
            "%s; retry %d on %s daemon %s", exc, attempt, exc.role, lease.instance.address
        )
        self.metrics.upstream_error(exc.role, exc.reason)
        self.metrics.retry(exc.role, exc.reason)
        tried.append(lease.instance)
        return lease

    # ------------------------------------------------------------------ the prefill

    async def _prefill(
        self, upstream: Upstream, exchange: Exchange, leg: _DecodeLeg | None
    ) -> PrefillResult:
        """The prefill on the first instance that takes it (step 3)."""
        lease = self._lease(upstream, "prefill", exchange)
        tried = [lease.instance]
        while True:
            try:
                return await self._prefill_once(upstream, exchange, lease, leg)
            except UpstreamError as exc:
                if leg is not None and leg.started_early:
                    raise  # announced: the decode holds its params and goes on
                lease = await self._retry_lease(upstream, exchange, tried, exc)

    async def _prefill_once(
        self, upstream: Upstream, exchange: Exchange, lease: _Lease, leg: _DecodeLeg | None
    ) -> PrefillResult:
        """One prefill call, its early decode watched; shielded from the client leaving at the
        very moment it ends (the call then gets `PREFILL_GRACE_S` to deliver a final message
        already on its way, whose KV is released; a prefill still computing is cancelled, and
        the daemon gives its KV back itself)."""
        streams = leg is not None and streams_kv(
            self.config.kv_stream, lease.instance, leg.instance
        )
        on_params = leg.start_early if leg is not None and streams else None
        called = now_ns()
        call = asyncio.ensure_future(
            upstream.run_prefill(
                lease.instance,
                exchange.request_id,
                exchange.choice,
                exchange.deadline,
                on_params,
            )
        )
        # Bound now: the loop below leases decodes, and the prefill's lease must end with its
        # call, not whichever lease a name pointed at by then.
        call.add_done_callback(lambda _, prefill_lease=lease: prefill_lease.end())
        call.add_done_callback(
            lambda _, rid=exchange.request_id, address=lease.instance.address: BOOK.record(
                rid, "prefill_call", called, now_ns(), instance=address, kv_stream=streams
            )
        )
        try:
            while True:
                watched: set[asyncio.Future[Any]] = {call}
                if leg is not None and not leg.ended.done():
                    watched.add(leg.ended)
                await asyncio.wait(watched, return_when=asyncio.FIRST_COMPLETED)
                if call.done():
                    return call.result()
                if leg is None:  # only a leg's end wakes this up; narrows the type
                    raise RuntimeError("unreachable: woken without a decode leg")
                failure = leg.failure_before_answer()
                if failure is not None:
                    try:
                        leg.restart(
                            await self._retry_lease(
                                upstream, exchange, leg.tried, failure, aggregated=False
                            )
                        )
                        continue
                    except UpstreamError:
                        pass  # no other decode: the choice ends with this one's failure
                self._abandon(exchange, lease, call, "decode_failed")
                raise _DecodeEndedFirst(lease.instance.address)
        except asyncio.CancelledError:
            self._abandon(exchange, lease, call, "client_gone")
            raise

    # ------------------------------------------------------------------ releasing KV

    def _abandon(
        self,
        exchange: Exchange,
        lease: _Lease,
        call: asyncio.Future[PrefillResult],
        trigger: str,
    ) -> None:
        """Nobody waits for this prefill any more: give it the grace, release what it
        returns, cancel it past the grace."""
        if call.done():
            if not call.cancelled() and call.exception() is None:
                self._release_soon(exchange, call.result(), trigger)
            return
        self._spawn(lease.instance, self._release_late(exchange, call, trigger))

    async def _release_late(
        self, exchange: Exchange, call: asyncio.Future[PrefillResult], trigger: str
    ) -> None:
        try:
            prefill = await asyncio.wait_for(call, PREFILL_GRACE_S)
        except (TimeoutError, asyncio.CancelledError, UpstreamError):
            return  # cancelled while computing (the daemon releases), or failed: nothing held
        upstream = self.upstream
        if upstream is not None:
            await self._release(upstream, exchange, prefill, trigger)

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
        self._spawn(prefill.daemon, self._release(upstream, exchange, prefill, trigger))

    def _spawn(self, instance: Instance, release: Any) -> None:
        upstream = self._require_upstream()
        # The instance's channel stays open for the call, even if it leaves the fleet now.
        upstream.fleet.call_started(instance)
        task = asyncio.get_running_loop().create_task(release)
        self.releases.add(task)

        def done(task: asyncio.Task[None]) -> None:
            self.releases.discard(task)
            upstream.fleet.call_ended(instance)

        task.add_done_callback(done)

    async def _release(
        self, upstream: Upstream, exchange: Exchange, prefill: PrefillResult, trigger: str
    ) -> None:
        outcome = await upstream.release_kv(
            prefill, exchange.request_id, self.config.release_timeout_s
        )
        self.metrics.kv_release(trigger, outcome)
        log = exchange.log.info if outcome in ("released", "not_held") else exchange.log.warning
        log("KV release on %s (%s): %s", prefill.daemon.address, trigger, outcome)


class _DecodeEndedFirst(Exception):
    """The early decode ended while the prefill on ``prefill_address`` still ran."""

    def __init__(self, prefill_address: str) -> None:
        super().__init__(f"the decode ended before the prefill on {prefill_address}")
        self.prefill_address = prefill_address


class _Lease:
    """An instance picked for one leg, counted in its ``in_flight`` until `end` (idempotent)."""

    def __init__(self, upstream: Upstream, instance: Instance) -> None:
        self._upstream = upstream
        self.instance = instance
        self._ended = False

    def end(self) -> None:
        if not self._ended:
            self._ended = True
            self._upstream.fleet.release(self.instance)


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


def _trace_attributes(exchange: Exchange, decoded: _Decoded) -> dict[str, Any]:
    """vLLM's ``gen_ai.*`` attributes of its ``llm_request`` span, where the router knows
    them, and the route."""
    attributes: dict[str, Any] = {
        "gen_ai.usage.prompt_tokens": decoded.num_prompt_tokens,
        "gen_ai.usage.completion_tokens": len(decoded.token_ids),
        "gen_ai.request.max_tokens": exchange.choice.max_tokens,
    }
    if decoded.first_token_at is not None:
        attributes["gen_ai.latency.time_to_first_token"] = decoded.first_token_at - exchange.started
    if decoded.final is not None:
        attributes["gen_ai.response.finish_reasons"] = (decoded.final.finish_reason,)
    attributes.update({f"kvtransfer.{role}": address for role, address in exchange.route.items()})
    return attributes


def _kvtransfer_info(
    exchange: Exchange, decoded: _Decoded, spans: Sequence[Span]
) -> dict[str, Any]:
    metrics = decoded.final.metrics if decoded.final is not None else None
    first = decoded.first_token_at
    origin = wall_ns(exchange.started)
    return {
        "request_id": exchange.request_id,
        **exchange.route,
        "token_ids": list(decoded.token_ids),
        "ttft_s": None if first is None else first - exchange.started,
        "kv_transfer_s": metrics.kv_transfer_s if metrics is not None else 0.0,
        "kv_blocks_received": metrics.kv_blocks_received if metrics is not None else 0,
        "kv_bytes_received": metrics.kv_bytes_received if metrics is not None else 0,
        "num_recomputed_tokens": metrics.num_recomputed_tokens if metrics is not None else 0,
        # The policy's expectation at the pick (None: no prefix index, or prompt tokens
        # unknown), for the role that computed the prompt.
        "predicted_cached_tokens": exchange.context.predicted_cached_tokens.get(
            "decode" if decoded.prefill is None else "prefill"
        ),
        "phases": decoded.phases(),
        # Where each millisecond went: every span, in ms from the request's arrival here
        # (that instant as wall-clock ns, to line a client's own times up with them).
        "timeline": relative(spans, origin),
        "timeline_origin_unix_ns": origin,
    }


_END = object()


class _DecodeLeg:
    """The decode call of one choice and the instance it is leased on.

    Started early (`start_early`: the prefill announced its params, its KV is being computed),
    after the prefill returned (`continue_with`), or alone (`start_alone`). A task reads the
    call's messages into a queue as they come, so the runner sees the call end (``ended``)
    while it still waits for the prefill; `messages` hands them on. `restart` moves the leg to
    another instance after a call that failed before answering."""

    def __init__(self, upstream: Upstream, exchange: Exchange, lease: _Lease) -> None:
        self._upstream = upstream
        self._exchange = exchange
        self._lease = lease
        self.tried: list[Instance] = [lease.instance]
        self.started_early = False
        self.alone = False
        # The prefill's stream when it announced its params (an early start's input).
        self._announced: generation_pb2.GenerateResponse | None = None
        self._stream: CallStream | None = None
        self._reader: asyncio.Task[None] | None = None
        self._queue: asyncio.Queue[Any] = asyncio.Queue()
        # How the current call failed, once it did; why none could be started.
        self._failure: UpstreamError | None = None
        self._unstarted: UpstreamError | None = None
        # Done when the current call's messages end (the call ended or failed).
        self.ended: asyncio.Future[None] = asyncio.get_running_loop().create_future()

    @property
    def instance(self) -> Instance:
        return self._lease.instance

    @property
    def address(self) -> str:
        return self._lease.instance.address

    @property
    def answered(self) -> bool:
        """Whether the current call sent a message (a retry would repeat it to the client)."""
        return self._stream is not None and self._stream.answered

    def start_early(self, prefill_so_far: generation_pb2.GenerateResponse) -> None:
        if self._stream is not None:
            return
        self._announced = prefill_so_far
        self.started_early = self._open(self._decode_call(prefill_so_far, None))

    def start_alone(self) -> None:
        exchange = self._exchange
        self.alone = True
        started = self._open(
            lambda: self._upstream.run_alone(
                self.instance, exchange.request_id, exchange.choice, exchange.deadline
            )
        )
        if not started:
            raise self._not_started()

    async def continue_with(self, prefill: PrefillResult | None) -> None:
        """Go on after the prefill's first token (``None``: the prefill failed after the decode
        was called; it computes its first token itself). Raises `UpstreamError` when the
        request's deadline ran out before a decode call could start."""
        exchange = self._exchange
        if self._stream is None:
            if prefill is None:
                raise RuntimeError("no decode call was started early")
            if not self._open(self._decode_call(prefill.final, prefill.final.token_ids)):
                raise self._not_started()
            return
        tokens = () if prefill is None else prefill.final.token_ids
        problem = await self._upstream.continue_decode(
            self.instance, exchange.request_id, tokens, exchange.deadline
        )
        if problem is not None:
            # The decode stream says what became of the request (e.g. its load failed).
            exchange.log.info("Continue on %s: %s", self.address, problem)

    def restart(self, lease: _Lease, prefill: PrefillResult | None = None) -> None:
        """Drop the current call (it failed before answering) and its lease; call ``lease``'s
        instance instead: continuing after ``prefill``'s first token, or early from the
        announcement while the prefill still runs, or alone."""
        self._drop()
        self._lease.end()
        self._lease = lease
        self._queue = asyncio.Queue()
        self.ended = asyncio.get_running_loop().create_future()
        if self.alone:
            self.start_alone()
        elif prefill is not None:
            if not self._open(self._decode_call(prefill.final, prefill.final.token_ids)):
                raise self._not_started()
        elif self._announced is not None:
            self._open(self._decode_call(self._announced, None))

    def failure_before_answer(self) -> UpstreamError | None:
        """The retryable failure of the current call, if it failed without sending a message
        (`messages` still raises it)."""
        failure = self._failure
        if failure is None or self.answered or not failure.retryable:
            return None
        return failure

    async def messages(self) -> AsyncIterator[generation_pb2.GenerateResponse]:
        """The current call's messages; raises its failure."""
        while True:
            item = await self._queue.get()
            if item is _END:
                return
            if isinstance(item, BaseException):
                raise item
            yield item

    async def close(self) -> None:
        """Cancel the call if it still runs (its daemon aborts the request and lets go of the
        producer's KV) and end the lease."""
        reader, stream = self._reader, self._stream
        self._drop()
        try:
            if reader is not None:
                await asyncio.gather(reader, return_exceptions=True)
            if stream is not None:
                await stream.aclose()
        finally:
            # Even when the unwinding is cancelled again or the stream fails to close: a lease
            # that never ends keeps the instance busy forever (a half-open breaker waits for
            # it to be idle).
            self._lease.end()

    # ------------------------------------------------------------------

    def _decode_call(
        self, prefill: generation_pb2.GenerateResponse, generated: Sequence[int] | None
    ) -> Any:
        exchange = self._exchange
        return lambda: self._upstream.run_decode(
            self.instance,
            exchange.request_id,
            exchange.choice,
            prefill,
            exchange.deadline,
            generated,
        )

    def _open(self, start: Any) -> bool:
        """Start the call; False when the request's deadline ran out first."""
        try:
            stream: CallStream = start()
        except UpstreamError as exc:
            self._exchange.log.info("decode not started: %s", exc)
            self._unstarted = exc
            return False
        self._stream, self._failure = stream, None
        reading = self._read(stream, self._queue, self.ended, now_ns())
        self._reader = asyncio.get_running_loop().create_task(reading)
        return True

    def _not_started(self) -> UpstreamError:
        if self._unstarted is None:
            raise RuntimeError("unreachable: a decode call neither started nor refused")
        return self._unstarted

    async def _read(
        self,
        stream: CallStream,
        queue: asyncio.Queue[Any],
        ended: asyncio.Future[None],
        called: int,
    ) -> None:
        first: int | None = None
        try:
            async for message in stream:
                if first is None:
                    first = now_ns()
                    name = "decode_first_message"
                    BOOK.record(self._exchange.request_id, name, called, first)
                if message.finished:
                    # Before the message is queued: the timeline is built from it.
                    BOOK.record(
                        self._exchange.request_id,
                        "decode_call",
                        called,
                        now_ns(),
                        instance=self.address,
                    )
                queue.put_nowait(message)
            queue.put_nowait(_END)
        except UpstreamError as exc:
            if stream is self._stream:
                self._failure = exc
            queue.put_nowait(exc)
        finally:
            if not ended.done():
                ended.set_result(None)

    def _drop(self) -> None:
        reader, self._reader = self._reader, None
        stream, self._stream = self._stream, None
        if reader is not None:
            reader.cancel()
        if stream is not None:
            # Cancel the call now; the reader's own unwinding closes the generator.
            stream.cancel()
