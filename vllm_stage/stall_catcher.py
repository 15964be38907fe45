"""Catch a stalled vLLM step in the act: stacks, CPU and affinity of every thread of the servers.

vLLM's engine core logs "No available shared memory broadcast block found in 60 seconds" when
a worker has not taken the step it broadcast; five of those, and vLLM's executor gives up and
kills the engine (issue 34). `StallCatcher` watches the servers' logs for that line and, the
first time it appears, writes into ``dumps/``:

* ``py-spy-PID.txt`` (and ``py-spy-native-PID.txt``): every thread's Python stack (and the C
  frames under it) for every process of every server's process group: API server, engine
  core, workers;
* ``threads.txt``: for every thread, its CPU share over the last sampling interval, its CPU
  affinity, its state and its name (kvtransfer's threads name themselves ``kvtx-...``).

`ThreadSampler` samples the same per-thread CPU shares every few seconds while the run goes on,
so a run that did not stall still says how much CPU kvtransfer's threads took.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

STALL_LINE = "No available shared memory broadcast block"
ENGINE_DEATH = re.compile(r"EngineCore encountered a fatal error|EngineDeadError|executor failed")
_CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


@dataclass(frozen=True)
class ThreadRow:
    pid: int
    tid: int
    process: str
    name: str
    state: str
    cpus: str
    cpu_share: float  # of one core, over the sampling interval


def group_members(pgids: list[int]) -> dict[int, int]:
    """pid -> process group of every live process in one of ``pgids``."""
    members = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        with contextlib.suppress(OSError, IndexError, ValueError):
            stat = Path(f"/proc/{entry}/stat").read_text()
            fields = stat[stat.rindex(")") + 2 :].split()
            if int(fields[2]) in pgids:
                members[int(entry)] = int(fields[2])
    return members


def group_pids(pgids: list[int]) -> list[int]:
    """Every live process whose process group is one of ``pgids``."""
    return sorted(group_members(pgids))


def _thread_ticks(pid: int) -> dict[int, tuple[int, str, str]]:
    """tid -> (utime + stime in ticks, state, name) for every thread of ``pid``."""
    ticks = {}
    with contextlib.suppress(OSError):
        for tid in os.listdir(f"/proc/{pid}/task"):
            with contextlib.suppress(OSError, ValueError, IndexError):
                stat = Path(f"/proc/{pid}/task/{tid}/stat").read_text()
                name = stat[stat.index("(") + 1 : stat.rindex(")")]
                fields = stat[stat.rindex(")") + 2 :].split()
                ticks[int(tid)] = (int(fields[11]) + int(fields[12]), fields[0], name)
    return ticks


def _affinity(pid: int, tid: int) -> str:
    with contextlib.suppress(OSError):
        for line in Path(f"/proc/{pid}/task/{tid}/status").read_text().splitlines():
            if line.startswith("Cpus_allowed_list:"):
                return line.split(":", 1)[1].strip()
    return "?"


def _process_name(pid: int) -> str:
    with contextlib.suppress(OSError):
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()[:120]
    return "?"


def sample_threads(pids: list[int], interval_s: float = 1.0) -> list[ThreadRow]:
    """Every thread of ``pids`` with its CPU share over about ``interval_s``, busiest first.
    Each process's share is over the time between its own two readings (a starved sampler
    reads late)."""
    before = {pid: (time.monotonic(), _thread_ticks(pid)) for pid in pids}
    time.sleep(interval_s)
    rows = []
    for pid in pids:
        read_at, ticks_before = before[pid]
        after = _thread_ticks(pid)
        elapsed = max(time.monotonic() - read_at, 1e-3)
        for tid, (ticks, state, name) in after.items():
            start = ticks_before.get(tid, (ticks, "", ""))[0]
            share = (ticks - start) / _CLOCK_TICKS / elapsed
            rows.append(
                ThreadRow(pid, tid, _process_name(pid), name, state, _affinity(pid, tid), share)
            )
    return sorted(rows, key=lambda row: -row.cpu_share)


def format_rows(rows: list[ThreadRow]) -> str:
    lines = [f"{'pid':>7} {'tid':>7} {'cpu%':>6} {'cpus':>5} st name (process)"]
    for row in rows:
        lines.append(
            f"{row.pid:>7} {row.tid:>7} {row.cpu_share * 100:6.1f} {row.cpus:>5} {row.state:>2} "
            f"{row.name} ({row.process})"
        )
    return "\n".join(lines)


def dump_everything(pgids: list[int], out: Path, reason: str, first_pid: int | None = None) -> Path:
    """py-spy stacks (Python and native) of every process of ``pgids`` and the CPU, affinity
    and state of each of their threads, into ``out``; returns ``out``. ``first_pid`` (a
    process seen spinning) is read before anything else, while it may still spin."""
    out.mkdir(parents=True, exist_ok=True)
    pids = group_pids(pgids)
    (out / "reason.txt").write_text(f"{time.strftime('%H:%M:%S')} {reason}\npids {pids}\n")
    beside = Path(sys.executable).with_name("py-spy")
    spy = str(beside) if beside.exists() else shutil.which("py-spy")
    if spy is None:
        (out / "py-spy-missing.txt").write_text("py-spy is not installed\n")
    elif first_pid is not None:
        _spy(spy, first_pid, [], out / f"py-spy-first-{first_pid}.txt")
    # CPU next: py-spy stops each process while it reads it, which would skew the shares.
    (out / "threads.txt").write_text(format_rows(sample_threads(pids)) + "\n")
    for pid in pids if spy is not None else ():
        for flags, name in (([], "py-spy"), (["--native"], "py-spy-native")):
            _spy(spy, pid, flags, out / f"{name}-{pid}.txt")
    return out


def _spy(spy: str, pid: int, flags: list[str], path: Path) -> None:
    with contextlib.suppress(subprocess.TimeoutExpired, OSError):
        done = subprocess.run(
            [spy, "dump", "--pid", str(pid), *flags], capture_output=True, text=True, timeout=60
        )
        path.write_text(f"# {_process_name(pid)}\n{done.stdout}{done.stderr}")


class StallCatcher:
    """Watches ``logs`` (files that grow) for vLLM's stall line; dumps once, on the first."""

    def __init__(self, logs: list[Path], pgids: list[int], out: Path, poll_s: float = 0.5):
        self._logs = logs
        self._pgids = pgids
        self._out = out
        self._poll_s = poll_s
        self._offsets = dict.fromkeys(logs, 0)
        self._stop = threading.Event()
        self.caught: Path | None = None
        self.stall_lines = 0
        self.deaths: list[str] = []
        self._thread = threading.Thread(target=self._watch, name="stall-catcher", daemon=True)
        self._thread.start()

    def _watch(self) -> None:
        while not self._stop.wait(self._poll_s):
            self.scan()

    def scan(self) -> None:
        for log in self._logs:
            with contextlib.suppress(OSError):
                with log.open("rb") as handle:
                    handle.seek(self._offsets[log])
                    chunk = handle.read()
                    self._offsets[log] += len(chunk)
                for line in chunk.decode(errors="replace").splitlines():
                    if ENGINE_DEATH.search(line):
                        self.deaths.append(f"{log.name}: {line.strip()[:300]}")
                    if STALL_LINE not in line:
                        continue
                    self.stall_lines += 1
                    if self.caught is None:
                        reason = f"{log.name}: {line.strip()[:300]}"
                        print(f"stall caught ({reason}); dumping to {self._out}", flush=True)
                        self.caught = dump_everything(self._pgids, self._out, reason)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(10)
        self.scan()


class ThreadSampler:
    """Samples every thread's CPU share of ``pgids`` each ``every_s``: the most any thread named
    ``kvtx-*`` (kvtransfer's) took. The first time one of ours takes more than ``spin_share``
    of a core, everything is dumped into ``out`` (as `StallCatcher` does): a spin caught in the
    act, whether or not vLLM stalls on it."""

    def __init__(
        self, groups: dict[int, str], out: Path, every_s: float = 2.0, spin_share: float = 0.5
    ) -> None:
        """``groups``: process group -> the server's name (each server is a group)."""
        self._groups = groups
        self._pgids = list(groups)
        self._out = out
        self._every_s = every_s
        self._spin_share = spin_share
        self._stop = threading.Event()
        self.ours_max: dict[str, float] = {}
        self.caught: Path | None = None
        self._thread = threading.Thread(target=self._run, name="thread-sampler", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self._every_s):
            members = group_members(self._pgids)
            for row in sample_threads(sorted(members), 1.0):
                if not row.name.startswith("kvtx-"):
                    continue
                process = row.process.split()[0].rsplit("/", 1)[-1] if row.process else "?"
                where = f"{self._groups.get(members.get(row.pid, 0), '?')}/{process}/{row.name}"
                self.ours_max[where] = max(self.ours_max.get(where, 0.0), row.cpu_share)
                if row.cpu_share > self._spin_share and self.caught is None:
                    reason = (
                        f"thread {row.name} (tid {row.tid}, pid {row.pid}, cpus {row.cpus}) at "
                        f"{row.cpu_share:.0%} of a core"
                    )
                    print(f"spin caught ({reason}); dumping to {self._out}", flush=True)
                    self.caught = dump_everything(self._pgids, self._out, reason, row.pid)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(120)
