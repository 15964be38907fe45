"""`ServiceStats`: what the router measured of one instance's speed, from the calls it routed
there. The SLO rule (`kvtransfer.router.routing.disagg`) predicts a route's TTFT and
inter-token latency from it.

Measured on the router's side, so it is the same for kvtransfer daemons and vLLM servers and
needs nothing from their reports:

- **prompt rate** (tokens/s): each prompt computation (a prefill call; a decode-alone request
  up to its first token) gives a sample, its computed tokens and its service time. Calls are
  treated as served one after another (FIFO): a call's service time starts at its own start or
  at the end of the instance's previous prompt, whichever is later, so time spent queued
  behind another prompt is not counted as slowness. The rate is the weighted mean of the
  tokens over the weighted mean of the seconds, not a mean of each sample's ratio: chunked
  prefill computes a short prompt in the step that also holds a long one's chunk, so the
  short one's own ratio is far too low and the long one's (its first chunk credited to the
  other) too high; summed, they are the instance's throughput.
- **queued prompt tokens**: the tokens of prompt computations in flight on it.
- **inter-token latency by batch**: every gap between two streamed deltas of a decode, per
  token, filed under the number of requests decoding on the instance at that moment. A gap
  during which the instance also computed a prompt is not filed: that is a stall, which the
  next figure keeps apart, not the pace of its steps.
- **stalls**: the service time of each prompt the instance computed (a decode alone; on a
  prefill every prompt), kept for `STALL_MEMORY_S`; the requests decoding there waited that
  long. The rule adds the recent and the pending ones to the gap it predicts for them, and
  reads a prefill's share of time spent on prompts (`busy_share`) as the share a request
  decoding there alone would lose.
- **the gap a request run alone got**: the mean gap between the tokens of each request the
  instance ran whole (its prompt, then every token), stalls included, kept for
  `ALONE_MEMORY_S`. How much the prompts computed beside such a request slow it depends on
  the engine and on the prompts that come after it: measured, it replaces the rule's
  prediction for a prefill alone.

A vLLM server (``--engine vllm``) also says, in its ``/metrics``, how many requests it runs and
the sum and count of the gaps between tokens it measured itself (`ServerTiming`, read at every
health check). From the first reading that shows tokens decoded, the gaps come from there: the
engine's own clock leaves out the network, SSE framing and the router's event loop, and counts
requests other clients sent. Its running count, when larger than the router's, is the batch
the rule predicts from. The prompt rate stays the router's: vLLM's prefill-time histogram
overlaps prompts computed in one step, and its prompt-token counters on a decode count the KV
a prefill sent.

Each figure is an exponentially weighted mean (`EWMA_WEIGHT` for the newest sample), so it
follows a change of load within a few requests. Nothing here blocks or locks: it runs on the
router's event loop.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass

EWMA_WEIGHT = 0.2
# Batches above this share one bucket: a CPU engine's step time has flattened by then.
MAX_BATCH_BUCKET = 32
# How long a prompt's stall is remembered: longer than any request decodes in a CPU test.
STALL_MEMORY_S = 120.0
# And how many at most: a prefill serving hundreds of requests a second keeps no more.
MAX_STALLS = 4096
# How long the gap requests run alone got on an instance stands for the next one (then the
# rule predicts again: the load may have changed since).
ALONE_MEMORY_S = 120.0


@dataclass(frozen=True)
class ServerTiming:
    """One reading of a vLLM server's own counters: requests running now, and the running
    totals of ``vllm:inter_token_latency_seconds`` (sum of gaps, number of gaps)."""

    itl_sum_s: float
    itl_count: int
    running: int


def _blend(old: float | None, sample: float) -> float:
    return sample if old is None else (1 - EWMA_WEIGHT) * old + EWMA_WEIGHT * sample


@dataclass
class PromptTicket:
    """One prompt computation in flight on an instance."""

    tokens: int
    started: float
    done: bool = False


class ServiceStats:
    """One instance's measured prompt rate, queued prompt tokens and inter-token latency."""

    def __init__(self) -> None:
        self.prompt_tokens_per_s: float | None = None
        self._prompt_tokens: float | None = None  # weighted means of the samples
        self._prompt_seconds: float | None = None
        self.queued_prompt_tokens = 0
        self.decoding = 0
        # What the server itself said at the last health check (vLLM's /metrics), if anything.
        self.server_running = 0
        self.itl_source = "router"
        self._itl_by_batch: dict[int, float] = {}
        self._last_prompt_end = float("-inf")
        self._prompts_computing = 0
        # (ended at, seconds served); the oldest dropped past MAX_STALLS.
        self._stalls: deque[tuple[float, float]] = deque(maxlen=MAX_STALLS)
        self._server: ServerTiming | None = None
        self._server_read_at = float("-inf")
        self._alone_gap_s: float | None = None
        self._alone_gap_at = float("-inf")

    @property
    def batch(self) -> int:
        """Requests decoding here: the router's count, or the server's when it said more."""
        return max(self.decoding, self.server_running)

    def prompt_started(self, tokens: int) -> PromptTicket:
        """A prompt of ``tokens`` uncached tokens (0: not known) starts computing here."""
        tokens = max(0, tokens)
        self.queued_prompt_tokens += tokens
        self._prompts_computing += 1
        return PromptTicket(tokens, time.monotonic())

    def prompt_done(self, ticket: PromptTicket, computed_tokens: int | None = None) -> None:
        """The prompt of ``ticket`` ended; ``computed_tokens``, when the engine said how many it
        computed, replaces the estimate in the sample. Idempotent: a failed call may end twice.
        """
        if ticket.done:
            return
        self._end(ticket)
        now = time.monotonic()
        tokens = ticket.tokens if computed_tokens is None else computed_tokens
        served = now - max(ticket.started, self._last_prompt_end)
        self._last_prompt_end = now
        self._forget_stalls(now)
        self._stalls.append((now, served))
        if tokens > 0 and served > 0:
            self._prompt_tokens = _blend(self._prompt_tokens, tokens)
            self._prompt_seconds = _blend(self._prompt_seconds, served)
            self.prompt_tokens_per_s = self._prompt_tokens / self._prompt_seconds

    def prompt_abandoned(self, ticket: PromptTicket) -> None:
        """The prompt of ``ticket`` ended without a result (failed, cancelled): no sample."""
        if not ticket.done:
            self._end(ticket)
            self._last_prompt_end = time.monotonic()

    def _end(self, ticket: PromptTicket) -> None:
        ticket.done = True
        self.queued_prompt_tokens = max(0, self.queued_prompt_tokens - ticket.tokens)
        self._prompts_computing = max(0, self._prompts_computing - 1)

    def _computed_a_prompt_since(self, start: float) -> bool:
        return self._prompts_computing > 0 or self._last_prompt_end > start

    def stall_s(self, within_s: float) -> float:
        """Seconds this instance spent on its own prompts in the last ``within_s`` seconds,
        and the seconds the ones still queued here will take (at its measured rate)."""
        now = time.monotonic()
        self._forget_stalls(now)
        recent = sum(served for ended, served in self._stalls if ended >= now - within_s)
        rate = self.prompt_tokens_per_s
        return recent + (self.queued_prompt_tokens / rate if rate else 0.0)

    def busy_share(self, within_s: float, extra_s: float = 0.0) -> float:
        """The share of the last ``within_s`` seconds this instance spent computing prompts,
        with the ones still queued here (and ``extra_s`` more seconds of them) counted as if
        they fell in that time: the share of its time a request decoding here will lose to
        prompts (its steps run in the rest)."""
        if within_s <= 0:
            raise ValueError(f"within_s must be > 0, got {within_s!r}")
        return (self.stall_s(within_s) + max(0.0, extra_s)) / within_s

    def _forget_stalls(self, now: float) -> None:
        while self._stalls and self._stalls[0][0] < now - STALL_MEMORY_S:
            self._stalls.popleft()

    def token_gap(self, seconds: float, tokens: int) -> None:
        """``tokens`` tokens arrived ``seconds`` after the previous ones of the same stream
        (not filed once the server's own timing is: see the module's docstring)."""
        if tokens <= 0 or seconds < 0 or self.itl_source != "router":
            return
        if self._computed_a_prompt_since(time.monotonic() - seconds):
            return
        self._file_gap(self.decoding, seconds / tokens)

    def server_timing(self, timing: ServerTiming) -> None:
        """A health check's reading of the server's counters. Between two readings, the
        change of the gaps' sum over the change of their count is the mean gap the engine
        measured meanwhile, filed under the mean of the two running counts, unless the router
        had a prompt computed there meanwhile (a stall). Counters that went down (the server
        restarted) start afresh."""
        previous, self._server = self._server, timing
        read_before, self._server_read_at = self._server_read_at, time.monotonic()
        self.server_running = timing.running
        if previous is None or self._computed_a_prompt_since(read_before):
            return
        gaps = timing.itl_count - previous.itl_count
        seconds = timing.itl_sum_s - previous.itl_sum_s
        if gaps <= 0 or seconds < 0:
            return
        self._file_gap(round((previous.running + timing.running) / 2), seconds / gaps)
        self.itl_source = "vllm"

    def _file_gap(self, batch: int, gap_s: float) -> None:
        bucket = min(max(1, batch), MAX_BATCH_BUCKET)
        self._itl_by_batch[bucket] = _blend(self._itl_by_batch.get(bucket), gap_s)

    def inter_token_s(self, batch: int) -> float | None:
        """The expected gap between tokens with ``batch`` requests decoding here: the bucket's
        mean when measured, else a straight line through the nearest measured buckets (flat
        beyond the largest or below the smallest), ``None`` before any was measured."""
        known = self._itl_by_batch
        if not known:
            return None
        batch = min(max(1, batch), MAX_BATCH_BUCKET)
        if batch in known:
            return known[batch]
        below = [b for b in known if b < batch]
        above = [b for b in known if b > batch]
        if below and above:
            lo, hi = max(below), min(above)
            share = (batch - lo) / (hi - lo)
            return known[lo] + share * (known[hi] - known[lo])
        if below and len(below) >= 2:
            # Extrapolate the last measured slope upwards (never downwards: more requests in a
            # batch do not make a step faster).
            b1, b2 = sorted(below)[-2:]
            slope = max(0.0, (known[b2] - known[b1]) / (b2 - b1))
            return known[b2] + slope * (batch - b2)
        return known[max(below)] if below else known[min(above)]

    def alone_decoded(self, mean_gap_s: float) -> None:
        """A request run whole here decoded with ``mean_gap_s`` between its tokens (from its
        first to its last, stalls included)."""
        if not 0 <= mean_gap_s < float("inf"):
            return
        now = time.monotonic()
        fresh = now - self._alone_gap_at <= ALONE_MEMORY_S
        self._alone_gap_s = _blend(self._alone_gap_s if fresh else None, mean_gap_s)
        self._alone_gap_at = now

    @property
    def alone_gap_s(self) -> float | None:
        """The mean gap requests run whole here got lately (None: none within
        `ALONE_MEMORY_S`)."""
        if time.monotonic() - self._alone_gap_at > ALONE_MEMORY_S:
            return None
        return self._alone_gap_s

    def describe(self) -> dict[str, object]:
        """What ``GET /workers`` and the fleet page show of it."""
        return {
            "prompt_tokens_per_s": self.prompt_tokens_per_s,
            "queued_prompt_tokens": self.queued_prompt_tokens,
            "decoding": self.decoding,
            "server_running": self.server_running,
            "itl_source": self.itl_source,
            "inter_token_s_by_batch": dict(sorted(self._itl_by_batch.items())),
            "alone_gap_s": self.alone_gap_s,
        }


class ArrivalRate:
    """Requests per second arriving at the router: the inverse of an exponentially weighted
    mean gap between arrivals (0 before the second one)."""

    def __init__(self) -> None:
        self._last: float | None = None
        self._gap_s: float | None = None

    def arrived(self) -> None:
        now = time.monotonic()
        if self._last is not None:
            self._gap_s = _blend(self._gap_s, now - self._last)
        self._last = now

    @property
    def per_s(self) -> float:
        return 1.0 / self._gap_s if self._gap_s else 0.0
