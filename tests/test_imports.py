"""Every module of ``lightning_sink`` imports on its own, and the package's own imports form no cycle.

The import graph is read from the source (``ast``), so an import inside a function counts like one at the top of
the module: a lazy import that only hides a cycle is still a cycle. An edge goes to the module an import names
(``from lightning_sink.a import b`` names ``lightning_sink.a.b`` when that is a module, else ``lightning_sink.a``);
the parent packages Python initialises on the way are not edges, so a package ``__init__`` that re-exports its own
submodules is not a cycle.
"""

from __future__ import annotations

import ast
import json
import pkgutil
import subprocess
import sys
from pathlib import Path

import pytest

import lightning_sink

PACKAGE = "lightning_sink"
PACKAGE_DIR = Path(lightning_sink.__file__).parent


def module_files() -> dict[str, Path]:
    """Every module of the package (pkgutil's walk over the source folders, nothing imported) and its file."""
    found = {PACKAGE: PACKAGE_DIR / "__init__.py"}
    folders = [(PACKAGE_DIR, PACKAGE)]
    while folders:
        folder, prefix = folders.pop()
        for info in pkgutil.iter_modules([str(folder)]):
            name = f"{prefix}.{info.name}"
            if info.ispkg:
                found[name] = folder / info.name / "__init__.py"
                folders.append((folder / info.name, name))
            else:
                found[name] = folder / f"{info.name}.py"
    return found


def _absolute(node: ast.ImportFrom, importer: str, is_package: bool) -> str:
    if not node.level:
        return node.module or ""
    parts = importer.split(".")
    base = parts if is_package else parts[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def imports_of(name: str, path: Path, modules: set[str]) -> set[str]:
    """The package's modules that ``name`` imports anywhere in its source (module level or in a function)."""
    edges = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            source = _absolute(node, name, path.name == "__init__.py")
            targets = [
                f"{source}.{alias.name}" if f"{source}.{alias.name}" in modules else source for alias in node.names
            ]
        else:
            continue
        for target in targets:
            while target and target not in modules:  # `import lightning_sink.a.b as c` and similar
                target = target.rpartition(".")[0]
            if target.startswith(PACKAGE) and target != name:
                edges.add(target)
    return edges


def import_graph() -> dict[str, set[str]]:
    files = module_files()
    return {name: imports_of(name, path, set(files)) for name, path in files.items()}


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of the graph as [a, b, ..., a], or None (depth-first search, white/grey/black)."""
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for successor in sorted(graph.get(node, ())):
            if state.get(successor) == 1:
                return stack[stack.index(successor) :] + [successor]
            if successor not in state and (cycle := visit(successor)):
                return cycle
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def test_the_cycle_finder_finds_a_lazy_import_cycle(tmp_path: Path):
    """The walker itself: a cycle closed only by an import inside a function is reported, a chain is not."""
    (tmp_path / "a.py").write_text("from lightning_sink.b import x\n")
    (tmp_path / "b.py").write_text("def f():\n    from lightning_sink import a\n")
    (tmp_path / "c.py").write_text("import lightning_sink.b\n")
    modules = {f"{PACKAGE}.{n}" for n in "abc"}
    graph = {f"{PACKAGE}.{n}": imports_of(f"{PACKAGE}.{n}", tmp_path / f"{n}.py", modules) for n in "abc"}
    assert graph[f"{PACKAGE}.c"] == {f"{PACKAGE}.b"}
    assert find_cycle(graph) == [f"{PACKAGE}.a", f"{PACKAGE}.b", f"{PACKAGE}.a"]
    del graph[f"{PACKAGE}.b"]
    assert find_cycle(graph) is None


def test_the_package_imports_form_no_cycle():
    graph = import_graph()
    assert len(graph) > 50 and f"{PACKAGE}.reshard.transform" in graph  # the walk saw the whole package
    cycle = find_cycle(graph)
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


_IMPORT_EACH = """
import importlib, json, sys, traceback
failures = {}
for name in json.loads(sys.argv[1]):
    for loaded in [m for m in sys.modules if m == "lightning_sink" or m.startswith("lightning_sink.")]:
        del sys.modules[loaded]
    try:
        importlib.import_module(name)
    except BaseException:
        failures[name] = traceback.format_exc(limit=-3)
print(json.dumps(failures))
"""


@pytest.mark.slow
def test_every_module_imports_on_its_own():
    """One fresh interpreter imports each module with no module of the package loaded before it."""
    names = sorted(module_files())
    done = subprocess.run(
        [sys.executable, "-c", _IMPORT_EACH, json.dumps(names)], capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stderr[-3000:]
    failures = json.loads(done.stdout.strip().splitlines()[-1])
    assert failures == {}, "\n".join(f"{name}:\n{trace}" for name, trace in failures.items())
