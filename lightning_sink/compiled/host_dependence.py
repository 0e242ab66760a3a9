"""Whether ``training_step`` depends on Python state the host changes as the fit runs: found by running the step
once eagerly before the programs are built (``host_dependence``).

A compiled program keeps every Python value its step read when it was built, and does the step's Python side
effects once per call. A call of several micro-batches would then give each of them the value the first read (a
``global_step`` warm-up, a random draw from Python's ``random``), and make a counter ``self.calls += 1`` go up
once; a value that changes from call to call would make TorchDynamo compile again at every call until its limit,
where a program compiled whole stops with an error. So the step is run once, on copies of the state, watching:

- the Python attributes of every submodule (numbers, strings, ``None``, a container's length, which object an
  attribute holds): one that changed, appeared or went is a side effect;
- the buffers every submodule assigns a new tensor (``self.count = self.count + 1``): a program runs the step on
  its own tensors for the buffers and keeps what they hold after a call, so only a buffer changed in place
  (``self.count.add_(1)``) is kept, and a new tensor would be dropped;
- the state of Python's and NumPy's global random generators, and of any ``torch.Generator`` a submodule holds: a
  step that draws from them draws on the host (a program cannot draw from a generator of the module's own);
- with a Lightning trainer, the trainer attributes the step reads that change while the fit runs (the caller's
  ``trainer_reads``: ``lightning_sink._lightning_compat.trainer_reads``).

Any of them refuses the programs, in one line naming it; the fit runs its eager step. Whatever the run changed is
put back (attributes and generator states), so the refusal leaves the run as it was.
"""

from __future__ import annotations

import contextlib
import copy
import random
from collections import Counter
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any, cast

import numpy
import torch
from torch import nn

__all__ = ["TrainerReads", "host_dependence"]

TrainerReads = Callable[[], AbstractContextManager[list[str]]]

_CONTAINERS = (list, dict, set, tuple)
_PLAIN = (int, float, bool, str, complex, type(None))
_MISSING = object()


def host_dependence(module: nn.Module, run: Callable[[], Any], trainer_reads: TrainerReads | None) -> str | None:
    """Why ``module``'s step cannot be compiled, from one ``run`` of it (on copies of the state), or None.
    ``trainer_reads``: a context listing the trainer attributes read that change during the fit (None: no trainer)."""
    attributes = _Attributes(module)
    generators = (random.getstate(), numpy.random.get_state())
    own = [(path, value, value.get_state()) for path, value in attributes.generators()]
    try:
        with trainer_reads() if trainer_reads is not None else contextlib.nullcontext([]) as reads:
            run()
    finally:
        reassigned = attributes.reassigned_buffers()  # (the module's own buffer dicts back, whatever happened)
    changed = attributes.changed()
    attributes.restore()
    drew = [name for name, same in _same_generators(generators) if not same]
    drew += [
        f"{path} (a torch.Generator of the module's)"
        for path, value, state in own
        if not torch.equal(value.get_state(), state)
    ]
    random.setstate(generators[0])
    numpy.random.set_state(generators[1])
    for _, value, state in own:
        value.set_state(state)
    if reads:
        return (
            f"training_step reads {reads[0]}, which changes while the fit runs: a compiled call"
            " would keep the value read when it was built for all its micro-batches (and compile again for each new"
            " value); use graph_mode='eager', or keep the value in a tensor buffer of the module set from a hook"
        )
    if reassigned:
        return (
            f"training_step assigns {reassigned[0]} a new tensor at each call: the programs keep a buffer's value"
            " only where the step changes it in place; update it in place (self.count.add_(1), .copy_(...)) or use"
            " graph_mode='eager'"
        )
    if changed:
        return (
            f"training_step changes {changed[0]} at each call: a compiled call would change it once for all its"
            " micro-batches (and compile again for each new value); keep that bookkeeping out of training_step"
            " (a hook, or a tensor buffer updated in place) or use graph_mode='eager'"
        )
    if drew:
        return (
            f"training_step draws from {drew[0]}: a compiled call would draw once for all its micro-batches; draw"
            " with torch (torch.rand, torch.randn: the programs draw what eager draws) or use graph_mode='eager'"
        )
    return None


def _same_generators(before: tuple[Any, Any]) -> list[tuple[str, bool]]:
    python, numpy_state = random.getstate(), cast(tuple, numpy.random.get_state())
    numpy_same = numpy.array_equal(before[1][1], numpy_state[1]) and before[1][2:] == numpy_state[2:]
    return [
        ("Python's random module (random.random(), ...)", before[0] == python),
        ("NumPy's global random generator (numpy.random.rand(), ...)", numpy_same),
    ]


class _BufferWrites(dict):
    """A submodule's ``_buffers`` during the run, counting the assignments to each name: the program's run puts its
    own tensor in and the module's back (``functional_call``: two), a third is the step's own."""

    def __init__(self, buffers: dict[str, Any]) -> None:
        super().__init__(buffers)
        self.writes: Counter[str] = Counter()

    def __setitem__(self, name: str, value: Any) -> None:
        self.writes[name] += 1
        super().__setitem__(name, value)


class _Attributes:
    """The plain Python attributes of a module's submodules as they were: what changed, and putting them back."""

    def __init__(self, module: nn.Module) -> None:
        self._modules = list(module.named_modules())
        self._values = [dict(vars(sub)) for _, sub in self._modules]
        self._copies = [
            {name: copy.copy(value) for name, value in values.items() if isinstance(value, _CONTAINERS)}
            for values in self._values
        ]
        self._marks = [{name: _mark(value) for name, value in values.items()} for values in self._values]
        self._buffer_writes = [_BufferWrites(vars(sub)["_buffers"]) for _, sub in self._modules]
        for (_, sub), writes in zip(self._modules, self._buffer_writes):
            vars(sub)["_buffers"] = writes  # (until ``reassigned_buffers``)

    def generators(self) -> list[tuple[str, torch.Generator]]:
        """``self.<path>`` and each ``torch.Generator`` a submodule holds as an attribute."""
        return [
            (f"self.{prefix + '.' if prefix else ''}{name}", value)
            for (prefix, _), values in zip(self._modules, self._values)
            for name, value in values.items()
            if isinstance(value, torch.Generator)
        ]

    def reassigned_buffers(self) -> list[str]:
        """``self.<path>`` of each buffer the run assigned a new tensor; the submodules' own buffer dicts back."""
        found = []
        for (prefix, sub), values, writes in zip(self._modules, self._values, self._buffer_writes):
            vars(sub)["_buffers"] = values["_buffers"]
            found += [
                f"self.{prefix + '.' if prefix else ''}{name}" for name, count in writes.writes.items() if count > 2
            ]
        return found

    def changed(self) -> list[str]:
        """``self.<path>`` of each attribute that changed, appeared or went, with its value before and after."""
        found = []
        for (prefix, sub), marks in zip(self._modules, self._marks):
            now = {name: _mark(value) for name, value in vars(sub).items()}
            for name in sorted(marks.keys() | now.keys()):
                before, after = marks.get(name, _MISSING), now.get(name, _MISSING)
                if before != after:
                    path = f"self.{prefix + '.' if prefix else ''}{name}"
                    found.append(f"{path} ({_said(before)} -> {_said(after)})")
        return found

    def restore(self) -> None:
        for (_, sub), values, copies in zip(self._modules, self._values, self._copies):
            attributes = vars(sub)
            for name in [name for name in attributes if name not in values]:
                del attributes[name]
            for name, value in values.items():
                attributes[name] = value
                if name in copies:  # a container changed in place: its contents as they were
                    _refill(value, copies[name])


def _mark(value: Any) -> tuple:
    """What stands for an attribute's value: a plain value itself, a container its kind and length and which one it
    is, any other object its kind and which one it is."""
    if isinstance(value, _PLAIN):
        return ("value", value)
    if isinstance(value, _CONTAINERS):
        return ("container", type(value).__name__, id(value), len(value))
    return ("object", type(value).__name__, id(value))


def _said(mark: Any) -> str:
    if mark is _MISSING:
        return "absent"
    if mark[0] == "value":
        return repr(mark[1])
    if mark[0] == "container":
        return f"a {mark[1]} of {mark[3]}"
    return f"a {mark[1]}"


def _refill(container: Any, contents: Any) -> None:
    if isinstance(container, list):
        container[:] = contents
    elif isinstance(container, (dict, set)):
        container.clear()
        container.update(contents)
