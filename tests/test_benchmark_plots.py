"""`benchmarks/plots.py`: each benchmark's picture drawn from a small JSON document of the shape
that benchmark writes (keys as in its source), a PNG of the expected size; a document of another
shape is refused naming what is missing; the command line draws one again from a file."""

from __future__ import annotations

import importlib.util
import json
import struct
import sys
from pathlib import Path
from types import ModuleType

import pytest

pytestmark = pytest.mark.unit

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


def _load_plots() -> ModuleType:
    name = "kvtransfer_benchmark_plots"
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, BENCHMARKS / "plots.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


plots = _load_plots()


def png_size(path: Path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    assert data[12:16] == b"IHDR"
    return struct.unpack(">II", data[16:24])


def _transfer_case(case: str, blocks: int, size: int, nixl: float | None) -> dict:
    return {
        "case": case,
        "blocks": blocks,
        "bytes": size,
        "rma_gbps": 9.5,
        "tagged_gbps": 4.1,
        "nixl_gbps": nixl,
        "tcp_gbps": 1.2,
        "memcpy_gbps": 11.0,
        "perftest_gbps": 10.2,
        "rma_p50_ms": 1.7,
        "rma_p99_ms": 2.0,
        "tagged_p50_ms": 4.0,
        "tagged_p99_ms": 5.0,
        "nixl_p50_ms": None if nixl is None else 6.2,
        "nixl_p99_ms": None if nixl is None else 7.0,
        "perftest_p50_ms": 1.6,
        "samples": 3,
        "nixl_note": None if nixl is not None else "nixl_cu12 missing",
    }


TRANSFER = {
    "host": "vm",
    "cpus": 2,
    "torch_threads": 1,
    "nixl": "nixl_cu12 1.0",
    "handshake": "n/a (--no-handshake)",
    "cases": [
        _transfer_case("256 blocks", 256, 256 << 20, 3.0),
        _transfer_case("1 block", 1, 1 << 20, None),
        _transfer_case("16 blocks", 16, 16 << 20, 2.7),
    ],
    "producer_compute_while_serving": {},
}


def _pd_row(model: str, length: int, colocated: float, pd: float) -> dict:
    return {
        "model": model,
        "prompt_tokens": length,
        "n": 3,
        "max_tokens": 8,
        "colocated_ttft_ms": colocated,
        "pd_ttft_ms": pd,
        "ttft_goal_ms": 1.1 * colocated + 1.0,
        "ttft_ratio": pd / colocated,
    }


PD_LATENCY = [
    _pd_row("builtin", 16, 7.5, 10.5),
    _pd_row("builtin", 512, 29.0, 29.7),
    _pd_row("builtin:small", 16, 12.0, 14.0),
    _pd_row("builtin:small", 512, 90.0, 95.0),
]


def _phase(hit: float | None, p50: float, p99: float) -> dict:
    return {"requests": 16, "errors": 0, "hit_rate": hit, "ttft_p50_ms": p50, "ttft_p99_ms": p99}


ROUTING = {
    "args": {"model": "builtin:small", "sessions": "8", "turns": "2", "prefixes": "4"},
    "setups": [
        {"setup": "round_robin", "main": _phase(0.47, 3815, 12031), "hot": _phase(0.5, 1, 2)},
        {"setup": "cache_aware/events", "main": _phase(0.78, 1027, 4802), "hot": _phase(0.9, 1, 2)},
        {"setup": "colocated", "main": _phase(None, 862, 3169), "hot": _phase(None, 1, 2)},
    ],
    "goals": [],
}
ROUTING_INDEX = {
    "blocks_indexed": 100000,
    "rows": [
        {"scenario": f"{kind}-{n}", "prompt_tokens": n, "choose_p50_us": p, "choose_p99_us": 2 * p}
        for kind, scale in (("hit", 1.0), ("half", 0.6), ("miss", 0.2))
        for n, p in ((512, 34 * scale), (2048, 55 * scale))
    ],
}
ENGINE = {
    "config": {"batch": 8},
    "rows": [
        {"preset": p, "connector": c, "prefill_tokens_per_s": t, "decode_tokens_per_s": t / 20}
        for p, t in (("tiny", 9000.0), ("small", 1500.0))
        for c in ("none (null object)", "no-op (active)")
    ],
}
HANDSHAKE = {
    "benchmark": "handshake",
    "pp_size": 2,
    "tp_size": 2,
    "results": {
        "cold": {"p50_ms": 2.1, "p99_ms": 4.0, "mean_ms": 2.3, "n": 200},
        "warm": {"p50_ms": 0.4, "p99_ms": 0.9, "mean_ms": 0.5, "n": 200},
    },
}

CASES = [
    ("transfer", TRANSFER, (1200, 800)),
    ("pd_latency", PD_LATENCY, (1200, 480)),  # two models, two panels
    ("routing", ROUTING, (1200, 480)),
    ("routing_index", ROUTING_INDEX, (800, 480)),
    ("engine", ENGINE, (1000, 480)),
    ("handshake", HANDSHAKE, (600, 480)),
]


def test_every_benchmark_has_a_picture_here():
    assert sorted(plots.PLOTS) == sorted(kind for kind, _, _ in CASES)


@pytest.mark.parametrize(("kind", "document", "size"), CASES, ids=[c[0] for c in CASES])
def test_each_picture_is_a_png_beside_its_json(tmp_path, capsys, kind, document, size):
    saved = tmp_path / f"{kind}.json"
    saved.write_text(json.dumps(document))
    png = plots.write_png(kind, saved)
    assert png == tmp_path / f"{kind}.png"
    assert capsys.readouterr().out == f"wrote {png}\n"
    assert png_size(png) == size


def test_a_document_of_another_shape_is_refused_naming_what_is_missing(tmp_path):
    png = tmp_path / "x.png"
    with pytest.raises(plots.PlotError, match="'setups' must be a non-empty list"):
        plots.plot_routing({"setups": []}, png)
    with pytest.raises(plots.PlotError, match="missing 'cases' \\(not the JSON this benchmark"):
        plots.plot_transfer({"rows": []}, png)
    with pytest.raises(plots.PlotError, match="missing 'model'"):
        plots.plot_pd_latency([{"prompt_tokens": 16}], png)
    with pytest.raises(plots.PlotError, match="pd_latency: expected a non-empty list of rows"):
        plots.plot_pd_latency({"rows": []}, png)
    assert not png.exists()


def test_the_command_line_draws_a_saved_json_again(tmp_path, capsys):
    saved = tmp_path / "results.json"
    saved.write_text(json.dumps(HANDSHAKE))
    out = tmp_path / "elsewhere" / "h.png"
    assert plots.main(["handshake", str(saved), "--png", str(out)]) == 0
    assert capsys.readouterr().out == f"wrote {out}\n"
    assert png_size(out) == (600, 480)
    assert plots.main(["routing", str(saved)]) == 1
    assert capsys.readouterr().err == (
        f"error: {saved}: missing 'setups' (not the JSON this benchmark writes?)\n"
    )
