"""The benchmarks' pictures: each benchmark that writes JSON writes a PNG beside it from it.

    .venv/bin/python benchmarks/plots.py KIND RESULTS.json [--png OUT.png]

draws one again from a saved JSON (KIND: one of `PLOTS`; default output: the JSON's path with
``.png``). Every function takes the JSON document exactly as its benchmark writes it, so a
picture never shows anything the JSON does not hold. matplotlib draws on its Agg canvas (no
display needed, no global backend switched).
"""

from __future__ import annotations

import argparse
import json
import sys
import textwrap
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

DPI = 100
# Ours first, then what it is compared with; one colour per method in every picture.
COLORS = {
    "rma": "#1f77b4",
    "tagged": "#6baed6",
    "nixl": "#e6550d",
    "perftest": "#636363",
    "colocated": "#636363",
    "pd": "#1f77b4",
    "goal": "#d62728",
}


class PlotError(ValueError):
    """A JSON document that is not what the benchmark writes; the message says what is off."""


def png_beside(json_path: Path) -> Path:
    """Where a benchmark's picture goes: next to its JSON, same name."""
    return json_path.with_suffix(".png")


# ------------------------------------------------------------------ transfer.py


def plot_transfer(report: dict[str, Any], png: Path) -> Path:
    """GB/s and p50 per case, ours (RMA, tagged) against NIXL and UCX's own limit."""
    cases = sorted(_list(report, "cases"), key=lambda row: (row["bytes"], row["case"]))
    # One above the other: seven cases of four methods need the width.
    figure, (rate, latency) = _figure(2, width=12.0, height=8.0, rows=2)
    labels = [f"{textwrap.fill(row['case'], 16)}\n{_size(row['bytes'])}" for row in cases]
    methods = (
        ("rma", "ours, RMA (one-sided)"),
        ("tagged", "ours, tagged"),
        ("nixl", "NIXL READ"),
        ("perftest", "limit: ucx_perftest ucp_get"),
    )
    _bars(
        rate, labels, [(label, [row.get(f"{m}_gbps") for row in cases], m) for m, label in methods]
    )
    rate.set_ylabel("GB/s (higher is better)")
    rate.set_title("throughput per request")
    _bars(
        latency,
        labels,
        [(label, [row.get(f"{m}_p50_ms") for row in cases], m) for m, label in methods],
    )
    _log_scale(latency.yaxis)
    latency.set_ylabel("p50 ms, log scale (lower is better)")
    latency.set_title("latency per request")
    figure.legend(*rate.get_legend_handles_labels(), loc="outside lower center", ncols=4)
    samples = cases[0].get("samples")
    # Its note names where NIXL came from (a path): the kind is enough here.
    nixl = str(report.get("nixl", "?")).split(" (")[0].split(",")[0]
    figure.suptitle(
        f"KV block pulls between two processes on one host ({report.get('cpus', '?')} CPUs, "
        f"{samples} timed requests per case); NIXL: {nixl}",
        fontsize=10,
    )
    return _save(figure, png)


# ------------------------------------------------------------------ pd_latency.py


def plot_pd_latency(rows: list[dict[str, Any]], png: Path) -> Path:
    """TTFT by prompt length, P/D against colocated, per model, with the issue's goal."""
    if not isinstance(rows, list) or not rows:
        raise PlotError("pd_latency: expected a non-empty list of rows")
    models = list(dict.fromkeys(_field(row, "model") for row in rows))
    figure, panels = _figure(len(models), width=5.5 * len(models) + 1)
    for axes, model in zip(panels, models, strict=True):
        mine = sorted((r for r in rows if r["model"] == model), key=lambda r: r["prompt_tokens"])
        lengths = [_field(r, "prompt_tokens") for r in mine]
        for key, label, color, style in (
            ("colocated_ttft_ms", "colocated (one daemon)", COLORS["colocated"], "o-"),
            ("pd_ttft_ms", "P/D through the router", COLORS["pd"], "s-"),
            ("ttft_goal_ms", "goal: 1.1 x colocated + 1 ms", COLORS["goal"], ":"),
        ):
            axes.plot(lengths, [_field(r, key) for r in mine], style, color=color, label=label)
        axes.set_xscale("log", base=2)
        _log_scale(axes.yaxis)
        axes.set_xticks(lengths, [str(n) for n in lengths])
        axes.set_xlabel("prompt tokens")
        axes.set_ylabel("TTFT ms, median, log scale")
        n = mine[0].get("n")
        axes.set_title(f"{model} (medians of {n} requests)", fontsize=10)
        axes.grid(True, which="major", color="#e6e6e6")
    panels[0].legend(fontsize=8)
    figure.suptitle("Time to first token: P/D against colocated", fontsize=11)
    return _save(figure, png)


# ------------------------------------------------------------------ routing.py


def plot_routing(report: dict[str, Any], png: Path) -> Path:
    """Prefix hit rate and TTFT per routing policy (setup), shared-prefix multi-turn phase."""
    setups = _list(report, "setups")
    names = [_field(row, "setup") for row in setups]
    main = [_field(row, "main") for row in setups]
    figure, (hits, ttft) = _figure(2, width=12.0)
    rates = [None if m.get("hit_rate") is None else 100 * m["hit_rate"] for m in main]
    _bars(hits, names, [("prefix hit rate", rates, "pd")], fmt="{:.0f}%")
    hits.set_ylim(0, 100)
    hits.set_ylabel("% of prompt tokens served from a prefix cache")
    hits.set_title("prefix hit rate (higher is better)")
    _bars(
        ttft,
        names,
        [
            ("TTFT p50", [m.get("ttft_p50_ms") for m in main], "pd"),
            ("TTFT p99", [m.get("ttft_p99_ms") for m in main], "tagged"),
        ],
        fmt="{:.0f}",
    )
    ttft.set_ylabel("ms (lower is better)")
    ttft.set_title("time to first token")
    ttft.legend(fontsize=8)
    for axes in (hits, ttft):
        axes.tick_params(axis="x", labelrotation=15)
    args = report.get("args", {})
    # The benchmark writes its arguments as strings.
    quick = ", --quick" if args.get("quick") == "True" else ""
    figure.suptitle(
        f"Routing policies, {args.get('model', '?')}, multi-turn phase: "
        f"{args.get('sessions', '?')} conversations x {args.get('turns', '?')} turns on "
        f"{args.get('prefixes', '?')} shared system prompts{quick}",
        fontsize=11,
    )
    return _save(figure, png)


# ------------------------------------------------------------------ routing_index.py

_SCENARIOS = {"hit": "fully cached", "half": "half cached", "miss": "not cached"}


def plot_routing_index(report: dict[str, Any], png: Path) -> Path:
    """The cache-aware decision's cost by prompt length, cached fully, half or not at all."""
    rows = _list(report, "rows")
    figure, (axes,) = _figure(1, width=8.0)
    kinds = list(dict.fromkeys(_field(row, "scenario").partition("-")[0] for row in rows))
    for kind, color in zip(kinds, ("#1f77b4", "#e6550d", "#636363", "#6baed6"), strict=False):
        mine = sorted(
            (r for r in rows if r["scenario"].partition("-")[0] == kind),
            key=lambda r: r["prompt_tokens"],
        )
        lengths = [r["prompt_tokens"] for r in mine]
        name = _SCENARIOS.get(kind, kind)
        p50, p99 = [r["choose_p50_us"] for r in mine], [r["choose_p99_us"] for r in mine]
        axes.plot(lengths, p50, "o-", color=color, label=f"{name}, p50")
        axes.plot(lengths, p99, "o--", color=color, label=f"{name}, p99")
    axes.axhline(200, color=COLORS["goal"], linestyle=":", label="goal: p99 within 200 µs")
    axes.set_xscale("log", base=2)
    lengths = sorted({r["prompt_tokens"] for r in rows})
    axes.set_xticks(lengths, [str(n) for n in lengths])
    axes.set_xlabel("prompt tokens")
    axes.set_ylabel("µs per decision")
    axes.grid(True, color="#e6e6e6")
    axes.legend(fontsize=8)
    axes.set_title(
        f"Cache-aware routing decision, {report.get('blocks_indexed', '?')} blocks indexed",
        fontsize=11,
    )
    return _save(figure, png)


# ------------------------------------------------------------------ engine.py, handshake.py


def plot_engine(report: dict[str, Any], png: Path) -> Path:
    """Prefill and decode tokens/s per preset, with no connector and with the no-op one."""
    rows = _list(report, "rows")
    presets = list(dict.fromkeys(_field(row, "preset") for row in rows))
    connectors = list(dict.fromkeys(_field(row, "connector") for row in rows))
    figure, panels = _figure(2, width=10.0)
    for axes, key, title in zip(
        panels,
        ("prefill_tokens_per_s", "decode_tokens_per_s"),
        ("prefill", "decode"),
        strict=True,
    ):
        series = []
        for connector, color in zip(connectors, ("pd", "tagged"), strict=False):
            by_preset = {r["preset"]: r.get(key) for r in rows if r["connector"] == connector}
            series.append((f"connector: {connector}", [by_preset.get(p) for p in presets], color))
        _bars(axes, presets, series, fmt="{:.0f}")
        axes.set_ylabel("tokens/s (higher is better)")
        axes.set_title(title)
    panels[0].legend(fontsize=8)
    figure.suptitle("Engine throughput, TP=1: the connector hooks' cost", fontsize=11)
    return _save(figure, png)


def plot_handshake(report: dict[str, Any], png: Path) -> Path:
    """The handshake fetch, cold (new channel) and warm (cached client), p50 and p99."""
    results = _field(report, "results")
    modes = list(results)
    figure, (axes,) = _figure(1, width=6.0)
    series = [
        ("p50", [results[m].get("p50_ms") for m in modes], "pd"),
        ("p99", [results[m].get("p99_ms") for m in modes], "tagged"),
    ]
    _bars(axes, modes, series, fmt="{:.2f}")
    axes.set_ylabel("ms (lower is better)")
    axes.legend(fontsize=8)
    workers = f"{report.get('pp_size', '?')} x {report.get('tp_size', '?')}"
    axes.set_title(f"Handshake of a PP x TP = {workers} engine", fontsize=11)
    return _save(figure, png)


PLOTS: dict[str, Callable[[Any, Path], Path]] = {
    "transfer": plot_transfer,
    "pd_latency": plot_pd_latency,
    "routing": plot_routing,
    "routing_index": plot_routing_index,
    "engine": plot_engine,
    "handshake": plot_handshake,
}


def write_png(kind: str, json_path: Path) -> Path:
    """The benchmark's picture next to its JSON, drawn from the file just written (so that it
    shows what the JSON holds, nothing else); a benchmark calls this right after writing it."""
    png = PLOTS[kind](json.loads(json_path.read_text()), png_beside(json_path))
    print(f"wrote {png}")
    return png


# ------------------------------------------------------------------ drawing helpers


def _figure(
    panels: int, width: float, height: float = 4.8, rows: int = 1
) -> tuple[Figure, list[Axes]]:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    figure = Figure(figsize=(width, height), dpi=DPI, layout="constrained")
    FigureCanvasAgg(figure)
    grid = figure.subplots(rows, panels // rows, squeeze=False)
    return figure, [axes for row in grid for axes in row]


def _bars(
    axes: Axes,
    labels: Sequence[str],
    series: Sequence[tuple[str, Sequence[float | None], str]],
    fmt: str | None = None,
) -> None:
    """Grouped bars, one group per label; a missing value (None) leaves a gap marked n/a."""
    width = 0.8 / len(series)
    for i, (name, values, color) in enumerate(series):
        xs = [x + (i - (len(series) - 1) / 2) * width for x in range(len(labels))]
        shown = [(x, v) for x, v in zip(xs, values, strict=True) if v is not None]
        bars = axes.bar(
            [x for x, _ in shown],
            [v for _, v in shown],
            width,
            label=name,
            color=COLORS.get(color, color),
        )
        texts = [_number(v) if fmt is None else fmt.format(v) for _, v in shown]
        axes.bar_label(bars, texts, fontsize=6.5, padding=1)
        for x, value in zip(xs, values, strict=True):
            if value is None:
                axes.annotate("n/a", (x, 0), ha="center", va="bottom", fontsize=6.5)
    axes.set_xticks(range(len(labels)), labels, fontsize=8)
    axes.grid(True, axis="y", color="#e6e6e6")
    axes.set_axisbelow(True)


def _log_scale(axis: Any) -> None:
    """A log axis read as plain numbers (1, 2, 5, 10, 20 ...), not powers of ten."""
    from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter

    axis.axes.set_yscale("log")
    axis.set_major_locator(LogLocator(subs=(1.0, 2.0, 5.0)))
    axis.set_major_formatter(FuncFormatter(lambda value, _: f"{value:g}"))
    axis.set_minor_formatter(NullFormatter())


def _save(figure: Figure, png: Path) -> Path:
    png.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(png, format="png", metadata={"Software": None})
    return png


def _list(document: Any, key: str) -> list[dict[str, Any]]:
    value = _field(document, key)
    if not isinstance(value, list) or not value:
        raise PlotError(f"{key!r} must be a non-empty list")
    return value


def _field(document: Any, key: str) -> Any:
    if not isinstance(document, dict) or key not in document:
        raise PlotError(f"missing {key!r} (not the JSON this benchmark writes?)")
    return document[key]


def _number(value: float) -> str:
    """Two significant digits, never in exponent form."""
    return f"{value:.0f}" if abs(value) >= 10 else f"{value:.2g}"


def _size(num_bytes: int) -> str:
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if num_bytes >= scale:
            return f"{num_bytes / scale:.3g} {unit}"
    return f"{num_bytes} B"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Draw a benchmark's PNG from its JSON again.")
    parser.add_argument("kind", choices=sorted(PLOTS))
    parser.add_argument("json", type=Path)
    parser.add_argument("--png", type=Path, help="default: the JSON's path with .png")
    args = parser.parse_args(argv)
    try:
        data = json.loads(args.json.read_text())
        png = PLOTS[args.kind](data, args.png or png_beside(args.json))
    except (OSError, json.JSONDecodeError, PlotError) as exc:
        print(f"error: {args.json}: {exc}", file=sys.stderr)
        return 1
    print(f"wrote {png}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
