"""What a worker hands back after a step, and what pipeline stages pass between them."""

from __future__ import annotations

import copy
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType

import torch

from kvtransfer.connector.outputs import KVConnectorOutput

_NO_INDEX: Mapping[str, int] = MappingProxyType({})


@dataclass(frozen=True)
class TokenLogprobs:
    """One sampled position: the output token's log-probability and the ``k`` most likely
    tokens' (most likely first, ties by lower id), under the model's raw distribution."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


@dataclass
class ModelRunnerOutput:
    """A worker's result for one step.

    Containers are read-only sequences/mappings: `EMPTY_MODEL_RUNNER_OUTPUT` is shared by every
    step that produced nothing, and shallow copies of it must not be able to change it.
    """

    req_ids: Sequence[str] = ()
    req_id_to_index: Mapping[str, int] = field(default_factory=lambda: _NO_INDEX)
    # Per request, the tokens accepted this step (several under speculative decoding).
    sampled_token_ids: Sequence[Sequence[int]] = ()
    # Per request, the draft tokens proposed for the next step.
    spec_token_ids: Sequence[Sequence[int]] = ()
    # Per request that asked for them (SamplingParams.return_logits), the float32 logits of
    # every position sampled this step, shape [num_sampled, vocab].
    sampled_logits: Mapping[str, torch.Tensor] = field(default_factory=lambda: _NO_INDEX)
    # Per request that asked for them (SamplingParams.logprobs), one entry per accepted token.
    sampled_logprobs: Mapping[str, Sequence[TokenLogprobs]] = field(
        default_factory=lambda: _NO_INDEX
    )
    kv_connector_output: KVConnectorOutput | None = None

    @staticmethod
    def with_kv_conn_output_only(
        kv_connector_output: KVConnectorOutput | None,
    ) -> ModelRunnerOutput:
        """An output that carries nothing but ``kv_connector_output``.

        ``None`` or an empty output gives the shared `EMPTY_MODEL_RUNNER_OUTPUT` itself;
        otherwise a shallow copy of it with the connector output set (the singleton is never
        mutated). Non-last pipeline ranks return this so completions still get aggregated.
        """
        if kv_connector_output is None or kv_connector_output.is_empty():
            return EMPTY_MODEL_RUNNER_OUTPUT
        output = copy.copy(EMPTY_MODEL_RUNNER_OUTPUT)
        output.kv_connector_output = kv_connector_output
        return output


EMPTY_MODEL_RUNNER_OUTPUT = ModelRunnerOutput()


def step_output(
    worker_outputs: Sequence[ModelRunnerOutput | None],
    output_rank: int,
    merged_kv: KVConnectorOutput | None,
) -> ModelRunnerOutput | None:
    """The engine's output for one step: worker ``output_rank``'s (the one that sampled),
    carrying the connector output merged over every worker (`KVOutputAggregator`).

    ``None`` when no worker returned anything and nothing finished. Inputs are never mutated,
    so the shared `EMPTY_MODEL_RUNNER_OUTPUT` stays empty.
    """
    if not 0 <= output_rank < len(worker_outputs):
        raise ValueError(
            f"output_rank {output_rank} out of range for {len(worker_outputs)} outputs"
        )
    base = worker_outputs[output_rank]
    if base is None:
        if merged_kv is None:
            return None if all(o is None for o in worker_outputs) else EMPTY_MODEL_RUNNER_OUTPUT
        base = EMPTY_MODEL_RUNNER_OUTPUT
    if merged_kv is None and base.kv_connector_output is None:
        return base
    result = copy.copy(base)
    result.kv_connector_output = merged_kv
    return result


class IntermediateTensors:
    """Activations one pipeline stage sends to the next: named tensors and nothing else.

    Connector results do not travel here (every rank reports them in its own
    `ModelRunnerOutput`), so rebuilding or slicing this object cannot silently drop them.
    """

    __slots__ = ("tensors",)

    def __init__(self, tensors: dict[str, torch.Tensor]) -> None:
        self.tensors = tensors

    @staticmethod
    def empty_like(other: IntermediateTensors) -> IntermediateTensors:
        """Uninitialised tensors of the same names, shapes, dtypes and devices (a receive
        buffer for the next stage)."""
        return IntermediateTensors({k: torch.empty_like(v) for k, v in other.tensors.items()})

    def __getitem__(self, key: str | slice) -> torch.Tensor | IntermediateTensors:
        if isinstance(key, str):
            return self.tensors[key]
        if isinstance(key, slice):
            return IntermediateTensors({k: v[key] for k, v in self.tensors.items()})
        raise TypeError(f"IntermediateTensors index must be str or slice, got {type(key)}")

    def __setitem__(self, key: str, value: torch.Tensor) -> None:
        self.tensors[key] = value

    def __iter__(self) -> Iterator[str]:
        return iter(self.tensors)

    def items(self):
        return self.tensors.items()

    def __len__(self) -> int:
        return len(self.tensors)

    def __eq__(self, other: object) -> bool:
        if (
            not isinstance(other, IntermediateTensors)
            or self.tensors.keys() != other.tensors.keys()
        ):
            return False
        return all(torch.equal(v, other.tensors[k]) for k, v in self.tensors.items())

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        shapes = {k: tuple(v.shape) for k, v in self.tensors.items()}
        return f"IntermediateTensors({shapes})"
