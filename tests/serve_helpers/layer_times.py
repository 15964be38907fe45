"""`TimedUcxConnector`: the `UcxConnector`, writing down when each layer's KV is computed and
when each pull lands, for the layer-wise streaming test. Daemons load it through
``kv_connector_module_path`` (with this directory on ``PYTHONPATH``, see `timed_kv_config`).

Every worker appends one JSON line per event to the file named by ``KVT_LAYER_TIMES``:

* ``{"event": "saved", "layer": name, "t": ...}``: ``save_kv_layer`` was called (``t``: when),
  so this step's KV of that layer is written, and a streaming lease serves it once the call
  returns;
* ``{"event": "forward_done", "t": ...}``: ``wait_for_save``, the step's forward is over;
* ``{"event": "pulled", "layers": [...], "t": ...}``: a pull this worker started completed
  (its blocks are in this worker's cache). Written by a thread waiting on the pull's handle, so
  never earlier than the pull completed;
* ``{"event": "pushed", "layers": [...], "t": ...}``: a write of a push this worker (a
  producer) made completed: flushed, so the layers are in the consumer's blocks;
* ``{"event": "held", "released_by": "transfer" | "bound", "t": ...}``: see below.

``t`` is `time.monotonic`: CLOCK_MONOTONIC, one clock for every process of the machine, so the
times of the prefill and the decode daemon compare.

Apart from that one hold, nothing here changes what the connector does; it only looks. The
hold makes "a layer landed on the decode while the prefill was still computing" a certainty
instead of a race: with ``KVT_HOLD_LAST_LAYER`` naming a file, a worker that is about to mark
its last layer computed while that file exists takes the file (once) and waits, before the
layer is marked, until the event file it names shows a pull (or push) completed after the time
it names (`arm_hold`: the consumer's file, or the producer's own for pushes), or
``HOLD_BOUND_S`` passed. A consumer that only loads once the whole
prompt is computed cannot release it: the hold then ends by its bound, and says so.
"""

from __future__ import annotations

import json
import os
import threading
import time
from pathlib import Path
from typing import Any

from kvtransfer.connectors.ucx.connector import UcxConnector

LOG_ENV = "KVT_LAYER_TIMES"
HOLD_ENV = "KVT_HOLD_LAST_LAYER"
# Ample for a decode to be called, handshake and land its first layer; a hold that runs out
# means no layer landed while the prefill computed (and the load may fail meanwhile).
HOLD_BOUND_S = 15.0
_TESTS_DIR = str(Path(__file__).resolve().parents[1])


def timed_kv_config() -> dict[str, str]:
    """The ``kv_transfer_config`` entries that make a daemon use `TimedUcxConnector`."""
    return {
        "kv_connector": "TimedUcxConnector",
        "kv_connector_module_path": "serve_helpers.layer_times",
    }


def timed_env(log: Path, hold: Path | None = None) -> dict[str, str]:
    """The environment of a daemon writing its events to ``log``, holding its last layer when
    ``hold`` exists (see `arm_hold`)."""
    path = os.environ.get("PYTHONPATH")
    env = {LOG_ENV: str(log), "PYTHONPATH": _TESTS_DIR + (os.pathsep + path if path else "")}
    if hold is not None:
        env[HOLD_ENV] = str(hold)
    return env


def arm_hold(hold: Path, consumer_log: Path, since: float) -> None:
    """The next forward of the daemon started with ``hold`` waits at its last layer for a pull
    (or push) completed in ``consumer_log`` at or after ``since`` (a `time.monotonic` time)."""
    staged = hold.with_name(hold.name + ".new")
    staged.write_text(json.dumps({"consumer_log": str(consumer_log), "since": since}))
    os.replace(staged, hold)  # whole or absent for the daemon reading it


def read_events(log: Path, since: float = 0.0) -> list[dict[str, Any]]:
    """The events of ``log`` at or after ``since``, in the order they were written."""
    if not log.exists():
        return []
    # Only whole lines: the writer may be half way through the last one.
    lines = log.read_text().split("\n")[:-1]
    events = [json.loads(line) for line in lines if line.strip()]
    return [event for event in events if event["t"] >= since]


class _Log:
    def __init__(self, path: str) -> None:
        self._lock = threading.Lock()
        self._file = open(path, "a", buffering=1)  # noqa: SIM115 - open for the process's life

    def write(self, event: str, t: float | None = None, **fields: Any) -> None:
        t = time.monotonic() if t is None else t
        line = json.dumps({"event": event, "t": t, "pid": os.getpid(), **fields})
        with self._lock:
            self._file.write(line + "\n")


class TimedUcxConnector(UcxConnector):
    def __init__(self, config: Any, role: Any, kv_cache_config: Any | None = None) -> None:
        super().__init__(config, role, kv_cache_config)
        path = os.environ.get(LOG_ENV)
        self._times = _Log(path) if path else None
        self._hold = os.environ.get(HOLD_ENV)
        self._last_layer: str | None = None

    def register_kv_caches(self, kv_caches: Any) -> None:
        super().register_kv_caches(kv_caches)
        self._last_layer = list(kv_caches)[-1] if kv_caches else None
        agent = self.worker_half.agent
        if self._times is None or agent is None:
            return
        times, pull = self._times, agent.pull

        def timed_pull(peer: Any, spec: Any, **kwargs: Any) -> Any:
            handle = pull(peer, spec, **kwargs)

            def landed() -> None:
                try:
                    error = handle.exception()
                except BaseException as exc:  # cancelled
                    error = exc
                if error is None:
                    times.write("pulled", layers=list(spec.layer_names))

            threading.Thread(target=landed, name="timed-pull", daemon=True).start()
            return handle

        # The worker's loads call agent.pull: this instance attribute is what they call.
        agent.pull = timed_pull
        write = agent._write

        def timed_write(session: Any, spec: Any, timeout_s: Any) -> Any:
            handle = write(session, spec, timeout_s)  # done: a push's write runs here
            if handle.exception() is None:
                times.write("pushed", layers=list(spec.layer_names))
            return handle

        # Push sessions call agent._write for each write (a producer's pusher threads).
        agent._write = timed_write

    def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: Any, **kwargs: Any):
        if self._hold is not None and layer_name == self._last_layer:
            self._held()
        # The layer's KV is written when save_kv_layer is called: stamp it then, since a
        # one-sided read may land before this thread runs again after marking it servable.
        written = time.monotonic()
        super().save_kv_layer(layer_name, kv_layer, attn_metadata, **kwargs)
        if self._times is not None:
            self._times.write("saved", t=written, layer=layer_name)

    def wait_for_save(self) -> None:
        super().wait_for_save()
        if self._times is not None:
            self._times.write("forward_done")

    def _held(self) -> None:
        """Wait here, the last layer not yet marked computed, if the hold is armed."""
        try:
            armed = json.loads(Path(self._hold).read_text())
            os.unlink(self._hold)
        except FileNotFoundError:
            return
        consumer_log, since = Path(armed["consumer_log"]), armed["since"]

        def pulled() -> bool:
            return any(e["event"] in ("pulled", "pushed") for e in read_events(consumer_log, since))

        deadline = time.monotonic() + HOLD_BOUND_S
        # Polls another process's file: this daemon has no other way to hear of the pull.
        while not pulled() and time.monotonic() < deadline:
            time.sleep(0.01)
        if self._times is not None:
            self._times.write("held", released_by="transfer" if pulled() else "bound")
