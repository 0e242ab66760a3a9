"""The package's code stays small enough to read: no module over 400 lines, no function over 60 lines, none with
more than 6 parameters.

Functions and methods at a module's or a class's top level are counted from ``def`` to their last line (docstring
included); parameters are every name a caller may pass (``self`` and ``cls`` left out, ``*args`` and ``**kwargs``
one each). A public class's constructor is exempt from the parameter limit, since its parameters are the options a
user sets; so is ``transform_checkpoints``, whose parameters are MindSpore's function of that name (the five it
shares, in its order) and four keyword-only options, all public API.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import lightning_sink

PACKAGE_DIR = Path(lightning_sink.__file__).parent
MODULE_LINES, FUNCTION_LINES, PARAMETERS = 400, 60, 6
PUBLIC_SIGNATURES = {"lightning_sink/reshard/transform.py:transform_checkpoints"}


def parameter_count(function: ast.FunctionDef | ast.AsyncFunctionDef) -> int:
    args = function.args
    named = [a.arg for a in args.posonlyargs + args.args + args.kwonlyargs if a.arg not in ("self", "cls")]
    return len(named) + (args.vararg is not None) + (args.kwarg is not None)


def functions(tree: ast.Module) -> list[tuple[ast.ClassDef | None, ast.FunctionDef | ast.AsyncFunctionDef]]:
    """Every function at the module's top level and every method at a class's (classes nested in classes too)."""
    found: list[tuple[ast.ClassDef | None, ast.FunctionDef | ast.AsyncFunctionDef]] = []
    bodies: list[tuple[ast.ClassDef | None, list[ast.stmt]]] = [(None, tree.body)]
    while bodies:
        owner, body = bodies.pop()
        for node in body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                found.append((owner, node))
            elif isinstance(node, ast.ClassDef):
                bodies.append((node, node.body))
    return found


def shape_problems(path: Path, relative: str) -> list[str]:
    source = path.read_text()
    problems = []
    lines = source.count("\n")
    if lines > MODULE_LINES:
        problems.append(f"{relative}: {lines} lines (at most {MODULE_LINES})")
    for owner, function in functions(ast.parse(source, str(path))):
        name = f"{owner.name}.{function.name}" if owner is not None else function.name
        length = (function.end_lineno or function.lineno) - function.lineno + 1
        if length > FUNCTION_LINES:
            problems.append(f"{relative}:{function.lineno} {name}: {length} lines (at most {FUNCTION_LINES})")
        public_constructor = owner is not None and function.name == "__init__" and not owner.name.startswith("_")
        exempt = public_constructor or f"{relative}:{name}" in PUBLIC_SIGNATURES
        parameters = parameter_count(function)
        if parameters > PARAMETERS and not exempt:
            problems.append(f"{relative}:{function.lineno} {name}: {parameters} parameters (at most {PARAMETERS})")
    return problems


def test_no_module_function_or_parameter_list_over_its_limit():
    problems = []
    for path in sorted(PACKAGE_DIR.rglob("*.py")):
        problems += shape_problems(path, f"lightning_sink/{path.relative_to(PACKAGE_DIR).as_posix()}")
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize(
    ("source", "expected"),
    [
        ("def f(a, b, c, d, e, f, g):\n    pass\n", "f: 7 parameters"),
        ("class _Hidden:\n    def __init__(self, a, b, c, d, e, f, g):\n        pass\n", "_Hidden.__init__: 7"),
        ("class A:\n    class B:\n        def m(self, *a, b, c, d, e, f, **g):\n            pass\n", "B.m: 7"),
        ("def f():\n" + "    x = 1\n" * 60, "f: 61 lines"),
        ("x = 1\n" * 401, "401 lines"),
    ],
)
def test_the_check_finds_each_kind_of_excess(tmp_path: Path, source: str, expected: str):
    path = tmp_path / "module.py"
    path.write_text(source)
    problems = shape_problems(path, "module.py")
    assert len(problems) == 1 and expected in problems[0], problems


def test_a_public_constructor_may_take_every_option(tmp_path: Path):
    path = tmp_path / "module.py"
    path.write_text("class Strategy:\n    def __init__(self, a, b, c, d, e, f, g, h):\n        pass\n")
    assert shape_problems(path, "module.py") == []
