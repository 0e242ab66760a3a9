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
_EXACT = (type(None), bool, int, str, bytes)  # (equal values of these classes have one ``repr``)
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
        # per path, what the name of the object found there read when it last matched (``_reads``): equal reads
        # need no new name (checked before every call of a program, where naming every function again would cost
        # more than a small step)
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
            reads = _reads(value)
            if reads == matched[index]:
                continue
            found = identity(value)
            if found != name:
                return f"{path}: {found} where the saved program has {name}"
            matched[index] = reads
        return None


def _reads(value: Any) -> tuple[Any, ...]:
    """What ``identity(value)`` reads, as a tuple: equal tuples (``==``, item by item, each plain value beside its
    type) give the same name, so a check that finds them equal need not name the object again."""
    out: list[Any] = []
    _read_into(out, value, 0)
    return tuple(out)


def _read_into(out: list[Any], value: Any, depth: int) -> None:
    """Appends what ``identity`` reads of ``value``, in its order; each kind of object appends a fixed number of
    items or its length first, so two different structures never give the same tuple."""
    kind = type(value)
    reader = _READERS.get(kind)
    if reader is None:
        reader = _READERS[kind] = _reader_of(kind)  # (decided once per class: its bases do not change)
    reader(out, value, depth)


def _reader_of(kind: type) -> Callable[[list[Any], Any, int], None]:
    """How ``_read_into`` reads an object of ``kind``: the order of ``identity``'s cases."""
    if issubclass(kind, (torch.dtype, torch.device, torch.layout, torch.memory_format, enum.Enum)):
        return _read_itself
    if issubclass(kind, _CONTAINERS):
        return _read_container
    if issubclass(kind, (types.ModuleType, type)):
        return _read_itself
    if issubclass(kind, types.FunctionType):
        return _read_function
    if issubclass(kind, types.MethodType):
        return _read_method
    if issubclass(kind, (types.BuiltinFunctionType, types.BuiltinMethodType)):
        return _read_builtin
    if kind in _EXACT:
        return _read_exact
    if issubclass(kind, _PLAIN):
        return _read_by_repr  # (a float by its name: 0.0 equals -0.0, and a NaN is not itself)
    return _read_class  # (an object is named by its class)


def _read_itself(out: list[Any], value: Any, _depth: int) -> None:
    out.append(value)


def _read_exact(out: list[Any], value: Any, _depth: int) -> None:
    out += (type(value), value)


def _read_by_repr(out: list[Any], value: Any, _depth: int) -> None:
    out += (type(value), repr(value))


def _read_class(out: list[Any], value: Any, _depth: int) -> None:
    out.append(type(value))


def _read_container(out: list[Any], value: Any, depth: int) -> None:
    out += (type(value), len(value))
    if depth < _DEPTH and len(value) <= _ITEMS:
        for item in _flat_items(value):
            _read_into(out, item, depth + 1)


def _read_function(out: list[Any], value: Any, depth: int) -> None:
    out += (value, value.__code__, value.__module__, value.__qualname__)
    if depth < _DEPTH:
        cells = value.__closure__ or ()
        out.append(len(cells))
        for cell in cells:
            _read_into(out, _cell_contents(cell), depth + 1)
        _read_into(out, value.__defaults__, depth + 1)
        _read_into(out, value.__kwdefaults__, depth + 1)


def _read_method(out: list[Any], value: Any, depth: int) -> None:
    out.append(type(value.__self__))
    _read_into(out, value.__func__, depth)


def _read_builtin(out: list[Any], value: Any, _depth: int) -> None:
    out += (value.__module__, value.__qualname__, type(getattr(value, "__self__", None)))


_READERS: dict[type, Callable[[list[Any], Any, int], None]] = {}


def _flat_items(container: Any) -> Any:
    """A container's items as ``identity`` names them one level down: a dict's keys and values in turn."""
    if isinstance(container, dict):
        return (part for pair in container.items() for part in pair)
    return container


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
            return _global(key)
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


def _global(name: Any) -> _Getter:
    """``G[name]``: a global of the program, or one TorchDynamo names for a module or the builtins (read the same
    way at every check, so decided here once)."""
    if isinstance(name, str) and name.startswith("__import_"):
        module = name[len("__import_") :].replace("_dot_", ".")
        return lambda _arguments, _globals: _imported(module)
    if isinstance(name, str) and name.startswith("__builtins_dict__"):
        return lambda _arguments, _globals: builtins.__dict__
    return lambda _arguments, globals_: globals_[name]


def _imported(module: str) -> Any:
    if module not in sys.modules:
        raise PathNotFollowed(f"module {module} is not imported")
    return sys.modules[module]
