"""torchmetrics ``Metric`` calls in a compiled ``training_step``: recorded inside the program, run eagerly after it.

The usual Lightning pattern updates a ``Metric`` attribute in ``training_step`` and logs the object::

    self.train_acc(logits, y)  # or self.train_acc.update(logits, y), or acc = self.train_acc(logits, y)
    self.log("train_acc", self.train_acc, on_step=True, on_epoch=True)

A ``Metric`` is a Python state machine (its update count, forward cache, compute cache, sync flags, list states
that grow) around a few tensors, and Lightning reads the object itself (the forward's batch value at a step, its
``compute()`` at the epoch's end). Traced into a program, TorchDynamo would guard on those Python values and
recompile at every step, and torchmetrics' lazy package checks (``importlib.metadata`` for ``torch_xla``) crash
the trace. So a program never runs a Metric: while it runs, each Metric of the module has its ``forward`` and
``update`` replaced by recorders, which keep the call's arguments (detached) and hand them out of the program; the
Metric's other methods are refused. After the call the host makes each recorded call on the real Metric, eagerly,
in order, as the eager step would have; then the step's ``self.log`` values are handed on, a logged Metric as the
object and a logged forward result as the real result. The Metric therefore sees exactly the eager step's calls
(the same inputs: the program's forward is the eager forward's), and every value Lightning logs from it is the
eager run's.

A ``MetricCollection`` is recorded as one Metric (its forward and update). Reading its members (``log_dict`` of it,
``collection[key]``) makes the members of a compute group share or copy their state, a Python-side change that a
trace would guard on: that call is recorded too, and ``log_dict`` of a collection is recorded as a call that reads
the members as Lightning's ``log_dict`` does; the host replays them in the step's order, so the collection ends each
step in the eager step's state. A member logged on its own (``self.log("f1", self.metrics["f1"])``) is handed on as
that member.

What a program cannot hold is refused at build time with one line naming the attribute and the call: another
method of a Metric (``compute``, ``reset``, ...), or a forward result used other than by ``self.log``.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from lightning_sink._lightning_compat import COLLECTION_STATE_SHARING, logged_collection_items

__all__ = [
    "MetricCallRefused",
    "MetricCalls",
    "MetricValue",
    "join_tensors",
    "metrics_of",
    "metrics_run_eagerly",
    "split_tensors",
]

_RECORDED = ("forward", "update", COLLECTION_STATE_SHARING)
_REFUSED = ("compute", "reset", "sync", "unsync", "merge_state", "plot", "clone")
_EAGER = _RECORDED + _REFUSED  # the methods run outside TorchDynamo on the forward-compiled path
_LOGGED_MEMBERS = "log_dict"  # a recorded call: a collection's members read as Lightning's log_dict reads them


class MetricCallRefused(RuntimeError):
    """A Metric used in a way the programs cannot hold (the message names the attribute and the call)."""


def metrics_of(module: nn.Module) -> list[tuple[str, nn.Module]]:
    """The torchmetrics ``Metric`` and ``MetricCollection`` submodules of ``module``, outermost ones, by attribute
    path (none where torchmetrics was never imported: then no Metric can exist)."""
    torchmetrics = sys.modules.get("torchmetrics")
    if torchmetrics is None:
        return []
    kinds = (torchmetrics.Metric, torchmetrics.MetricCollection)
    found: list[tuple[str, nn.Module]] = []
    for path, submodule in module.named_modules():
        inside = any(path.startswith(f"{outer}.") for outer, _ in found)
        if isinstance(submodule, kinds) and not inside:
            found.append((path, submodule))
    return found


def _is_collection(metric: nn.Module) -> bool:
    torchmetrics = sys.modules["torchmetrics"]  # (a Metric exists: torchmetrics is imported)
    return isinstance(metric, torchmetrics.MetricCollection)


@dataclass(frozen=True)
class MetricValue:
    """What a Metric's ``forward`` returns inside a program: a reference to the result the host's call will give.
    ``self.log`` takes it; anything else refuses it."""

    path: str  # the Metric's attribute path (a collection's member: the collection's path, a dot, its key)
    call: int  # the recorded call's position in the micro-batch's calls; -1: the Metric object itself
    entry: str | None = None  # a logged collection's member, by the name log_dict logs it under

    def _refuse(self, *args: Any) -> Any:
        raise MetricCallRefused(_used_message(self.path))

    __add__ = __radd__ = __sub__ = __rsub__ = __mul__ = __rmul__ = __truediv__ = __rtruediv__ = _refuse
    __float__ = __bool__ = __lt__ = __gt__ = __neg__ = _refuse


def _used_message(path: str) -> str:
    return (
        f"training_step uses the result of torchmetrics Metric `self.{path}`(...) other than in self.log: a compiled"
        " program runs the Metric after the step, so its result exists only there; log it, or compute the value"
        " with tensor operations, or use graph_mode='eager'"
    )


def _refused_message(path: str, method: str) -> str:
    return (
        f"training_step calls torchmetrics Metric `self.{path}.{method}()`: a compiled program runs only a Metric's"
        " forward/update (after the step, eagerly); move that call to a hook such as on_train_epoch_end, or use"
        " graph_mode='eager'"
    )


class MetricCalls:
    """Records one program call's Metric calls (``installed_on``) and makes them on the host (``replay``)."""

    def __init__(self, module: nn.Module) -> None:
        self.metrics = metrics_of(module)
        # every object a step may log by identity: the Metrics, and each member of a collection under its own path
        self._objects: dict[str, nn.Module] = {}
        self._logged_names: dict[str, tuple[str, ...]] = {}  # per collection: the names log_dict logs it under
        for path, metric in self.metrics:
            self._objects[path] = metric
            if _is_collection(metric):
                members: Any = metric
                self._objects.update({f"{path}.{key}": members[key] for key in members.keys(keep_base=True)})
                self._logged_names[path] = tuple(members.keys(keep_base=False))  # (reading names changes nothing)
        self.calls: list[tuple[int, str, tuple[Any, ...], dict[str, Any]]] = []  # of the call being traced
        # made once, so that what is installed on each Metric is the same object at every call (no new guards)
        self._installed = [
            (metric, self._recorders(index, path, metric)) for index, (path, metric) in enumerate(self.metrics)
        ]

    def _recorders(self, index: int, path: str, metric: nn.Module) -> dict[str, Any]:
        calls = self

        def recorder(method: str) -> Any:
            def record(*args: Any, **kwargs: Any) -> Any:
                calls.calls.append((index, method, _detached(args), _detached(kwargs)))
                return MetricValue(path, len(calls.calls) - 1) if method == "forward" else None

            return record

        def refuser(method: str) -> Any:
            def refuse(*args: Any, **kwargs: Any) -> Any:
                raise MetricCallRefused(_refused_message(path, method))

            return refuse

        recorded = {name: recorder(name) for name in _RECORDED if hasattr(metric, name)}
        return {**recorded, **{name: refuser(name) for name in _REFUSED}}

    @contextlib.contextmanager
    def installed_on(self) -> Iterator[None]:
        """The recorders in place of each Metric's methods for the duration; the Metric's own afterwards."""
        held = [
            (metric, {name: vars(metric)[name] for name in recorders if name in vars(metric)})
            for metric, recorders in self._installed
        ]
        for metric, recorders in self._installed:
            vars(metric).update(recorders)  # (past Metric.__setattr__: nothing of the Metric's own is set)
        try:
            yield
        finally:
            for (metric, recorders), (_, own) in zip(self._installed, held):
                for name in recorders:
                    if name in own:
                        vars(metric)[name] = own[name]
                    else:
                        del vars(metric)[name]

    def reference(self, value: Any) -> MetricValue | None:
        """A logged value that is one of the Metrics (by identity): the reference to hand on; else None."""
        for path, metric in self._objects.items():
            if value is metric:
                return MetricValue(path, -1)
        return value if isinstance(value, MetricValue) else None

    def collection_entries(self, dictionary: Any) -> dict[str, MetricValue] | None:
        """A ``log_dict`` argument that is one of the module's MetricCollections: the read of its members recorded
        as a call, and a reference per member under the name Lightning logs it by; else None (a plain dictionary,
        logged entry by entry)."""
        for index, (path, metric) in enumerate(self.metrics):
            if dictionary is metric and path in self._logged_names:
                self.calls.append((index, _LOGGED_MEMBERS, (), {}))
                call = len(self.calls) - 1
                return {name: MetricValue(path, call, entry=name) for name in self._logged_names[path]}
        return None

    def replay(self, calls: list[tuple[int, str, tuple[Any, ...], dict[str, Any]]]) -> list[Any]:
        """Make ``calls`` on the real Metrics, in order (outside ``installed_on``); each call's result."""
        results = []
        for index, method, args, kwargs in calls:
            metric: Any = self.metrics[index][1]
            if method == "forward":
                results.append(metric(*args, **kwargs))
            elif method == _LOGGED_MEMBERS:
                results.append(dict(logged_collection_items(metric)))
            else:
                results.append(getattr(metric, method)(*args, **kwargs))
        return results

    def resolve(self, value: Any, results: list[Any]) -> Any:
        """A logged value as the host hands it to ``self.log``: the Metric itself, or the result of its call."""
        if not isinstance(value, MetricValue):
            return value
        if value.entry is not None:  # a member, from the recorded read of the collection's members
            return results[value.call][value.entry]
        if value.call < 0:
            return self._objects[value.path]
        return results[value.call]

    def refusal_in(self, error: BaseException) -> str | None:
        """The refusal message behind a failed build (TorchDynamo wraps the exception), or None."""
        text, seen = "", set()
        current: BaseException | None = error
        while current is not None and id(current) not in seen:
            seen.add(id(current))
            text += f"{current!r} {current}"
            current = current.__cause__ or current.__context__
        for path, _ in self.metrics:
            for message in [_used_message(path)] + [_refused_message(path, name) for name in _REFUSED]:
                if message in text:
                    return message
        return None


def split_tensors(tree: Any, tensors: list[Tensor]) -> Any:
    """``tree`` with each tensor moved to ``tensors`` and replaced by its position there (a program returns the
    tensors as outputs and the rest, plain Python, through its side channel); ``join_tensors`` undoes it."""
    if isinstance(tree, Tensor):
        tensors.append(tree)
        return _Slot(len(tensors) - 1)
    if isinstance(tree, dict):
        return {key: split_tensors(value, tensors) for key, value in tree.items()}
    if isinstance(tree, (list, tuple)):
        return type(tree)(split_tensors(value, tensors) for value in tree)
    return tree


def join_tensors(tree: Any, tensors: list[Tensor]) -> Any:
    if isinstance(tree, _Slot):
        return tensors[tree.position]
    if isinstance(tree, dict):
        return {key: join_tensors(value, tensors) for key, value in tree.items()}
    if isinstance(tree, (list, tuple)):
        return type(tree)(join_tensors(value, tensors) for value in tree)
    return tree


@dataclass(frozen=True)
class _Slot:
    position: int


def _detached(tree: Any) -> Any:
    """``tree`` with every tensor detached (the arguments a Metric call keeps: inputs, not part of the graph)."""
    if isinstance(tree, Tensor):
        return tree.detach()
    if isinstance(tree, dict):
        return {key: _detached(value) for key, value in tree.items()}
    if isinstance(tree, (list, tuple)):
        return type(tree)(_detached(value) for value in tree)
    return tree


def metrics_run_eagerly(compiled_step: Callable[..., Any], module: nn.Module) -> Callable[..., Any]:
    """``compiled_step`` (``torch.compile`` of ``module``'s ``training_step``, graph breaks allowed) with the
    module's Metrics outside TorchDynamo: for each call their methods are replaced by ``torch.compiler.disable``-d
    versions of themselves, so TorchDynamo breaks the graph at a Metric call and the call runs eagerly, as ``self.log``
    does. Traced, a Metric's Python state (update count, caches) would be guarded on and recompiled at every step,
    and its lazy package checks can crash the trace. The versions are made once (the same objects at every call: no
    new guards)."""
    metrics = metrics_of(module)
    if not metrics:
        return compiled_step
    installed = [
        (metric, {name: torch.compiler.disable(getattr(metric, name)) for name in _EAGER if hasattr(metric, name)})
        for _, metric in metrics
    ]

    def step(*args: Any, **kwargs: Any) -> Any:
        held = [{name: vars(metric)[name] for name in eager if name in vars(metric)} for metric, eager in installed]
        for metric, eager in installed:
            vars(metric).update(eager)
        try:
            return compiled_step(*args, **kwargs)
        finally:
            for (metric, eager), own in zip(installed, held):
                for name in eager:
                    if name in own:
                        vars(metric)[name] = own[name]
                    else:
                        del vars(metric)[name]

    return step
