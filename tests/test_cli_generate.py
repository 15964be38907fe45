"""`kvtransfer generate` and `kvtransfer model init`, run as real commands."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from kvtransfer.engine.config import EngineConfig
from kvtransfer.engine.llm import LLM
from kvtransfer.engine.sampling_params import SamplingParams

pytestmark = pytest.mark.integration

PROMPT_IDS = [72, 101, 108, 108, 111, 44, 32, 119, 111, 114, 108, 100]


def kvtransfer(*args: str, timeout: float = 240) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "kvtransfer.cli", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
    )


@pytest.fixture(scope="module")
def colocated_tokens() -> list[int]:
    with LLM(EngineConfig(model="builtin")) as llm:
        (output,) = llm.generate([PROMPT_IDS], SamplingParams(max_tokens=8, ignore_eos=True))
    return output.token_ids


def generate_json(*args: str) -> dict:
    result = kvtransfer("generate", "--max-tokens", "8", "--ignore-eos", "--json", *args)
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


def test_generate_json_equals_in_process_run(colocated_tokens):
    out = generate_json("--model", "builtin", "--prompt-token-ids", ",".join(map(str, PROMPT_IDS)))
    assert out["token_ids"] == colocated_tokens
    assert out["prompt_token_ids"] == PROMPT_IDS
    assert out["finish_reason"] == "length"
    assert isinstance(out["text"], str) and len(out["text"]) > 0


def test_text_prompt_is_tokenized_like_token_ids(colocated_tokens):
    assert generate_json("--prompt", "Hello, world")["token_ids"] == colocated_tokens


def test_connector_from_module_path_runs_on_scheduler_and_every_worker(tmp_path, colocated_tokens):
    kv_config = {
        "kv_connector": "RecordingConnector",
        "kv_connector_module_path": "kvtransfer.testing.recording",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {"record_dir": str(tmp_path)},
    }
    out = generate_json(
        "--prompt",
        "Hello, world",
        "--tp",
        "2",
        "--kv-transfer-config",
        json.dumps(kv_config),
    )
    assert out["token_ids"] == colocated_tokens
    records = [json.loads(p.read_text()) for p in tmp_path.glob("*.json")]
    assert sorted(r["role"] for r in records) == ["SCHEDULER", "WORKER", "WORKER"]
    (scheduler,) = [r["calls"] for r in records if r["role"] == "SCHEDULER"]
    hooks = [hook for hook, _ in scheduler]
    assert ["set_xfer_handshake_metadata_pp_aware", [[0, 0], [0, 1]]] in scheduler
    for hook in ("get_num_new_matched_tokens", "update_state_after_alloc", "request_finished"):
        assert hooks.count(hook) == 1, hook
    assert hooks.count("build_connector_meta") >= 8  # once per step: prefill + 7 decodes
    for worker in (r["calls"] for r in records if r["role"] == "WORKER"):
        worker_hooks = [hook for hook, _ in worker]
        assert worker_hooks[0] == "register_kv_caches"
        assert worker_hooks.count("bind_connector_metadata") == hooks.count("build_connector_meta")
        assert worker_hooks.count("clear_connector_metadata") == worker_hooks.count(
            "bind_connector_metadata"
        )
        assert worker_hooks[-1] == "shutdown"


def test_model_init_writes_a_checkpoint_that_generates_the_same(tmp_path, colocated_tokens):
    target = tmp_path / "tiny"
    result = kvtransfer("model", "init", str(target), "--preset", "tiny")
    assert result.returncode == 0, result.stderr
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= {
        p.name for p in target.iterdir()
    }
    ids = ",".join(map(str, PROMPT_IDS))
    assert generate_json("--model", str(target), "--prompt-token-ids", ids)["token_ids"] == (
        colocated_tokens
    )
    again = kvtransfer("model", "init", str(target))
    assert again.returncode == 2
    assert "error:" in again.stderr and str(target) in again.stderr


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--prompt-token-ids", "1,x"], "--prompt-token-ids must be comma-separated integers"),
        (["--prompt", "hi", "--tp", "3"], "tensor_parallel_size must be 1, 2 or 4, got 3"),
        (["--prompt", "hi", "--kv-transfer-config", "{bad"], "kv_transfer_config is not valid"),
        (["--prompt", "hi", "--model", "/nonexistent/model"], "/nonexistent/model"),
        (
            ["--prompt", "hi", "--kv-transfer-config", '{"kv_connector": "NoSuchConnector"}'],
            "NoSuchConnector",
        ),
        (["--prompt-token-ids", "1,99999"], "99999"),
    ],
)
def test_bad_input_fails_with_a_clear_message(args, message):
    result = kvtransfer("generate", *args)
    assert result.returncode == 2, result.stderr
    assert message in result.stderr
    assert "Traceback" not in result.stderr
