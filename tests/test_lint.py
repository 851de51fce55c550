"""The code stays lint-clean and type-checks (the same tools and versions as `[dev]`)."""

from __future__ import annotations

import ast
import functools
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _run(*cmd: str) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)


@pytest.mark.skipif(shutil.which("ruff") is None, reason="ruff is not installed ([dev] extra)")
def test_ruff_check():
    res = _run(
        "ruff", "check", "pagectl", "tests", "benchmarks", "scripts", "--output-format", "concise"
    )
    assert res.returncode == 0, res.stdout + res.stderr


@pytest.mark.slow
def test_mypy():
    pytest.importorskip("mypy")
    res = _run(sys.executable, "-m", "mypy")
    assert res.returncode == 0, res.stdout + res.stderr


def test_engine_imports_no_server_or_console_libraries():
    """pagectl.engine must not import aiohttp, zmq or textual (checked in a fresh process)."""
    code = (
        "import sys, pagectl.engine.core, pagectl.engine.llm, pagectl.engine.builder;"
        "bad = [m for m in ('aiohttp', 'zmq', 'textual') if m in sys.modules];"
        "print(','.join(bad))"
    )
    res = _run(sys.executable, "-c", code)
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip() == ""


# -- the import contract, read from the source (ast): no import is executed ------------------

PKG = ROOT / "pagectl"


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


@functools.cache
def _modules() -> dict[str, Path]:
    return {_module_name(p): p for p in sorted(PKG.rglob("*.py"))}


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


@functools.cache
def _imported_names(module: str, path: Path) -> frozenset[str]:
    """Every module name ``module`` imports, at any depth (functions included: a lazy import
    still runs), except under ``if TYPE_CHECKING:``. ``from a import b`` yields ``a`` and
    ``a.b`` (b may be a submodule)."""
    names: set[str] = set()
    is_pkg = path.name == "__init__.py"

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            for child in node.orelse:
                visit(child)
            return
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = module.split(".")
                base = base[: len(base) - node.level + (1 if is_pkg else 0)]
                if node.module:
                    base.append(node.module)
                target = ".".join(base)
            else:
                target = node.module or ""
            names.add(target)
            names.update(f"{target}.{alias.name}" for alias in node.names)
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(ast.parse(path.read_text(), str(path)))
    return frozenset(names)


@functools.cache
def _import_graph() -> dict[str, set[str]]:
    """pagectl module -> the pagectl modules it imports."""
    mods = _modules()
    return {
        name: {n for n in _imported_names(name, path) if n in mods and n != name}
        for name, path in mods.items()
    }


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def strongconnect(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                strongconnect(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                found.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            strongconnect(v)
    return found


def test_the_cycle_finder_finds_a_cycle():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []


def test_no_import_cycle_between_pagectl_modules():
    cycles = _cycles(_import_graph())
    assert not cycles, "import cycles (break them, or import under TYPE_CHECKING): " + "; ".join(
        " <-> ".join(c) for c in cycles
    )


def _reachable(graph: dict[str, set[str]], roots: list[str]) -> set[str]:
    seen: set[str] = set()
    todo = list(roots)
    while todo:
        m = todo.pop()
        if m not in seen:
            seen.add(m)
            todo.extend(graph[m])
    return seen


def _third_party(mods: set[str]) -> set[str]:
    paths = _modules()
    return {n.split(".")[0] for m in mods for n in _imported_names(m, paths[m])}


def test_the_engine_imports_no_server_control_or_console_code():
    graph = _import_graph()
    engine = [m for m in graph if m == "pagectl.engine" or m.startswith("pagectl.engine.")]
    reached = _reachable(graph, engine)
    outside = {m for m in reached if not m.startswith("pagectl.engine") and m != "pagectl"}
    assert outside == set(), f"pagectl.engine reaches {sorted(outside)}"
    assert not {"aiohttp", "zmq", "textual"} & _third_party(reached)


def test_the_console_and_ctl_import_no_http_server_module():
    graph = _import_graph()
    roots = [m for m in graph if m.startswith(("pagectl.tui", "pagectl.control"))]
    roots += ["pagectl.cli.ctl", "pagectl.cli.top"]
    reached = _reachable(graph, roots)
    bad = {
        m
        for m in reached
        if m.startswith(("pagectl.server", "pagectl.daemon", "pagectl.engine_process"))
    }
    assert bad == set(), f"the console / ctl reach {sorted(bad)}"
    assert "aiohttp" not in _third_party(reached)


def test_no_pagectl_module_imports_the_test_doubles():
    graph = _import_graph()
    users = {
        m
        for m, deps in graph.items()
        if not m.startswith("pagectl.testing")
        and any(d.startswith("pagectl.testing") for d in deps)
    }
    assert users == set()


def test_nothing_outside_the_engine_reaches_into_its_scheduler():
    """The engine's scheduler is the EngineCore's business: callers use EngineCore methods."""
    offenders = []
    for name, path in _modules().items():
        if name.startswith("pagectl.engine.") or name == "pagectl.engine":
            continue
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Attribute) and node.attr == "scheduler":
                offenders.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert offenders == []
