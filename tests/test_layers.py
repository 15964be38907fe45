"""The package's layers, read from the source: no module imports from a layer above its own,
and sibling layers do not import each other. Imports under ``TYPE_CHECKING`` and inside
functions count too (a lazy import is still a dependency).

Lower first; packages on one line are siblings.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

PACKAGE_DIR = Path(__file__).resolve().parents[1] / "kvtransfer"

LAYERS: list[tuple[str, ...]] = [
    # kvtransfer.models: data shipped in the package (the demo model), named from above.
    (
        "kvtransfer.v1",
        "kvtransfer.logs",
        "kvtransfer.timeline",
        "kvtransfer.models",
        "kvtransfer.threads",
        # The ratio model: pure arithmetic on a measured profile (the plan command's).
        "kvtransfer.planning",
    ),
    # The picture draws what answers carry: it reads the timeline's types, nothing else.
    ("kvtransfer.connector", "kvtransfer.timeline_picture"),
    ("kvtransfer.transport", "kvtransfer.control"),
    ("kvtransfer.clients",),
    ("kvtransfer.connectors", "kvtransfer.engine"),
    ("kvtransfer.integrations", "kvtransfer.testing", "kvtransfer.serve"),
    ("kvtransfer.router",),
    ("kvtransfer.cli",),
    ("kvtransfer", "kvtransfer.__main__"),
]

# Inside the engine, the call chain: llm -> engine_core -> scheduler | executor -> runner -> model.
ENGINE_LAYERS: list[tuple[str, ...]] = [
    (
        "kvtransfer.engine.config",
        "kvtransfer.engine.sampling_params",
        "kvtransfer.engine.parallel",
        "kvtransfer.engine.spec_decode",
        "kvtransfer.engine.wakeup",
    ),
    ("kvtransfer.engine.outputs", "kvtransfer.engine.scheduler_output"),
    ("kvtransfer.engine.model",),
    ("kvtransfer.engine.scheduler", "kvtransfer.engine.runner"),
    ("kvtransfer.engine.executor",),
    ("kvtransfer.engine.engine_core",),
    ("kvtransfer.engine.llm", "kvtransfer.engine"),
]

# Inside the router, calls flow down: web (HTTP) -> one of the two P/D flows -> fleet -> routing
# policies -> the OpenAI types and the config -> shared names.
ROUTER_LAYERS: list[tuple[str, ...]] = [
    (
        "kvtransfer.router.names",
        "kvtransfer.router.errors",
        "kvtransfer.router.tracing",
        "kvtransfer.router.echo",
    ),
    ("kvtransfer.router.config", "kvtransfer.router.openai"),
    ("kvtransfer.router.routing",),
    ("kvtransfer.router.fleet", "kvtransfer.router.metrics"),
    ("kvtransfer.router.flow_rules",),
    ("kvtransfer.router.daemon_flow", "kvtransfer.router.vllm_flow"),
    ("kvtransfer.router.web",),
    ("kvtransfer.router.server",),
    ("kvtransfer.router.__main__", "kvtransfer.router"),
]


def module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE_DIR.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def imported_modules(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(), str(path))
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.add(node.module)
            # ``from kvtransfer.engine import scheduler`` imports a submodule.
            found.update(f"{node.module}.{alias.name}" for alias in node.names)
    return {name for name in found if name == "kvtransfer" or name.startswith("kvtransfer.")}


def place(module: str, layers: list[tuple[str, ...]]) -> tuple[int, str] | None:
    """(layer index, the layer entry owning ``module``), by the longest matching prefix."""
    best: tuple[int, str] | None = None
    for index, names in enumerate(layers):
        for name in names:
            # The root package is a layer of its own, not a prefix of every other one.
            inside = module == name or (name != "kvtransfer" and module.startswith(name + "."))
            if inside and (best is None or len(name) > len(best[1])):
                best = (index, name)
    return best


def violations(layers: list[tuple[str, ...]], scope: str) -> list[str]:
    found = []
    for path in sorted(PACKAGE_DIR.rglob("*.py")):
        importer = module_name(path)
        if not (importer == scope or importer.startswith(scope + ".")):
            continue
        if importer.startswith("kvtransfer.v1."):
            continue  # generated
        own = place(importer, layers)
        assert own is not None, f"{importer} is in no layer: add it to the table"
        for target in sorted(imported_modules(path)):
            theirs = place(target, layers)
            if theirs is None or theirs[1] == own[1] or not target.startswith(scope):
                continue
            if theirs[0] >= own[0]:
                kind = "a sibling" if theirs[0] == own[0] else "a layer above"
                found.append(f"{importer} ({own[1]}) imports {target}: {kind} ({theirs[1]})")
    return found


def test_no_package_imports_from_a_layer_above_or_beside_it():
    assert violations(LAYERS, "kvtransfer") == []


def test_engine_calls_flow_one_way():
    assert violations(ENGINE_LAYERS, "kvtransfer.engine") == []


def test_router_calls_flow_one_way():
    assert violations(ROUTER_LAYERS, "kvtransfer.router") == []


def import_circles(scope: str) -> list[list[str]]:
    """Every module of ``scope`` on a circle of imports (module to module, lazy ones too), one
    circle per strongly connected group."""
    modules = {module_name(p): p for p in PACKAGE_DIR.rglob("*.py")}
    inside = {m: p for m, p in modules.items() if m == scope or m.startswith(scope + ".")}
    edges = {
        m: {t for t in imported_modules(p) if t in inside and t != m} for m, p in inside.items()
    }
    # Tarjan's strongly connected components, iteratively: a component of two or more is a circle.
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    circles = []
    for root in sorted(edges):
        if root in index:
            continue
        work = [(root, iter(sorted(edges[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        while work:
            node, targets = work[-1]
            target = next(targets, None)
            if target is None:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    group = []
                    while True:
                        member = stack.pop()
                        group.append(member)
                        if member == node:
                            break
                    if len(group) > 1:
                        circles.append(sorted(group))
            elif target not in index:
                index[target] = low[target] = len(index)
                stack.append(target)
                work.append((target, iter(sorted(edges[target]))))
            elif target in stack:
                low[node] = min(low[node], index[target])
    return circles


def test_no_import_circle_in_the_router():
    assert import_circles("kvtransfer.router") == []


def test_the_checker_sees_an_upward_import(tmp_path):
    assert place("kvtransfer.connector.base", LAYERS) == (1, "kvtransfer.connector")
    assert place("kvtransfer.connectors.ucx.worker", LAYERS) == (4, "kvtransfer.connectors")
    source = tmp_path / "probe.py"
    source.write_text(
        "from typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n"
        "    from kvtransfer.control.book import HandshakeBook\n"
        "def f():\n"
        "    from kvtransfer.engine import scheduler\n"
    )
    assert imported_modules(source) == {
        "kvtransfer.control.book",
        "kvtransfer.control.book.HandshakeBook",
        "kvtransfer.engine",
        "kvtransfer.engine.scheduler",
    }
