"""What the compiled programs took as fixed when they were built, checked at each segment's start.

A program reads the module's parameters and buffers at the addresses they had, runs the hooks there were, clips as
the trainer was set to, and updates the optimizer state it found. A callback may change any of these between sinks:
a parameter given a new tensor (``p.data = p.data.clamp(...)``), a buffer assigned anew, a hook added (a pruning
callback), ``trainer.gradient_clip_val`` scheduled, ``optimizer.state`` cleared for a warm restart, or the trainable
parameters (a layer unfrozen). The programs would then train the old tensors, skip the hook, clip with the old value
or stop with an error; the fit hands over to the eager pair instead, in one line naming the change
(``CompiledProgramChooser._changed_since_build``). A change made in place (``p.data.clamp_(...)``) keeps the
programs: they read the new values.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from lightning_sink import _torch_compat as compat
from lightning_sink.accumulation import unique_trainable

__all__ = ["BuildAssumptions", "clip_settings"]


def clip_settings(trainer: Any) -> tuple[float | None, str]:
    """The trainer's gradient clipping as the programs are built with it: the value (None: none) and the algorithm."""
    algorithm = trainer.gradient_clip_algorithm or "norm"
    return trainer.gradient_clip_val or None, str(getattr(algorithm, "value", algorithm))


def _tensors(module: nn.Module) -> list[tuple[str, int, int]]:
    """Each parameter and buffer by name, with the tensor object and the memory it holds."""
    named = [*module.named_parameters(), *module.named_buffers()]
    return [(name, id(tensor), tensor.data_ptr()) for name, tensor in named]


def _trainable(optimizer: torch.optim.Optimizer) -> tuple[int, ...]:
    params = [p for group in optimizer.param_groups for p in group["params"]]
    return tuple(sorted(id(p) for p in unique_trainable(params)))


class BuildAssumptions:
    """The module's tensors, hooks and trainable parameters, and the trainer's clipping, as the build found them."""

    def __init__(self, module: nn.Module, optimizer: torch.optim.Optimizer, clip: tuple[float | None, str]) -> None:
        self._tensors = _tensors(module)
        self._hooks = compat.module_hook_counts(module)
        self._trainable = _trainable(optimizer)
        self._clip = clip

    def changed(
        self, module: nn.Module, optimizer: torch.optim.Optimizer, clip: tuple[float | None, str]
    ) -> str | None:
        """What no longer holds, in words for the fit's line, or None."""
        if _trainable(optimizer) != self._trainable:
            return "the optimizer's trainable parameters changed (a parameter unfrozen or a param group added)"
        if compat.module_hook_counts(module) != self._hooks:
            return "a hook was added to or removed from the module after the programs were built (a pruning callback)"
        tensors = _tensors(module)
        if tensors != self._tensors:
            now = {name: place for name, *place in tensors}
            name = next((name for name, *place in self._tensors if now.get(name) != place), tensors[-1][0])
            return (
                f"the module's {name!r} was given a new tensor after the programs were built (p.data = ..., or a"
                " buffer assigned anew), which they would not train; change it in place (p.data.clamp_(...),"
                " buffer.mul_(...)) to keep them"
            )
        if clip != self._clip:
            return f"the trainer's gradient clipping changed from {self._clip} to {clip} after the programs were built"
        return None
