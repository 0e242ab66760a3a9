"""A compiled program kept on disk and loaded by a later process (torch's ``aot_compile``): which of TorchDynamo's
guards such a program cannot keep, how the values its guards read are pickled, the globals those guards look up,
TorchDynamo's checksums of the sources it traced, and the size marks a loaded program must not see."""

from __future__ import annotations

import builtins
import contextlib
import io
import itertools
import platform
import re
import sys
import types
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

__all__ = [
    "DroppedGuard",
    "caches_disabled",
    "compile_to_save",
    "constant_marked",
    "cpu_vector_isa",
    "forget_size_marks",
    "guards_pass",
    "hook_paths",
    "inlined_sources",
    "load_saved",
    "save_program",
    "source_checksum",
]

# the attributes TorchDynamo's size marks (``maybe_mark_dynamic`` and the like) leave on a tensor
_SIZE_MARKS = (
    "_dynamo_dynamic_indices",
    "_dynamo_weak_dynamic_indices",
    "_dynamo_unbacked_indices",
    "_dynamo_strict_unbacked_indices",
    "_dynamo_static_indices",
    "_has_dynamo_dim_marking",
)
_BUILTINS_GLOBAL = re.compile(rb"__builtins_dict___\d+")
# guards whose expected value a loaded program takes from the loading process's objects, as it does for globals: a
# class's attributes (reached through ``type(...)`` and its ``__dict__``) and a function's defaults
_REBUILT_ON_LOAD = re.compile(r"type\(|__dict__|__defaults__|__kwdefaults__")
# the hooks a module runs around its forward and backward: its own, and those ``torch.nn.modules.module`` runs for
# every module (``register_module_forward_hook`` and the like)
_MODULE_HOOKS = ("_forward_pre_hooks", "_forward_hooks", "_backward_pre_hooks", "_backward_hooks")
_GLOBAL_HOOKS = tuple(f"_global{name}" for name in _MODULE_HOOKS)


@dataclass(frozen=True)
class DroppedGuard:
    """A guard a saved program cannot check by itself: its kind, the path it reads (a Python expression over the
    program's arguments by name and ``G``, its globals) and the value it found there when the program was built.
    Either TorchDynamo cannot save it (object identities), or it reads a global, a class attribute or a function's
    defaults: a loaded program's guards on those are built again from the values the loading process has, so they
    hold there whatever changed; they are saved too (``saved``), and catch what changes after the load."""

    kind: str
    path: str
    value: Any
    saved: bool = False


def hook_paths(module_path: str, module: torch.nn.Module) -> list[str]:
    """The paths, as guards write them, of the hook dicts of ``module`` (found at ``module_path``), of each of its
    submodules and of torch's hooks on every module. TorchDynamo does not guard on hooks (its
    ``skip_nnmodule_hook_guards``: it assumes they do not change after a build), so a program saved in one process
    and loaded in another checks them itself: a hook registered in the second would otherwise not run."""
    paths = []
    for name, _ in module.named_modules():
        found_at = module_path + "".join(f"._modules[{part!r}]" for part in name.split(".") if part)
        paths += [f"{found_at}.{hooks}" for hooks in _MODULE_HOOKS]
    every_module = "G['__import_torch_dot_nn_dot_modules_dot_module']"
    return paths + [f"{every_module}.{hooks}" for hooks in _GLOBAL_HOOKS]


def cpu_vector_isa() -> str:
    """The vector instructions Inductor's generated CPU code uses here (``avx512``, ``avx2``, ``neon``, ...): a
    program built where they differ may not run."""
    from torch._inductor.cpu_vec_isa import pick_vec_isa

    return f"{platform.machine()} {pick_vec_isa()}"


def caches_disabled() -> bool:
    """Whether Inductor's on-disk caches are switched off (``TORCHINDUCTOR_FORCE_DISABLE_CACHES``): saved programs
    are then neither read nor written either."""
    from torch._inductor import config

    return bool(config.force_disable_caches)


def compile_to_save(
    function: Callable[..., Any], options: dict[str, Any] | None, args: tuple, dropped: list[DroppedGuard]
) -> Any:
    """``function`` compiled for ``args`` as ``torch.compile(fullgraph=True, backend="inductor", dynamic=False)``
    would, into a program ``save_program`` can write, which runs without checking TorchDynamo's guards: the caller
    checks them first (``guards_pass``). The guards of kinds TorchDynamo cannot save (object identities: of modules,
    classes, functions and their closures) are left out and listed in ``dropped``, for the caller to check in its
    own way; so are, saved as well, the guards on a global's value (``DroppedGuard``: why)."""
    from torch._dynamo.guards import CheckFunctionManager

    unsaved = set(CheckFunctionManager.UNSUPPORTED_SERIALIZATION_GUARD_TYPES)

    def keep(entries: Any) -> list[bool]:
        kept = []
        for entry in entries:
            saved = not ({entry.guard_type, *(entry.derived_guard_types or ())} & unsaved)
            value = entry.value if entry.has_value else None
            if entry.guard_type == "NOT_PRESENT_IN_GENERIC_DICT":
                dropped.append(DroppedGuard("CLASS_MEMBER", f"type({entry.name}).{_looked_up(entry)}", None))
            if not saved:
                dropped.append(DroppedGuard(entry.guard_type, entry.name, value))
            elif entry.has_value and (entry.is_global or _REBUILT_ON_LOAD.search(entry.name)):
                dropped.append(DroppedGuard(entry.guard_type, entry.name, value, saved=True))
            kept.append(saved)
        return kept

    traced = _with_own_globals(function)
    compiled: Any = torch.compile(
        traced,
        fullgraph=True,
        backend="inductor",
        dynamic=False,
        options={**(options or {}), "guard_filter_fn": keep},
    )
    with _guard_values_pickled(), _graph_named_alike(traced.__globals__):
        program = compiled.aot_compile((args, {}))
    program.disable_guard_check()  # (the caller checks them before each call: ``guards_pass``)
    return program


def _with_own_globals(function: Callable[..., Any]) -> Callable[..., Any]:
    """``function`` with a copy of its module's globals (the same code, defaults and closure), for TorchDynamo to
    put a program's graph into: each build's graph then has the same name (``_graph_named_alike``) and the module's
    own globals stay as they were, so a second build of the same graph in one process reads it from AOTAutograd's
    cache, and no program's graph takes the place of another's. A loaded program runs on such a copy too
    (``load_saved``)."""
    own = types.FunctionType(
        function.__code__, dict(function.__globals__), function.__name__, function.__defaults__, function.__closure__
    )
    own.__kwdefaults__, own.__qualname__ = function.__kwdefaults__, function.__qualname__
    return own


# a compiled graph's name as TorchDynamo writes it: a prefix, a number and a UUID, here a fixed one
_GRAPH_NAME = "__compiled_fn_{}_6c696768_746e_4000_8000_73696e6b6c6f"


@contextlib.contextmanager
def _graph_named_alike(scope: dict[str, Any]) -> Iterator[None]:
    """Each graph of a program compiled to be saved named alike in every process. TorchDynamo names a graph with a
    random UUID, and on the way to a saved program that name is part of the key of the compiled graph's entry in
    AOTAutograd's cache, so no build found the entry an earlier one wrote: a loop built again after an edit that left
    its graph as it was (a comment, another method of the module's file) compiled it whole again. TorchDynamo puts
    the graph into ``scope`` (the traced function's own copy of its globals, ``_with_own_globals``) under that name,
    which must be new there: the first free number is taken, the same in every build."""
    from torch._dynamo import output_graph

    original = getattr(output_graph, "make_compiled_fn_name", None)
    if original is None:  # (another torch: its own names, and each build compiles in full)
        yield
        return
    free = (name for name in map(_GRAPH_NAME.format, itertools.count()) if name not in scope)
    output_graph.make_compiled_fn_name = lambda: next(free)
    try:
        yield
    finally:
        output_graph.make_compiled_fn_name = original


def _looked_up(entry: Any) -> str:
    """The attribute that a guard found missing from an object's own ``__dict__``, so that the trace read it from
    the object's class: a class attribute, a method, a base's constant. TorchDynamo keeps no guard on what the class
    holds there (and those it keeps on a class's dict are built again from the loading process's class), so each
    such attribute is a ``DroppedGuard`` at ``type(path).attribute``, named by what it holds."""
    attribute = getattr(entry.orig_guard.create_fn, "keywords", {}).get("attr")
    if not (isinstance(attribute, str) and attribute.isidentifier()):
        raise TypeError(f"the attribute a guard on {entry.name} looks up is not known")  # (the loop is not saved)
    return attribute


@contextlib.contextmanager
def _guard_values_pickled() -> Iterator[None]:
    """While a program's guards are saved, two mends to torch's pickler of the values they read. It marks a module's
    attributes that no guard reads as missing by their ``id``: a dtype or a device is one object that every tensor
    shares, so a LightningModule's ``_dtype`` made every tensor's dtype missing and the program could not be loaded
    (dtypes, devices, layouts and memory formats are pickled as themselves). And it pickles an optimizer whole,
    whose ``__setstate__`` then reads the state tensors the pickler left out: an optimizer's attributes are
    restored as they were, without it."""
    from torch._dynamo.guards import GuardsStatePickler

    pickler: Any = GuardsStatePickler
    original = pickler.reducer_override

    def reducer_override(self: Any, obj: Any) -> Any:
        if isinstance(obj, (torch.dtype, torch.device, torch.layout, torch.memory_format)):
            return NotImplemented
        if isinstance(obj, torch.optim.Optimizer):
            return (_new_object, (type(obj),), dict(obj.__dict__), None, None, _restore_attributes)
        return original(self, obj)

    pickler.reducer_override = reducer_override  # (restored below)
    try:
        yield
    finally:
        pickler.reducer_override = original


def _new_object(cls: type) -> Any:
    return object.__new__(cls)


def _restore_attributes(obj: Any, attributes: dict[str, Any]) -> None:
    obj.__dict__.update(attributes)


def constant_marked(program: Any) -> str | None:
    """A function marked ``torch._dynamo.assume_constant_result`` among the globals of the modules ``program``
    traced (its name), or None. TorchDynamo calls such a function once while tracing and keeps its result in the
    graph with no guard, so a saved program would keep a value another process may not have."""
    for module_name in sorted({source[0] for source in inlined_sources(program)}):
        module = sys.modules.get(module_name)
        for name, value in vars(module).items() if module is not None else ():
            if callable(value) and getattr(value, "_dynamo_marked_constant", False) is True:
                return f"{module_name}.{name}"
    return None


def save_program(program: Any, path: Path) -> None:
    """Write a program from ``compile_to_save`` to ``path`` (torch's format: a pickle, as Inductor's caches are)."""
    program.save_compiled_function(str(path))


def load_saved(data: bytes, program_globals: dict[str, Any]) -> Any:
    """The program saved in ``data`` (its guards checked by the caller, ``guards_pass``), its code run with
    ``program_globals`` (the traced function's module's globals). The builtins are put back where its guards look
    for them: TorchDynamo puts them into the globals of the process that traced, under names the saved guards keep
    (``__builtins_dict___0``)."""
    for name in sorted(set(_BUILTINS_GLOBAL.findall(data))):
        program_globals.setdefault(name.decode(), builtins.__dict__)
    program: Any = torch.compiler.load_compiled_function(io.BytesIO(data), f_globals=program_globals)
    program.disable_guard_check()  # (the caller checks them before each call: ``guards_pass``)
    return program


def guards_pass(program: Any, args: tuple) -> bool:
    """Whether the saved guards of ``program`` hold for ``args`` (TorchDynamo's own check, as at every call)."""
    return bool(program.guard_check(*args))


def inlined_sources(program: Any) -> list[tuple[str, int, int, str]]:
    """The sources TorchDynamo traced into ``program``: (module, first line, last line, checksum) each."""
    sources = program.source_info().inlined_sources
    return sorted((source.module, source.firstlineno, source.lastlineno, source.checksum) for source in sources)


def source_checksum(module_name: str, first: int, last: int) -> str | None:
    """TorchDynamo's checksum of lines ``first`` to ``last`` of an imported module as its file reads now (None:
    the module is not imported, or its source cannot be read; nothing is imported here)."""
    from torch._dynamo.package import _hash_sourcelines

    module = sys.modules.get(module_name)
    if module is None:
        return None
    try:
        return str(_hash_sourcelines(module, first, last))
    except (OSError, TypeError):
        return None


def forget_size_marks(tensor: torch.Tensor) -> None:
    """Take TorchDynamo's size marks off ``tensor``: a loaded program's guards refuse a tensor marked where the
    saved example was not (its marks are not saved), while its graph already leaves the marked sizes open."""
    for name in _SIZE_MARKS:
        if hasattr(tensor, name):
            delattr(tensor, name)
