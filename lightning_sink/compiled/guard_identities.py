"""The guards a saved program cannot keep, checked another way: by what the object at each guard's path is.

TorchDynamo guards a compiled program on the identity of the modules, classes and functions it traced through
(``id(...)``), which means nothing in another process, so a saved program leaves those guards out
(``_torch_compat.saved_programs.DroppedGuard``). ``GuardIdentities`` keeps each such guard as its path and a name of
the object found there that holds across processes: a module's name, a class's qualified name, a function's
qualified name with a digest of its code and of what its closure holds. A later fit follows each path again and
compares; a path it cannot follow, or a different object, means the saved program is not the one for this fit.

Paths are followed, never evaluated: only the program's arguments by name, attributes, items whose key is a
constant or a path, ``G[...]`` (the program's globals; ``__import_a_dot_b`` and ``__import__('a')`` a module already
imported, nothing imported here), and ``dict(...)``, ``type(...)`` and ``list(dict.keys(...))`` of what they reach.
"""

from __future__ import annotations

import ast
import builtins
import enum
import functools
import hashlib
import sys
import types
from collections.abc import Callable, Sequence
from typing import Any

import torch

__all__ = ["GuardIdentities", "PathNotFollowed", "identity"]

_Getter = Callable[[dict[str, Any], dict[str, Any]], Any]
_CALLS: dict[str, Callable[[Any], Any]] = {"dict": dict, "type": type}
_PLAIN = (type(None), bool, int, float, complex, str, bytes)
_CONTAINERS = (dict, list, tuple, set, frozenset)
_DEPTH, _ITEMS = 3, 64  # how deep and how long a container is named item by item
_EMPTY_CELL = object()


class PathNotFollowed(Exception):
    """A guard's path that ``GuardIdentities`` does not follow (or that no longer leads anywhere)."""


def identity(value: Any, depth: int = 0) -> str:
    """A name for ``value`` that is the same in another process exactly when the object is the same code or the
    same value: an enum member by its name, a container by what it holds (a global dict's entries, a module's
    hooks), to ``_DEPTH`` levels."""
    if isinstance(value, (torch.dtype, torch.device, torch.layout, torch.memory_format)):
        return f"torch {value}"  # (one object per value, named by it: torch.bfloat16, cpu)
    if isinstance(value, enum.Enum):
        return f"enum {_class_name(type(value))}.{value.name}"
    if isinstance(value, _CONTAINERS):
        return _container_identity(value, depth)
    if isinstance(value, types.ModuleType):
        return f"module {value.__name__}"
    if isinstance(value, type):
        return _class_name(value)
    if isinstance(value, types.FunctionType) and depth >= _DEPTH:  # (a closure may hold the function itself)
        return f"function {value.__module__}.{value.__qualname__} {_code_digest(value.__code__)}"
    if isinstance(value, types.FunctionType):
        cells = tuple(_cell_identity(cell, depth + 1) for cell in value.__closure__ or ())
        defaults = identity(value.__defaults__, depth + 1), identity(value.__kwdefaults__, depth + 1)
        return f"function {value.__module__}.{value.__qualname__} {_code_digest(value.__code__)} {cells} {defaults}"
    if isinstance(value, types.MethodType):
        return f"method {identity(value.__func__, depth)} of {_class_name(type(value.__self__))}"
    if isinstance(value, (types.BuiltinFunctionType, types.BuiltinMethodType)):
        owner = getattr(value, "__self__", None)
        where = value.__module__ or (_class_name(type(owner)) if owner is not None else "")
        return f"builtin {where}.{value.__qualname__}"
    if isinstance(value, _PLAIN):
        return f"value {value!r}"
    return f"object of {_class_name(type(value))}"


def _class_name(cls: type) -> str:
    return f"class {cls.__module__}.{cls.__qualname__}"


def _container_identity(value: Any, depth: int) -> str:
    kind = _class_name(type(value))
    if depth >= _DEPTH or len(value) > _ITEMS:
        return f"{kind} of {len(value)} items"  # (what a guard of its own below it reads is checked at its path)
    if isinstance(value, dict):
        items = [f"{identity(key, depth + 1)}: {identity(item, depth + 1)}" for key, item in value.items()]
    else:
        items = [identity(item, depth + 1) for item in value]
        items = sorted(items) if isinstance(value, (set, frozenset)) else items
    return f"{kind} [{', '.join(items)}]"


def _cell_identity(cell: Any, depth: int) -> str:
    contents = _cell_contents(cell)
    return "empty" if contents is _EMPTY_CELL else identity(contents, depth)


@functools.lru_cache(maxsize=4096)
def _code_digest(code: types.CodeType) -> str:
    """The code's instructions, constants and names (not its line numbers; ``marshal`` is not used because its
    output depends on reference counts)."""
    consts = [_constant(const) for const in code.co_consts]
    parts = (code.co_code, consts, code.co_names, code.co_varnames, code.co_freevars, code.co_cellvars, code.co_flags)
    return hashlib.sha256(repr(parts).encode()).hexdigest()[:24]


def _constant(const: Any) -> str:
    """A code constant by value; a frozenset's items sorted (its order follows the process's string hashing)."""
    if isinstance(const, types.CodeType):
        return _code_digest(const)
    if isinstance(const, frozenset):
        return f"frozenset {sorted(_constant(item) for item in const)}"
    if isinstance(const, tuple):
        return f"tuple {[_constant(item) for item in const]}"
    return repr(const)


class GuardIdentities:
    """Each left-out guard as (path, identity of the object there), followed again by ``first_difference``."""

    def __init__(self, entries: Sequence[tuple[str, str]]) -> None:
        self.entries = [(str(path), str(name)) for path, name in entries]
        self._getters = [(path, name, _getter(path)) for path, name in self.entries]
        # per path, what was found there when it last matched: the same objects again need no new name (checked
        # before every call of a program, where naming every function again would cost more than a small step)
        self._matched: list[tuple[Any, ...] | None] = [None] * len(self.entries)

    @classmethod
    def recorded(
        cls, paths: Sequence[str], arguments: dict[str, Any], program_globals: dict[str, Any]
    ) -> GuardIdentities:
        """The identities found now at ``paths`` (raises ``PathNotFollowed`` for a path it does not follow)."""
        entries = sorted({(path, identity(_getter(path)(arguments, program_globals))) for path in paths})
        return cls(entries)

    def first_difference(self, arguments: dict[str, Any], program_globals: dict[str, Any]) -> str | None:
        """The first path where another object is found now (or none), as one line; None where all are the same."""
        matched = self._matched
        for index, (path, name, get) in enumerate(self._getters):
            try:
                value = get(arguments, program_globals)
            except (PathNotFollowed, AttributeError, LookupError, TypeError) as error:
                return f"{path}: not found ({type(error).__name__})"
            parts = _parts(value)
            last = matched[index]
            if last is not None and len(last) == len(parts) and all(a is b for a, b in zip(last, parts)):
                continue
            found = identity(value)
            if found != name:
                return f"{path}: {found} where the saved program has {name}"
            matched[index] = parts
        return None


def _parts(value: Any) -> tuple[Any, ...]:
    """The objects ``identity`` reads from ``value``: the same objects give the same name."""
    if isinstance(value, types.FunctionType):
        cells = (_cell_contents(cell) for cell in value.__closure__ or ())
        return (value, value.__code__, value.__defaults__, value.__kwdefaults__, *cells)
    if isinstance(value, types.MethodType):
        return (value.__self__, *_parts(value.__func__))
    if isinstance(value, _CONTAINERS):
        return (object(),)  # (its items may change while it stays the same object: named again at every check)
    return (value,)


def _cell_contents(cell: Any) -> Any:
    try:
        return cell.cell_contents
    except ValueError:  # (an empty cell)
        return _EMPTY_CELL


@functools.lru_cache(maxsize=8192)
def _getter(path: str) -> _Getter:
    """``path`` as a function of (arguments, globals); raises ``PathNotFollowed`` for what it does not follow."""
    try:
        tree = ast.parse(path, mode="eval").body
    except SyntaxError as error:
        raise PathNotFollowed(path) from error
    return _node(tree, path)


def _node(node: ast.expr, path: str) -> _Getter:
    if isinstance(node, ast.Name):
        name = node.id
        return lambda arguments, _globals: arguments[name]
    if isinstance(node, ast.Attribute):
        inner, attribute = _node(node.value, path), node.attr
        return lambda arguments, globals_: getattr(inner(arguments, globals_), attribute)
    if isinstance(node, ast.Subscript) and isinstance(node.slice, ast.Constant):
        key = node.slice.value
        if isinstance(node.value, ast.Name) and node.value.id == "G":
            return lambda _arguments, globals_: _global(globals_, key)
        inner = _node(node.value, path)
        return lambda arguments, globals_: inner(arguments, globals_)[key]
    if isinstance(node, ast.Subscript):  # an item whose key is itself a path (a dict's first key)
        container, item = _node(node.value, path), _node(node.slice, path)
        return lambda arguments, globals_: container(arguments, globals_)[item(arguments, globals_)]
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and len(node.args) == 1 and not node.keywords:
        if node.func.id == "__import__" and isinstance(node.args[0], ast.Constant):
            module = str(node.args[0].value)  # (``__import__`` returns the top package of a dotted name)
            return lambda _arguments, _globals: (_imported(module), _imported(module.partition(".")[0]))[1]
        argument = node.args[0]
        if node.func.id == "list" and isinstance(argument, ast.Call) and _is_keys_call(argument):
            keys = _node(argument.args[0], path)  # list(dict.keys(...)): a dict's keys in order
            return lambda arguments, globals_: list(dict.keys(keys(arguments, globals_)))
        call = _CALLS.get(node.func.id)
        if call is not None:
            inner = _node(node.args[0], path)
            return lambda arguments, globals_: call(inner(arguments, globals_))
    raise PathNotFollowed(path)


def _is_keys_call(node: ast.Call) -> bool:
    function = node.func
    return (
        isinstance(function, ast.Attribute)
        and isinstance(function.value, ast.Name)
        and (function.value.id, function.attr) == ("dict", "keys")
        and len(node.args) == 1
        and not node.keywords
    )


def _global(program_globals: dict[str, Any], name: Any) -> Any:
    if isinstance(name, str) and name.startswith("__import_"):
        return _imported(name[len("__import_") :].replace("_dot_", "."))
    if isinstance(name, str) and name.startswith("__builtins_dict__"):
        return builtins.__dict__
    return program_globals[name]


def _imported(module: str) -> Any:
    if module not in sys.modules:
        raise PathNotFollowed(f"module {module} is not imported")
    return sys.modules[module]
