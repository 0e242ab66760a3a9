"""Gradient accumulation state: fp32 buffers, the window position, and the partial-window rule.

This is MindSpore's ``accu_grads`` (``TrainAccuStepsCell``) for PyTorch: one flat fp32 tensor holds the
gradient sum of the current window for every trainable parameter. fp32 parameters let autograd add straight into
their slice of it (``param.grad`` is a view), so accumulating costs no extra copy; low-precision parameters get a
fresh gradient each micro-step that is added in fp32, so 64 bf16 micro-steps lose nothing to bf16 rounding.
"""

from __future__ import annotations

from collections.abc import Iterable
from enum import Enum
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor
from torch.nn import Parameter

__all__ = [
    "PARTIAL_WINDOW_MODES",
    "UPDATING_PARTIAL_WINDOWS",
    "MicroStep",
    "plan_micro_step",
    "GradientAccumulator",
    "SingleStepGradients",
    "unique_trainable",
]

PARTIAL_WINDOW_MODES = ("scale", "drop", "carry", "lightning")
# the modes whose last, short window of a pass updates at the pass's end (they differ in its divisor only)
UPDATING_PARTIAL_WINDOWS = ("scale", "lightning")


class MicroStep(Enum):
    """What the strategy does with one micro-batch."""

    ACCUMULATE = "accumulate"  # forward, backward, add into the buffers
    UPDATE = "update"  # the same, then reduce, clip, optimizer step, clear
    ACCUMULATE_THEN_DROP = "accumulate_then_drop"  # the epoch ends inside a window under "drop": discard it


def plan_micro_step(window_position: int, accumulation_steps: int, is_last: bool, partial_window: str) -> MicroStep:
    """Decide what happens to the next micro-batch.

    Args:
        window_position: micro-steps already accumulated in the current window.
        accumulation_steps: N, micro-steps per full window.
        is_last: whether this micro-batch is the last one of the epoch.
        partial_window: ``"scale"``, ``"drop"``, ``"carry"`` or ``"lightning"`` (see ``SinkStrategy``). Under ``"drop"`` the
            strategy already shortens sized loaders to whole windows; this rule covers the rest (unsized loaders,
            ``limit_train_batches``).
    """
    if window_position + 1 == accumulation_steps:
        return MicroStep.UPDATE
    if not is_last or partial_window == "carry":
        return MicroStep.ACCUMULATE
    return MicroStep.UPDATE if partial_window in UPDATING_PARTIAL_WINDOWS else MicroStep.ACCUMULATE_THEN_DROP


def unique_trainable(params: Iterable[Parameter]) -> list[Parameter]:
    """The parameters that get gradients, each once (an optimizer may list a shared parameter twice)."""
    seen: set[int] = set()
    unique = []
    for param in params:
        if param.requires_grad and id(param) not in seen:
            seen.add(id(param))
            unique.append(param)
    return unique


class GradientAccumulator:
    """The fp32 gradient sum of one window, for the parameters of one optimizer."""

    def __init__(self, params: Iterable[Parameter], follows_zero_grad: bool = True) -> None:
        self.params = unique_trainable(params)
        if not self.params:
            raise ValueError("GradientAccumulator(params=...) got no trainable parameters; the optimizer is empty.")
        device = self.params[0].device
        total = sum(p.numel() for p in self.params)
        self.flat = torch.zeros(total, dtype=torch.float32, device=device)
        self.views: list[Tensor] = []
        offset = 0
        for param in self.params:
            self.views.append(self.flat[offset : offset + param.numel()].view_as(param))
            offset += param.numel()
        self._aliased = [p.dtype == torch.float32 and p.device == device for p in self.params]
        self.follows_zero_grad = follows_zero_grad
        self.micro_steps = 0

    def begin_micro_step(self, window_ends: bool = False) -> None:
        """Prepare ``.grad`` for a backward that adds into the window's fp32 sum.

        The sum follows ``zero_grad`` as a plain ``.grad`` would: a gradient set to ``None`` since the last backward
        (``optimizer.zero_grad()``) starts again from zero, a view zeroed in place (``set_to_none=False``) is zero
        already, and a gradient left alone keeps accumulating. Without ``follows_zero_grad`` (windows that run
        across Lightning's own zero-grad points) only ``clear`` resets the sum.
        """
        for param, view, aliased in zip(self.params, self.views, self._aliased):
            grad = param.grad
            if aliased:
                if grad is view:
                    continue
                if grad is not None:
                    view.copy_(grad)  # a gradient assigned by hand joins the window
                elif self.follows_zero_grad:
                    view.zero_()
                param.grad = view
            else:
                if grad is None and self.follows_zero_grad:
                    view.zero_()
                param.grad = None  # a fresh low-precision gradient, added in fp32 by end_micro_step

    def end_micro_step(self) -> None:
        """Add this micro-step's low-precision gradients into the fp32 buffers.

        Their ``.grad`` keeps a low-precision tensor afterwards (never ``None``), so that ``begin_micro_step`` can
        tell a ``zero_grad(set_to_none=True)`` from a window that goes on.
        """
        for param, view, aliased in zip(self.params, self.views, self._aliased):
            if aliased:
                continue
            if param.grad is not None:
                view.add_(param.grad)
            else:
                param.grad = torch.zeros_like(param)  # unused this micro-step: still inside the window
        self.micro_steps += 1

    def zero_grad(self) -> None:
        """What ``optimizer.zero_grad()`` followed by ``begin_micro_step`` amounts to, in one kernel."""
        self.flat.zero_()
        for param, view, aliased in zip(self.params, self.views, self._aliased):
            if aliased:
                if param.grad is not view:
                    param.grad = view
            else:
                param.grad = None

    def unscale(self, scaling: Any, divisor: float) -> Tensor | None:
        """Divide the window's sum by ``divisor`` (and the loss scale); the device overflow flag, if scaled."""
        if scaling is None:
            if divisor != 1:
                self.flat.div_(divisor)
            return None
        return scaling.unscale_window(self.flat, divisor)

    def reduce(self, group: Any = None) -> None:
        """Sum the window's gradients over all ranks: one collective for the whole model."""
        dist.all_reduce(self.flat, op=dist.ReduceOp.SUM, group=group)

    def has_overflow(self) -> Tensor:
        """Device flag: the window's sum holds inf or NaN (absorbing under addition, so any micro-step's)."""
        return torch.logical_not(torch.isfinite(self.flat).all())

    def write_gradients(self) -> None:
        """Hand the (already unscaled, averaged) window gradient to the optimizer as ``param.grad``."""
        for param, view, aliased in zip(self.params, self.views, self._aliased):
            if not aliased:
                param.grad = view.to(param.dtype)
            elif param.grad is not view:  # (assigning .grad re-validates it: skip when it is already the view)
                param.grad = view

    def end_window(self) -> None:
        """The update is done; the sum stays in ``.grad`` until the next ``zero_grad`` (or ``clear``)."""
        self.micro_steps = 0
        if not self.follows_zero_grad:
            self.clear()

    def clear(self) -> None:
        self.flat.zero_()
        self.micro_steps = 0
        for param, aliased in zip(self.params, self._aliased):
            if not aliased:
                param.grad = None

    def state_dict(self) -> dict[str, Any]:
        """The window position, and the buffer only when the window is open (it is all zeros otherwise)."""
        return {"micro_steps": self.micro_steps, "buffer": self.flat.clone() if self.micro_steps else None}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        buffer = state.get("buffer")
        self.flat.zero_()
        if buffer is not None:
            if buffer.numel() != self.flat.numel():
                raise ValueError(
                    f"Checkpoint accumulation buffer has {buffer.numel()} elements but the model's trainable"
                    f" parameters have {self.flat.numel()}; was the checkpoint saved from a different model?"
                )
            self.flat.copy_(buffer)
        self.micro_steps = int(state["micro_steps"])
        self.attach()

    def attach(self) -> None:
        """The sum, written from elsewhere (a checkpoint, the compiled programs' buffers), as the open window's:
        attached to ``.grad``, so that the next backward adds to it (``begin_micro_step`` would take a ``.grad`` of
        ``None`` for a ``zero_grad`` and start the sum again)."""
        for param, view, aliased in zip(self.params, self.views, self._aliased):
            param.grad = view if aliased else torch.zeros_like(param)


class SingleStepGradients:
    """The window store when a window is one micro-step on one process without loss scaling.

    Nothing is summed, reduced or unscaled then, so the fp32 buffer would only cost an in-place add per parameter
    and a zeroing per step. The micro-step's own gradients go to the optimizer as they are, cleared before each
    backward as a plain loop's ``optimizer.zero_grad(set_to_none=True)`` does. Same interface as
    ``GradientAccumulator`` for what the strategies call; no ``flat`` buffer.
    """

    flat: Tensor | None = None

    def __init__(self, params: Iterable[Parameter]) -> None:
        self.params = unique_trainable(params)
        if not self.params:
            raise ValueError("SingleStepGradients(params=...) got no trainable parameters; the optimizer is empty.")
        self.micro_steps = 0

    follows_zero_grad = True

    def begin_micro_step(self, window_ends: bool = False) -> None:
        for param in self.params:
            param.grad = None

    def zero_grad(self) -> None:
        for param in self.params:
            param.grad = None

    def unscale(self, scaling: Any, divisor: float) -> Tensor | None:
        """Nothing to divide: one micro-step on one process without a loss scale."""
        return None

    def end_micro_step(self) -> None:
        self.micro_steps += 1

    def has_overflow(self) -> Tensor:
        """Device flag: the micro-step's own gradients hold inf or NaN."""
        grads = [param.grad for param in self.params if param.grad is not None]
        if not grads:
            return torch.zeros((), dtype=torch.bool, device=self.params[0].device)
        return torch.logical_not(torch.stack([torch.isfinite(grad).all() for grad in grads]).all())

    def write_gradients(self) -> None:
        """The gradients are already in ``param.grad``."""

    def clear(self) -> None:
        self.micro_steps = 0

    def end_window(self) -> None:
        self.micro_steps = 0

    def state_dict(self) -> dict[str, Any]:
        return {"micro_steps": 0, "buffer": None}  # a window of one micro-step is never open at a checkpoint

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state.get("buffer") is not None or int(state["micro_steps"]):
            raise ValueError(
                f"The checkpoint was saved inside an accumulation window ({state['micro_steps']} micro-steps"
                " accumulated), but this run updates on every micro-batch (accumulation_steps=1). Resume with the"
                " checkpoint's accumulation_steps, or from a checkpoint saved at a window boundary."
            )
