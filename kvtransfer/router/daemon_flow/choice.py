"""One choice of a request, from its prefill to its decode's last token: `ChoiceRunner.run`.

Life cycle of a choice (step 4 of a request, see `kvtransfer.router.web.app`):

1. Route: the choice's `RouteContext` holds its id and, when the router knows them, its
   prompt's token ids. `disagg.decide` chooses P/D or a decode instance alone (step 7): by
   ``disagg_min_prompt_tokens`` (a prompt whose uncached part is below it goes alone), and with
   SLO targets by the route predicted to meet them, from what the router measured of each
   instance (`fleet.service`: every call below feeds it), unless the fleet runs aggregated
   (`routing.fleet_mode`: then whole on the least loaded instance). The decision and its
   reason go into the metrics and the answer's ``kvtransfer`` object; with SLO targets the
   choice's tokens and end score it for the fleet's mode (`flow_rules.SloOutcome`).
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
   pulls each layer as it is computed (`DecodeLeg`, its messages read as they come). Its final
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
   a decode (step 5); nothing to release. A request decided to run on a prefill alone (with
   SLO targets, while the decodes are at their gap target) is the same call on a prefill
   instance picked instead of any decode, retried on another prefill.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from contextlib import aclosing
from typing import Any

from kvtransfer.router.config import RouterConfig
from kvtransfer.router.daemon_flow.decode_leg import DecodeLeg
from kvtransfer.router.daemon_flow.exchange import Decoded, Delta, Exchange, message_delta
from kvtransfer.router.daemon_flow.leases import Lease, Leases
from kvtransfer.router.daemon_flow.releases import KvReleases
from kvtransfer.router.daemon_flow.report import ChoiceReport
from kvtransfer.router.daemon_flow.upstream import PrefillResult, Upstream
from kvtransfer.router.errors import UpstreamError
from kvtransfer.router.fleet.instance import Instance
from kvtransfer.router.fleet.service import PromptTicket, ServiceStats
from kvtransfer.router.flow_rules import RouteDecider
from kvtransfer.router.metrics import RouterMetrics
from kvtransfer.router.names import AGGREGATED
from kvtransfer.router.routing.disagg import PREFILL_ONLY, RouteDecision
from kvtransfer.router.tracing import TraceExporter
from kvtransfer.timeline import BOOK, now_ns


def streams_kv(mode: str, prefill: Instance, decode: Instance) -> bool:
    """Whether ``prefill`` streams its KV to ``decode``, called while it computes (step 3).
    ``auto``: unless both said they compute on the same cores of one host: there the decode's
    work (its admission, each layer's read) takes CPU from the prefill's compute, measured to
    cost it more than the transfer that streaming hides (docs/operations.md)."""
    if mode != "auto":
        return mode == "always"
    here, there = prefill.placement, decode.placement
    return here is None or there is None or not here.shares_cores(there)


class ChoiceRunner:
    """Runs choices on one `Upstream`: picks and retries (`leases.Leases`), the decode leg
    (`decode_leg.DecodeLeg`), releasing KV nobody decoded (`releases.KvReleases`, tasks it
    keeps) and the choice's last delta (`report.ChoiceReport`)."""

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
        self.leases = Leases(config.max_retries, metrics)
        self.kv = KvReleases(upstream, config.release_timeout_s, metrics)
        self.report = ChoiceReport(metrics, traces)
        self.decider = RouteDecider(config, metrics)

    @property
    def releases(self) -> set[asyncio.Task[None]]:
        """``ReleaseKV`` calls and abandoned prefills in flight."""
        return self.kv.tasks

    async def close(self) -> None:
        """Wait for the releases in flight (each has a deadline), then stop releasing."""
        await self.kv.drain()
        if self.upstream is not None:
            await self.upstream.close()
        self.upstream = None
        self.kv.stop()

    async def run(self, exchange: Exchange) -> AsyncIterator[Delta]:
        """The choice's deltas; raises `UpstreamError` when it fails. Closing the iterator
        early (the client left, a sibling failed) cancels its calls and releases its KV."""
        upstream = self._require_upstream()
        decision = self.decider.decide(upstream.fleet, exchange.context, exchange.choice.max_tokens)
        exchange.decision = decision
        self.metrics.route_decision(decision.mode, decision.reason)
        outcome = self.decider.track(exchange.started)
        ended = failed = False
        try:
            async with aclosing(self._routed(upstream, exchange, decision)) as deltas:
                async for delta in deltas:
                    outcome.tokens(len(delta.token_ids))
                    yield delta
            ended = True
        except UpstreamError:
            failed = True
            raise
        finally:
            # A choice its consumer closed (the client left, a sibling failed) is not scored.
            outcome.close(failed=failed, scored=ended)

    async def _routed(
        self, upstream: Upstream, exchange: Exchange, decision: RouteDecision
    ) -> AsyncIterator[Delta]:
        """The choice's deltas on the route ``decision`` chose."""
        fleet = upstream.fleet
        if decision.on_prefill:
            self.metrics.route_mode(PREFILL_ONLY)
            on_prefill = self.leases.take(upstream, "prefill", exchange)
            async with aclosing(self._run_alone(upstream, exchange, on_prefill)) as deltas:
                async for delta in deltas:
                    yield delta
            return
        alone = decision.alone
        lease: Lease | None = None
        can_prefill = fleet.any_pickable("prefill")
        # With no prefill pickable the decision is "alone", but only aggregated instances may
        # take it (a decode daemon's policy weighs them with the KV it will pull).
        if not can_prefill or (not alone and exchange.choice.max_tokens > 1):
            if not can_prefill and not fleet.any_pickable(AGGREGATED):
                fleet.require_pickable("decode")  # with neither role up, name the decode
                fleet.require_pickable("prefill")
            # The decode first: KV prefilled for no decode daemon would only wait out its
            # lease. Its policy weighs aggregated instances with the others; with no prefill
            # to pick, only they can serve.
            lease = self.leases.take(
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
        leg = None if lease is None else DecodeLeg(upstream, exchange, lease)
        try:
            async with aclosing(self._run_legs(upstream, exchange, leg)) as deltas:
                async for delta in deltas:
                    yield delta
        finally:
            if leg is not None:
                await leg.close()

    async def _run_legs(
        self, upstream: Upstream, exchange: Exchange, leg: DecodeLeg | None
    ) -> AsyncIterator[Delta]:
        try:
            prefill = await self._prefill(upstream, exchange, leg)
        except _DecodeEndedFirst as ended:
            # The early decode ended while the prefill computed: its outcome is the choice's.
            exchange.log.warning("decode ended before the prefill returned; prefill abandoned")
            if leg is None:  # only a started leg ends first; narrows the type
                raise RuntimeError("unreachable: no decode leg") from None
            exchange.route = {"prefill": ended.prefill_address, "decode": leg.address}
            async with aclosing(self._follow(exchange, Decoded(), leg)) as deltas:
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
            async with aclosing(self._follow(exchange, Decoded(), leg)) as deltas:
                async for delta in deltas:
                    yield delta
            return
        exchange.route = {"prefill": prefill.daemon.address}
        decoded = Decoded()
        decoded.seed(prefill.final)
        if not prefill.continues or leg is None:
            # The first token ended the choice (max_tokens 1, a stop, the end of sequence).
            if leg is not None:
                await leg.close()
            decoded.final = prefill.final
            exchange.decoded = True
            if prefill.kv_transfer_params_json:
                self.kv.soon(exchange, prefill, "ended_at_first_token")
            yield self.report.last(exchange, decoded, prefill.final, prefill.final.text)
            return
        try:
            exchange.route["decode"] = leg.address
            # The first token goes out now, before the decode daemon answers.
            yield message_delta(exchange, prefill.final)
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
                    lease = await self.leases.retry(
                        upstream, exchange, leg.tried, exc, aggregated=False
                    )
                    leg.restart(lease, prefill)
                    exchange.route["decode"] = leg.address
        except BaseException as exc:
            self.kv.unless_decoded(exchange, prefill, _release_trigger(exc))
            raise
        # A decode that failed after its first message ends here too.
        self.kv.unless_decoded(exchange, prefill, "decode_failed")

    async def _run_alone(
        self, upstream: Upstream, exchange: Exchange, lease: Lease | None = None
    ) -> AsyncIterator[Delta]:
        """Step 7: the whole choice on one instance (``lease``'s, else a decode picked now),
        retried on another of its role before its first message."""
        leg = DecodeLeg(upstream, exchange, lease or self.leases.take(upstream, "decode", exchange))
        tokens = _uncached_estimate(exchange)
        ticket = leg.instance.service.prompt_started(tokens)
        try:
            leg.start_alone()
            exchange.route = {leg.instance.role: leg.address}
            why = "an aggregated instance"
            if not leg.instance.aggregated and exchange.decision is not None:
                why = exchange.decision.reason
            exchange.log.info("alone on %s %s (%s)", leg.instance.role, leg.address, why)
            while True:
                try:
                    follow = self._follow(exchange, Decoded(), leg, ticket)
                    async with aclosing(follow) as deltas:
                        async for delta in deltas:
                            yield delta
                    return
                except UpstreamError as exc:
                    if leg.answered:
                        raise
                    leg.instance.service.prompt_abandoned(ticket)
                    leg.restart(await self.leases.retry(upstream, exchange, leg.tried, exc))
                    ticket = leg.instance.service.prompt_started(tokens)
                    exchange.route = {leg.instance.role: leg.address}
        finally:
            leg.instance.service.prompt_abandoned(ticket)
            await leg.close()

    async def _follow(
        self,
        exchange: Exchange,
        decoded: Decoded,
        leg: DecodeLeg,
        prompt: PromptTicket | None = None,
    ) -> AsyncIterator[Delta]:
        """The decode stream's deltas, the last one with the finish reason. Its instance's
        `ServiceStats` get the gaps between its tokens and, for a decode alone (``prompt``),
        the prompt's compute time up to its first token."""
        service = leg.instance.service
        last_tokens_at: float | None = None
        # After its first tokens: the seconds and the tokens that followed.
        decoded_s, tokens_after_first = 0.0, 0
        try:
            async for reply in leg.messages():
                if not decoded.absorb(reply):
                    continue
                if reply.token_ids:
                    now = time.monotonic()
                    if last_tokens_at is None:
                        # Its first tokens: the gap before them is the prompt or the KV load.
                        if prompt is not None:
                            service.prompt_done(prompt)
                        service.decoding += 1
                    else:
                        service.token_gap(now - last_tokens_at, len(reply.token_ids))
                        decoded_s += now - last_tokens_at
                        tokens_after_first += len(reply.token_ids)
                    last_tokens_at = now
                if decoded.final is None and (reply.text or reply.token_ids):
                    yield message_delta(exchange, reply)
        finally:
            if last_tokens_at is not None:
                service.decoding -= 1
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
        if prompt is not None and tokens_after_first:
            # Run whole here: the gap it got, stalls included (`ServiceStats.alone_gap_s`).
            service.alone_decoded(decoded_s / tokens_after_first)
        leg.instance.succeeded()
        exchange.decoded = decoded.clean
        yield self.report.last(exchange, decoded, final, final.text)

    def _require_upstream(self) -> Upstream:
        if self.upstream is None:
            raise RuntimeError("the router is closed (no gRPC channels)")
        return self.upstream

    async def _prefill(
        self, upstream: Upstream, exchange: Exchange, leg: DecodeLeg | None
    ) -> PrefillResult:
        """The prefill on the first instance that takes it (step 3), once its turn at the
        prefills came (with SLO targets, `routing.prefill_order`)."""
        turn = self.decider.prefill_turn(
            upstream.fleet, exchange.decision, exchange.started, exchange.deadline
        )
        async with turn:
            lease = self.leases.take(upstream, "prefill", exchange)
            tried = [lease.instance]
            while True:
                try:
                    return await self._prefill_once(upstream, exchange, lease, leg)
                except UpstreamError as exc:
                    if leg is not None and leg.started_early:
                        raise  # announced: the decode holds its params and goes on
                    lease = await self.leases.retry(upstream, exchange, tried, exc)

    async def _prefill_once(
        self, upstream: Upstream, exchange: Exchange, lease: Lease, leg: DecodeLeg | None
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
        ticket = lease.instance.service.prompt_started(_uncached_estimate(exchange))
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
            lambda done, service=lease.instance.service: _prompt_ended(service, ticket, done)
        )
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
                            await self.leases.retry(
                                upstream, exchange, leg.tried, failure, aggregated=False
                            )
                        )
                        continue
                    except UpstreamError:
                        pass  # no other decode: the choice ends with this one's failure
                self.kv.abandon(exchange, lease, call, "decode_failed")
                raise _DecodeEndedFirst(lease.instance.address)
        except asyncio.CancelledError:
            self.kv.abandon(exchange, lease, call, "client_gone")
            raise


def _uncached_estimate(exchange: Exchange) -> int:
    """The prompt tokens the decision expected to be computed (0: not known)."""
    decision = exchange.decision
    if decision is not None and decision.uncached_tokens is not None:
        return decision.uncached_tokens
    return len(exchange.context.token_ids or ())


def _prompt_ended(service: ServiceStats, ticket: PromptTicket, call: asyncio.Future[Any]) -> None:
    """A prefill call ended: a rate sample from what it computed when it succeeded."""
    if call.cancelled() or call.exception() is not None:
        service.prompt_abandoned(ticket)
        return
    final = call.result().final
    computed = None
    if final.num_prompt_tokens:
        computed = final.num_prompt_tokens - int(final.metrics.num_cached_tokens)
    service.prompt_done(ticket, computed)


class _DecodeEndedFirst(Exception):
    """The early decode ended while the prefill on ``prefill_address`` still ran."""

    def __init__(self, prefill_address: str) -> None:
        super().__init__(f"the decode ended before the prefill on {prefill_address}")
        self.prefill_address = prefill_address


def _release_trigger(exc: BaseException) -> str:
    # GeneratorExit: the consumer closed the choice (its client left, or a sibling failed).
    if isinstance(exc, asyncio.CancelledError | GeneratorExit | ConnectionResetError):
        return "client_gone"
    return "decode_failed" if isinstance(exc, UpstreamError) else "error"
