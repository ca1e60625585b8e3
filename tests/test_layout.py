"""The package's shape, read from its source: imports flow one way with no cycles, modules and functions stay small
enough to read, and the kernels' oracles stay oracles."""
from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("jaxserve", "pallas_kernels")
MAX_MODULE_LINES = 500
MAX_FUNCTION_LINES = 80


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _modules() -> dict[str, Path]:
    return {_module_name(p): p for pkg in PACKAGES for p in sorted((ROOT / pkg).rglob("*.py"))}


def _imports(path: Path, name: str, known: set[str]) -> set[str]:
    """Every project module `name` imports, at module level or inside a function (a deferred import is still an
    edge), resolved to the longest known module name."""
    found: set[str] = set()
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1] + ([base] if base else []))
            targets = [f"{base}.{a.name}" for a in node.names] + [base]
        else:
            continue
        for t in targets:
            while t and t not in known:
                t = t.rpartition(".")[0]
            if t and t != name:
                found.add(t)
    return found


def _graph() -> dict[str, set[str]]:
    mods = _modules()
    known = set(mods)
    return {n: _imports(p, n, known) for n, p in mods.items()}


def _reaches(graph: dict[str, set[str]], src: str, dst: str) -> bool:
    seen, todo = set(), [src]
    while todo:
        n = todo.pop()
        for m in graph[n]:
            if m == dst:
                return True
            if m not in seen:
                seen.add(m)
                todo.append(m)
    return False


def test_no_import_cycles():
    graph = _graph()
    # A package face (__init__) re-exports its children; an edge child -> face is the child importing a sibling.
    faces = {n for n, p in _modules().items() if p.name == "__init__.py"}
    g = {n: {m for m in deps if m not in faces} for n, deps in graph.items()}
    cycles = sorted((a, b) for a, deps in g.items() for b in deps if _reaches(g, b, a))
    assert cycles == []


def test_kernels_import_nothing_from_jaxserve_and_oracles_serve_only_tests():
    graph = _graph()
    kernels_up = {(a, b) for a, deps in graph.items() if a.startswith("pallas_kernels") for b in deps
                  if b.startswith("jaxserve")}
    assert kernels_up == set()
    oracle_users = {(a, b) for a, deps in graph.items() if a.startswith("jaxserve") for b in deps
                    if b.startswith("pallas_kernels.reference")}
    assert oracle_users == set()


def test_only_the_engine_imports_the_scheduler():
    importers = {a for a, deps in _graph().items() if "jaxserve.engine.scheduler" in deps}
    assert importers <= {"jaxserve.engine.engine"}


def test_modules_and_functions_are_small():
    long_modules, long_functions = [], []
    for name, path in _modules().items():
        if not name.startswith("jaxserve"):
            continue
        text = path.read_text()
        if text.count("\n") > MAX_MODULE_LINES:
            long_modules.append((name, text.count("\n")))
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                lines = node.end_lineno - node.lineno + 1
                if lines > MAX_FUNCTION_LINES:
                    long_functions.append((f"{name}.{node.name}", lines))
    assert long_modules == []
    assert long_functions == []
