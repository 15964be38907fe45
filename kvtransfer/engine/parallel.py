"""Where a worker sits in the TPxPP grid and which layers it owns."""

from __future__ import annotations

from dataclasses import dataclass


def pp_layer_range(num_layers: int, pp_size: int, pp_rank: int) -> tuple[int, int]:
    """Contiguous ``[start, end)`` layers of ``pp_rank``; earlier ranks take the remainder."""
    if pp_size < 1 or not 0 <= pp_rank < pp_size:
        raise ValueError(f"pp_rank {pp_rank} out of range for pp_size {pp_size}")
    if num_layers < pp_size:
        raise ValueError(
            f"cannot split {num_layers} layers over {pp_size} pipeline stages (need >= 1 each)"
        )
    base, extra = divmod(num_layers, pp_size)
    start = pp_rank * base + min(pp_rank, extra)
    return start, start + base + (1 if pp_rank < extra else 0)


@dataclass(frozen=True)
class ParallelRank:
    """A worker's coordinates; global rank is ``pp_rank * tp_size + tp_rank``."""

    tp_rank: int = 0
    tp_size: int = 1
    pp_rank: int = 0
    pp_size: int = 1

    def __post_init__(self) -> None:
        if not 0 <= self.tp_rank < self.tp_size or not 0 <= self.pp_rank < self.pp_size:
            raise ValueError(f"invalid parallel rank {self}")

    @property
    def rank(self) -> int:
        return self.pp_rank * self.tp_size + self.tp_rank

    @property
    def world_size(self) -> int:
        return self.tp_size * self.pp_size

    @property
    def is_first_pp_rank(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last_pp_rank(self) -> bool:
        return self.pp_rank == self.pp_size - 1

    @property
    def key(self) -> tuple[int, int]:
        """``(pp_rank, tp_rank)``: how handshake metadata is keyed."""
        return self.pp_rank, self.tp_rank
