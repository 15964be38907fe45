from __future__ import annotations

import multiprocessing.process
import subprocess

import grpc
import pytest

from kvtransfer.connector.factory import KVConnectorFactory
from kvtransfer.serve.launcher import log_tail


@pytest.fixture(autouse=True)
def _isolated_connector_policy(monkeypatch):
    """Each test starts with no allow/deny list, whatever the environment or a test set."""
    monkeypatch.delenv("KVTRANSFER_CONNECTORS_ALLOW", raising=False)
    monkeypatch.delenv("KVTRANSFER_CONNECTORS_DENY", raising=False)
    KVConnectorFactory.reset_policy()
    KVConnectorFactory.clear_cache()
    yield
    KVConnectorFactory.reset_policy()
    KVConnectorFactory.clear_cache()


# Every test belongs to exactly one tier (`-m unit`, `-m integration`, `-m deploy`); see README.
TIERS = ("unit", "integration", "deploy")


def pytest_collection_modifyitems(config, items):
    wrong = {}
    for item in items:
        tiers = sorted({m.name for m in item.iter_markers() if m.name in TIERS})
        if len(tiers) != 1:
            wrong.setdefault(item.module.__name__, tiers)
    if wrong:
        listed = "; ".join(f"{mod}: {tiers or 'none'}" for mod, tiers in sorted(wrong.items()))
        raise pytest.UsageError(
            f"every test needs exactly one tier marker of {TIERS} (module-level "
            f"`pytestmark = pytest.mark.<tier>`); found {listed}"
        )


def pytest_sessionstart(session: pytest.Session) -> None:
    # matplotlib builds its font cache on first import by running fc-list, a child process a
    # unit test may not start: on a fresh machine (no cache yet) the plotting unit tests failed
    # on that alone. Built here, before any test, it is read from disk afterwards.
    import matplotlib.font_manager  # noqa: F401 - imported for its side effect


def _refuse(what: str):
    def refuse(*args, **kwargs):
        raise AssertionError(
            f"a unit test may not start {what}: mark the module integration instead (README, Tests)"
        )

    return refuse


@pytest.fixture(autouse=True)
def _unit_tests_stay_in_process(request, monkeypatch):
    """A `unit` test runs in this process only: no child process, no gRPC server."""
    if request.node.get_closest_marker("unit") is None:
        return
    monkeypatch.setattr(subprocess.Popen, "__init__", _refuse("a child process"))
    monkeypatch.setattr(multiprocessing.process.BaseProcess, "start", _refuse("a child process"))
    monkeypatch.setattr(grpc, "server", _refuse("a gRPC server"))
    monkeypatch.setattr(grpc.aio, "server", _refuse("a gRPC server"))


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """A failed test shows the last lines of every daemon log it left in its ``tmp_path``: a
    child that died (CI gives no other view of it) explains the failure there."""
    outcome = yield
    report = outcome.get_result()
    tmp_path = getattr(item, "funcargs", {}).get("tmp_path")
    if not report.failed or tmp_path is None:
        return
    for log in sorted(tmp_path.rglob("*.log")):
        report.sections.append((f"log {log.relative_to(tmp_path)}", log_tail(log, 40)))
