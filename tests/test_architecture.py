"""The layout's rules, checked on the source: no import circles, and a guard that never loads torch.

The import graph is read from the AST of every module of ``engine`` and ``guard``, with every import
counted: those under ``if TYPE_CHECKING:`` and inside functions too, because a circle that only type
checking or a late import hides is still two files that cannot be understood one without the other.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

from support import ROOT
from support.processes import run_command

PACKAGES = ("engine", "guard")
# What the guard may import from the engine: the torch-free modules (DESIGN.md, "Layout").
GUARD_MAY_IMPORT = ("engine.protocol", "engine.prompting", "engine.kv.hashing")


def _modules() -> dict[str, Path]:
    found = {}
    for package in PACKAGES:
        for path in (ROOT / package).rglob("*.py"):
            parts = path.relative_to(ROOT).with_suffix("").parts
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


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    return {name: _imports(name, path, modules) for name, path in modules.items()}


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
    assert "engine.core" in graph and "guard.http.app" in graph
    assert "engine.sched.scheduler" in graph["engine.core"]


def test_the_cycle_finder_finds_a_cycle():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_no_import_circles_in_engine_or_guard():
    assert _cycles(_graph()) == []


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
    code = "import sys, guard.http.app, guard.__main__; print(sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'triton')))"
    result = run_command(sys.executable, "-c", code)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"
