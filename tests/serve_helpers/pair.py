"""`DaemonPair`: a prefill and a decode daemon as child processes, spoken to over gRPC.

This is how tests run engines in other processes: the real daemons (`ServiceProcess`), their
Generation service (`GenerationClient`) and KVAdmin (`AdminClient`), nothing test-only in
between. `generate` prefills each prompt with ``max_tokens=1`` and ``{"do_remote_decode": true}``,
then decodes it with the params the prefill returned, under the same request id on both sides
(``"<name>-<n>"``), so the two daemons' logs line up.

Both daemons bind 127.0.0.1, every port picked by the OS; they start together (model loads
overlap) and `stop` ends them with SIGTERM, returning what each said about KV blocks at exit.
"""

from __future__ import annotations

import itertools
import os
import signal
import threading
import urllib.request
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from prometheus_client.parser import text_string_to_metric_families
from transport_helpers.procs import freeze
from waiting import wait_until

from kvtransfer.clients.generation import GenerateResult, GenerationClient, generate_request
from kvtransfer.control.admin import EngineStatus, TransferDirection, TransferInfo
from kvtransfer.serve.launcher import ServiceProcess
from serve_helpers.daemons import admin, start_daemon

REMOTE_DECODE: Mapping[str, Any] = {"do_remote_decode": True}
STOP_TIMEOUT_S = 60.0
CALL_TIMEOUT_S = 120.0
# `DaemonPair.step_once`'s requests (ids NAME-step-N, which no test uses).
PROMPT_FOR_STEPS = "step"
_POLICIES = ("fail", "recompute")

Prompt = str | Sequence[int]


@dataclass(frozen=True)
class Stopped:
    """How a daemon ended: its exit code and the KV blocks its last log line reported in use
    (``None``: it never said, e.g. it was killed)."""

    exit_code: int
    blocks_in_use_at_exit: int | None


@dataclass
class BackgroundDecode:
    """A decode call running on a thread; ``outcome`` gets its result or its exception."""

    request_id: str
    thread: threading.Thread
    outcome: list[GenerateResult | BaseException] = field(default_factory=list)

    def result(self, timeout_s: float) -> GenerateResult | BaseException:
        self.thread.join(timeout_s)
        if self.thread.is_alive():
            raise AssertionError(f"decode of {self.request_id!r} still running after {timeout_s} s")
        (outcome,) = self.outcome
        return outcome


class DaemonPair:
    """A started prefill/decode pair joined by `UcxConnector`; a context manager that stops both.

    ``extra_config`` goes to both sides' ``kv_connector_extra_config`` (``kv_lease_s``,
    ``transfer_timeout_s``...); ``kv_load_failure_policy`` is the decode side's;
    ``common_flags`` go to both daemons (``--device cuda``...), ``prefill_flags`` and
    ``decode_flags`` to one (``--tp 2``...).
    """

    def __init__(self, prefill: ServiceProcess, decode: ServiceProcess, name: str) -> None:
        self.prefill = prefill
        self.decode = decode
        self.name = name
        self._ids = itertools.count()
        self._steps = itertools.count()
        self._stopped: dict[str, Stopped] = {}

    @classmethod
    def start(
        cls,
        log_dir: Path,
        *,
        name: str = "pd",
        prefill_flags: Sequence[str] = (),
        decode_flags: Sequence[str] = (),
        common_flags: Sequence[str] = (),
        kv_load_failure_policy: str = "fail",
        extra_config: Mapping[str, Any] | None = None,
    ) -> DaemonPair:
        if kv_load_failure_policy not in _POLICIES:
            raise ValueError(
                f"kv_load_failure_policy must be one of {list(_POLICIES)}, got "
                f"{kv_load_failure_policy!r}"
            )
        # Every prompt streams its KV (the default leaves short ones out): tests' prompts are short.
        extra = {"kv_stream_min_tokens": 0, **(extra_config or {})}
        policy = kv_load_failure_policy
        decode_kv = {"kv_connector_extra_config": extra, "kv_load_failure_policy": policy}
        sides = {
            "prefill": ([*common_flags, *prefill_flags], {"kv_connector_extra_config": extra}),
            "decode": ([*common_flags, *decode_flags], decode_kv),
        }

        def launch(role: str) -> ServiceProcess:
            flags, kv = sides[role]
            engine_id = f"{name}-{role}"
            return start_daemon(
                role, log_dir, "--engine-id", engine_id, *flags, kv=kv, name=engine_id
            )

        # Both start at once: model load and worker spawn overlap.
        with ThreadPoolExecutor(2) as pool:
            futures = {role: pool.submit(launch, role) for role in sides}
        started = {role: f.result() for role, f in futures.items() if f.exception() is None}
        errors = [f.exception() for f in futures.values() if f.exception() is not None]
        if errors:
            # One side failed: the other must not outlive the attempt.
            for process in started.values():
                process.terminate()
            raise errors[0]
        return cls(started["prefill"], started["decode"], name)

    # ------------------------------------------------------------------ generation

    def new_request_ids(self, n: int) -> list[str]:
        return [f"{self.name}-{next(self._ids)}" for _ in range(n)]

    def run_prefill(
        self, prompts: Sequence[Prompt], request_ids: Sequence[str] | None = None
    ) -> list[GenerateResult]:
        """One token per prompt; the prompts' blocks stay on the prefill for the decode side."""
        ids = list(request_ids) if request_ids is not None else self.new_request_ids(len(prompts))
        with GenerationClient(self.prefill.address) as client:
            return [
                client.generate(
                    generate_request(rid, prompt, 1, kv_transfer_params=dict(REMOTE_DECODE)),
                    CALL_TIMEOUT_S,
                )
                for rid, prompt in zip(ids, prompts, strict=True)
            ]

    def step_once(self, role: str) -> None:
        """One plain one-token request on ``role``'s daemon, answered: its engine ran a step
        after every request answered before. A prefill publishes the lease of a request it
        finished at its next step (a consumer's grant wait covers the lag): after this, the
        leases of every prefill answered so far are published."""
        with GenerationClient(self._daemon(role).address) as client:
            result = client.generate(
                generate_request(f"{self.name}-step-{next(self._steps)}", PROMPT_FOR_STEPS, 1),
                CALL_TIMEOUT_S,
            )
        if result.finish_reason != "length":
            raise RuntimeError(f"the {role}'s step request ended {result.finish_reason!r}")

    def run_decode(
        self,
        prompts: Sequence[Prompt],
        kv_transfer_params: Sequence[Mapping[str, Any] | None],
        request_ids: Sequence[str],
        max_tokens: int,
        first_tokens: Sequence[Sequence[int]] | None = None,
    ) -> list[GenerateResult]:
        """Decode with the params a prefill returned; a failed load comes back as a result
        with ``finish_reason == "error"`` (the daemon's answer), not as an exception.

        ``first_tokens``: each request's tokens the prefill generated, handed to the decode
        as the router does (the decode then computes none of the prompt)."""
        firsts = first_tokens or [()] * len(prompts)
        with GenerationClient(self.decode.address) as client:
            results = []
            for rid, prompt, params, first in zip(
                request_ids, prompts, kv_transfer_params, firsts, strict=True
            ):
                message = generate_request(
                    rid,
                    prompt,
                    max_tokens,
                    kv_transfer_params=dict(params) if params is not None else None,
                )
                message.generated_token_ids.extend(first)
                results.append(client.generate(message, CALL_TIMEOUT_S))
            return results

    def generate(
        self, prompts: Sequence[Prompt], max_tokens: int, *, hand_first_token: bool = False
    ) -> list[GenerateResult]:
        """Prefill on one daemon, decode on the other; results in prompt order.

        ``hand_first_token``: the decode gets the prefill's first token, as from the router
        (needed by a recurrent state, which holds the whole prompt); else it computes it."""
        ids = self.new_request_ids(len(prompts))
        prefilled = self.run_prefill(prompts, ids)
        for result in prefilled:
            assert result.finish_reason == "length", f"{result.request_id}: {result.error}"
        params = [result.kv_transfer_params for result in prefilled]
        firsts = [result.token_ids for result in prefilled] if hand_first_token else None
        return self.run_decode(prompts, params, ids, max_tokens, firsts)

    def decode_in_background(
        self,
        prompt: Prompt,
        kv_transfer_params: Mapping[str, Any],
        request_id: str,
        max_tokens: int,
    ) -> BackgroundDecode:
        """Start one decode call on a thread and return once its KV load is under way (the
        decode daemon lists it as a transfer it receives)."""
        background = BackgroundDecode(request_id, threading.Thread(target=lambda: None))

        def decode() -> None:
            try:
                background.outcome.extend(
                    self.run_decode([prompt], [kv_transfer_params], [request_id], max_tokens)
                )
            except BaseException as exc:
                background.outcome.append(exc)

        background.thread = threading.Thread(target=decode, name=f"decode-{request_id}")
        background.thread.start()
        self.wait_loading(request_id)
        return background

    def wait_loading(self, request_id: str, for_at_least_s: float = 0.0) -> float:
        """Wait until the decode daemon has been loading ``request_id``'s KV for
        ``for_at_least_s`` (by its own clock); returns that load's age."""

        def loading() -> TransferInfo | None:
            for transfer in admin(self.decode.address, "transfers"):
                if (
                    transfer.request_id == request_id
                    and transfer.direction == TransferDirection.RECV
                    and transfer.age_s >= for_at_least_s
                ):
                    return transfer
            return None

        what = f"decode loading {request_id!r} for {for_at_least_s:g} s"
        return wait_until(loading, what, 30 + for_at_least_s).age_s

    # ------------------------------------------------------------------ state

    def status(self, role: str) -> EngineStatus:
        return admin(self._daemon(role).address, "status")

    def counters(self, role: str) -> dict[str, int]:
        return self.status(role).counters

    def wait_no_blocks_in_use(self, timeout_s: float = 30.0) -> None:
        """Both daemons hold no KV block (decode first: its pulls free the prefill's blocks)."""
        for role in ("decode", "prefill"):
            if self._daemon(role).is_alive():
                wait_until(
                    lambda role=role: self.status(role).num_used_blocks == 0,
                    f"{role} daemon holds no KV block",
                    timeout_s,
                )

    def failures(self, role: str) -> dict[str, float]:
        """The daemon's ``kvtransfer_failures_total`` by reason (its Prometheus endpoint), the
        reasons that happened: every known reason is exported at 0 from start-up."""
        port = self._daemon(role).ready["metrics_port"]
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
            text = response.read().decode()
        return {
            sample.labels["reason"]: sample.value
            for family in text_string_to_metric_families(text)
            if family.name == "kvtransfer_failures"
            for sample in family.samples
            if sample.name == "kvtransfer_failures_total" and sample.value
        }

    def worker_pids(self) -> list[int]:
        """The engine worker processes of both daemons (none for a TP1xPP1 engine, whose
        worker runs in the daemon)."""
        return [
            pid
            for daemon in (self.prefill, self.decode)
            for pid in descendants(daemon.pid)
            if "spawn_main" in _cmdline(pid)
        ]

    # ------------------------------------------------------------------ life cycle

    def kill(self, role: str) -> None:
        """SIGKILL one daemon (its workers follow it, watching their parent)."""
        self._daemon(role).kill()

    def pause(self, role: str) -> None:
        """SIGSTOP: the process stays (the kernel still accepts its connections), runs nothing
        (returns once every thread of it is stopped)."""
        freeze(self._daemon(role).pid)

    def resume(self, role: str) -> None:
        os.kill(self._daemon(role).pid, signal.SIGCONT)

    def stop(self) -> dict[str, Stopped]:
        """SIGTERM both (decode first), each drained; idempotent. A daemon already dead keeps
        the exit code it died with."""
        for role in ("decode", "prefill"):
            if role not in self._stopped:
                daemon = self._daemon(role)
                code = daemon.terminate(STOP_TIMEOUT_S)
                self._stopped[role] = Stopped(code, daemon.blocks_in_use_at_exit())
        return dict(self._stopped)

    def _daemon(self, role: str) -> ServiceProcess:
        return {"prefill": self.prefill, "decode": self.decode}[role]

    def __enter__(self) -> DaemonPair:
        return self

    def __exit__(self, *exc: object) -> None:
        for role in ("decode", "prefill"):
            if self._daemon(role).is_alive():
                self.resume(role)  # a stopped process cannot handle SIGTERM
        self.stop()


def descendants(pid: int) -> list[int]:
    """Every live process below ``pid`` (read from /proc; zombies run nothing)."""
    parents: dict[int, int] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue  # exited while we looked
        state, ppid = stat.rsplit(")", 1)[1].split()[:2]
        if state != "Z":
            parents[int(entry.name)] = int(ppid)
    found: list[int] = []
    frontier = [pid]
    while frontier:
        parent = frontier.pop()
        children = [child for child, ppid in parents.items() if ppid == parent]
        found += children
        frontier += children
    return found


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_text().replace("\0", " ")
    except OSError:
        return ""


def is_gone(pid: int) -> bool:
    """Whether ``pid`` exited (a zombie counts: it runs nothing)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return True
    return stat.rsplit(")", 1)[1].split()[0] == "Z"
