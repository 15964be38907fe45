"""A watchdog over connector calls made inside an engine step.

A worker hook that blocks holds the whole step, and vLLM's executor kills an engine whose step
has not come back within its RPC timeout (300 s; its engine core warns every 60 s with "No
available shared memory broadcast block"). Nothing of ours said so before issue 34. Each
watched call is entered in `HookWatchdog`; one thread looks at the calls in flight every
``poll_s`` and, for a call past its bound (a hook: ``hook_bound_s``, 1 s by default; a load:
its own deadline plus a grace, since a load that neither finished nor failed by then is a bug
of ours), logs at ERROR the call, how long it has run and the *stack of the thread running
it*, again every `_RELOG_S` while it stays stuck, and counts it:

* ``stalls``: calls that went past their bound, per hook name (vLLM: ``vllm:kvtransfer_hook_
  stalls_total`` through the connector's stats, which reach vLLM's ``/metrics`` once the
  step ends);
* `blocked_s`: per hook, how long its oldest call in flight has run, for an endpoint outside
  the step (the stats cannot leave a step that does not end; see `serve_metrics`).
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import sys
import threading
import time
import traceback
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from kvtransfer.threads import enter_own_thread, parse_cpus

logger = logging.getLogger(__name__)

DEFAULT_HOOK_BOUND_S = 1.0
# The hook name loads are watched under (their bound: their own deadline plus a grace).
LOAD_HOOK = "load"
# The name a whole engine step is watched under (from binding its connector metadata to clearing
# it): a step stuck anywhere, in our hooks or not, is logged with the stack of its thread.
STEP_HOOK = "step"
DEFAULT_STEP_BOUND_S = 30.0
# How often a call still stuck is logged again.
_RELOG_S = 30.0


@dataclass(frozen=True)
class WatchdogSettings:
    """The watchdog's and our threads' settings, from ``kv_connector_extra_config``:
    ``hook_bound_s`` (> 0), ``watchdog_metrics_port`` (1-65535; unset: not served) and
    ``thread_cpus`` (a CPU list such as ``"3"`` or ``"2-3"``; unset: our threads stay where
    their process runs). `ValueError` naming the key for a bad value."""

    hook_bound_s: float = DEFAULT_HOOK_BOUND_S
    metrics_port: int | None = None
    thread_cpus: frozenset[int] | None = None
    step_bound_s: float = DEFAULT_STEP_BOUND_S

    @classmethod
    def from_extra(cls, extra: Mapping[str, Any]) -> WatchdogSettings:
        bound = _seconds(extra, "hook_bound_s", DEFAULT_HOOK_BOUND_S)
        step_bound = _seconds(extra, "step_bound_s", DEFAULT_STEP_BOUND_S)
        port = extra.get("watchdog_metrics_port")
        if port is not None and (
            isinstance(port, bool) or not isinstance(port, int) or not 0 < port < 65536
        ):
            raise ValueError(f"watchdog_metrics_port must be a port (1-65535), got {port!r}")
        cpus = extra.get("thread_cpus")
        if cpus is not None and not isinstance(cpus, str):
            raise ValueError(f"thread_cpus must be a CPU list such as '2-3', got {cpus!r}")
        return cls(bound, port, None if cpus is None else parse_cpus(cpus), step_bound)


def _seconds(extra: Mapping[str, Any], key: str, default: float) -> float:
    value = extra.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int | float) or not value > 0:
        raise ValueError(f"{key} must be a number of seconds > 0, got {value!r}")
    return float(value)


@dataclass
class _Call:
    hook: str
    thread: int
    thread_name: str
    started: float
    bound_s: float
    detail: str
    native_id: int
    cpu_started: float
    reported_at: float | None = None

    def what(self) -> str:
        return f"{self.hook} ({self.detail})" if self.detail else self.hook


class HookWatchdog:
    """Counts and logs connector calls that run past their bound (see the module docstring)."""

    def __init__(
        self, hook_bound_s: float = DEFAULT_HOOK_BOUND_S, poll_s: float = 0.25, name: str = ""
    ) -> None:
        if hook_bound_s <= 0 or poll_s <= 0:
            raise ValueError(
                f"watchdog bounds must be positive (hook_bound_s={hook_bound_s}, poll_s={poll_s})"
            )
        self.hook_bound_s = hook_bound_s
        self._poll_s = poll_s
        self._name = name
        self._lock = threading.Lock()
        self._calls: dict[int, _Call] = {}
        self._ids = itertools.count()
        self.stalls: dict[str, int] = {}
        self._unreported: dict[str, int] = {}
        self._stop = threading.Event()
        # Started here, at start-up: starting a thread waits for it to run, which a hook
        # must never do (on a starved core that took seconds).
        self._thread = threading.Thread(target=self._run, name="kvtransfer-watchdog", daemon=True)
        self._thread.start()

    @contextlib.contextmanager
    def watch(self, hook: str, bound_s: float | None = None, detail: str = "") -> Iterator[None]:
        """Run the body as the call ``hook`` (``detail``: what it works on, for the log),
        watched against ``bound_s`` (default: the hook bound). Costs a lock and a dict entry:
        fine once per hook per step."""
        key = self.enter(hook, bound_s, detail)
        try:
            yield
        finally:
            self.leave(key)

    def enter(self, hook: str, bound_s: float | None = None, detail: str = "") -> int:
        """`watch` in two halves, for a span that is not one call (an engine step, from
        binding its metadata to clearing it): the key to `leave` with."""
        current = threading.current_thread()
        call = _Call(
            hook,
            threading.get_ident(),
            current.name,
            time.monotonic(),
            self.hook_bound_s if bound_s is None else bound_s,
            detail,
            threading.get_native_id(),
            time.thread_time(),
        )
        key = next(self._ids)
        with self._lock:
            self._calls[key] = call
        return key

    def leave(self, key: int) -> None:
        """The span `enter` began has ended (a key already left: nothing)."""
        with self._lock:
            call = self._calls.pop(key, None)
        if call is not None and call.reported_at is not None:
            logger.warning(
                "%s%s returned after %.1f s (past its %.1f s bound)",
                self._prefix(),
                call.what(),
                time.monotonic() - call.started,
                call.bound_s,
            )

    def blocked_s(self) -> dict[str, float]:
        """Per hook with a call in flight past its bound: how long the oldest has run."""
        now = time.monotonic()
        with self._lock:
            calls = list(self._calls.values())
        blocked: dict[str, float] = {}
        for call in calls:
            if call.reported_at is not None:
                blocked[call.hook] = max(blocked.get(call.hook, 0.0), now - call.started)
        return blocked

    def take_stalls(self) -> dict[str, int]:
        """The stall counts since the last call (for per-step stats, which add up)."""
        with self._lock:
            taken, self._unreported = self._unreported, {}
        return taken

    def close(self) -> None:
        self._stop.set()
        if self._thread is not threading.current_thread():
            self._thread.join(5)

    # -- the watchdog's thread ---------------------------------------------------------------

    def _run(self) -> None:
        enter_own_thread("kvtransfer-watchdog")
        while not self._stop.wait(self._poll_s):
            self.check()

    def check(self) -> None:
        """Log and count every call past its bound (the thread calls this every ``poll_s``)."""
        now = time.monotonic()
        with self._lock:
            due = [
                call
                for call in self._calls.values()
                if now - call.started >= call.bound_s
                and (call.reported_at is None or now - call.reported_at >= _RELOG_S)
            ]
            for call in due:
                if call.reported_at is None:
                    self.stalls[call.hook] = self.stalls.get(call.hook, 0) + 1
                    self._unreported[call.hook] = self._unreported.get(call.hook, 0) + 1
                call.reported_at = now
        frames = sys._current_frames() if due else {}
        for call in due:
            frame = frames.get(call.thread)
            stack = "".join(traceback.format_stack(frame)) if frame is not None else "(gone)\n"
            logger.error(
                "%s%s has run for %.1f s, past its %.1f s bound, on thread %r (%s): an engine "
                "step that does not come back is killed by vLLM's executor (300 s). Its stack "
                "(where the thread is now):\n%s",
                self._prefix(),
                call.what(),
                now - call.started,
                call.bound_s,
                call.thread_name,
                _how_it_spent(call, now),
                stack.rstrip(),
            )

    def _prefix(self) -> str:
        return f"[{self._name}] " if self._name else ""


_STATES = {"S": "sleeping: blocked on something", "D": "in uninterruptible I/O"}


def _how_it_spent(call: _Call, now: float) -> str:
    """Whether a slow call computed, waited for a CPU or was blocked: the CPU its thread used
    since the call began, and the thread's state now (a starved thread is runnable, a blocked
    one sleeps)."""
    try:
        used = time.clock_gettime(time.pthread_getcpuclockid(call.thread)) - call.cpu_started
        with open(f"/proc/self/task/{call.native_id}/stat") as stat:
            state = stat.read().rsplit(")", 1)[1].split()[0]
    except (OSError, ValueError, IndexError):
        return "its CPU use and state unknown"
    elapsed = now - call.started
    if state == "R":
        # Running or waiting for a CPU: the CPU it got says which.
        how = "computing" if used > elapsed / 2 else "runnable: waiting for a CPU, starved"
    else:
        how = _STATES.get(state, f"state {state}")
    return f"{used:.3f} s of CPU in {elapsed:.3f} s, {how}"


_PROCESS_WATCHDOG: HookWatchdog | None = None
_PROCESS_LOCK = threading.Lock()


def process_watchdog() -> HookWatchdog:
    """The watchdog shared by every connector of this process (one thread, one set of counts:
    vLLM's worker runs the adapter's hooks and our loads in one process)."""
    global _PROCESS_WATCHDOG
    with _PROCESS_LOCK:
        if _PROCESS_WATCHDOG is None:
            _PROCESS_WATCHDOG = HookWatchdog()
        return _PROCESS_WATCHDOG


class _WatchdogCollector:
    """Prometheus collector reading a watchdog when scraped."""

    def __init__(self, watchdog: HookWatchdog) -> None:
        self._watchdog = watchdog

    def collect(self) -> Iterator[object]:
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        stalls = CounterMetricFamily(
            "kvtransfer_connector_hook_stalls",
            "Connector calls inside an engine step that ran past their bound",
            labels=["hook"],
        )
        for hook, count in sorted(self._watchdog.stalls.items()):
            stalls.add_metric([hook], count)
        yield stalls
        blocked = GaugeMetricFamily(
            "kvtransfer_connector_hook_blocked_seconds",
            "How long the oldest call of each hook still in flight past its bound has run",
            labels=["hook"],
        )
        for hook, seconds in sorted(self._watchdog.blocked_s().items()):
            blocked.add_metric([hook], seconds)
        yield blocked


def serve_metrics(watchdog: HookWatchdog, host: str, port: int) -> int:
    """Serve ``watchdog``'s counts on ``http://host:port/metrics`` from a thread of its own, so
    they can be read while an engine step (and with it the engine's own metrics) is stuck.
    Returns the port (``port`` 0: one the OS chose). `OSError` if it cannot listen."""
    from prometheus_client import CollectorRegistry, start_http_server

    registry = CollectorRegistry()
    registry.register(_WatchdogCollector(watchdog))  # type: ignore[arg-type]
    server, _ = start_http_server(port, addr=host, registry=registry)
    return int(server.server_address[1])
