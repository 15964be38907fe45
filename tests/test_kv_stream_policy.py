"""The router's ``--kv-stream auto``: a prefill streams its KV to a decode called while it computes
only when the two do not compute on the same cores of one host (each daemon reports its host and
CPU affinity in ``GetStatus``). Real daemons, pinned with ``taskset`` where the test needs
disjoint cores; the timeline of each answer says whether the decode was called early, and the
tokens equal colocated either way."""

from __future__ import annotations

import json
import os
import shutil
import urllib.request

import pytest
from serve_helpers.daemons import (
    BLOCK_SIZE,
    COMMON_FLAGS,
    colocated,
    exit_used_blocks,
    running,
    start_router,
)

from kvtransfer.control.placement import Placement
from kvtransfer.serve.launcher import ServiceProcess, daemon_command

pytestmark = pytest.mark.integration

PROMPT = [(11 * i) % 180 + 40 for i in range(3 * BLOCK_SIZE + 5)]
MAX_TOKENS = 4


def _start(role: str, log_dir, cpus: str | None) -> ServiceProcess:
    kv = {"kv_port": 0, "kv_connector_extra_config": {"kv_stream_min_tokens": 0}}
    argv = daemon_command(role, *COMMON_FLAGS, "--kv-transfer-config", json.dumps(kv))
    if cpus is not None:
        argv = ["taskset", "-c", cpus, *argv]
    return ServiceProcess.start(role, argv, log_dir / f"{role}.log")


def _complete(base_url: str) -> dict:
    body = json.dumps({"prompt": PROMPT, "max_tokens": MAX_TOKENS}).encode()
    request = urllib.request.Request(
        f"{base_url}/v1/completions", data=body, headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=120) as response:
        return json.loads(response.read())["kvtransfer"]


def _run(tmp_path, prefill_cpus: str | None, decode_cpus: str | None) -> list[dict]:
    prefill = _start("prefill", tmp_path, prefill_cpus)
    decode = _start("decode", tmp_path, decode_cpus)
    with running(decode, prefill):
        router = start_router(tmp_path, [prefill], [decode], "--kv-stream", "auto")
        with running(router):
            # The first request may come before the router read the daemons' placement.
            answers = [_complete(router.address) for _ in range(3)]
    assert exit_used_blocks(prefill) == 0
    assert exit_used_blocks(decode) == 0
    return answers[1:]


def _spans(info: dict) -> dict[str, dict]:
    return {row["name"]: row for row in info["timeline"]}


@pytest.fixture(scope="module")
def expected():
    return colocated([PROMPT], MAX_TOKENS)[0]


def test_daemons_sharing_cores_hand_over_once_the_prefill_returned(tmp_path, expected):
    here = Placement.of_this_process()
    assert here.shares_cores(here)  # unpinned daemons of one host: the same cores
    for info in _run(tmp_path, None, None):
        assert info["token_ids"] == expected
        spans = _spans(info)
        call = spans["router.prefill_call"]
        assert call["attributes"]["kv_stream"] is False
        # The decode was called after the prefill's answer, and read the KV in one pull.
        assert spans["router.decode_call"]["start_ms"] >= call["start_ms"] + call["duration_ms"]
        assert info["phases"]["kv_overlapped_s"] == 0.0


@pytest.mark.skipif(
    len(os.sched_getaffinity(0)) < 2 or shutil.which("taskset") is None,
    reason="needs two CPUs and taskset to pin the daemons apart",
)
def test_daemons_on_disjoint_cores_stream_while_the_prefill_computes(tmp_path, expected):
    first, second = sorted(os.sched_getaffinity(0))[:2]
    for info in _run(tmp_path, str(first), str(second)):
        assert info["token_ids"] == expected
        spans = _spans(info)
        call = spans["router.prefill_call"]
        assert call["attributes"]["kv_stream"] is True
        # Called on the prefill's announcement, before its answer.
        assert spans["router.decode_call"]["start_ms"] < call["start_ms"] + call["duration_ms"]


def test_placements_share_cores_only_on_one_host_with_common_cpus():
    a = Placement("boot-1", frozenset({0, 1}))
    assert a.shares_cores(Placement("boot-1", frozenset({1, 2})))
    assert not a.shares_cores(Placement("boot-1", frozenset({2, 3})))
    assert not a.shares_cores(Placement("boot-2", frozenset({0, 1})))
    assert Placement.reported("", [0, 1]) is None
    assert Placement.reported("boot-1", [1, 0]) == a


def test_bad_stream_and_switch_settings_are_refused_naming_them(capsys):
    from kvtransfer.router.__main__ import main as router_main
    from kvtransfer.router.config import RouterConfig
    from kvtransfer.serve.settings import SettingsError, load_settings

    with pytest.raises(ValueError, match=r"kv_stream must be one of \('auto', 'always', 'never'\)"):
        RouterConfig(prefill=("127.0.0.1:1",), decode=("127.0.0.1:2",), kv_stream="sometimes")
    assert RouterConfig(prefill=("a:1",), decode=("b:2",), kv_stream=False).kv_stream == "never"
    with pytest.raises(SystemExit) as exited:
        router_main(["--prefill", "a:1", "--decode", "b:2", "--switch-interval-ms", "0"])
    assert exited.value.code == 2
    assert "--switch-interval-ms must be in (0, 100], got 0.0" in capsys.readouterr().err
    with pytest.raises(
        SettingsError, match=r"^--switch-interval-ms: Input should be greater than 0"
    ):
        load_settings("prefill", ["--switch-interval-ms", "0"], environ={})
