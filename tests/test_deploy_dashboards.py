"""deploy/grafana and deploy/prometheus against the series a real fleet exports.

promtool (Debian's ``prometheus`` package; .ci/run installs it, so its absence fails) checks the
rules and runs their unit tests. A real prefill daemon, decode daemon and router then serve P/D
completions, a lease that nobody pulls expires and its late decode falls back to recompute; their
``/metrics`` are scraped, and every series the rules, the rules' unit tests and the dashboard's
queries name must be one of those: a metric name (a histogram's ``_bucket``/``_sum``/``_count``,
a counter's ``_total``) that some process exports, a label name it carries, or a recording rule
the rules file defines.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml
from deploy_helpers.promql import Selector, names, selectors
from prometheus_client.parser import text_string_to_metric_families
from serve_helpers.daemons import PROMPTS, running, start_router
from serve_helpers.pair import DaemonPair
from serve_helpers.probes import post
from waiting import wait_until

pytestmark = pytest.mark.deploy

ROOT = Path(__file__).resolve().parents[1]
RULES = ROOT / "deploy" / "prometheus" / "kvtransfer-rules.yaml"
RULE_TESTS = ROOT / "deploy" / "prometheus" / "kvtransfer-rules.test.yaml"
DASHBOARD = ROOT / "deploy" / "grafana" / "kvtransfer-pd.json"

# The labels Prometheus itself puts on every scraped series.
TARGET_LABELS = {"job", "instance"}
# A label and its value in a promtool input series (values there hold no quote).
LABEL_PAIR = re.compile(r'(\w+)="([^"]*)"')
# Short enough to wait out, long enough that the router's own P/D requests pull in time.
LEASE_S = 3.0
MAX_TOKENS = 6
# Completions through the router: a prompt seen again hits the prefill's prefix cache.
ROUTED = (PROMPTS[2], PROMPTS[2], PROMPTS[0], PROMPTS[2])
# Exported series a family of each type stands for (``# TYPE`` names the family).
SUFFIXES = {
    "counter": ("_total", "_created"),
    "histogram": ("_bucket", "_sum", "_count", "_created"),
    "gauge": ("",),
}


def promtool() -> str:
    found = shutil.which("promtool")
    if found is None:
        pytest.fail("no promtool on PATH: install Debian's prometheus (apt-get install prometheus)")
    return found


def rules() -> list[dict[str, Any]]:
    return [
        rule for group in yaml.safe_load(RULES.read_text())["groups"] for rule in group["rules"]
    ]


def recording_names() -> set[str]:
    return {rule["record"] for rule in rules() if "record" in rule}


def dashboard_panels() -> list[dict[str, Any]]:
    return json.loads(DASHBOARD.read_text())["panels"]


def dashboard_exprs() -> list[tuple[str, str]]:
    """(panel title, expr) of every query of the dashboard."""
    return [
        (panel["title"], target["expr"])
        for panel in dashboard_panels()
        if panel["type"] != "row"
        for target in panel["targets"]
    ]


def rule_test_series() -> list[str]:
    tests = yaml.safe_load(RULE_TESTS.read_text())["tests"]
    return [series["series"] for test in tests for series in test["input_series"]]


# ---------------------------------------------------------------------------------- promtool


def test_promtool_checks_the_rules():
    done = subprocess.run(
        [promtool(), "check", "rules", str(RULES)], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert f"SUCCESS: {len(rules())} rules found" in done.stdout, done.stdout


def test_promtool_runs_the_rules_unit_tests():
    # From the tests' directory: rule_files are relative to it.
    done = subprocess.run(
        [promtool(), "test", "rules", RULE_TESTS.name],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=RULE_TESTS.parent,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.strip().endswith("SUCCESS"), done.stdout


def test_every_alert_has_a_test_that_fires_it():
    tests = yaml.safe_load(RULE_TESTS.read_text())["tests"]
    fired = {
        case["alertname"]
        for test in tests
        for case in test.get("alert_rule_test", ())
        if case["exp_alerts"]
    }
    assert fired == {rule["alert"] for rule in rules() if "alert" in rule}


# ---------------------------------------------------------------------------------- dashboard


def test_the_dashboard_is_grafana_json_on_a_datasource_variable():
    dashboard = json.loads(DASHBOARD.read_text())
    (variable,) = dashboard["templating"]["list"]
    assert (variable["type"], variable["name"], variable["query"]) == (
        "datasource",
        "datasource",
        "prometheus",
    )
    datasource = {"type": "prometheus", "uid": "${datasource}"}
    panels = dashboard["panels"]
    ids = [panel["id"] for panel in panels]
    assert len(ids) == len(set(ids)), ids
    for panel in panels:
        assert {"h", "w", "x", "y"} <= set(panel["gridPos"]), panel["title"]
        if panel["type"] == "row":
            continue
        assert panel["datasource"] == datasource, panel["title"]
        targets = panel["targets"]
        assert targets, panel["title"]
        refs = [target["refId"] for target in targets]
        assert len(refs) == len(set(refs)), panel["title"]
        for target in targets:
            assert target["datasource"] == datasource, panel["title"]
            assert target["expr"].strip(), panel["title"]


def test_the_dashboard_shows_what_operators_watch():
    shown = set().union(*(names(expr) for _, expr in dashboard_exprs()))
    assert {
        "kvtransfer_router_time_to_first_token_seconds_bucket",
        "kvtransfer_time_to_first_token_seconds_bucket",
        "kvtransfer_inter_token_latency_seconds_bucket",
        "kvtransfer_kv_transfer_bytes_sum",
        "kvtransfer_kv_transfer_seconds_bucket",
        "kvtransfer_router_breaker_transitions_total",
        "kvtransfer_failures_total",
        "kvtransfer_kv_recomputed_tokens_total",
        "kvtransfer_prefix_cache_hit_tokens_total",
        "kvtransfer_prompt_tokens_total",
        "kvtransfer_kv_leases_expired_total",
        "kvtransfer_router_requests_total",
    } <= shown


def test_promql_names_leave_out_functions_labels_strings_and_durations():
    expr = (
        'histogram_quantile(0.99, sum by (role, le) (rate(a_bucket{reason=~"x|y", b!="c"}'
        "[$__rate_interval]))) / on (role) group_left (engine_id) kv:b:rate5m offset 5m "
        "and bool c_total > 1e3 unless sum without (le) (d)"
    )
    assert selectors(expr) == {
        Selector("a_bucket", frozenset({"reason", "b"})),
        Selector("kv:b:rate5m", frozenset()),
        Selector("c_total", frozenset()),
        Selector("d", frozenset()),
    }


# ---------------------------------------------------------------------------------- a real fleet


@dataclass(frozen=True)
class Scrape:
    """What one process's ``/metrics`` said: exported series name -> label names (``None``:
    the family is declared but has no sample yet, so its labels are unknown) and the ``le``
    bounds of each histogram."""

    series: dict[str, frozenset[str] | None]
    bounds: dict[str, set[str]]
    values: dict[tuple[str, frozenset[tuple[str, str]]], float]

    def value(self, name: str, **labels: str) -> float:
        return self.values[(name, frozenset(labels.items()))]


def scrape(url: str) -> Scrape:
    with urllib.request.urlopen(url, timeout=30) as response:
        text = response.read().decode()
    series: dict[str, frozenset[str] | None] = {}
    bounds: dict[str, set[str]] = {}
    values: dict[tuple[str, frozenset[tuple[str, str]]], float] = {}
    for family in text_string_to_metric_families(text):
        for suffix in SUFFIXES.get(family.type, ("",)):
            series.setdefault(family.name + suffix, None)
        for sample in family.samples:
            labels = frozenset(sample.labels)
            known = series.get(sample.name)
            series[sample.name] = labels if known is None else known | labels
            values[(sample.name, frozenset(sample.labels.items()))] = sample.value
            if "le" in sample.labels:
                bounds.setdefault(sample.name, set()).add(sample.labels["le"])
    return Scrape(series, bounds, values)


@dataclass(frozen=True)
class Fleet:
    prefill: Scrape
    decode: Scrape
    router: Scrape
    # The prefix-cache hits the router's answers reported (usage.prompt_tokens_details).
    cached_tokens: int

    def series(self) -> dict[str, frozenset[str] | None]:
        """Every exported series name, with the label names any process gives it."""
        merged: dict[str, frozenset[str] | None] = {}
        for part in (self.prefill, self.decode, self.router):
            for name, labels in part.series.items():
                known = merged.get(name)
                merged[name] = labels if known is None else known | (labels or frozenset())
        return merged

    def bounds(self, name: str) -> set[str]:
        return set().union(
            *(p.bounds.get(name, set()) for p in (self.prefill, self.decode, self.router))
        )


def metrics_url(daemon: Any) -> str:
    return f"http://127.0.0.1:{daemon.ready['metrics_port']}/metrics"


@pytest.fixture(scope="module")
def fleet(tmp_path_factory) -> Iterator[Fleet]:
    """A 1P1D fleet behind a router after P/D completions (`ROUTED`), one expired lease and the
    recompute fallback of its late decode."""
    logs = tmp_path_factory.mktemp("dashboards")
    with DaemonPair.start(
        logs,
        name="dash",
        kv_load_failure_policy="recompute",
        extra_config={"kv_lease_s": LEASE_S},
    ) as pair:
        router = start_router(logs, [pair.prefill], [pair.decode])
        with running(router):
            cached = 0
            for prompt in ROUTED:
                status, text = post(router.address, {"prompt": prompt, "max_tokens": MAX_TOKENS})
                assert status == 200, text
                cached += json.loads(text)["usage"]["prompt_tokens_details"]["cached_tokens"]

            # Prefilled for a decode that comes only after the lease ended.
            (prefilled,) = pair.run_prefill([PROMPTS[1]])
            wait_until(
                lambda: (
                    scrape(metrics_url(pair.prefill)).value(
                        "kvtransfer_kv_leases_expired_total",
                        role="prefill",
                        engine_id="dash-prefill",
                    )
                    == 1
                ),
                "the prefill's lease expired",
                LEASE_S + 30,
            )
            (late,) = pair.run_decode(
                [PROMPTS[1]], [prefilled.kv_transfer_params], [prefilled.request_id], MAX_TOKENS
            )
            assert late.finish_reason == "length", late.error

            router_url = f"{router.address}/metrics"
            # The router reads its daemons' load and health in the background: wait for both.
            wait_until(
                lambda: (
                    {"kvtransfer_router_daemon_healthy", "kvtransfer_router_instance_requests"}
                    <= {n for n, labels in scrape(router_url).series.items() if labels is not None}
                ),
                "the router's health and load series",
            )
            yield Fleet(
                scrape(metrics_url(pair.prefill)),
                scrape(metrics_url(pair.decode)),
                scrape(router_url),
                cached,
            )


def test_the_fleet_counts_fallbacks_leases_and_prefix_hits(fleet):
    decode = {"role": "decode", "engine_id": "dash-decode"}
    prefill = {"role": "prefill", "engine_id": "dash-prefill"}
    assert (
        fleet.decode.value("kvtransfer_failures_total", **decode, reason="kv_load_recomputed") == 1
    )
    assert fleet.decode.value("kvtransfer_failures_total", **decode, reason="kv_load_failed") == 0
    assert fleet.decode.value("kvtransfer_kv_recomputed_tokens_total", **decode) == len(
        PROMPTS[1].encode()
    )
    assert fleet.prefill.value("kvtransfer_kv_leases_expired_total", **prefill) == 1
    assert fleet.decode.value("kvtransfer_kv_leases_expired_total", **decode) == 0
    # Every prompt the prefill saw, and the prefix-cache hits the router reported for it.
    prompts = [*ROUTED, PROMPTS[1]]
    assert fleet.prefill.value("kvtransfer_prompt_tokens_total", **prefill) == sum(
        len(p.encode()) for p in prompts
    )
    # PROMPTS[1] shares no block with the others: all hits came through the router.
    assert fleet.cached_tokens > 0
    hits = fleet.prefill.value("kvtransfer_prefix_cache_hit_tokens_total", **prefill)
    assert hits == fleet.cached_tokens


def exported_or_recorded(fleet: Fleet, where: str, expr: str) -> list[str]:
    """What ``expr`` reads that is neither exported by the fleet nor recorded by the rules, and
    matcher labels an exported series does not carry."""
    series = fleet.series()
    recorded = recording_names()
    wrong = []
    for selector in selectors(expr):
        if selector.name in recorded:
            continue
        if selector.name not in series:
            wrong.append(f"{where}: {selector.name} is not exported")
            continue
        labels = series[selector.name]
        if labels is not None and not selector.labels <= labels | TARGET_LABELS:
            missing = sorted(selector.labels - labels - TARGET_LABELS)
            wrong.append(f"{where}: {selector.name} has no label {missing}")
    return wrong


def test_the_rules_read_only_exported_series(fleet):
    wrong = []
    for rule in rules():
        wrong += exported_or_recorded(fleet, rule.get("record") or rule["alert"], rule["expr"])
    assert wrong == []


def test_the_dashboard_reads_only_exported_series(fleet):
    wrong = []
    for title, expr in dashboard_exprs():
        wrong += exported_or_recorded(fleet, title, expr)
    assert wrong == []


def test_the_rules_unit_tests_feed_exported_series_with_their_labels(fleet):
    series = fleet.series()
    for text in rule_test_series():
        (selector,) = selectors(text)
        labels = series.get(selector.name)
        assert labels is not None, f"{text}: not exported with samples by the fleet"
        assert selector.labels == labels | TARGET_LABELS, text
        bound = dict(LABEL_PAIR.findall(text)).get("le")
        if bound is not None:
            assert bound in fleet.bounds(selector.name), f"{text}: no bucket le={bound}"
