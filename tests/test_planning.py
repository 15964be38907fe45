"""`kvtransfer.planning`: instance counts from a profile, worked out by hand; `kvtransfer plan`."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from kvtransfer.cli import main
from kvtransfer.planning import (
    BIND_BATCH_LIMIT,
    BIND_DECODE_CAPACITY,
    BIND_ITL,
    BIND_NONE,
    BIND_PREFILL_CAPACITY,
    BIND_TTFT,
    PROFILE_SCHEMA,
    ProfileError,
    SaturatedError,
    Workload,
    WorkloadError,
    itl_seconds,
    load_profile,
    md1_wait,
    parse_profile,
    plan,
    predict_aggregated,
    predict_prefill,
    prefill_seconds,
    steady_batch,
)

pytestmark = pytest.mark.unit


def profile_data(**changes: Any) -> dict[str, Any]:
    """1000 prompt tokens/s at every length (S = L / 1000 s); ITL 10 ms at batch 1, 20 ms at
    5 (2.5 ms per request in the batch, also beyond 5); 0.01 ms of transfer per token."""
    data: dict[str, Any] = {
        "schema": PROFILE_SCHEMA,
        "model": "builtin:small",
        "created": "2026-01-01T00:00:00+00:00",
        "prefill": [
            {"prompt_tokens": 100, "prefill_ms": 100.0},
            {"prompt_tokens": 1000, "prefill_ms": 1000.0},
        ],
        "decode": [{"batch_size": 1, "itl_ms": 10.0}, {"batch_size": 5, "itl_ms": 20.0}],
        "kv_transfer_ms_per_token": 0.01,
        "overhead_ms": 0.0,
    }
    data.update(changes)
    return data


# R = 3 req/s of 500-token prompts (S = 0.5 s, transfer 5 ms), 100 tokens out.
WORK = Workload(rate=3, prompt_tokens=500, output_tokens=100, ttft_slo_s=1.0, itl_slo_s=0.020)


def test_known_profile_gives_known_counts():
    result = plan(parse_profile(profile_data()), WORK)
    # Prefill: P=1 rho 1.5 (refused); P=2 rho 0.75, wait 0.75*0.5/(2*0.25) = 0.75 s, TTFT
    # 0.5 + 0.75 + 0.005 = 1.255 s > 1 s; P=3 rho 0.5, wait 0.25 s, TTFT 0.755 s: 3, by TTFT.
    assert result.prefill is not None
    assert result.prefill.instances == 3
    assert result.prefill.utilisation == pytest.approx(0.5)
    assert result.prefill.ttft_s == pytest.approx(0.755)
    assert result.prefill_binding == BIND_TTFT
    # Decode: b = (R/D) * 100 * ITL(b). D=1: b = 300*(0.0075 + 0.0025 b) -> b = 9, ITL 30 ms
    # > 20. D=2: b = 150*(0.0075 + 0.0025 b) -> b = 1.8, ITL 12 ms: 2, by the ITL SLO; the
    # SLO allows batch 5, so utilisation 1.8 / 5.
    assert result.decode is not None
    assert result.decode.instances == 2
    assert result.decode.batch == pytest.approx(1.8)
    assert result.decode.itl_s == pytest.approx(0.012)
    assert result.decode.utilisation == pytest.approx(0.36)
    assert result.decode_binding == BIND_ITL
    assert result.disaggregated_total == 5
    # Aggregated: rho_p = 1.5/A. A=2: a = 1.5*100/0.25 = 600 and 600*0.0025 >= 1: no steady
    # batch. A=3: rho 0.5, b = 200*(0.0075 + 0.0025 b) -> 3, ITL 15 / 0.5 = 30 ms > 20. A=4:
    # rho 0.375, b = 120*(0.0075 + 0.0025 b) -> 1.2857, ITL 10.714 / 0.625 = 17.14 ms; TTFT
    # 0.5 + 0.375*0.5/(2*0.625) + one step 0.0107 = 0.6607 s.
    assert result.aggregated is not None
    assert result.aggregated.instances == 4
    assert result.aggregated.itl_s == pytest.approx(0.010714286 / 0.625)
    assert result.aggregated.ttft_s == pytest.approx(0.65 + 0.010714286)
    assert result.aggregated_binding == BIND_ITL


def test_prefill_capacity_binds_when_the_ttft_slo_is_loose():
    work = Workload(rate=3, prompt_tokens=500, output_tokens=1, ttft_slo_s=100, itl_slo_s=1)
    result = plan(parse_profile(profile_data()), work)
    # P=1: rho 1.5; P=2: rho 0.75, TTFT 1.255 s within 100 s. Decode: ITL 10 ms at any batch
    # below 1 (b = 3*1*0.01 = 0.03), within 1 s with one instance.
    assert result.prefill is not None and result.prefill.instances == 2
    assert result.prefill_binding == BIND_PREFILL_CAPACITY
    assert result.decode is not None and result.decode.instances == 1
    assert result.decode_binding == BIND_NONE


def test_utilisation_at_or_above_one_is_refused():
    with pytest.raises(SaturatedError, match=r"utilisation 1.000 >= 1"):
        md1_wait(1.0, 0.5)
    with pytest.raises(SaturatedError, match=r"utilisation 1.500 >= 1"):
        predict_prefill(parse_profile(profile_data()), WORK, 1)
    # 0.5 is fine: 0.5*0.5 / (2*0.5).
    assert md1_wait(0.5, 0.5) == pytest.approx(0.25)


def test_no_steady_decode_batch_is_refused():
    profile = parse_profile(profile_data())
    # ITL grows 2.5 ms per request beyond batch 1: with a = 400, 400*0.0025 = 1, so every
    # request in the batch adds at least one more: no fixed point.
    with pytest.raises(SaturatedError, match="decode cannot keep up"):
        steady_batch(profile, 400)
    assert steady_batch(profile, 50) == pytest.approx(0.5)  # 50 * 10 ms, below batch 1


def test_decode_capacity_binds_when_one_decode_saturates():
    work = Workload(rate=4, prompt_tokens=100, output_tokens=100, ttft_slo_s=10, itl_slo_s=1)
    result = plan(parse_profile(profile_data()), work)
    # D=1: a = 400, no steady batch; D=2: a = 200, b = 200*0.0075/0.5 = 3, ITL 15 ms.
    assert result.decode is not None and result.decode.instances == 2
    assert result.decode.batch == pytest.approx(3.0)
    assert result.decode_binding == BIND_DECODE_CAPACITY


def test_the_engines_batch_limit_binds():
    profile = parse_profile(profile_data(engine={"max_num_seqs": 2}))
    work = Workload(rate=1, prompt_tokens=100, output_tokens=400, ttft_slo_s=10, itl_slo_s=1)
    # D=1: a = 400, saturated; D=2: b = 200*(0.0075 + 0.0025 b) -> 3, over the limit of 2 (its
    # ITL, 15 ms, would do); D=3: b = 133.3*(0.0075 + 0.0025 b) -> 1.5.
    result = plan(profile, work)
    assert result.decode is not None and result.decode.instances == 3
    assert result.decode.batch == pytest.approx(1.5)
    assert result.decode.utilisation == pytest.approx(0.75)  # of the 2 the engine allows
    assert result.decode_binding == BIND_BATCH_LIMIT


def test_an_unreachable_slo_and_too_few_instances_give_no_plan():
    profile = parse_profile(profile_data())
    tight = Workload(rate=0.1, prompt_tokens=500, output_tokens=10, ttft_slo_s=0.4, itl_slo_s=1)
    result = plan(profile, tight)
    # 0.5 s of prefill alone is over a 0.4 s SLO, whatever the count.
    assert result.prefill is None
    assert result.prefill_binding == "unreachable: TTFT 505.0 ms with no queueing at all"
    assert result.disaggregated_total is None
    # The first test's 3 + 2 does not fit 4.
    small = plan(profile, WORK, max_instances=4)
    assert small.prefill is not None and small.decode is not None
    assert small.disaggregated_total is None


def test_a_spread_of_prompt_lengths_waits_longer_than_their_mean():
    profile = parse_profile(profile_data())
    # Half 100-token prompts (0.1 s), half 900 (0.9 s): mean 500 tokens, E[S] 0.5 s,
    # E[S^2] (0.01 + 0.81) / 2 = 0.41 s^2.
    mixed = Workload.mixed(1, [(100, 50), (900, 50)], 100, ttft_slo_s=0.9, itl_slo_s=1)
    assert mixed.prompt_tokens == pytest.approx(500)
    same = Workload(1, 500, 100, ttft_slo_s=0.9, itl_slo_s=1)
    # M/D/1 at 500 tokens, P=1: rho 0.5, wait 0.25 s, TTFT 0.5 + 0.25 + 0.005 = 0.755 s.
    assert predict_prefill(profile, same, 1).ttft_s == pytest.approx(0.755)
    # M/G/1, P=1: wait 1 * 0.41 / (2 * 0.5) = 0.41 s, TTFT 0.915 s, over 0.9 s. P=2: wait
    # 0.5 * 0.41 / (2 * 0.75), TTFT 0.5 + 0.13667 + 0.005.
    one = predict_prefill(profile, mixed, 1)
    assert (one.utilisation, one.wait_s, one.ttft_s) == pytest.approx((0.5, 0.41, 0.915))
    result = plan(profile, mixed)
    assert result.prefill is not None and result.prefill.instances == 2
    assert result.prefill.ttft_s == pytest.approx(0.5 + 0.41 / 3 + 0.005)
    assert result.prefill_binding == BIND_TTFT
    assert plan(profile, same).prefill.instances == 1  # type: ignore[union-attr]


def test_an_aggregated_gap_carries_the_biggest_chunk_of_the_mix():
    profile = parse_profile(profile_data(engine={"max_num_batched_tokens": 500}))
    work = Workload.mixed(0.5, [(100, 50), (900, 50)], 10, ttft_slo_s=10, itl_slo_s=1)
    # A=1: rho 0.25, a = 0.5 * 10 / 0.75 = 6.67, b = 0.0667 (ITL 10 ms below batch 1); the
    # 900-token prompt in 2 chunks of 0.45 s, the 100-token one in 1 of 0.1 s: mean 1.5
    # chunks; wait 0.5 * 0.41 / (2 * 0.75).
    got = predict_aggregated(profile, work, 1)
    assert got.worst_gap_s == pytest.approx(0.010 + 0.45)
    assert got.ttft_s == pytest.approx(0.5 + 0.41 / 3 + 1.5 * 0.010)


@pytest.mark.parametrize(
    ("mix", "message"),
    [
        ([], "prompt_mix must name at least one prompt length"),
        ([(100, 50), (900, 40)], "prompt_mix percents must add to 100, got 90"),
        ([(0, 50), (900, 50)], "prompt_mix tokens must be a positive number, got 0"),
        ([(100, -10), (900, 110)], "prompt_mix percent must be a positive number, got -10"),
    ],
)
def test_a_bad_prompt_mix_is_named(mix, message):
    with pytest.raises(WorkloadError, match=f"^{message}$"):
        Workload.mixed(1, mix, 10, ttft_slo_s=1, itl_slo_s=1)


def test_a_mix_must_agree_with_its_mean():
    with pytest.raises(WorkloadError, match=r"^prompt_tokens 400 is not the mix's mean 500.0$"):
        Workload(1, 400, 10, 1, 1, prompt_mix=((100.0, 0.5), (900.0, 0.5)))


def test_curves_interpolate_and_extrapolate():
    profile = parse_profile(profile_data())
    assert prefill_seconds(profile, 50) == pytest.approx(0.05)  # proportional below 100
    assert prefill_seconds(profile, 550) == pytest.approx(0.55)
    assert prefill_seconds(profile, 2000) == pytest.approx(2.0)  # last segment's slope
    assert itl_seconds(profile, 0.5) == pytest.approx(0.010)  # held below batch 1
    assert itl_seconds(profile, 3) == pytest.approx(0.015)
    assert itl_seconds(profile, 9) == pytest.approx(0.030)
    # A falling last segment (noise) is held flat beyond it, not extrapolated down.
    noisy = parse_profile(
        profile_data(decode=[{"batch_size": 1, "itl_ms": 10}, {"batch_size": 2, "itl_ms": 8}])
    )
    assert itl_seconds(noisy, 10) == pytest.approx(0.008)


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"schema": "other/1"}, "schema must be 'kvtransfer.pd_profile/1', got 'other/1'"),
        ({"prefill": []}, "prefill must be a non-empty list, got []"),
        (
            {"prefill": [{"prompt_tokens": 100, "prefill_ms": 100}, {"prompt_tokens": 200}]},
            "prefill[1].prefill_ms must be a number, got None",
        ),
        (
            {"decode": [{"batch_size": 1, "itl_ms": -5}]},
            "decode[0].itl_ms must be > 0, got -5",
        ),
        (
            {"decode": [{"batch_size": 1.5, "itl_ms": 5}]},
            "decode[0].batch_size must be a whole number, got 1.5",
        ),
        (
            {"decode": [{"batch_size": 2, "itl_ms": 5}, {"batch_size": 2, "itl_ms": 6}]},
            "decode lists a batch_size twice: [2, 2]",
        ),
        ({"kv_transfer_ms_per_token": True}, "kv_transfer_ms_per_token must be a number, got True"),
        ({"engine": {"max_num_seqs": 0}}, "engine.max_num_seqs must be > 0, got 0"),
    ],
)
def test_a_malformed_profile_names_the_field(changes, message):
    with pytest.raises(ProfileError) as info:
        parse_profile(profile_data(**changes), "p.json")
    assert str(info.value) == f"p.json: {message}"


def test_profile_file_errors(tmp_path):
    with pytest.raises(ProfileError, match=r"missing\.json: no such file$"):
        load_profile(tmp_path / "missing.json")
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(ProfileError, match=r"bad\.json: not JSON \("):
        load_profile(bad)
    listed = tmp_path / "list.json"
    listed.write_text("[]")
    with pytest.raises(ProfileError, match=r"list\.json: expected a JSON object, got list$"):
        load_profile(listed)


def test_workload_numbers_must_be_positive():
    with pytest.raises(WorkloadError, match=r"^rate must be a positive number, got 0$"):
        Workload(rate=0, prompt_tokens=1, output_tokens=1, ttft_slo_s=1, itl_slo_s=1)
    with pytest.raises(WorkloadError, match=r"max_instances must be an integer >= 2, got 1"):
        plan(parse_profile(profile_data()), WORK, max_instances=1)


# ------------------------------------------------------------------ the command


def _plan_argv(profile: Path, **flags: str) -> list[str]:
    values = {
        "rate": "3",
        "ttft-ms": "1000",
        "itl-ms": "20",
        "prompt-tokens": "500",
        "output-tokens": "100",
    }
    values.update(flags)
    argv = ["plan", "--profile", str(profile)]
    for key, value in values.items():
        argv += [f"--{key}", value]
    return argv


@pytest.fixture
def profile_file(tmp_path) -> Path:
    path = tmp_path / "profile.json"
    path.write_text(json.dumps(profile_data()))
    return path


def test_plan_command_prints_the_split(profile_file, capsys):
    assert main(_plan_argv(profile_file)) == 0
    out = capsys.readouterr().out
    assert "suggested: 3 prefill + 2 decode = 5 instances" in out
    assert "TTFT 755.0 ms" in out
    assert "ITL 12.0 ms" in out
    assert "prefill count set by (what fails with one fewer): TTFT SLO" in out
    assert "decode count set by (what fails with one fewer): ITL SLO" in out
    assert "aggregated only: 4 instances" in out


def test_plan_command_json_and_no_plan(profile_file, capsys):
    assert main([*_plan_argv(profile_file), "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert (data["prefill"]["instances"], data["decode"]["instances"], data["total"]) == (3, 2, 5)
    assert main(_plan_argv(profile_file, **{"max-instances": "4"})) == 1
    assert "suggested: none within --max-instances 4" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        ({"rate": "-1"}, "error: --rate must be a positive number, got '-1'"),
        ({"itl-ms": "fast"}, "error: --itl-ms must be a number, got 'fast'"),
        ({"max-instances": "1"}, "error: --max-instances must be at least 2, got 1"),
    ],
)
def test_plan_command_bad_input_exits_2_with_one_line(profile_file, capsys, flags, message):
    assert main(_plan_argv(profile_file, **flags)) == 2
    captured = capsys.readouterr()
    assert captured.err == message + "\n"
    assert captured.out == ""


def test_plan_command_takes_a_prompt_mix(profile_file, capsys):
    # Half 100, half 900 tokens at 1 req/s under a 900 ms TTFT: 2 prefills (the first test's
    # arithmetic), where one would do for 500-token prompts.
    argv = _plan_argv(profile_file, rate="1", **{"ttft-ms": "900"})
    assert main(argv) == 0
    assert "suggested: 1 prefill" in capsys.readouterr().out
    mixed = [arg for arg in argv if arg not in ("--prompt-tokens", "500")]
    assert main([*mixed, "--prompt-mix", "100:50,900:50"]) == 0
    out = capsys.readouterr().out
    assert "prompts of 50% 100, 50% 900 tokens (mean 500)" in out
    assert "suggested: 2 prefill" in out
    assert "M/G/1 prefill queue" in out


@pytest.mark.parametrize(
    ("mix", "message"),
    [
        ("100:50,900", "error: --prompt-mix: expected TOKENS:PERCENT, got '900'"),
        ("100:50,900:40", "error: --prompt-mix: the percents must add to 100, got 90"),
        ("x:50,900:50", "error: --prompt-mix tokens must be a number, got 'x'"),
    ],
)
def test_plan_command_bad_prompt_mix_exits_2(profile_file, capsys, mix, message):
    argv = [arg for arg in _plan_argv(profile_file) if arg not in ("--prompt-tokens", "500")]
    assert main([*argv, "--prompt-mix", mix]) == 2
    assert capsys.readouterr().err == message + "\n"


def test_plan_command_missing_profile(tmp_path, capsys):
    assert main(_plan_argv(tmp_path / "nope.json")) == 2
    assert capsys.readouterr().err == f"error: profile {tmp_path / 'nope.json'}: no such file\n"
