"""Unit tests for `kvtransfer.connector.topology`: registry, TP head math and PP layer matching."""

from __future__ import annotations

import itertools

import pytest

from kvtransfer.connector.topology import (
    EngineTransferInfo,
    HeadSource,
    LayerCoverageError,
    LayerSource,
    TransferTopology,
    UnknownRemoteEngineError,
    kv_head_range,
)

pytestmark = pytest.mark.unit

BLOCK_SIZE = 16
LOCAL = "decode-0"
REMOTE = "prefill-0"


def make_topology(
    *,
    tp_rank: int = 0,
    tp_size: int = 1,
    heads: int = 8,
    is_mla: bool = False,
    pp_rank: int = 0,
    pp_size: int = 1,
    start_layer: int = 0,
    end_layer: int = 8,
) -> TransferTopology:
    return TransferTopology(
        tp_rank=tp_rank,
        tp_size=tp_size,
        block_size=BLOCK_SIZE,
        engine_id=LOCAL,
        is_mla=is_mla,
        total_num_kv_heads=heads,
        pp_rank=pp_rank,
        pp_size=pp_size,
        start_layer=start_layer,
        end_layer=end_layer,
    )


def make_info(
    *,
    tp_size: int = 1,
    pp_rank: int = 0,
    start_layer: int = 0,
    end_layer: int = 8,
    block_size: int = BLOCK_SIZE,
    block_len: int = 4096,
) -> EngineTransferInfo:
    return EngineTransferInfo(
        remote_tp_size=tp_size,
        remote_block_len=block_len,
        remote_block_size=block_size,
        remote_physical_blocks_per_logical=1,
        remote_pp_rank=pp_rank,
        start_layer=start_layer,
        end_layer=end_layer,
    )


def brute_force_heads(tp_rank: int, tp_size: int, heads: int) -> list[int]:
    """Heads a rank holds, by enumerating every (head, replica) copy and dealing them out."""
    copies_per_head = max(tp_size // heads, 1)
    copies = [h for h in range(heads) for _ in range(copies_per_head)]
    per_rank = len(copies) // tp_size
    return copies[tp_rank * per_rank : (tp_rank + 1) * per_rank]


def vllm_target_ranks(tp_rank: int, local_tp: int, remote_tp: int) -> list[int]:
    """vLLM's target_remote_ranks, restated for comparison."""
    if local_tp >= remote_tp:
        return [tp_rank // (local_tp // remote_tp)]
    ratio = remote_tp // local_tp
    return [tp_rank * ratio + i for i in range(ratio)]


# -- EngineTransferInfo -----------------------------------------------------------------------


def test_engine_transfer_info_defaults() -> None:
    info = EngineTransferInfo(
        remote_tp_size=2,
        remote_block_len=1024,
        remote_block_size=16,
        remote_physical_blocks_per_logical=1,
    )
    assert (info.remote_pp_rank, info.start_layer, info.end_layer) == (0, 0, 0)
    assert info.layers == range(0)
    with pytest.raises(AttributeError):
        info.remote_tp_size = 4  # type: ignore[misc]


@pytest.mark.parametrize(
    ("overrides", "field_name"),
    [
        ({"remote_tp_size": 0}, "remote_tp_size"),
        ({"remote_block_len": 0}, "remote_block_len"),
        ({"remote_block_size": 0}, "remote_block_size"),
        ({"remote_physical_blocks_per_logical": 0}, "remote_physical_blocks_per_logical"),
        ({"remote_pp_rank": -1}, "remote_pp_rank"),
        ({"start_layer": -1}, "start_layer"),
        ({"start_layer": 5, "end_layer": 4}, "start_layer"),
        ({"remote_tp_size": True}, "remote_tp_size"),
        ({"remote_block_size": 1.5}, "remote_block_size"),
    ],
)
def test_engine_transfer_info_validation(overrides: dict[str, object], field_name: str) -> None:
    kwargs: dict[str, object] = {
        "remote_tp_size": 1,
        "remote_block_len": 1,
        "remote_block_size": 1,
        "remote_physical_blocks_per_logical": 1,
    }
    kwargs.update(overrides)
    with pytest.raises(ValueError, match=field_name):
        EngineTransferInfo(**kwargs)  # type: ignore[arg-type]


# -- TransferTopology construction ------------------------------------------------------------


@pytest.mark.parametrize(
    ("overrides", "field_name"),
    [
        ({"tp_size": 0}, "tp_size"),
        ({"tp_rank": -1}, "tp_rank"),
        ({"tp_rank": 2, "tp_size": 2}, "tp_rank"),
        ({"block_size": 0}, "block_size"),
        ({"engine_id": ""}, "engine_id"),
        ({"is_mla": 1}, "is_mla"),
        ({"total_num_kv_heads": 0}, "total_num_kv_heads"),
        ({"total_num_kv_heads": 6, "tp_size": 4}, "tp_size"),
        ({"pp_size": 0}, "pp_size"),
        ({"pp_rank": 1, "pp_size": 1}, "pp_rank"),
        ({"start_layer": -1}, "start_layer"),
        ({"start_layer": 4, "end_layer": 2}, "start_layer"),
    ],
)
def test_topology_validation(overrides: dict[str, object], field_name: str) -> None:
    kwargs: dict[str, object] = {
        "tp_rank": 0,
        "tp_size": 2,
        "block_size": 16,
        "engine_id": LOCAL,
        "is_mla": False,
        "total_num_kv_heads": 8,
    }
    kwargs.update(overrides)
    with pytest.raises(ValueError, match=field_name):
        TransferTopology(**kwargs)  # type: ignore[arg-type]


def test_topology_requires_keywords() -> None:
    with pytest.raises(TypeError):
        TransferTopology(0, 1, 16, LOCAL, False, 8)  # type: ignore[misc]


def test_mla_topology_skips_head_divisibility() -> None:
    topo = make_topology(tp_size=4, tp_rank=3, heads=1, is_mla=True)
    assert topo.local_kv_heads == range(1)


def test_instances_do_not_share_registry() -> None:
    first, second = make_topology(), make_topology()
    first.register_remote_engine(REMOTE, make_info())
    assert not second.is_registered(REMOTE)


# -- registry ---------------------------------------------------------------------------------


def test_first_registration_wins() -> None:
    topo = make_topology()
    first = make_info(tp_size=1, block_len=1024)
    assert topo.register_remote_engine(REMOTE, first) is first
    later = make_info(tp_size=2, block_len=2048)
    assert topo.register_remote_engine(REMOTE, later) is first
    assert topo.get_engine_info(REMOTE) is first


def test_first_registration_wins_even_over_invalid_later_info() -> None:
    topo = make_topology()
    first = topo.register_remote_engine(REMOTE, make_info())
    assert topo.register_remote_engine(REMOTE, make_info(block_size=32)) is first


def test_local_engine_id_rejected() -> None:
    topo = make_topology()
    with pytest.raises(ValueError, match=LOCAL):
        topo.register_remote_engine(LOCAL, make_info())
    assert not topo.is_registered(LOCAL)


def test_block_size_mismatch_names_both_sizes() -> None:
    topo = make_topology()
    with pytest.raises(ValueError, match=r"remote_block_size \(32\).*block_size \(16\)"):
        topo.register_remote_engine(REMOTE, make_info(block_size=32))
    assert not topo.is_registered(REMOTE)


def test_incompatible_remote_tp_rejected() -> None:
    topo = make_topology(heads=8)
    with pytest.raises(ValueError, match="remote_tp_size"):
        topo.register_remote_engine(REMOTE, make_info(tp_size=3))


def test_non_divisible_tp_ratio_rejected_at_registration() -> None:
    # Both 2 and 3 divide 6 heads, but neither TP size divides the other.
    topo = make_topology(tp_size=2, heads=6)
    with pytest.raises(ValueError, match="remote_tp_size"):
        topo.register_remote_engine(REMOTE, make_info(tp_size=3))


def test_mla_accepts_any_divisible_remote_tp() -> None:
    topo = make_topology(tp_size=2, heads=1, is_mla=True)
    topo.register_remote_engine(REMOTE, make_info(tp_size=8))
    assert topo.is_registered(REMOTE, 0)


def test_same_engine_two_pp_ranks_stored_separately() -> None:
    topo = make_topology()
    pp0 = topo.register_remote_engine(REMOTE, make_info(pp_rank=0, end_layer=4))
    pp1 = topo.register_remote_engine(REMOTE, make_info(pp_rank=1, start_layer=4, end_layer=8))
    assert topo.get_engine_info(REMOTE, 0) is pp0
    assert topo.get_engine_info(REMOTE, 1) is pp1
    assert topo.remote_pp_ranks(REMOTE) == [0, 1]


def test_get_engine_info_defaults_to_pp_rank_zero() -> None:
    topo = make_topology()
    info = topo.register_remote_engine(REMOTE, make_info())
    assert topo.get_engine_info(REMOTE) is info


def test_unknown_engine_error_names_id_pp_rank_and_registered_keys() -> None:
    topo = make_topology()
    topo.register_remote_engine(REMOTE, make_info())
    with pytest.raises(UnknownRemoteEngineError) as excinfo:
        topo.get_engine_info(REMOTE, 3)
    message = str(excinfo.value)
    assert "prefill-0" in message
    assert "pp_rank 3" in message
    assert "('prefill-0', 0)" in message
    assert isinstance(excinfo.value, KeyError)


def test_unknown_engine_error_from_helpers() -> None:
    topo = make_topology()
    with pytest.raises(UnknownRemoteEngineError, match="nobody"):
        topo.target_remote_ranks("nobody")
    with pytest.raises(UnknownRemoteEngineError, match="nobody"):
        topo.layer_sources("nobody")


def test_unregister_removes_all_pp_ranks() -> None:
    topo = make_topology()
    topo.register_remote_engine(REMOTE, make_info(pp_rank=0, end_layer=4))
    topo.register_remote_engine(REMOTE, make_info(pp_rank=1, start_layer=4))
    topo.register_remote_engine("prefill-1", make_info())
    assert topo.unregister_remote_engine(REMOTE) == 2
    assert topo.remote_pp_ranks(REMOTE) == []
    assert not topo.is_registered(REMOTE)
    assert topo.is_registered("prefill-1")
    assert topo.unregister_remote_engine(REMOTE) == 0


def test_is_registered_with_and_without_pp_rank() -> None:
    topo = make_topology()
    topo.register_remote_engine(REMOTE, make_info(pp_rank=1, start_layer=4))
    assert topo.is_registered(REMOTE)
    assert topo.is_registered(REMOTE, 1)
    assert not topo.is_registered(REMOTE, 0)
    assert not topo.is_registered("other")


def test_remote_pp_ranks_sorted() -> None:
    topo = make_topology()
    for pp in (2, 0, 1):
        topo.register_remote_engine(REMOTE, make_info(pp_rank=pp, start_layer=pp, end_layer=pp + 1))
    assert topo.remote_pp_ranks(REMOTE) == [0, 1, 2]
    assert topo.remote_pp_ranks("other") == []


# -- tp_ratio and replication -----------------------------------------------------------------


@pytest.mark.parametrize(
    ("local_tp", "remote_tp", "expected"),
    [(1, 1, 1), (4, 1, 4), (4, 2, 2), (8, 8, 1), (1, 4, -4), (2, 8, -4), (4, 8, -2)],
)
def test_tp_ratio(local_tp: int, remote_tp: int, expected: int) -> None:
    assert make_topology(tp_size=local_tp).tp_ratio(remote_tp) == expected


@pytest.mark.parametrize(("local_tp", "remote_tp"), [(4, 3), (3, 4), (6, 4), (2, 3)])
def test_tp_ratio_non_divisible(local_tp: int, remote_tp: int) -> None:
    topo = make_topology(tp_size=local_tp, heads=12)
    with pytest.raises(ValueError, match="tp_size"):
        topo.tp_ratio(remote_tp)


def test_tp_ratio_rejects_zero() -> None:
    with pytest.raises(ValueError, match="remote_tp_size"):
        make_topology().tp_ratio(0)


def test_tp_ratio_from_engine_id() -> None:
    topo = make_topology(tp_size=2)
    topo.register_remote_engine(REMOTE, make_info(tp_size=8, pp_rank=0, end_layer=4))
    topo.register_remote_engine(REMOTE, make_info(tp_size=1, pp_rank=1, start_layer=4))
    assert topo.tp_ratio_from_engine_id(REMOTE) == -4
    assert topo.tp_ratio_from_engine_id(REMOTE, 1) == 2


@pytest.mark.parametrize(
    ("heads", "remote_tp", "is_mla", "replicated", "replicates"),
    [
        (8, 8, False, False, False),
        (8, 2, False, False, False),
        (2, 4, False, True, True),
        (1, 4, True, True, True),
        (1, 1, True, False, True),
    ],
)
def test_replication_flags(
    heads: int, remote_tp: int, is_mla: bool, replicated: bool, replicates: bool
) -> None:
    topo = make_topology(heads=heads, is_mla=is_mla)
    topo.register_remote_engine(REMOTE, make_info(tp_size=remote_tp))
    assert topo.is_kv_replicated(REMOTE) is replicated
    assert topo.replicates_kv_cache(REMOTE) is replicates


def test_replication_flags_per_pp_rank() -> None:
    topo = make_topology(heads=2)
    topo.register_remote_engine(REMOTE, make_info(tp_size=1, pp_rank=0, end_layer=4))
    topo.register_remote_engine(REMOTE, make_info(tp_size=4, pp_rank=1, start_layer=4))
    assert not topo.is_kv_replicated(REMOTE)
    assert topo.is_kv_replicated(REMOTE, 1)
    assert topo.replicates_kv_cache(REMOTE, 1)


# -- kv_head_range ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("tp_rank", "tp_size", "heads", "expected"),
    [
        (0, 1, 8, range(0, 8)),
        (1, 2, 8, range(4, 8)),
        (3, 4, 8, range(6, 8)),
        (0, 4, 2, range(0, 1)),
        (1, 4, 2, range(0, 1)),
        (2, 4, 2, range(1, 2)),
        (7, 8, 1, range(0, 1)),
    ],
)
def test_kv_head_range(tp_rank: int, tp_size: int, heads: int, expected: range) -> None:
    assert kv_head_range(tp_rank, tp_size, heads) == expected


@pytest.mark.parametrize(
    ("tp_rank", "tp_size", "heads", "field_name"),
    [(2, 2, 8, "tp_rank"), (0, 3, 8, "tp_size"), (0, 0, 8, "tp_size"), (0, 2, 0, "heads")],
)
def test_kv_head_range_validation(tp_rank: int, tp_size: int, heads: int, field_name: str) -> None:
    with pytest.raises(ValueError, match=field_name):
        kv_head_range(tp_rank, tp_size, heads)


# -- target_remote_ranks / head_sources: named cases ------------------------------------------


def sources_for(local_tp: int, remote_tp: int, heads: int) -> list[list[HeadSource]]:
    result = []
    for rank in range(local_tp):
        topo = make_topology(tp_rank=rank, tp_size=local_tp, heads=heads)
        topo.register_remote_engine(REMOTE, make_info(tp_size=remote_tp))
        result.append(topo.head_sources(REMOTE))
    return result


def test_replicated_remote_read_once_per_distinct_head() -> None:
    topo = make_topology(tp_size=1, heads=2)
    topo.register_remote_engine(REMOTE, make_info(tp_size=4))
    # Remote ranks 0,1 hold head 0 and 2,3 hold head 1: two reads, not vLLM's four.
    assert topo.target_remote_ranks(REMOTE) == [0, 2]
    assert vllm_target_ranks(0, 1, 4) == [0, 1, 2, 3]
    assert topo.head_sources(REMOTE) == [
        HeadSource(0, range(0, 1), remote_offset=0, local_offset=0, num_heads=1),
        HeadSource(2, range(1, 2), remote_offset=0, local_offset=1, num_heads=1),
    ]


def test_local_tp2_remote_tp1() -> None:
    assert sources_for(local_tp=2, remote_tp=1, heads=8) == [
        [HeadSource(0, range(0, 4), remote_offset=0, local_offset=0, num_heads=4)],
        [HeadSource(0, range(4, 8), remote_offset=4, local_offset=0, num_heads=4)],
    ]


def test_local_tp1_remote_tp2() -> None:
    assert sources_for(local_tp=1, remote_tp=2, heads=8) == [
        [
            HeadSource(0, range(0, 4), remote_offset=0, local_offset=0, num_heads=4),
            HeadSource(1, range(4, 8), remote_offset=0, local_offset=4, num_heads=4),
        ]
    ]


def test_local_tp2_remote_tp4_heads4() -> None:
    assert sources_for(local_tp=2, remote_tp=4, heads=4) == [
        [
            HeadSource(0, range(0, 1), remote_offset=0, local_offset=0, num_heads=1),
            HeadSource(1, range(1, 2), remote_offset=0, local_offset=1, num_heads=1),
        ],
        [
            HeadSource(2, range(2, 3), remote_offset=0, local_offset=0, num_heads=1),
            HeadSource(3, range(3, 4), remote_offset=0, local_offset=1, num_heads=1),
        ],
    ]


def test_local_tp4_remote_tp2_heads2_local_replicated() -> None:
    per_rank = sources_for(local_tp=4, remote_tp=2, heads=2)
    assert per_rank == [
        [HeadSource(0, range(0, 1), remote_offset=0, local_offset=0, num_heads=1)],
        [HeadSource(0, range(0, 1), remote_offset=0, local_offset=0, num_heads=1)],
        [HeadSource(1, range(1, 2), remote_offset=0, local_offset=0, num_heads=1)],
        [HeadSource(1, range(1, 2), remote_offset=0, local_offset=0, num_heads=1)],
    ]


def test_local_and_remote_replicated_spread_over_replicas() -> None:
    # heads=2, local tp 4, remote tp 8: local ranks 0,1 share head 0 (remote replicas 0..3).
    targets = []
    for rank in range(4):
        topo = make_topology(tp_rank=rank, tp_size=4, heads=2)
        topo.register_remote_engine(REMOTE, make_info(tp_size=8))
        targets.append(topo.target_remote_ranks(REMOTE))
    assert targets == [[0], [2], [4], [6]]


def test_local_shares_head_more_than_remote_replicas_spreads_evenly() -> None:
    # heads=1, local tp 4, remote tp 2: vLLM's tp_rank // 2 spreads 2 local ranks per replica.
    targets = []
    for rank in range(4):
        topo = make_topology(tp_rank=rank, tp_size=4, heads=1)
        topo.register_remote_engine(REMOTE, make_info(tp_size=2))
        targets.append(topo.target_remote_ranks(REMOTE))
    assert targets == [[0], [0], [1], [1]]


@pytest.mark.parametrize(("local_tp", "remote_tp"), [(1, 1), (2, 1), (4, 2), (1, 4), (2, 8)])
def test_mla_reads_one_rank_whole_latent(local_tp: int, remote_tp: int) -> None:
    for rank in range(local_tp):
        topo = make_topology(tp_rank=rank, tp_size=local_tp, heads=1, is_mla=True)
        topo.register_remote_engine(REMOTE, make_info(tp_size=remote_tp))
        assert topo.target_remote_ranks(REMOTE) == [rank % remote_tp]
        assert topo.head_sources(REMOTE) == [
            HeadSource(rank % remote_tp, range(0, 1), remote_offset=0, local_offset=0, num_heads=1)
        ]


def test_target_remote_ranks_per_pp_rank() -> None:
    topo = make_topology(tp_rank=1, tp_size=2, heads=8)
    topo.register_remote_engine(REMOTE, make_info(tp_size=1, pp_rank=0, end_layer=4))
    topo.register_remote_engine(REMOTE, make_info(tp_size=4, pp_rank=1, start_layer=4))
    assert topo.target_remote_ranks(REMOTE) == [0]
    assert topo.target_remote_ranks(REMOTE, 1) == [2, 3]


# -- head coverage: brute force over many layouts ---------------------------------------------


def _compatible(tp: int, heads: int) -> bool:
    return tp % heads == 0 or heads % tp == 0


HEAD_CASES = [
    (heads, local_tp, remote_tp)
    for heads, local_tp, remote_tp in itertools.product(
        [1, 2, 4, 6, 8], [1, 2, 3, 4, 6, 8, 12, 16], [1, 2, 3, 4, 6, 8, 12, 16]
    )
    if _compatible(local_tp, heads)
    and _compatible(remote_tp, heads)
    and (local_tp % remote_tp == 0 or remote_tp % local_tp == 0)
]


def test_head_cases_are_many() -> None:
    assert len(HEAD_CASES) > 60


@pytest.mark.parametrize(("heads", "local_tp", "remote_tp"), HEAD_CASES)
def test_head_sources_cover_local_heads_exactly_once(
    heads: int, local_tp: int, remote_tp: int
) -> None:
    remote_holdings = [brute_force_heads(r, remote_tp, heads) for r in range(remote_tp)]
    for rank in range(local_tp):
        expected_local = brute_force_heads(rank, local_tp, heads)
        assert list(kv_head_range(rank, local_tp, heads)) == expected_local

        topo = make_topology(tp_rank=rank, tp_size=local_tp, heads=heads)
        topo.register_remote_engine(REMOTE, make_info(tp_size=remote_tp))
        sources = topo.head_sources(REMOTE)

        read: list[int] = []
        for src in sources:
            assert src.num_heads == len(src.remote_heads) > 0
            assert src.remote_heads.step == 1
            held = remote_holdings[src.remote_tp_rank]
            # The slice sits at remote_offset inside the remote rank's head dim ...
            assert held[src.remote_offset : src.remote_offset + src.num_heads] == list(
                src.remote_heads
            )
            # ... and lands at local_offset inside ours.
            assert expected_local[src.local_offset : src.local_offset + src.num_heads] == list(
                src.remote_heads
            )
            read.extend(src.remote_heads)
        assert read == expected_local

        targets = topo.target_remote_ranks(REMOTE)
        assert targets == [src.remote_tp_rank for src in sources]
        assert len(set(targets)) == len(targets)
        vllm = vllm_target_ranks(rank, local_tp, remote_tp)
        if local_tp >= remote_tp:
            assert targets == vllm
        else:
            assert set(targets) <= set(vllm)
            if remote_tp > heads:
                assert len(targets) == len(expected_local)
            else:
                assert targets == vllm


@pytest.mark.parametrize(("heads", "local_tp", "remote_tp"), HEAD_CASES)
def test_replicas_shared_evenly_across_local_ranks(
    heads: int, local_tp: int, remote_tp: int
) -> None:
    """Each remote rank serves at most local_tp // remote_tp local ranks (the even share)."""
    load: dict[int, int] = {}
    for rank in range(local_tp):
        topo = make_topology(tp_rank=rank, tp_size=local_tp, heads=heads)
        topo.register_remote_engine(REMOTE, make_info(tp_size=remote_tp))
        for target in topo.target_remote_ranks(REMOTE):
            load[target] = load.get(target, 0) + 1
    assert max(load.values()) <= max(local_tp // remote_tp, 1)


# -- layer_sources ----------------------------------------------------------------------------


def register_pp(topo: TransferTopology, bounds: list[tuple[int, int]]) -> None:
    for pp, (start, end) in enumerate(bounds):
        topo.register_remote_engine(REMOTE, make_info(pp_rank=pp, start_layer=start, end_layer=end))


def test_layer_sources_equal_pp() -> None:
    topo = make_topology(pp_rank=1, pp_size=2, start_layer=4, end_layer=8)
    register_pp(topo, [(0, 4), (4, 8)])
    assert topo.layer_sources(REMOTE) == [LayerSource(1, 4, 8)]


def test_layer_sources_remote_pp_greater_than_local() -> None:
    topo = make_topology(start_layer=0, end_layer=8)
    register_pp(topo, [(0, 4), (4, 8)])
    assert topo.layer_sources(REMOTE) == [LayerSource(0, 0, 4), LayerSource(1, 4, 8)]


def test_layer_sources_local_pp_greater_than_remote() -> None:
    topo = make_topology(pp_rank=1, pp_size=4, start_layer=2, end_layer=4)
    register_pp(topo, [(0, 4), (4, 8)])
    assert topo.layer_sources(REMOTE) == [LayerSource(0, 2, 4)]


def test_layer_sources_mismatched_splits() -> None:
    topo = make_topology(pp_rank=1, pp_size=2, start_layer=2, end_layer=6)
    register_pp(topo, [(0, 3), (3, 8)])
    sources = topo.layer_sources(REMOTE)
    assert sources == [LayerSource(0, 2, 3), LayerSource(1, 3, 6)]
    assert [layer for s in sources for layer in s.layers] == list(range(2, 6))


def test_layer_sources_sorted_by_layer_not_registration_order() -> None:
    topo = make_topology(start_layer=0, end_layer=8)
    # PP rank numbering need not follow layer order; the result follows layers.
    topo.register_remote_engine(REMOTE, make_info(pp_rank=0, start_layer=4, end_layer=8))
    topo.register_remote_engine(REMOTE, make_info(pp_rank=1, start_layer=0, end_layer=4))
    assert topo.layer_sources(REMOTE) == [LayerSource(1, 0, 4), LayerSource(0, 4, 8)]


def test_layer_sources_explicit_range_overrides_local() -> None:
    topo = make_topology(start_layer=0, end_layer=8)
    register_pp(topo, [(0, 4), (4, 8)])
    assert topo.layer_sources(REMOTE, start_layer=3, end_layer=5) == [
        LayerSource(0, 3, 4),
        LayerSource(1, 4, 5),
    ]
    assert topo.layer_sources(REMOTE, start_layer=6) == [LayerSource(1, 6, 8)]


def test_layer_sources_gap_names_missing_layers_and_registered() -> None:
    topo = make_topology(start_layer=0, end_layer=8)
    register_pp(topo, [(0, 3), (5, 7)])
    with pytest.raises(LayerCoverageError) as excinfo:
        topo.layer_sources(REMOTE)
    message = str(excinfo.value)
    assert "[3,5)" in message
    assert "[7,8)" in message
    assert "remote_pp=0 layers=[0,3)" in message
    assert "remote_pp=1 layers=[5,7)" in message
    assert isinstance(excinfo.value, ValueError)


def test_layer_sources_gap_only_matters_inside_requested_range() -> None:
    topo = make_topology(pp_rank=0, pp_size=2, start_layer=0, end_layer=3)
    register_pp(topo, [(0, 3), (5, 7)])
    assert topo.layer_sources(REMOTE) == [LayerSource(0, 0, 3)]


def test_layer_sources_missing_prefix() -> None:
    topo = make_topology(start_layer=0, end_layer=8)
    topo.register_remote_engine(REMOTE, make_info(pp_rank=1, start_layer=4, end_layer=8))
    with pytest.raises(LayerCoverageError, match=r"\[0,4\)"):
        topo.layer_sources(REMOTE)


def test_layer_sources_overlap_rejected() -> None:
    topo = make_topology(start_layer=0, end_layer=8)
    register_pp(topo, [(0, 5), (4, 8)])
    with pytest.raises(LayerCoverageError, match=r"remote_pp=0 and remote_pp=1.*\[4,5\)"):
        topo.layer_sources(REMOTE)


def test_layer_sources_legacy_registration_without_layers_is_a_gap() -> None:
    topo = make_topology(start_layer=0, end_layer=8)
    topo.register_remote_engine(REMOTE, make_info(start_layer=0, end_layer=0))
    with pytest.raises(LayerCoverageError, match=r"\[0,8\)"):
        topo.layer_sources(REMOTE)


@pytest.mark.parametrize(
    ("start", "end", "field_name"), [(4, 2, "start_layer"), (-1, 2, "start_layer"), (3, 3, "empty")]
)
def test_layer_sources_bad_range(start: int, end: int, field_name: str) -> None:
    topo = make_topology()
    register_pp(topo, [(0, 8)])
    with pytest.raises(ValueError, match=field_name):
        topo.layer_sources(REMOTE, start_layer=start, end_layer=end)


def test_layer_sources_default_empty_local_range_rejected() -> None:
    topo = make_topology(start_layer=0, end_layer=0)
    register_pp(topo, [(0, 8)])
    with pytest.raises(ValueError, match="empty"):
        topo.layer_sources(REMOTE)


@pytest.mark.parametrize("local_pp", [1, 2, 3, 4, 6])
@pytest.mark.parametrize("remote_pp", [1, 2, 3, 4, 6])
def test_layer_sources_tile_every_split(local_pp: int, remote_pp: int) -> None:
    num_layers = 12

    def split(pp_size: int) -> list[tuple[int, int]]:
        step = num_layers // pp_size
        return [(i * step, (i + 1) * step) for i in range(pp_size)]

    for pp_rank, (start, end) in enumerate(split(local_pp)):
        topo = make_topology(pp_rank=pp_rank, pp_size=local_pp, start_layer=start, end_layer=end)
        register_pp(topo, split(remote_pp))
        sources = topo.layer_sources(REMOTE)
        assert [layer for s in sources for layer in s.layers] == list(range(start, end))
        for s in sources:
            owner = topo.get_engine_info(REMOTE, s.remote_pp_rank)
            assert owner.start_layer <= s.start_layer < s.end_layer <= owner.end_layer


# -- describe ---------------------------------------------------------------------------------


def test_describe_lists_local_and_every_remote_pp_rank() -> None:
    topo = make_topology(tp_rank=1, tp_size=2, heads=8, start_layer=0, end_layer=8)
    topo.register_remote_engine(REMOTE, make_info(tp_size=4, pp_rank=1, start_layer=4))
    topo.register_remote_engine(REMOTE, make_info(tp_size=4, pp_rank=0, end_layer=4))
    lines = topo.describe().splitlines()
    assert len(lines) == 3
    assert "tp_rank=1/2" in lines[0]
    assert "pp_rank=0" in lines[0]
    assert LOCAL in lines[0]
    assert lines[1].startswith("engine=prefill-0 remote_pp=0 remote_tp=4 tp_ratio=-2 layers=[0,4)")
    assert "block_size=16" in lines[1]
    assert "replicated=False" in lines[1]
    assert "remote_pp=1" in lines[2]
    assert "layers=[4,8)" in lines[2]


def test_describe_without_remotes_is_one_line() -> None:
    assert len(make_topology().describe().splitlines()) == 1


def test_describe_reports_replication() -> None:
    topo = make_topology(heads=2)
    topo.register_remote_engine(REMOTE, make_info(tp_size=4))
    assert "replicated=True" in topo.describe()
