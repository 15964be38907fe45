"""`kvtransfer demo`, the README's main command: daemons and router as real processes, tokens
checked against a colocated run, everything stopped cleanly."""

from __future__ import annotations

import ast
import re
import xml.etree.ElementTree as ET

import pytest
from script_modules import load_script

from kvtransfer.cli import demo
from kvtransfer.models import demo_model_dir

pytestmark = pytest.mark.integration


def test_demo_runs_end_to_end(capsys, tmp_path):
    pictures = tmp_path / "pictures"
    argv = ["--max-tokens", "8", "--log-dir", str(tmp_path), "--picture-dir", str(pictures)]
    assert demo.main(argv) == 0
    out = capsys.readouterr().out
    # The longest default prompt's timeline, drawn.
    png, svg = pictures / "handover.png", pictures / "handover.svg"
    assert f"prompt 1's handover, drawn from its timeline: {png} and {svg}" in out
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert ET.parse(svg).getroot().tag == "{http://www.w3.org/2000/svg}svg"
    assert out.count("tokens identical") == len(demo.DEFAULT_PROMPTS)
    assert "kv_tokens_recomputed=0" in out
    # The demo model goes on as the docs it memorised do, through the router (one streamed).
    corpus = _demo_model_corpus()
    for prompt, completion in _completions(out):
        assert prompt + completion in corpus, (prompt, completion)
    for name in ("router", "decode daemon", "prefill daemon"):
        assert f"{name}: exit code 0" in out
    assert out.rstrip().endswith(f"demo OK (logs: {tmp_path})")


def test_demo_with_parallel_sides_and_a_drafter(capsys, tmp_path):
    argv = ["--prefill-tp", "2", "--decode-pp", "2", "--speculative", "draft"]
    assert demo.main([*argv, "--max-tokens", "8", "--log-dir", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    # The demo model drafts for itself (no drafter shares its vocabulary).
    assert "P/D: prefill TP2xPP1 -> decode TP1xPP2, model demo, speculative draft" in out
    assert out.count("tokens identical") == len(demo.DEFAULT_PROMPTS)


def test_demo_reports_a_daemon_that_cannot_start(capsys, tmp_path):
    assert demo.main(["--model", str(tmp_path / "no-such-model"), "--log-dir", str(tmp_path)]) == 1
    out = capsys.readouterr().out
    assert "demo FAILED: prefill daemon exited with code 1 before it was ready" in out


def _completions(out: str) -> list[tuple[str, str]]:
    """(prompt, completion) of every request the demo printed, in order."""
    pairs = re.findall(r"^> (.+)\n  completion: (.+)$", out, flags=re.MULTILINE)
    assert len(pairs) == len(demo.DEFAULT_PROMPTS)
    return [(ast.literal_eval(prompt), ast.literal_eval(text)) for prompt, text in pairs]


def _demo_model_corpus() -> str:
    """The prose the demo model was trained on, as shipped beside it."""
    texts = load_script("train_demo_model").load_corpus(demo_model_dir())
    return "".join(texts[name] for name in sorted(texts))
