"""The package's shape: no import cycle (function-level imports included), modules a reader can hold in one sitting,
and the environment read in one place."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = "gdn_jax"
MAX_LINES = 600
# Where `os.environ` may appear: the declarations of every variable, and nothing else.
ENVIRONMENT_READERS = {"gdn_jax.envs"}


def modules(root: Path = ROOT, package: str = PACKAGE) -> dict[str, Path]:
    """Module name -> file, a package's `__init__.py` named as the package."""
    out = {}
    for path in sorted((root / package).rglob("*.py")):
        name = ".".join(path.relative_to(root).with_suffix("").parts)
        out[name.removesuffix(".__init__")] = path
    return out


def import_graph(mods: dict[str, Path]) -> dict[str, set[str]]:
    """Module -> the package's modules it imports anywhere in its body (top level, functions, conditionals)."""
    graph = {}
    for name, path in mods.items():
        is_package = path.name == "__init__.py"
        targets = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    parts = name.split(".")[: len(name.split(".")) - node.level + (1 if is_package else 0)]
                    base = ".".join(parts + ([base] if base else []))
                # `from a import b`: the module a.b where there is one, else a (b is a name a defines)
                names = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in mods else base for alias in node.names]
            else:
                continue
            for imported in names:
                while imported and imported not in mods:  # `from a.b import name`: the module a.b
                    imported = imported.rpartition(".")[0]
                if imported and imported != name:
                    targets.add(imported)
        graph[name] = targets
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The graph's strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in graph:
        if v not in index:
            visit(v)
    return found


def test_the_package_has_no_import_cycle():
    assert cycles(import_graph(modules())) == []


def test_the_cycle_finder_sees_a_function_level_import(tmp_path):
    """The check itself: a lower module importing an upper one inside a function closes a cycle it reports."""
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "low.py").write_text("def f():\n    from pkg.sub import high\n")
    (pkg / "sub" / "high.py").write_text("from pkg import low\n")
    (pkg / "apart.py").write_text("from .low import f\n")
    mods = modules(tmp_path, "pkg")
    assert cycles(import_graph(mods)) == [["pkg.low", "pkg.sub.high"]]
    (pkg / "low.py").write_text("def f():\n    pass\n")
    assert cycles(import_graph(modules(tmp_path, "pkg"))) == []


def test_no_module_is_longer_than_a_sitting():
    long = {name: n for name, path in modules().items() if (n := len(path.read_text().splitlines())) > MAX_LINES}
    assert long == {}


def test_only_envs_reads_the_environment():
    readers = {name for name, path in modules().items() if "os.environ" in path.read_text() or "getenv" in
               path.read_text()}
    assert readers <= ENVIRONMENT_READERS, readers - ENVIRONMENT_READERS
