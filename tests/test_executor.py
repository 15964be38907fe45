"""Executors with real worker processes and real gloo collectives (`ProbeWorker`, no model)."""

from __future__ import annotations

import gc
import multiprocessing as mp
import os
import pickle
import signal
from collections.abc import Iterator

import pytest
import torch
from engine_helpers.probe_worker import (
    PROBE_WORKER,
    ProbeHandshake,
    ProbeWorker,
    expected_seen,
    parse_seen,
)

from kvtransfer.engine.config import EngineConfig
from kvtransfer.engine.executor.executor import (
    DEFAULT_WORKER,
    Executor,
    ExecutorClosedError,
    ExecutorError,
    MultiprocExecutor,
    UniprocExecutor,
    WorkerDiedError,
    WorkerError,
    WorkerInfo,
    WorkerTimeoutError,
    dumps,
    loads,
    parallel_ranks,
    parse_worker_cls,
)
from kvtransfer.engine.outputs import EMPTY_MODEL_RUNNER_OUTPUT, ModelRunnerOutput
from kvtransfer.engine.parallel import ParallelRank
from kvtransfer.engine.runner.distributed import WorkerDistributed
from kvtransfer.engine.sampling_params import SamplingParams
from kvtransfer.engine.scheduler_output import NewRequestData, SchedulerOutput

pytestmark = pytest.mark.integration


def config(tp: int = 1, pp: int = 1, **extra: str) -> EngineConfig:
    return EngineConfig(
        model="builtin",
        tensor_parallel_size=tp,
        pipeline_parallel_size=pp,
        num_kv_blocks=8,
        extra=extra,
    )


def step(*req_ids: str) -> SchedulerOutput:
    return SchedulerOutput(num_scheduled_tokens=dict.fromkeys(req_ids, 1))


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def worker_children() -> list[mp.process.BaseProcess]:
    return [p for p in mp.active_children() if p.name.startswith("kvtransfer-worker")]


def assert_all_gone(pids: list[int]) -> None:
    assert worker_children() == []
    assert [pid for pid in pids if alive(pid)] == []


@pytest.fixture
def spawned() -> Iterator[list[MultiprocExecutor]]:
    """Executors a test starts; shut down (and checked gone) whatever the test did."""
    executors: list[MultiprocExecutor] = []
    yield executors
    for executor in executors:
        executor.shutdown()
    assert worker_children() == []


def start(
    spawned: list[MultiprocExecutor], cfg: EngineConfig, **kwargs: float
) -> MultiprocExecutor:
    executor = MultiprocExecutor(cfg, PROBE_WORKER, **kwargs)
    spawned.append(executor)
    return executor


# ----------------------------------------------------------------------------- in-process


def test_parallel_ranks_are_in_global_rank_order():
    ranks = parallel_ranks(config(tp=2, pp=2))
    assert [(r.rank, r.pp_rank, r.tp_rank) for r in ranks] == [
        (0, 0, 0),
        (1, 0, 1),
        (2, 1, 0),
        (3, 1, 1),
    ]


@pytest.mark.parametrize("bad", ["no_colon", ":Worker", "module:", "a:b:c"])
def test_worker_cls_must_name_module_and_class(bad):
    with pytest.raises(ValueError, match=r"worker_cls must look like 'package.module:Class'"):
        parse_worker_cls(bad)
    with pytest.raises(ValueError, match=r"worker_cls must look like"):
        Executor.create(config(), bad)


def test_default_worker_path():
    assert parse_worker_cls(DEFAULT_WORKER) == ("kvtransfer.engine.runner.worker", "Worker")


def test_messages_survive_the_pipe_encoding():
    # The mappingproxy defaults of both types are not picklable by the stock pickler.
    with pytest.raises(TypeError, match="mappingproxy"):
        pickle.dumps(SchedulerOutput())
    request = NewRequestData("r", 2, (1, 2), SamplingParams(seed=3), 3, (0,), 0)
    sent = SchedulerOutput(scheduled_new_reqs=(request,), finished_req_ids=frozenset({"x"}))
    assert loads(dumps(sent)) == sent
    assert loads(dumps(SchedulerOutput())) == SchedulerOutput()
    output = ModelRunnerOutput(
        req_ids=("a",), sampled_token_ids=((5,),), sampled_logits={"a": torch.ones(1, 4)}
    )
    back = loads(dumps(output))
    assert back.req_ids == ("a",) and back.sampled_token_ids == ((5,),)
    assert torch.equal(back.sampled_logits["a"], torch.ones(1, 4))
    assert loads(dumps(EMPTY_MODEL_RUNNER_OUTPUT)) is EMPTY_MODEL_RUNNER_OUTPUT
    copied = loads(dumps(ModelRunnerOutput()))
    assert copied is not EMPTY_MODEL_RUNNER_OUTPUT
    with pytest.raises(TypeError, match="mappingproxy"):
        copied.req_id_to_index["a"] = 0  # still read-only after the trip


def test_distributed_rejects_bad_peers_without_touching_the_network():
    comm = WorkerDistributed(ParallelRank(0, 1, 0, 2), "gloo", torch.device("cpu"))
    with pytest.raises(ValueError, match=r"dst_pp_rank 0 is this worker's own stage"):
        comm.pp_send(None, 0)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"src_pp_rank 2 out of range for pp_size 2"):
        comm.pp_recv(None, 2)  # type: ignore[arg-type]
    # With one TP rank the TP collectives are the identity and need no process group.
    t = torch.tensor([7.0])
    assert comm.tp_all_reduce(t) is t and comm.tp_broadcast_tokens(t) is t
    assert comm.broadcast_object_in_tp_group("x") == "x"
    with pytest.raises(ValueError, match=r"distributed backend must be one of \('gloo', 'nccl'\)"):
        WorkerDistributed.init(ParallelRank(), "file:///nowhere", backend="mpi")


def test_uniproc_executor_runs_the_worker_in_process():
    executor = Executor.create(config(), PROBE_WORKER)
    assert isinstance(executor, UniprocExecutor)
    assert (executor.world_size, executor.output_rank) == (1, 0)
    with pytest.raises(ExecutorError, match=r"call initialize\(\) before execute_model\(\)"):
        executor.execute_model(step())
    with executor:
        [info] = executor.initialize()
        assert info == WorkerInfo(
            rank=ParallelRank(),
            num_kv_blocks=8,
            handshake_metadata={(0, 0): ProbeHandshake(pid=os.getpid(), global_rank=0)},
            layer_names=tuple(f"model.layers.{i}.self_attn" for i in range(4)),
        )
        with pytest.raises(ExecutorError, match=r"initialize\(\) was already called"):
            executor.initialize()
        [output] = executor.execute_model(SchedulerOutput())
        assert output is not None and parse_seen(output) == {"rank": "0"}
        assert executor.execute_model(step("empty"))[0] is EMPTY_MODEL_RUNNER_OUTPUT
        assert executor.execute_model(step("none")) == [None]
        executor.check_health()
        assert executor.num_worker_requests() == [3]
    assert executor.is_closed
    executor.shutdown()  # idempotent
    with pytest.raises(ExecutorClosedError, match="executor is closed: the executor was shut down"):
        executor.execute_model(step())


def test_uniproc_worker_exception_fails_the_executor():
    executor = Executor.create(config(), PROBE_WORKER)
    executor.initialize()
    with pytest.raises(WorkerError) as caught:
        executor.execute_model(step("raise@0"))
    assert str(caught.value) == "worker rank 0 (pp 0, tp 0) failed: ValueError: boom"
    assert isinstance(caught.value.__cause__, ValueError)
    assert (caught.value.rank, caught.value.exc_type) == (ParallelRank(), "ValueError")
    assert "in execute_model" in caught.value.traceback_text
    with pytest.raises(ExecutorClosedError, match=r"failed earlier: worker rank 0 .* boom"):
        executor.execute_model(step())
    executor.shutdown()


def test_uniproc_reports_an_unimportable_worker_on_initialize():
    executor = Executor.create(config(), "engine_helpers.probe_worker:Missing")
    with pytest.raises(
        WorkerError,
        match=r"failed: ImportError: module 'engine_helpers.probe_worker' has no attribute "
        r"'Missing'",
    ):
        executor.initialize()


def test_uniproc_check_health_failure():
    with Executor.create(config(), PROBE_WORKER) as executor:
        executor.initialize()
        executor.execute_model(step("sick@0"))
        with pytest.raises(WorkerError, match=r"RuntimeError: probe rank 0 is sick"):
            executor.check_health()


# ------------------------------------------------------------------------ worker processes


@pytest.mark.parametrize(("tp", "pp"), [(2, 1), (1, 2), (2, 2)])
def test_multiproc_collectives_cross_processes(spawned, tmp_path, tp, pp):
    cfg = config(tp, pp, **{"probe.shutdown_dir": str(tmp_path)})
    executor = Executor.create(cfg, PROBE_WORKER)
    assert isinstance(executor, MultiprocExecutor)
    spawned.append(executor)
    assert executor.world_size == tp * pp
    assert executor.output_rank == (pp - 1) * tp

    infos = executor.initialize()
    ranks = parallel_ranks(cfg)
    assert [info.rank for info in infos] == ranks
    pids = [info.handshake_metadata[info.rank.key].pid for info in infos]
    assert pids == executor.pids and os.getpid() not in pids
    assert [info.handshake_metadata for info in infos] == [
        {r.key: ProbeHandshake(pid=pid, global_rank=r.rank)}
        for r, pid in zip(ranks, pids, strict=True)
    ]
    assert {info.layer_names for info in infos if info.rank.is_first_pp_rank} == {
        tuple(f"model.layers.{i}.self_attn" for i in range(4 // pp))
    }

    for _ in range(2):  # the groups keep working step after step
        outputs = executor.execute_model(SchedulerOutput())
        assert [parse_seen(o) for o in outputs] == [expected_seen(r) for r in ranks]
    assert executor.execute_model(step("empty")) == [EMPTY_MODEL_RUNNER_OUTPUT] * len(ranks)
    assert all(o is EMPTY_MODEL_RUNNER_OUTPUT for o in executor.execute_model(step("empty")))
    assert executor.execute_model(step("none")) == [None] * len(ranks)
    executor.check_health()
    assert executor.num_worker_requests() == [5] * len(ranks)

    executor.shutdown()
    executor.shutdown()
    assert_all_gone(pids)
    # Every worker was stopped gracefully: its own shutdown() ran.
    assert sorted(p.name for p in tmp_path.iterdir()) == [f"shutdown-{r.rank}" for r in ranks]
    with pytest.raises(ExecutorClosedError, match="the executor was shut down"):
        executor.check_health()


def test_expected_values_are_not_trivial():
    # Guards the matrix test against vacuous agreement: ranks must see different things.
    seen = [expected_seen(r) for r in parallel_ranks(config(2, 2))]
    assert [s["tp_sum"] for s in seen] == ["3", "3", "7", "7"]
    assert [s.get("pp_hidden") for s in seen] == [None, None, "1", "101"]


def test_multiproc_worker_exception_names_rank_and_message(spawned):
    executor = start(spawned, config(tp=2))
    pids = [info.handshake_metadata[info.rank.key].pid for info in executor.initialize()]
    # Rank 1 raises before the all-reduce that rank 0 is already waiting in.
    with pytest.raises(WorkerError) as caught:
        executor.execute_model(step("raise@1"))
    assert str(caught.value) == "worker rank 1 (pp 0, tp 1) failed: ValueError: boom"
    # The worker's traceback travels along as a note, shown wherever the error is printed.
    assert caught.value.__notes__[0].startswith("traceback in worker rank 1 (pp 0, tp 1):\n")
    assert caught.value.rank == ParallelRank(1, 2, 0, 1)
    assert 'raise ValueError("boom")' in caught.value.traceback_text
    assert_all_gone(pids)
    with pytest.raises(ExecutorClosedError, match=r"failed earlier: worker rank 1 .*boom"):
        executor.execute_model(step())
    executor.shutdown()


def test_multiproc_worker_exit_is_reported_with_its_code(spawned):
    executor = start(spawned, config(pp=2))
    pids = [info.handshake_metadata[info.rank.key].pid for info in executor.initialize()]
    with pytest.raises(
        WorkerDiedError, match=r"^worker rank 1 \(pp 1, tp 0\) died with exit code 3$"
    ):
        executor.execute_model(step("exit@1:3"))
    assert_all_gone(pids)
    with pytest.raises(ExecutorClosedError, match="died with exit code 3"):
        executor.check_health()


def test_multiproc_killed_worker_is_detected_between_steps(spawned):
    executor = start(spawned, config(tp=2))
    pids = [info.handshake_metadata[info.rank.key].pid for info in executor.initialize()]
    os.kill(pids[0], signal.SIGKILL)
    with pytest.raises(
        WorkerDiedError, match=r"^worker rank 0 \(pp 0, tp 0\) died with exit code -9 \(SIGKILL\)$"
    ):
        executor.execute_model(step())
    assert_all_gone(pids)


def test_multiproc_check_health_reports_the_sick_rank(spawned):
    executor = start(spawned, config(tp=2))
    executor.initialize()
    executor.execute_model(step("sick@1"))
    with pytest.raises(WorkerError, match=r"^worker rank 1 \(pp 0, tp 1\) failed: RuntimeError"):
        executor.check_health()


def test_multiproc_pipeline_layout_mismatch_fails_cleanly(spawned):
    executor = start(spawned, config(pp=2))
    executor.initialize()
    with pytest.raises(
        WorkerError,
        match=r"^worker rank 1 \(pp 1, tp 0\) failed: PipelineMismatchError: pp_recv from "
        r"stage 0: the sent tensors differ from the template",
    ):
        executor.execute_model(step("mismatch"))


def test_multiproc_constructor_failure_surfaces_on_initialize(spawned):
    executor = start(spawned, config(tp=2, **{"probe.fail_init_rank": "1"}))
    with pytest.raises(WorkerError) as caught:
        executor.initialize()
    assert str(caught.value) == (
        "worker rank 1 (pp 0, tp 1) failed: RuntimeError: probe constructor failed on rank 1"
    )


def test_multiproc_initialize_is_bounded(spawned):
    executor = start(
        spawned,
        config(tp=2, **{"probe.init_sleep_s": "60"}),
        startup_timeout_s=0.5,
        shutdown_timeout_s=0.5,
    )
    pids = executor.pids
    with pytest.raises(
        WorkerTimeoutError,
        match=r"^worker rank 0 \(pp 0, tp 0\), worker rank 1 \(pp 0, tp 1\) did not answer "
        r"Initialize within 0.5 s$",
    ):
        executor.initialize()
    assert_all_gone(pids)


def test_forgotten_executor_leaves_no_processes():
    executor = MultiprocExecutor(config(tp=2), PROBE_WORKER)
    executor.initialize()
    pids = executor.pids
    del executor
    gc.collect()
    assert_all_gone(pids)


def test_probe_worker_refuses_a_missing_dist():
    with pytest.raises(ValueError, match="world_size 2 with dist=None"):
        ProbeWorker(config(tp=2), ParallelRank(0, 2, 0, 1), None)
