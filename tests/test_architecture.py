"""The layout's rules, checked on the source: no import circles between modules, the engine's and the
guard's folders in layers (in each package, no two of its folders or top-level modules import each other,
however indirectly), no guard function past ``MAX_FUNCTION_LINES``, tests that share helpers only through
``tests/support/``, and a guard that never loads torch.

The import graph is read from the AST of every module of ``engine`` and ``guard``, with every import
counted: those under ``if TYPE_CHECKING:`` and inside functions too, because a circle that only type
checking or a late import hides is still two files that cannot be understood one without the other.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest
from support import ROOT
from support.processes import run_command

PACKAGES = ("engine", "guard")
# What the guard may import from the engine: the torch-free modules (DESIGN.md, "Layout").
GUARD_MAY_IMPORT = ("engine.protocol", "engine.prompting", "engine.kv.hashing")


MAX_FUNCTION_LINES = 60  # in guard/: a longer function is asking to be split into stages


def _modules(root: Path = ROOT, packages: tuple[str, ...] = PACKAGES) -> dict[str, Path]:
    found = {}
    for package in packages:
        for path in (root / package).rglob("*.py"):
            parts = path.relative_to(root).with_suffix("").parts
            name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
            found[name] = path
    return found


def _imports(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The project modules ``name`` imports (a package's ``__init__`` counts as the package)."""
    is_package = path.name == "__init__.py"
    targets: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            targets.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = name.split(".")[: len(name.split(".")) - node.level + (1 if is_package else 0)]
                base = ".".join([*anchor, base] if base else anchor)
            targets.add(base)
            targets.update(f"{base}.{alias.name}" for alias in node.names)
    return {t for t in targets if t in modules and t != name}


def _graph(root: Path = ROOT, packages: tuple[str, ...] = PACKAGES) -> dict[str, set[str]]:
    modules = _modules(root, packages)
    return {name: _imports(name, path, modules) for name, path in modules.items()}


def _layers(graph: dict[str, set[str]], package: str) -> dict[str, set[str]]:
    """The graph of ``package``'s units: its folders and its top-level modules (``guard.pool.gate`` is
    ``pool``, ``guard.config`` is ``config``), with an edge where any module of one imports one of the other."""
    def unit(module: str) -> str | None:
        parts = module.split(".")
        return parts[1] if parts[0] == package and len(parts) > 1 else None

    folded: dict[str, set[str]] = {}
    for module, targets in graph.items():
        if (source := unit(module)) is not None:
            folded.setdefault(source, set()).update(
                target for t in targets if (target := unit(t)) is not None and target != source)
    return folded


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for succ in graph[node]:
            if succ not in index:
                visit(succ)
                low[node] = min(low[node], low[succ])
            elif succ in on_stack:
                low[node] = min(low[node], index[succ])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                components.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return components


def test_the_import_graph_reads_real_edges():
    graph = _graph()
    assert "engine.core" in graph and "guard.server.app" in graph
    assert "engine.sched.scheduler" in graph["engine.core"]


def test_the_cycle_finder_finds_a_cycle():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_no_import_circles_in_engine_or_guard():
    assert _cycles(_graph()) == []


@pytest.mark.parametrize("package", PACKAGES)
def test_the_folders_form_layers(package: str):
    assert _cycles(_layers(_graph(), package)) == []


# Two units whose modules import each other, and nothing circular at module level: the module rule passes
# them, the layer rule must not. Each package's files (path: text); every folder gets an empty __init__.py.
PLANTED_TWO_WAY_IMPORTS = {
    # Two folders, one way only for type checking.
    "guard": {"a/x.py": "from guard.b.y import Y\n",
              "a/z.py": "Z = 1\n",
              "b/y.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from guard.a.z import Z\n"},
    # A top-level module and a folder, one way only by a late import (how engine/async_engine.py and
    # engine/server/ once stood).
    "engine": {"loop.py": "def metrics():\n    from engine.server.metrics import Metrics\n    return Metrics\n",
               "server/metrics.py": "class Metrics: ...\n",
               "server/app.py": "from engine.loop import metrics\n"},
}


@pytest.mark.parametrize("package", PACKAGES)
def test_a_planted_two_way_import_between_units_is_found(tmp_path: Path, package: str):
    files = PLANTED_TWO_WAY_IMPORTS[package]
    for relative, text in files.items():
        path = tmp_path / package / relative
        path.parent.mkdir(parents=True, exist_ok=True)
        for folder in Path(package, relative).parents[:-1]:  # the package, and the folder the file is in
            (tmp_path / folder / "__init__.py").touch()
        path.write_text(text)
    units = sorted({relative.split("/")[0].removesuffix(".py") for relative in files})
    graph = _graph(tmp_path, (package,))
    assert _cycles(graph) == []
    assert _cycles(_layers(graph, package)) == [units]


def test_no_guard_function_is_longer_than_the_limit():
    long = []
    for path in sorted((ROOT / "guard").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                lines = node.end_lineno - node.lineno + 1
                if lines > MAX_FUNCTION_LINES:
                    long.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.name} ({lines} lines)")
    assert long == []


def test_tests_share_helpers_only_through_support():
    """A test module importing another test module couples two files that should each read alone."""
    found = []
    for path in sorted((ROOT / "tests").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            names = ([alias.name for alias in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            found += [f"{path.relative_to(ROOT)}: {name}" for name in names
                      if name.split(".")[-1].startswith("test_") or name.split(".")[0] == "conftest"]
    assert found == []


def test_the_guard_imports_only_the_engines_torch_free_modules():
    graph = _graph()
    wrong = {
        (module, target)
        for module, targets in graph.items() if module.startswith("guard")
        for target in targets
        if target.startswith("engine") and target != "engine"
        and not any(target == allowed or target.startswith(allowed + ".") for allowed in GUARD_MAY_IMPORT)
    }
    assert wrong == set()


def test_the_engine_never_imports_the_guard():
    graph = _graph()
    assert not [(m, t) for m, targets in graph.items() if m.startswith("engine") for t in targets
                if t.startswith("guard")]


def test_importing_the_guard_app_loads_no_torch():
    code = "import sys, guard.server.app, guard.__main__; print(sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'triton')))"
    result = run_command(sys.executable, "-c", code)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"


# The wire (DESIGN.md, "Wave 4"): bytes in and out, deadlines; what a request means is injected into it.
WIRE_MAY_NOT_IMPORT = ("guard.admission", "guard.detect", "guard.pool.scheduling", "guard.records", "guard.http",
                       "guard.instance")


def test_the_wire_imports_no_policy():
    graph = _graph()
    assert any(module.startswith("guard.wire.") for module in graph)
    wrong = {(module, target) for module, targets in graph.items() if module.startswith("guard.wire")
             for target in targets
             if any(target == banned or target.startswith(banned + ".") for banned in WIRE_MAY_NOT_IMPORT)}
    assert wrong == set()


def test_the_instance_state_lives_outside_the_http_folder():
    graph = _graph()
    assert "guard.instance" in graph and not [m for m in graph if m.startswith("guard.http.context")]
    assert not [target for target in graph["guard.instance"] if target.startswith("guard.http")]


def test_no_shared_twin_modules():
    """One admission core over two state backends (DESIGN.md, "Wave 4"): dispatch, limits and verdicts are
    written once; Redis is a backend in guard/state/, not a ``shared_*`` copy beside each of them."""
    assert sorted(str(p.relative_to(ROOT)) for p in (ROOT / "guard").rglob("shared_*.py")) == []


# The test modules of admission, rate limits and verdicts, each run on both state backends.
BACKEND_TESTS = ("tests/guard/test_admission_backends.py", "tests/guard/test_borrowing.py",
                 "tests/guard/test_rate_limits.py", "tests/guard/test_verdicts.py")


def _parametrizes_backends(node: ast.AST) -> bool:
    """``pytest.mark.parametrize(..., BACKENDS)`` or ``pytest.fixture(params=BACKENDS)``."""
    if not isinstance(node, ast.Call):
        return False
    name = ast.unparse(node.func)
    given = node.args if name.endswith("parametrize") else [k.value for k in node.keywords if k.arg == "params"] \
        if name.endswith("fixture") else []
    return any(isinstance(arg, ast.Name) and arg.id == "BACKENDS" for arg in given)


def test_admission_limits_and_verdict_tests_run_on_both_backends():
    """Each names ``BACKENDS`` (tests/support/admission_backends.py: local and Redis) in a parametrization."""
    missing = [name for name in BACKEND_TESTS
               if not any(_parametrizes_backends(node)
                          for node in ast.walk(ast.parse((ROOT / name).read_text(encoding="utf-8"))))]
    assert missing == []
