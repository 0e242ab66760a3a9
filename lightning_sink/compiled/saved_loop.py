"""The loop over windows kept on disk (``SavedLoop``): a later fit of the same module, optimizer, settings and code
loads the compiled loop instead of tracing it again, which is most of an identical build's time (TorchDynamo's
trace and reading the graph back from Inductor's caches).

**On by default; ``LIGHTNING_SINK_SAVED_LOOP=0`` turns it off** (``saved_loops_on``). It was off while fits that
differed from the saving one loaded the saved loop and trained the wrong model, where the checks below did not see
what changed (a module-level constant, an enum attribute, a hook, a class attribute, a method replaced on a class, a
function's defaults: ``benchmarks/README.md``, "The saved loop off by default" and the sections after it). Each
cause is checked now, and the same searches of single changes found none that loads and trains differently.

The loops are kept in ``lightning_sink_loops/`` of Inductor's cache folder (``TORCHINDUCTOR_CACHE_DIR``), each a
program in torch's format (``aot_compile``; a pickle, as Inductor's own cache entries are) and an entry
(``loop_store.py``: read bounded, the program's SHA-256 checked). That folder is made this user's alone (mode 0o700);
one that another user owns or may write to is neither read nor written (the build's line says so). A saved loop
is used only where all of these hold:

- the key: torch's, Python's and this package's versions, the CPU's vector instructions, Inductor's settings, the
  module's classes (by name: what the trace read from them is checked below) and the shapes, dtypes and devices of
  everything the program reads;
- the sources TorchDynamo traced (the module's ``training_step``, this package's programs, torch's optimizer code)
  read the same as when the program was built (TorchDynamo's checksums);
- TorchDynamo's guards saved with the program hold (the values, flags and tensor properties the trace relied on: a
  dropout's ``p``, ``training``, an optimizer flag), checked before every call as a compiled program's are;
- checked here, before every call too (``GuardIdentities``): the guards it cannot save (which module, class, function
  or enum member sits at each path); the values of its guards on globals, on a class's dict and on a function's
  defaults (TorchDynamo builds a loaded program's guards on those again from the loading process's own values, so
  alone they would hold whatever changed); what each attribute the trace read through an object's class holds
  there (a class attribute, a method by its code and defaults: TorchDynamo keeps no guard on those); and the hooks
  of the module and its submodules and torch's hooks on every module, on which TorchDynamo sets no guard.

A call whose checks fail runs the loop compiled as usual instead (``fallback``), as a recompile would. Where nothing
is saved, the loop is compiled by ``aot_compile`` (its graph read from AOTAutograd's cache where an earlier build
wrote it) and saved for the next fit; where torch cannot save it, the loop is compiled as usual and
the reason kept, so that later fits do not try again. A module whose class is defined inside a function cannot be
saved (torch refuses it): its loop is compiled as usual; so is one whose traced code calls a function marked
``assume_constant_result`` (TorchDynamo keeps its value with no guard). ``TORCHINDUCTOR_FORCE_DISABLE_CACHES=1``
turns saving and loading off with Inductor's caches. Anything that goes wrong while saving or loading leaves the loop
compiled as usual, with the reason in the build's line."""

from __future__ import annotations

import hashlib
import importlib.metadata
import os
import sys
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import torch

from lightning_sink._torch_compat import (
    DroppedGuard,
    caches_disabled,
    compile_to_save,
    constant_marked,
    cpu_vector_isa,
    forget_size_marks,
    guards_pass,
    hook_paths,
    inductor_cache_folder,
    inlined_sources,
    load_saved,
    save_program,
    source_checksum,
    tree_map,
)
from lightning_sink.compiled.guard_identities import GuardIdentities, PathNotFollowed, identity
from lightning_sink.compiled.loop_store import FORMAT, LoopStore
from lightning_sink.error_text import reason_of

__all__ = ["LOOPS_FOLDER", "SAVED_LOOP_VARIABLE", "SavedLoop", "saved_loops_on"]

LOOPS_FOLDER = "lightning_sink_loops"
SAVED_LOOP_VARIABLE = "LIGHTNING_SINK_SAVED_LOOP"


def saved_loops_on() -> bool:
    """Whether loops are saved and loaded: unless ``LIGHTNING_SINK_SAVED_LOOP=0``."""
    return os.environ.get(SAVED_LOOP_VARIABLE, "").strip() != "0"


_ARGUMENTS = ("self", "state", "call")


class SavedLoop:
    """``program`` (``TracedPrograms.several_program``, bound) run through its saved file (module docstring).
    ``options``: Inductor's; ``fallback``: the loop compiled as usual, for calls the saved one does not serve;
    ``mark``: marks a call's sizes that may vary (before the build, so that one graph serves them)."""

    def __init__(
        self,
        program: Any,
        options: dict[str, Any] | None,
        fallback: Callable[..., Any],
        mark: Callable[[dict[str, Any]], None],
        folder: Path | None = None,
    ) -> None:
        self._owner, self._function = program.__self__, program.__func__
        self._options, self._fallback, self._mark = options, fallback, mark
        self._store = LoopStore(folder if folder is not None else inductor_cache_folder() / LOOPS_FOLDER)
        self._program: Any = None
        self._identities: GuardIdentities | None = None
        self._started = False
        self.note = ""  # what became of the saved loop at the first call, for the build's line
        self.kept = False  # whether the loop is on disk after the first call (saved, or loaded from there)

    def __call__(self, state: dict[str, Any], call: dict[str, Any]) -> Any:
        if not self._started:
            self._started = True
            try:
                self._start(state, call)
            except Exception as error:  # (a cache: whatever fails in it, the loop compiled as usual runs)
                self._program, self._identities, self.kept = None, None, False
                self.note = f"; the loop is not saved for a later fit ({type(error).__name__}: {reason_of(error)})"
        if self._program is not None:
            tree_map(_unmarked, call)
            arguments = dict(zip(_ARGUMENTS, (self._owner, state, call)))
            if self._serves(arguments):
                return self._program(self._owner, state, call)
        return self._fallback(state, call)

    def _serves(self, arguments: dict[str, Any]) -> bool:
        """Whether the guards hold: TorchDynamo's saved ones, and the identities and values checked here
        (``DroppedGuard``), before every call: a callback may replace a function or change a setting between two."""
        assert self._identities is not None
        program_globals = self._function.__globals__
        try:
            if self._identities.first_difference(arguments, program_globals) is not None:
                return False
            return guards_pass(self._program, (arguments["self"], arguments["state"], arguments["call"]))
        except Exception:  # (a guard that cannot be checked does not hold: the loop compiled as usual runs)
            return False

    def _start(self, state: dict[str, Any], call: dict[str, Any]) -> None:
        refused = None if not caches_disabled() else "Inductor's caches are switched off"
        refused = refused or _local_class(self._owner)
        if refused is not None:
            self.note = f"; the loop is not saved for a later fit ({refused})"
            return
        not_private = self._store.privacy()
        if not_private is not None:  # (its programs are pickles: another user's would run as this one)
            self.note = f"; no saved loop is read or written ({not_private})"
            return
        key = _key(self._owner, state, call, self._options)
        refused = self._store.refusal(key)
        if refused is not None:
            self.note = f"; the loop is not saved for a later fit (an earlier fit found: {refused})"
            return
        if self._load(key, state, call):
            self.note = "; the loop loaded from the program a fit of the same module and settings saved"
            self.kept = True
            return
        self._build_and_save(key, state, call)

    def _load(self, key: str, state: dict[str, Any], call: dict[str, Any]) -> bool:
        """The saved program of ``key``, taken where every check passes for this call."""
        stored = self._store.load(key)
        if stored is None or not _sources_unchanged(stored.sources):
            return False
        try:
            program = load_saved(stored.program, dict(self._function.__globals__))
            identities = GuardIdentities([(path, name) for path, name in stored.identities])
        except Exception:  # a file torch cannot read back (another torch build, a damaged file): build instead
            return False
        self._program, self._identities = program, identities
        tree_map(_unmarked, call)
        if self._serves(dict(zip(_ARGUMENTS, (self._owner, state, call)))):
            return True
        self._program, self._identities = None, None
        return False

    def _build_and_save(self, key: str, state: dict[str, Any], call: dict[str, Any]) -> None:
        self._mark(call)
        dropped: list[DroppedGuard] = []
        try:
            program = compile_to_save(self._function, self._options, (self._owner, state, call), dropped)
            marked = constant_marked(program)
            if marked is not None:
                raise ValueError(f"{marked} is marked assume_constant_result: its value would not be checked")
            arguments = dict(zip(_ARGUMENTS, (self._owner, state, call)))
            identities = _identities(dropped, arguments, self._function.__globals__)
        except Exception as error:  # (the loop is then compiled as usual, by the fallback)
            reason = f"{type(error).__name__}: {reason_of(error)}"
            self._store.refuse(key, reason)
            self.note = f"; the loop is not saved for a later fit ({reason})"
            return
        self._program, self._identities = program, identities
        sources = [list(source) for source in inlined_sources(program)]
        written = self._store.save(
            key, partial(save_program, program), sources, [list(row) for row in identities.entries]
        )
        self.note = (
            "; the loop saved for a later fit" if written else "; the loop could not be saved (folder not writable)"
        )
        self.kept = written


def _unmarked(leaf: Any) -> None:
    if isinstance(leaf, torch.Tensor):
        forget_size_marks(leaf)


def _local_class(owner: Any) -> str | None:
    """Why the module cannot be saved: a class of its, or its optimizer's, defined inside a function."""
    module = owner.gradients.module
    for value in [*module.modules(), owner.update.rule.optimizer]:
        if "<locals>" in type(value).__qualname__:
            return f"{type(value).__qualname__} is defined inside a function"
    return None


def _identities(dropped: list[DroppedGuard], arguments: dict[str, Any], program_globals: dict[str, Any]) -> Any:
    """The left-out guards as identities, each checked against the value TorchDynamo saw at its path, and the
    module's hooks, on which TorchDynamo sets no guard."""
    hooks = hook_paths("self.gradients.module", arguments["self"].gradients.module)
    identities = GuardIdentities.recorded([guard.path for guard in dropped] + hooks, arguments, program_globals)
    seen = dict(identities.entries)
    for guard in dropped:
        if guard.value is not None and seen[guard.path] != identity(guard.value):
            raise PathNotFollowed(f"{guard.path} leads elsewhere than TorchDynamo's guard")
    return identities


def _key(owner: Any, state: dict[str, Any], call: dict[str, Any], options: dict[str, Any] | None) -> str:
    module = owner.gradients.module
    described = [
        torch.__version__,
        sys.version,
        cpu_vector_isa(),
        _package_version(),
        FORMAT,
        sorted((options or {}).items()),
        identity(type(module)),
        [identity(type(value)) for value in module.modules()],
        _spec(state),
        _spec(call),
    ]
    return hashlib.sha256(repr(described).encode()).hexdigest()[:32]


def _package_version() -> str:
    """This package's installed version (read from its metadata: importing the package here would be a cycle)."""
    try:
        return importlib.metadata.version("lightning-sink")
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def _spec(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return ("tensor", tuple(value.shape), str(value.dtype), str(value.device), value.requires_grad)
    if isinstance(value, dict):
        return {str(key): _spec(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [_spec(item) for item in value]
    return identity(value) if not isinstance(value, (int, float, str, bool, type(None))) else repr(value)


def _sources_unchanged(sources: list[list[Any]]) -> bool:
    return all(source_checksum(module, first, last) == checksum for module, first, last, checksum in sources)
