"""``self.log`` inside a compiled ``training_step``: the values come out of the program instead of reaching
Lightning's logger from inside it.

While a program runs, the module's ``log`` and ``log_dict`` are replaced by a recorder that keeps each value
(detached) under its name, with the options it was logged with (``prog_bar``, ``on_step``, ...). The program returns
the values as a dict of tensors next to the loss; the caller hands them to the sink's log buffer, which logs them as
Lightning would have.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from torch import Tensor, nn

__all__ = ["LoggedValues"]


class LoggedValues:
    """Collects what one ``training_step`` call logs."""

    def __init__(self) -> None:
        self.values: dict[str, Tensor] = {}  # of the call being traced (a program returns them)
        self.call_options: dict[str, dict[str, Any]] = {}  # likewise, the keyword arguments of each log call
        self.options: dict[str, dict[str, Any]] = {}  # per name, as the programs last returned them
        # bound once, so that the attributes installed on the module are the same objects at every call
        self._log, self._log_dict = self.log, self.log_dict

    def log(self, name: str, value: Any, *args: Any, **kwargs: Any) -> None:
        self.values[name] = value.detach() if isinstance(value, Tensor) else torch.as_tensor(value)
        self.call_options[name] = kwargs

    def log_dict(self, dictionary: dict[str, Any], *args: Any, **kwargs: Any) -> None:
        for name, value in dictionary.items():
            self.log(name, value, **kwargs)

    @contextlib.contextmanager
    def installed_on(self, module: nn.Module) -> Iterator[None]:
        """Route ``module.log`` and ``module.log_dict`` here for the duration; whatever the module's instance held
        under those names before (a sink's log buffer stands in for ``log`` there) is put back afterwards."""
        names = ("log", "log_dict")
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
