"""``self.log`` inside a compiled ``training_step``: the values come out of the program instead of reaching
Lightning's logger from inside it.

While a program runs, the module's ``log`` and ``log_dict`` are replaced by a recorder that keeps each value
(detached) under its name, with the options it was logged with (``prog_bar``, ``on_step``, ...). The program returns
the values as a dict of tensors next to the loss; the caller hands them to the sink's log buffer, which logs them as
Lightning would have.

Every argument form the module's own ``log`` / ``log_dict`` accepts is taken: the call is bound against that
method's signature (``self.log("x", v, True)`` is ``prog_bar=True``), and the options are replayed as keywords. The
binding is plain Python over the signature's parameter names, read once per module class, because the recorder
runs inside the traced program, where ``inspect.Signature.bind`` cannot be traced.

After a call, the host makes each micro-batch's ``StepOutputs`` from what the program returned (``step_outputs``)
and hands its values on in the order they were logged (``host_logs``), a torchmetrics Metric's calls made then.
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from lightning_sink.compiled.metric_calls import MetricCalls, MetricValue, join_tensors
from lightning_sink.compiled.program_results import StepOutputs
from lightning_sink.compiled.program_state import clone_tree

__all__ = ["LoggedValues"]


@dataclass(frozen=True)
class _Parameters:
    """A logging method's parameters after ``self``, as binding a call needs them."""

    method: str
    positional: tuple[str, ...]  # positional-or-keyword, in order: the first is the name (log) or the dictionary
    keyword_only: frozenset[str]
    required: tuple[str, ...]
    any_keyword: bool  # the method takes **kwargs

    def bind(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> dict[str, Any]:
        """The call's arguments by parameter name (defaults not filled in), or ``TypeError`` as Python's own
        binding would raise it."""
        if len(args) > len(self.positional):
            raise TypeError(
                f"{self.method}() takes {len(self.positional)} positional arguments but {len(args)} were given"
            )
        bound = dict(zip(self.positional, args))
        for key, value in kwargs.items():
            if key in bound:
                raise TypeError(f"{self.method}() got multiple values for argument {key!r}")
            if not (self.any_keyword or key in self.positional or key in self.keyword_only):
                raise TypeError(f"{self.method}() got an unexpected keyword argument {key!r}")
            bound[key] = value
        for key in self.required:
            if key not in bound:
                raise TypeError(f"{self.method}() missing required argument {key!r}")
        return bound


# What a module without its own logging methods is taken to accept (a plain nn.Module's training_step that logs
# only through the recorder): the values by name, options as keywords.
_KEYWORDS_ONLY = {
    "log": _Parameters("log", ("name", "value"), frozenset(), ("name", "value"), True),
    "log_dict": _Parameters("log_dict", ("dictionary",), frozenset(), ("dictionary",), True),
}


def _parameters_of(kind: type, method: str) -> _Parameters:
    """The parameters of ``kind``'s own ``method`` (``log`` or ``log_dict``); a class without it: keywords only."""
    function = getattr(kind, method, None)
    if not callable(function):
        return _KEYWORDS_ONLY[method]
    parameters = list(inspect.signature(function).parameters.values())[1:]  # after self
    if any(p.kind is p.VAR_POSITIONAL or p.kind is p.POSITIONAL_ONLY for p in parameters):
        # positional arguments it would not name: only the values by name, and options as keywords, are bound
        return _KEYWORDS_ONLY[method]
    return _Parameters(
        method=f"{kind.__name__}.{method}",
        positional=tuple(p.name for p in parameters if p.kind is p.POSITIONAL_OR_KEYWORD),
        keyword_only=frozenset(p.name for p in parameters if p.kind is p.KEYWORD_ONLY),
        required=tuple(p.name for p in parameters if p.default is p.empty and p.kind is not p.VAR_KEYWORD),
        any_keyword=any(p.kind is p.VAR_KEYWORD for p in parameters),
    )


class LoggedValues:
    """Collects what one ``training_step`` call logs."""

    def __init__(self) -> None:
        self.values: dict[str, Tensor] = {}  # of the call being traced (a program returns them)
        self.call_options: dict[str, dict[str, Any]] = {}  # likewise, the options of each log call, as keywords
        self.references: dict[str, MetricValue] = {}  # of the call being traced: logged Metrics (metric_calls.py)
        self.metric_calls: MetricCalls | None = None  # the module's Metrics, where it has any
        self.options: dict[str, dict[str, Any]] = {}  # per name, as the programs last returned them
        self._log_parameters = _KEYWORDS_ONLY["log"]  # the installed module's (installed_on)
        self._log_dict_parameters = _KEYWORDS_ONLY["log_dict"]
        self._parameters_read_for: type | None = None  # the module class they were read from
        # bound once, so that the attributes installed on the module are the same objects at every call
        self._log, self._log_dict = self.log, self.log_dict

    def log(self, *args: Any, **kwargs: Any) -> None:
        parameters = self._log_parameters
        options = parameters.bind(args, kwargs)
        name, value = options.pop(parameters.positional[0]), options.pop(parameters.positional[1])
        reference = None if self.metric_calls is None else self.metric_calls.reference(value)
        if reference is not None:  # a Metric or its forward's result: handed on by the host after its call
            self.references[name] = reference
        else:
            self.values[name] = value.detach() if isinstance(value, Tensor) else torch.as_tensor(value)
        self.call_options[name] = options

    def log_dict(self, *args: Any, **kwargs: Any) -> None:
        parameters = self._log_dict_parameters
        options = parameters.bind(args, kwargs)
        dictionary = options.pop(parameters.positional[0])
        members = None if self.metric_calls is None else self.metric_calls.collection_entries(dictionary)
        if members is not None:  # a MetricCollection: its members are read on the host, after its calls
            for name, reference in members.items():
                self.references[name] = reference
                self.call_options[name] = dict(options)
            return
        for name, value in dictionary.items():  # as LightningModule.log_dict: each entry logged with its options
            self.log(name, value, **options)

    @contextlib.contextmanager
    def installed_on(self, module: nn.Module) -> Iterator[None]:
        """Route ``module.log`` and ``module.log_dict`` here for the duration; whatever the module's instance held
        under those names before (a sink's log buffer stands in for ``log`` there) is put back afterwards."""
        names = ("log", "log_dict")
        kind = type(module)
        if kind is not self._parameters_read_for:  # read once: installed at every program call
            self._log_parameters, self._log_dict_parameters = (
                _parameters_of(kind, "log"),
                _parameters_of(kind, "log_dict"),
            )
            self._parameters_read_for = kind
        held = {name: module.__dict__[name] for name in names if name in module.__dict__}
        module.__dict__["log"], module.__dict__["log_dict"] = self._log, self._log_dict
        try:
            yield
        finally:
            for name in names:
                if name in held:
                    module.__dict__[name] = held[name]
                else:
                    del module.__dict__[name]

    def step_outputs(
        self,
        loss: Tensor,
        values: tuple,
        side: dict[str, Any],
        found_inf: Tensor | None = None,
        scale: Tensor | None = None,
        skipped: Tensor | None = None,
    ) -> StepOutputs:
        """One micro-batch's ``StepOutputs`` from what its program returned: the logged tensors and the Metric
        calls' tensors (``values``), and what the trace returned besides tensors (``side``: the log options, the
        Metric calls and logged Metrics)."""
        logs, metric_tensors = values
        self.options.update(side["options"])
        calls = join_tensors(side["calls"], list(metric_tensors)) if side["calls"] else []
        return StepOutputs(loss, logs, found_inf, scale, skipped, calls, side["references"])

    def host_logs(self, out: StepOutputs, copy_calls: bool) -> dict[str, Any]:
        """The micro-batch's ``self.log`` values as the host hands them on, in the order they were logged: its
        Metric calls made first, on the real Metrics, eagerly (``metric_calls.py``), then a logged Metric as the
        object and a logged forward result as that call's result. ``copy_calls``: the calls' tensors are a CUDA
        graph's outputs, which its next replay overwrites (and a Metric may keep its inputs: list states)."""
        if not (out.logs or out.metric_calls or out.references):
            return {}  # (a module that logs nothing in training_step)
        logs: dict[str, Any] = dict(out.logs)
        if out.metric_calls or out.references:
            assert self.metric_calls is not None  # (only a module with Metrics records their calls)
            results = self.metric_calls.replay(clone_tree(out.metric_calls) if copy_calls else out.metric_calls)
            for name, reference in out.references.items():
                logs[name] = self.metric_calls.resolve(reference, results)
        order = [name for name in self.options if name in logs]
        return {name: logs[name] for name in order + [name for name in logs if name not in order]}
