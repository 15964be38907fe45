"""`WorkerDistributed`: the collectives one worker process uses to talk to its peers.

One instance per worker process of a multi-worker engine (the executor's child bootstrap builds
it). The world is the TP x PP grid, global rank ``pp_rank * tp_size + tp_rank``. Tensor-parallel
ranks of one pipeline stage form a TP subgroup (all-reduce of partial activations, agreement on
sampled tokens); neighbouring stages exchange activations point to point, each tp_rank with the
same tp_rank of the other stage.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from kvtransfer.engine.outputs import IntermediateTensors
from kvtransfer.engine.parallel import ParallelRank
from kvtransfer.engine.runner.devices import cuda_device_for

_BACKENDS = ("gloo", "nccl")


class PipelineMismatchError(ValueError):
    """The tensors a stage sent do not match the template the next stage received them into."""


def _signature(tensors: IntermediateTensors) -> int:
    # A checksum of names, dtypes and shapes sent ahead of the payload: a sender and receiver that
    # disagree about the layout fail with a clear error instead of hanging or mixing up bytes.
    text = ";".join(
        f"{name}:{tensors[name].dtype}:{tuple(tensors[name].shape)}" for name in sorted(tensors)
    )
    return zlib.crc32(text.encode())


@dataclass
class WorkerDistributed:
    """Process groups of one worker; build it with `WorkerDistributed.init`."""

    rank: ParallelRank
    backend: str
    device: torch.device
    _tp_group: Any = None
    _destroyed: bool = False

    @classmethod
    def init(
        cls,
        rank: ParallelRank,
        init_method: str,
        backend: str = "gloo",
        timeout: timedelta | None = None,
    ) -> WorkerDistributed:
        """Join the ``tp_size * pp_size`` world at ``init_method`` (``file://`` or ``tcp://``)
        and create the TP subgroups. Every rank of the world must call this concurrently."""
        if backend not in _BACKENDS:
            raise ValueError(f"distributed backend must be one of {_BACKENDS}, got {backend!r}")
        if not init_method:
            raise ValueError("distributed init_method must not be empty")
        if dist.is_initialized():
            raise RuntimeError("torch.distributed is already initialised in this process")
        if backend == "nccl":
            device = cuda_device_for(rank.rank)
            torch.cuda.set_device(device)
        else:
            device = torch.device("cpu")
        kwargs: dict[str, Any] = {} if timeout is None else {"timeout": timeout}
        dist.init_process_group(
            backend=backend,
            init_method=init_method,
            world_size=rank.world_size,
            rank=rank.rank,
            **kwargs,
        )
        tp_group = None
        if rank.tp_size > 1:
            # new_group is collective over the whole world: every process creates every stage's
            # group, in stage order, and keeps only its own.
            for pp_rank in range(rank.pp_size):
                start = pp_rank * rank.tp_size
                group = dist.new_group(ranks=list(range(start, start + rank.tp_size)))
                if pp_rank == rank.pp_rank:
                    tp_group = group
        return cls(rank=rank, backend=backend, device=device, _tp_group=tp_group)

    # ------------------------------------------------------------------ tensor parallel

    @property
    def _tp_src(self) -> int:
        return self.rank.pp_rank * self.rank.tp_size

    def tp_all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        """Sum ``t`` over this stage's TP ranks, in place; returns ``t``."""
        if self.rank.tp_size > 1:
            self._check_open()
            dist.all_reduce(t, op=dist.ReduceOp.SUM, group=self._tp_group)
        return t

    def tp_broadcast_tokens(self, t: torch.Tensor) -> torch.Tensor:
        """Overwrite ``t`` on every TP rank of this stage with tp_rank 0's ``t``; returns it.

        Every rank passes a tensor of the same shape and dtype.
        """
        if self.rank.tp_size > 1:
            self._check_open()
            if not t.is_contiguous():
                raise ValueError("tp_broadcast_tokens needs a contiguous tensor")
            dist.broadcast(t, src=self._tp_src, group=self._tp_group)
        return t

    def broadcast_object_in_tp_group(self, obj: Any) -> Any:
        """tp_rank 0's picklable ``obj``, returned on every TP rank of this stage."""
        if self.rank.tp_size == 1:
            return obj
        self._check_open()
        box = [obj]
        dist.broadcast_object_list(box, src=self._tp_src, group=self._tp_group)
        return box[0]

    # ---------------------------------------------------------------- pipeline parallel

    def _peer(self, pp_rank: int, what: str) -> int:
        if not 0 <= pp_rank < self.rank.pp_size:
            raise ValueError(f"{what} {pp_rank} out of range for pp_size {self.rank.pp_size}")
        if pp_rank == self.rank.pp_rank:
            raise ValueError(f"{what} {pp_rank} is this worker's own stage")
        return pp_rank * self.rank.tp_size + self.rank.tp_rank

    def pp_send(self, tensors: IntermediateTensors, dst_pp_rank: int) -> None:
        """Send ``tensors`` to the same tp_rank of stage ``dst_pp_rank`` (blocks until sent)."""
        peer = self._peer(dst_pp_rank, "dst_pp_rank")
        self._check_open()
        header = torch.tensor([_signature(tensors)], dtype=torch.int64, device=self.device)
        dist.send(header, dst=peer)
        for name in sorted(tensors):
            dist.send(tensors[name].contiguous(), dst=peer)

    def pp_recv(self, template: IntermediateTensors, src_pp_rank: int) -> IntermediateTensors:
        """Receive what stage ``src_pp_rank`` sent with `pp_send` into fresh tensors shaped like
        ``template`` (names, shapes, dtypes and devices; its values are not read)."""
        peer = self._peer(src_pp_rank, "src_pp_rank")
        self._check_open()
        header = torch.empty(1, dtype=torch.int64, device=self.device)
        dist.recv(header, src=peer)
        if int(header.item()) != _signature(template):
            raise PipelineMismatchError(
                f"pp_recv from stage {src_pp_rank}: the sent tensors differ from the template "
                f"{template!r} in names, shapes or dtypes"
            )
        received = IntermediateTensors.empty_like(template)
        for name in sorted(received):
            dist.recv(received[name], src=peer)
        return received

    # ----------------------------------------------------------------------- lifetime

    def barrier(self) -> None:
        """Wait until every rank of the world reached this call."""
        self._check_open()
        if self.backend == "nccl":
            dist.barrier(device_ids=[self.device.index])
        else:
            dist.barrier()

    def destroy(self) -> None:
        """Leave the world; later collectives raise. Safe to call more than once."""
        if self._destroyed:
            return
        self._destroyed = True
        self._tp_group = None
        if dist.is_initialized():
            dist.destroy_process_group()

    def _check_open(self) -> None:
        if self._destroyed:
            raise RuntimeError(f"WorkerDistributed of rank {self.rank.key} was destroyed")
