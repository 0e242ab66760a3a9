"""Whether a module and optimizer can run as compiled step programs, and if not, why (one line naming what to
change). A program applies when nothing needs the host between the forward pass and the update."""

from __future__ import annotations

import torch
from torch import nn

from lightning_sink._torch_compat import hooks_a_functional_step_would_skip

__all__ = ["Unavailable", "unsupported_reason"]

# LightningModule hooks that run between forward and update in Lightning's automatic optimization: a compiled
# program would not call an override of any of them.
_STEP_HOOKS = (
    "backward",
    "on_before_backward",
    "on_after_backward",
    "on_before_optimizer_step",
    "optimizer_step",
    "optimizer_zero_grad",
    "configure_gradient_clipping",
)


class Unavailable:
    """No program: ``reason`` says why, in one line, and what to change; the caller runs the eager step."""

    def __init__(self, reason: str, host_state: bool = False) -> None:
        self.reason = reason
        # the step reads Python state the host changes: a compiled forward would compile again for each value too
        self.host_state = host_state

    def __repr__(self) -> str:
        return f"Unavailable({self.reason!r})"


def _overridden_step_hooks(module: nn.Module) -> list[str]:
    try:
        from lightning.pytorch import LightningModule
    except ImportError:  # a plain nn.Module has none of these hooks
        return []
    if not isinstance(module, LightningModule):
        return []
    return [name for name in _STEP_HOOKS if getattr(type(module), name) is not getattr(LightningModule, name)]


def unsupported_reason(module: nn.Module, optimizer: object) -> str | None:
    """Why ``module`` with ``optimizer`` cannot run as compiled programs, or None (then the rule, the trace and
    the compile may still refuse; those say so themselves)."""
    if not isinstance(optimizer, torch.optim.Optimizer):
        return f"the optimizer {type(optimizer).__qualname__} is not a torch.optim.Optimizer"
    if isinstance(optimizer, torch.optim.LBFGS):
        return "LBFGS needs a closure (it re-evaluates the loss inside step): the compiled programs take none"
    if not callable(getattr(module, "training_step", None)):
        return f"{type(module).__qualname__} has no training_step"
    if getattr(module, "automatic_optimization", True) is False:
        return "manual optimization (automatic_optimization=False): training_step calls the optimizer itself"
    overridden = _overridden_step_hooks(module)
    if overridden:
        return (
            f"{type(module).__qualname__} overrides {', '.join(overridden)}: a compiled program would not call"
            " it; move that work into training_step or use graph_mode='eager'"
        )
    hooks = hooks_a_functional_step_would_skip(module, optimizer)
    if hooks:
        return f"{hooks[0]}: a compiled program would not run it; remove it or use graph_mode='eager'"
    if not any(param.requires_grad for param in module.parameters()):
        return "the module has no trainable parameters"
    return None
