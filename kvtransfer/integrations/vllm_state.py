"""vLLM's recurrent-state pages as `StatePart`s, so state moves between engines of other TP
sizes (see `kvtransfer.connector.state_parts`).

A ``MambaSpec`` says each state's per-rank shape and dtype, packed in that order in a page
(``MambaBase.bind_kv_cache``), and the layer kind (``mamba_type``). Two kinds are split: Mamba2
(conv x|B|C, SSM state by head) and Gated DeltaNet (conv q|k|v, recurrent state by value head).
What the spec does not say is read from vLLM itself: the conv state's orientation (vLLM's
``VLLM_SSM_CONV_STATE_LAYOUT``, "SD" by default) and Mamba2's true group count (the model
config's; vLLM replicates a group count below the TP size on every rank). Any other kind
(Mamba1, short conv, linear attention, KDA) keeps opaque pages: equal TP sizes only.
"""

from __future__ import annotations

from typing import Any

from kvtransfer.connector.state_parts import StatePart, gdn_parts, mamba2_parts

# hf config names of Mamba2's group count across the families vLLM serves.
_GROUP_COUNT_NAMES = ("n_groups", "mamba_n_groups", "mamba_ngroups", "ssm_n_groups")


def vllm_state_parts(spec: Any, vllm_config: Any | None) -> tuple[StatePart, ...]:
    """The parts of a ``MambaSpec`` group's pages on this rank; ``()`` (pages move whole)
    for a kind not split, a state replicated on every rank, or no config to read."""
    kind = getattr(getattr(spec, "mamba_type", None), "name", None)
    if vllm_config is None or kind not in ("MAMBA2", "GDN_ATTN"):
        return ()
    if getattr(spec, "tp_replicated", False):
        return ()
    shapes, dtypes = tuple(spec.shapes), tuple(spec.dtypes)
    if len(shapes) != 2 or len(dtypes) != 2:
        return ()
    dim_first = conv_state_dim_first()
    if dim_first is None:
        return ()
    tp_size = int(vllm_config.parallel_config.tensor_parallel_size)
    (conv, ssm), (conv_dtype, ssm_dtype) = shapes, dtypes
    if kind == "MAMBA2":
        return mamba2_parts(
            conv,
            ssm,
            conv_dtype.itemsize,
            ssm_dtype.itemsize,
            dim_first=dim_first,
            tp_size=tp_size,
            total_groups=_group_count(vllm_config),
        )
    return gdn_parts(
        conv, ssm, conv_dtype.itemsize, ssm_dtype.itemsize, dim_first=dim_first, tp_size=tp_size
    )


def conv_state_dim_first() -> bool | None:
    """Whether vLLM keeps conv states as (channels, positions) ("DS"); None when this vLLM
    does not say."""
    try:
        from vllm.model_executor.layers.mamba.mamba_utils import is_conv_state_dim_first
    except ImportError:
        return None
    return bool(is_conv_state_dim_first())


def _group_count(vllm_config: Any) -> int | None:
    model = vllm_config.model_config
    config = getattr(model, "hf_text_config", None) or getattr(model, "hf_config", None)
    for name in _GROUP_COUNT_NAMES:
        value = getattr(config, name, None)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
    return None
