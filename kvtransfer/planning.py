"""How many prefill and decode instances a request rate needs under TTFT and ITL SLOs.

The input is a profile that ``benchmarks/pd_profile.py`` measures on real daemons (schema in
that module's docstring): the prefill's time per prompt at several prompt lengths, the decode's
inter-token latency (ITL) at several batch sizes, the KV transfer time per prompt token and the
client's fixed overhead. `plan` turns it, a workload (rate R requests/s, prompt tokens L: one
length or a mix of lengths with their shares, output tokens O) and two SLOs on the *mean* TTFT
and the *mean* ITL into instance counts.

The model (docs/planning.md says the same for operators):

- Prefill pool, P instances. One prompt occupies a prefill for S(L) = L / tps(L) seconds; the
  profile's prompt time is interpolated linearly between measured lengths (proportionally
  below the shortest, along the last segment above the longest). The router splits arrivals
  evenly, so each instance sees Poisson arrivals at R/P, first come first served: an M/G/1
  queue, utilisation rho = R*E[S]/P, mean wait W = (R/P)*E[S^2] / (2*(1 - rho))
  (Pollaczek-Khinchine), the moments over the workload's prompt lengths. One length makes it
  M/D/1, W = rho*S / (2*(1 - rho)); a spread of lengths with the same mean waits longer, in
  proportion to E[S^2]: a 1536-token prompt ahead makes every short one behind it wait.
  TTFT = E[S] + W + T + c, T = E[L] * kv_transfer_s_per_token, c the profile's fixed client
  overhead. rho >= 1 is refused (the queue grows without bound). T is in TTFT as a
  disaggregated setup where the decode emits the first token pays it; kvtransfer's router
  streams the prefill's token first, so there T lands on the second token instead and the
  predicted TTFT is that much conservative.
- Decode pool, D instances. A request occupies a decode for O * ITL(b) seconds (O, not O-1:
  the decode's first step, after the KV load, is about one ITL too). By Little's law the mean
  batch on one instance is b = (R/D) * O * ITL(b); ITL(b) is interpolated linearly between
  measured batch sizes, held at the smallest one's value below it (a running request is a
  batch of at least itself) and extrapolated along the last segment above the largest (slope
  floored at 0: noise must not make a larger batch faster). The smallest fixed point is the
  operating point; none means the decodes cannot keep up. Require ITL(b) <= the ITL SLO and
  b <= the engine's max_num_seqs when the profile names it.
- The two pools are independent, so the smallest P+D is the smallest feasible P plus the
  smallest feasible D (the tie rule "fewer prefills" never has to choose), within
  ``max_instances`` in total.
- Aggregated comparison, A instances that each prefill and decode (chunked prefill, decodes
  scheduled first, as this engine does). Prefill takes rho_p = (R/A)*S of each instance's
  time and decode steps only run in the rest, so the mean ITL is ITL(b) / (1 - rho_p) with
  the batch from b = (R/A) * O * ITL(b) / (1 - rho_p). The mean TTFT is the M/G/1 prefill
  time E[S] + W (rho_p as rho) plus one decode step per prompt chunk (each chunk shares its
  step with the running decodes: E[ceil(L / max_num_batched_tokens)] * ITL(b)) plus c. The
  mean hides the stall: a gap that carries a whole chunk of the longest prompt is
  ITL(b) + S / chunks (``worst_gap``), which is what a p99 ITL SLO would see; the model plans
  for means only.

Everything here is pure (no I/O but `load_profile`); times are seconds, rates per second.
"""

from __future__ import annotations

import itertools
import json
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

PROFILE_SCHEMA = "kvtransfer.pd_profile/1"

# Why a pool needs the count it got: the constraint that fails with one instance fewer.
BIND_NONE = "none (one instance is enough)"
BIND_PREFILL_CAPACITY = "prefill capacity (rho >= 1)"
BIND_DECODE_CAPACITY = "decode capacity (no steady batch)"
BIND_BATCH_LIMIT = "decode batch limit (max_num_seqs)"
BIND_AGGREGATED_CAPACITY = "capacity (prefill rho >= 1 or no steady decode batch)"
BIND_TTFT = "TTFT SLO"
BIND_ITL = "ITL SLO"
# The start of a binding that no count can fix (an SLO below one unloaded instance's time).
UNREACHABLE = "unreachable"


class PlanningError(ValueError):
    """Bad input to the planner (a ValueError: the CLI turns it into exit code 2)."""


class ProfileError(PlanningError):
    """The profile file is missing, not JSON, or not the schema `pd_profile.py` writes."""


class WorkloadError(PlanningError):
    """A rate, SLO or token count that is not a positive number."""


class SaturatedError(PlanningError):
    """Utilisation at or above 1, or no steady decode batch: the queue grows without bound."""


@dataclass(frozen=True)
class PrefillPoint:
    prompt_tokens: int
    prefill_s: float  # the daemon's admission to first token, one request at a time


@dataclass(frozen=True)
class DecodePoint:
    batch_size: int
    itl_s: float


@dataclass(frozen=True)
class Profile:
    prefill: tuple[PrefillPoint, ...]  # sorted by prompt_tokens, distinct
    decode: tuple[DecodePoint, ...]  # sorted by batch_size, distinct
    kv_transfer_s_per_token: float
    overhead_s: float = 0.0
    max_num_seqs: int | None = None
    max_num_batched_tokens: int | None = None
    label: str = ""  # model, machine and date, for the printout


@dataclass(frozen=True)
class Workload:
    rate: float  # requests/s
    prompt_tokens: float  # mean
    output_tokens: float
    ttft_slo_s: float
    itl_slo_s: float
    # (prompt tokens, share) pairs whose shares add to 1 and whose mean is prompt_tokens; empty:
    # every prompt has prompt_tokens. `Workload.mixed` builds one from percents.
    prompt_mix: tuple[tuple[float, float], ...] = ()

    def __post_init__(self) -> None:
        for name in ("rate", "prompt_tokens", "output_tokens", "ttft_slo_s", "itl_slo_s"):
            _check_positive(getattr(self, name), name)
        if not self.prompt_mix:
            return
        for tokens, share in self.prompt_mix:
            _check_positive(tokens, "prompt_mix tokens")
            _check_positive(share, "prompt_mix share")
        if not math.isclose(sum(share for _, share in self.prompt_mix), 1.0, rel_tol=1e-9):
            raise WorkloadError(f"prompt_mix shares must add to 1, got {self.prompt_mix!r}")
        mean = sum(tokens * share for tokens, share in self.prompt_mix)
        if not math.isclose(mean, self.prompt_tokens, rel_tol=1e-9):
            raise WorkloadError(
                f"prompt_tokens {self.prompt_tokens!r} is not the mix's mean {mean!r}"
            )

    @classmethod
    def mixed(
        cls,
        rate: float,
        mix: Sequence[tuple[float, float]],
        output_tokens: float,
        ttft_slo_s: float,
        itl_slo_s: float,
    ) -> Workload:
        """A workload whose prompts have these lengths, each with a percent (they add to 100)."""
        if not mix:
            raise WorkloadError("prompt_mix must name at least one prompt length")
        for tokens, percent in mix:
            _check_positive(tokens, "prompt_mix tokens")
            _check_positive(percent, "prompt_mix percent")
        total = sum(percent for _, percent in mix)
        if not math.isclose(total, 100.0, rel_tol=1e-9):
            raise WorkloadError(f"prompt_mix percents must add to 100, got {total:g}")
        shares = tuple((float(tokens), percent / total) for tokens, percent in mix)
        mean = sum(tokens * share for tokens, share in shares)
        return cls(rate, mean, output_tokens, ttft_slo_s, itl_slo_s, shares)

    def lengths(self) -> tuple[tuple[float, float], ...]:
        """(prompt tokens, share) pairs: the mix, or the one length with share 1."""
        return self.prompt_mix or ((self.prompt_tokens, 1.0),)


def _check_positive(value: Any, name: str) -> None:
    # bool is an int to Python, never a quantity.
    if (
        isinstance(value, bool)
        or not isinstance(value, int | float)
        or not (math.isfinite(value) and value > 0)
    ):
        raise WorkloadError(f"{name} must be a positive number, got {value!r}")


@dataclass(frozen=True)
class PrefillPrediction:
    instances: int
    service_s: float
    utilisation: float
    wait_s: float
    transfer_s: float
    ttft_s: float


@dataclass(frozen=True)
class DecodePrediction:
    instances: int
    batch: float  # mean requests in flight per instance
    itl_s: float
    utilisation: float  # batch over the largest batch that still meets the ITL SLO


@dataclass(frozen=True)
class AggregatedPrediction:
    instances: int
    prefill_utilisation: float
    batch: float
    itl_s: float
    ttft_s: float
    worst_gap_s: float


@dataclass(frozen=True)
class Plan:
    workload: Workload
    max_instances: int
    prefill: PrefillPrediction | None  # None: no count meets the SLOs
    prefill_binding: str  # or why none does
    decode: DecodePrediction | None
    decode_binding: str
    aggregated: AggregatedPrediction | None
    aggregated_binding: str

    @property
    def disaggregated_total(self) -> int | None:
        if self.prefill is None or self.decode is None:
            return None
        total = self.prefill.instances + self.decode.instances
        return total if total <= self.max_instances else None


# ------------------------------------------------------------------ the profile


def load_profile(path: str | Path) -> Profile:
    path = Path(path)
    try:
        text = path.read_text()
    except FileNotFoundError:
        raise ProfileError(f"profile {path}: no such file") from None
    except OSError as exc:
        raise ProfileError(f"profile {path}: cannot read it ({exc.strerror})") from None
    try:
        data = json.loads(text)
    except ValueError as exc:
        raise ProfileError(f"profile {path}: not JSON ({exc})") from None
    return parse_profile(data, str(path))


def parse_profile(data: Any, source: str = "profile") -> Profile:
    """Check every field the planner reads; the message names the first bad one exactly."""

    def fail(what: str) -> ProfileError:
        return ProfileError(f"{source}: {what}")

    if not isinstance(data, Mapping):
        raise fail(f"expected a JSON object, got {type(data).__name__}")
    if data.get("schema") != PROFILE_SCHEMA:
        raise fail(f"schema must be {PROFILE_SCHEMA!r}, got {data.get('schema')!r}")

    def number(obj: Mapping[str, Any], key: str, where: str, zero_ok: bool = False) -> float:
        value = obj.get(key)
        # bool is an int to Python, never a measurement.
        if (
            isinstance(value, bool)
            or not isinstance(value, int | float)
            or not math.isfinite(value)
        ):
            raise fail(f"{where}{key} must be a number, got {value!r}")
        if value < 0 or (value == 0 and not zero_ok):
            raise fail(f"{where}{key} must be {'>=' if zero_ok else '>'} 0, got {value!r}")
        return float(value)

    def points(key: str, x_key: str, y_key: str) -> list[tuple[int, float]]:
        rows = data.get(key)
        if not isinstance(rows, list) or not rows:
            raise fail(f"{key} must be a non-empty list, got {rows!r}")
        out: list[tuple[int, float]] = []
        for i, row in enumerate(rows):
            if not isinstance(row, Mapping):
                raise fail(f"{key}[{i}] must be an object, got {row!r}")
            x = number(row, x_key, f"{key}[{i}].")
            if x != int(x):
                raise fail(f"{key}[{i}].{x_key} must be a whole number, got {row[x_key]!r}")
            out.append((int(x), number(row, y_key, f"{key}[{i}].") / 1e3))
        xs = [x for x, _ in out]
        if len(set(xs)) != len(xs):
            raise fail(f"{key} lists a {x_key} twice: {sorted(xs)}")
        return sorted(out)

    prefill = tuple(PrefillPoint(x, y) for x, y in points("prefill", "prompt_tokens", "prefill_ms"))
    decode = tuple(DecodePoint(x, y) for x, y in points("decode", "batch_size", "itl_ms"))
    # Zero is a fair measurement for both (same-host transfers, an in-process client).
    transfer = number(data, "kv_transfer_ms_per_token", "", zero_ok=True) / 1e3
    overhead_s = (
        number(data, "overhead_ms", "", zero_ok=True) / 1e3 if "overhead_ms" in data else 0.0
    )
    engine = data.get("engine") or {}
    if not isinstance(engine, Mapping):
        raise fail(f"engine must be an object, got {engine!r}")
    limits = {
        key: int(number(engine, key, "engine.")) if engine.get(key) is not None else None
        for key in ("max_num_seqs", "max_num_batched_tokens")
    }
    label = " ".join(str(data.get(key, "")) for key in ("model", "created")).strip()
    return Profile(prefill, decode, transfer, overhead_s, label=label, **limits)


# ------------------------------------------------------------------ the curves


def prefill_seconds(profile: Profile, prompt_tokens: float) -> float:
    """S(L): linear between measured lengths, proportional below, last segment's slope above."""
    pts = profile.prefill
    if prompt_tokens <= pts[0].prompt_tokens:
        return pts[0].prefill_s * prompt_tokens / pts[0].prompt_tokens
    return _piecewise(
        [(p.prompt_tokens, p.prefill_s) for p in pts], prompt_tokens, floor_slope=False
    )


def itl_seconds(profile: Profile, batch: float) -> float:
    """ITL(b): held below the smallest measured batch, linear between, extrapolated above."""
    pts = [(p.batch_size, p.itl_s) for p in profile.decode]
    if batch <= pts[0][0]:
        return pts[0][1]
    return _piecewise(pts, batch, floor_slope=True)


def _piecewise(pts: Sequence[tuple[float, float]], x: float, floor_slope: bool) -> float:
    for (x0, y0), (x1, y1) in itertools.pairwise(pts):
        if x <= x1:
            return y0 + (y1 - y0) * (x - x0) / (x1 - x0)
    (x0, y0), (x1, y1) = pts[-2:] if len(pts) > 1 else (pts[-1], pts[-1])
    slope = 0.0 if x1 == x0 else (y1 - y0) / (x1 - x0)
    if floor_slope:
        slope = max(slope, 0.0)
    return y1 + slope * (x - x1)


def _itl_pieces(profile: Profile) -> list[tuple[float, float, float, float]]:
    """ITL(b) as pieces (lo, hi, ITL at lo, slope), from b = 0 to infinity."""
    pts = [(float(p.batch_size), p.itl_s) for p in profile.decode]
    pieces = [(0.0, pts[0][0], pts[0][1], 0.0)]
    for (x0, y0), (x1, y1) in itertools.pairwise(pts):
        pieces.append((x0, x1, y0, (y1 - y0) / (x1 - x0)))
    last_slope = max(pieces[-1][3], 0.0) if len(pts) > 1 else 0.0
    pieces.append((pts[-1][0], math.inf, pts[-1][1], last_slope))
    return pieces


def steady_batch(profile: Profile, occupancy_per_itl: float) -> float:
    """The smallest b with b = a * ITL(b), a = arrivals/s per instance * tokens per request.

    g(b) = a*ITL(b) - b is positive at 0 and linear on each piece, so the first piece where
    it reaches 0 holds the root; `SaturatedError` when it never does."""
    a = occupancy_per_itl
    for lo, hi, y_lo, slope in _itl_pieces(profile):
        # Here b = a*(y_lo + slope*(b - lo)), so b*(1 - a*slope) = a*(y_lo - slope*lo).
        denominator = 1.0 - a * slope
        if denominator <= 0:
            continue  # g does not fall on this piece
        root = a * (y_lo - slope * lo) / denominator
        if lo - 1e-12 <= root <= hi:
            return root
    raise SaturatedError(
        f"decode cannot keep up: each request adds {a:.4g} batch-seconds per ITL-second and "
        "ITL grows with the batch at least as fast as the batch it would drain"
    )


def batch_at_itl(profile: Profile, itl_s: float) -> float:
    """The largest batch whose ITL is still <= ``itl_s`` (inf if ITL never gets there)."""
    for lo, hi, y_lo, slope in _itl_pieces(profile):
        y_hi = y_lo + slope * (hi - lo) if math.isfinite(hi) else math.inf if slope > 0 else y_lo
        if y_hi > itl_s:
            return lo if slope <= 0 else lo + (itl_s - y_lo) / slope
    return math.inf


@dataclass(frozen=True)
class ServiceTime:
    """A prefill's time per prompt over the workload's prompt lengths."""

    mean_s: float
    second_moment_s2: float  # E[S^2]: what a spread of lengths adds to the queue's wait


def prefill_service(profile: Profile, work: Workload) -> ServiceTime:
    times = [(prefill_seconds(profile, tokens), share) for tokens, share in work.lengths()]
    return ServiceTime(
        mean_s=sum(s * share for s, share in times),
        second_moment_s2=sum(s * s * share for s, share in times),
    )


def mg1_wait(arrivals_per_s: float, service: ServiceTime) -> float:
    """Mean queueing delay of an M/G/1 queue (Pollaczek-Khinchine); rho >= 1 is refused."""
    utilisation = arrivals_per_s * service.mean_s
    if utilisation >= 1.0:
        raise SaturatedError(
            f"utilisation {utilisation:.3f} >= 1: the instances cannot keep up with the arrivals"
        )
    return arrivals_per_s * service.second_moment_s2 / (2.0 * (1.0 - utilisation))


def md1_wait(utilisation: float, service_s: float) -> float:
    """Mean queueing delay of an M/D/1 queue (every service takes ``service_s``)."""
    return mg1_wait(utilisation / service_s, ServiceTime(service_s, service_s**2))


# ------------------------------------------------------------------ the pools


def predict_prefill(profile: Profile, work: Workload, instances: int) -> PrefillPrediction:
    service = prefill_service(profile, work)
    wait = mg1_wait(work.rate / instances, service)
    rho = work.rate / instances * service.mean_s
    transfer = work.prompt_tokens * profile.kv_transfer_s_per_token
    ttft = service.mean_s + wait + transfer + profile.overhead_s
    return PrefillPrediction(instances, service.mean_s, rho, wait, transfer, ttft)


def predict_decode(profile: Profile, work: Workload, instances: int) -> DecodePrediction:
    batch = steady_batch(profile, work.rate / instances * work.output_tokens)
    itl = itl_seconds(profile, batch)
    cap = batch_at_itl(profile, work.itl_slo_s)
    if profile.max_num_seqs is not None:
        cap = min(cap, profile.max_num_seqs)
    return DecodePrediction(instances, batch, itl, batch / cap if cap > 0 else math.inf)


def predict_aggregated(profile: Profile, work: Workload, instances: int) -> AggregatedPrediction:
    service = prefill_service(profile, work)
    wait = mg1_wait(work.rate / instances, service)
    rho = work.rate / instances * service.mean_s
    batch = steady_batch(profile, work.rate / instances * work.output_tokens / (1.0 - rho))
    step = itl_seconds(profile, batch)
    budget = profile.max_num_batched_tokens

    def chunks(tokens: float) -> int:
        return math.ceil(tokens / budget) if budget else 1

    mean_chunks = sum(chunks(tokens) * share for tokens, share in work.lengths())
    ttft = service.mean_s + wait + mean_chunks * step + profile.overhead_s
    biggest_chunk_s = max(
        prefill_seconds(profile, tokens) / chunks(tokens) for tokens, _ in work.lengths()
    )
    return AggregatedPrediction(
        instances, rho, batch, step / (1.0 - rho), ttft, step + biggest_chunk_s
    )


def _over_batch_limit(profile: Profile, batch: float) -> bool:
    return profile.max_num_seqs is not None and batch > profile.max_num_seqs


def _smallest(
    limit: int, attempt: Callable[[int], tuple[Any, str | None]]
) -> tuple[Any | None, str]:
    """The first n in 1..limit that ``attempt`` passes, and what failed at n - 1.

    ``attempt(n)`` returns (prediction, None) on success, else (_, the failed constraint); a
    constraint starting with `UNREACHABLE` ends the search (more instances cannot help)."""
    failed: str | None = None
    for n in range(1, limit + 1):
        prediction, miss = attempt(n)
        if miss is None:
            return prediction, failed or BIND_NONE
        if miss.startswith(UNREACHABLE):
            return None, miss
        failed = miss
    return None, f"none within {limit} instances ({failed} at {limit})"


def plan(profile: Profile, work: Workload, max_instances: int = 64) -> Plan:
    """The smallest prefill and decode counts (each within ``max_instances - 1``: the other
    pool needs one) and, for comparison, the smallest aggregated count."""
    if isinstance(max_instances, bool) or not isinstance(max_instances, int) or max_instances < 2:
        raise WorkloadError(f"max_instances must be an integer >= 2, got {max_instances!r}")

    def prefill(n: int) -> tuple[PrefillPrediction | None, str | None]:
        try:
            got = predict_prefill(profile, work, n)
        except SaturatedError:
            return None, BIND_PREFILL_CAPACITY
        if got.ttft_s <= work.ttft_slo_s:
            return got, None
        bare = got.ttft_s - got.wait_s  # more instances only shorten the wait
        if bare > work.ttft_slo_s:
            return got, f"{UNREACHABLE}: TTFT {1e3 * bare:.1f} ms with no queueing at all"
        return got, BIND_TTFT

    def decode(n: int) -> tuple[DecodePrediction | None, str | None]:
        floor = itl_seconds(profile, 0)
        if floor > work.itl_slo_s:
            why = f"{UNREACHABLE}: ITL {1e3 * floor:.1f} ms at the smallest batch"
            return None, why
        try:
            got = predict_decode(profile, work, n)
        except SaturatedError:
            return None, BIND_DECODE_CAPACITY
        if _over_batch_limit(profile, got.batch):
            return got, BIND_BATCH_LIMIT
        return got, None if got.itl_s <= work.itl_slo_s else BIND_ITL

    def aggregated(n: int) -> tuple[AggregatedPrediction | None, str | None]:
        try:
            got = predict_aggregated(profile, work, n)
        except SaturatedError:
            return None, BIND_AGGREGATED_CAPACITY
        checks = (
            (BIND_TTFT, got.ttft_s <= work.ttft_slo_s),
            (BIND_ITL, got.itl_s <= work.itl_slo_s),
            (BIND_BATCH_LIMIT, not _over_batch_limit(profile, got.batch)),
        )
        misses = [name for name, ok in checks if not ok]
        return got, " and ".join(misses) or None

    p, p_why = _smallest(max_instances - 1, prefill)
    d, d_why = _smallest(max_instances - 1, decode)
    a, a_why = _smallest(max_instances, aggregated)
    return Plan(work, max_instances, p, p_why, d, d_why, a, a_why)
