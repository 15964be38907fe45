"""`ProbeWorker`: a stand-in for `kvtransfer.engine.runner.worker.Worker` that runs no model.

Each step it runs every collective of `WorkerDistributed` with rank-derived values and reports
what it saw as ``"key=value"`` strings in ``ModelRunnerOutput.req_ids``, so executor tests can
check that the collectives really crossed process boundaries. Scheduled request ids steer it:

* ``raise@R``: global rank ``R`` raises ``ValueError("boom")`` before any collective;
* ``exit@R:C``: global rank ``R`` calls ``os._exit(C)``;
* ``sick@R``: global rank ``R`` fails every later `check_health`;
* ``mismatch``: receiving pipeline stages expect a differently shaped activation;
* ``empty`` / ``none``: every rank returns `EMPTY_MODEL_RUNNER_OUTPUT` / ``None``.

``EngineConfig.extra`` steers start-up: ``probe.fail_init_rank`` (that rank's constructor
raises), ``probe.init_sleep_s`` (`initialize` sleeps) and ``probe.shutdown_dir`` (`shutdown`
leaves a ``shutdown-R`` file there).
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import torch

from kvtransfer.connector.metadata import KVConnectorHandshakeMetadata
from kvtransfer.engine.config import EngineConfig
from kvtransfer.engine.outputs import (
    EMPTY_MODEL_RUNNER_OUTPUT,
    IntermediateTensors,
    ModelRunnerOutput,
)
from kvtransfer.engine.parallel import ParallelRank, pp_layer_range
from kvtransfer.engine.runner.distributed import WorkerDistributed
from kvtransfer.engine.runner.worker import WorkerInfo
from kvtransfer.engine.scheduler_output import SchedulerOutput

PROBE_WORKER = "engine_helpers.probe_worker:ProbeWorker"
NUM_LAYERS = 4


class ProbeHandshake(KVConnectorHandshakeMetadata):
    pid: int
    global_rank: int


def expected_seen(rank: ParallelRank) -> dict[str, str]:
    """What `ProbeWorker.execute_model` reports on ``rank`` when the collectives work."""
    stage_start = rank.pp_rank * rank.tp_size
    seen = {
        "rank": str(rank.rank),
        "tp_sum": str(sum(g + 1 for g in range(stage_start, stage_start + rank.tp_size))),
        "tokens": str(100 * (stage_start + 1)),
        "object_from": str(stage_start),
    }
    if not rank.is_first_pp_rank:
        seen["pp_hidden"] = str(_hidden_value(rank.tp_rank, rank.pp_rank - 1))
        seen["pp_positions"] = ",".join(str(10 * (rank.pp_rank - 1) + i) for i in range(4))
    return seen


def parse_seen(output: ModelRunnerOutput) -> dict[str, str]:
    return dict(item.split("=", 1) for item in output.req_ids)


def _hidden_value(tp_rank: int, pp_rank: int) -> int:
    return 100 * tp_rank + pp_rank + 1


def _targets(req_ids: set[str], prefix: str) -> dict[int, str]:
    """``{global rank: argument}`` of the ``prefix<rank>[:argument]`` request ids."""
    found = {}
    for req_id in req_ids:
        if req_id.startswith(prefix):
            rank, _, argument = req_id.removeprefix(prefix).partition(":")
            found[int(rank)] = argument
    return found


class ProbeWorker:
    def __init__(
        self,
        config: EngineConfig,
        rank: ParallelRank,
        dist: WorkerDistributed | None,
        kv_event_signal: object = None,
    ) -> None:
        if config.extra.get("probe.fail_init_rank") == str(rank.rank):
            raise RuntimeError(f"probe constructor failed on rank {rank.rank}")
        if (dist is None) != (rank.world_size == 1):
            raise ValueError(f"world_size {rank.world_size} with dist={dist!r}")
        self.config = config
        self.rank = rank
        self.dist = dist
        self.steps = 0
        self.sick = False

    def initialize(self) -> WorkerInfo:
        # A deliberately slow start-up (the executor's start-up timeout is under test).
        time.sleep(float(self.config.extra.get("probe.init_sleep_s", "0")))
        start, end = pp_layer_range(NUM_LAYERS, self.rank.pp_size, self.rank.pp_rank)
        handshake = ProbeHandshake(pid=os.getpid(), global_rank=self.rank.rank)
        return WorkerInfo(
            rank=self.rank,
            num_kv_blocks=self.config.num_kv_blocks or 1,
            handshake_metadata={self.rank.key: handshake},
            layer_names=tuple(f"model.layers.{i}.self_attn" for i in range(start, end)),
        )

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput | None:
        self.steps += 1
        req_ids = set(scheduler_output.num_scheduled_tokens)
        me = self.rank.rank
        if me in _targets(req_ids, "sick@"):
            self.sick = True
        if me in _targets(req_ids, "raise@"):
            raise ValueError("boom")
        exits = _targets(req_ids, "exit@")
        if me in exits:
            os._exit(int(exits[me]))
        if "empty" in req_ids:
            return EMPTY_MODEL_RUNNER_OUTPUT
        if "none" in req_ids:
            return None
        seen = {"rank": str(me)}
        if self.dist is not None:
            seen.update(self._collectives(self.dist, mismatch="mismatch" in req_ids))
        return ModelRunnerOutput(req_ids=tuple(f"{k}={v}" for k, v in seen.items()))

    def _collectives(self, dist: WorkerDistributed, mismatch: bool) -> dict[str, str]:
        rank = self.rank
        partial = torch.tensor([float(rank.rank + 1)])
        tokens = torch.tensor([100 * (rank.rank + 1)], dtype=torch.int64)
        seen = {
            "tp_sum": str(int(dist.tp_all_reduce(partial).item())),
            "tokens": str(int(dist.tp_broadcast_tokens(tokens).item())),
            "object_from": str(dist.broadcast_object_in_tp_group({"from": rank.rank})["from"]),
        }
        if not rank.is_first_pp_rank:
            rows = 3 if mismatch else 2
            template = IntermediateTensors(
                {
                    "positions": torch.empty(4, dtype=torch.int64),
                    "hidden": torch.empty(rows, 3, dtype=torch.float32),
                }
            )
            received = dist.pp_recv(template, rank.pp_rank - 1)
            values = received["hidden"].unique().tolist()
            seen["pp_hidden"] = ",".join(str(int(v)) for v in values)
            seen["pp_positions"] = ",".join(str(v) for v in received["positions"].tolist())
        if not rank.is_last_pp_rank:
            value = float(_hidden_value(rank.tp_rank, rank.pp_rank))
            outgoing = IntermediateTensors(
                {
                    # Transposed, so pp_send has to make it contiguous.
                    "hidden": torch.full((3, 2), value).t(),
                    "positions": torch.arange(4, dtype=torch.int64) + 10 * rank.pp_rank,
                }
            )
            dist.pp_send(outgoing, rank.pp_rank + 1)
        dist.barrier()
        return seen

    def check_health(self) -> None:
        if self.sick:
            raise RuntimeError(f"probe rank {self.rank.rank} is sick")

    def num_requests(self) -> int:
        return self.steps

    def shutdown(self) -> None:
        directory = self.config.extra.get("probe.shutdown_dir")
        if directory:
            (Path(directory) / f"shutdown-{self.rank.rank}").write_text(str(os.getpid()))
