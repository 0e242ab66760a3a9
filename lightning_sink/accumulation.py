"""Gradient accumulation state: fp32 buffers, the window position, and the partial-window rule.

This is MindSpore's ``accu_grads`` (``TrainAccuStepsCell``) for PyTorch: one flat fp32 tensor holds the
gradient sum of the current window for every trainable parameter (float64 where a parameter is float64, so that
its sum loses nothing). Parameters of the buffer's dtype let autograd add straight into their slice of it
(``param.grad`` is a view), so accumulating costs no extra copy; low-precision parameters get a fresh gradient each
micro-step that is added in fp32, so 64 bf16 micro-steps lose nothing to bf16 rounding.

A parameter that no backward of the window reached (an unused branch, a layer skipped for some batches) has no
gradient at the update, as after Lightning's ``zero_grad``: its ``.grad`` is ``None``, so the optimizer leaves it
and its state alone rather than stepping it on a zero gradient (weight decay, momentum). The store learns which
parameters a backward reached from autograd's post-accumulate hooks, on one process (``tracks_reached``); under
several processes another rank may have reached it, so every parameter takes the summed gradient, zero or not.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
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

    def __init__(
        self, params: Iterable[Parameter], follows_zero_grad: bool = True, tracks_reached: bool = False
    ) -> None:
        """``tracks_reached``: learn which parameters a backward of the window reached, and give the others no
        gradient at the update (one process; see the module's docstring)."""
        self.params = unique_trainable(params)
        if not self.params:
            raise ValueError("GradientAccumulator(params=...) got no trainable parameters; the optimizer is empty.")
        device = self.params[0].device
        total = sum(p.numel() for p in self.params)
        dtype = torch.float64 if any(p.dtype == torch.float64 for p in self.params) else torch.float32
        self.flat = torch.zeros(total, dtype=dtype, device=device)
        self.views: list[Tensor] = []
        offset = 0
        for param in self.params:
            self.views.append(self.flat[offset : offset + param.numel()].view_as(param))
            offset += param.numel()
        self._aliased = [p.dtype == dtype and p.device == device for p in self.params]
        self.follows_zero_grad = follows_zero_grad
        self.micro_steps = 0
        # per parameter: whether a backward of the open window reached it (always, when not tracked)
        self.reached = [True] * len(self.params)
        self._hooks = []
        if tracks_reached:
            self.reached = [False] * len(self.params)
            self._hooks = [
                param.register_post_accumulate_grad_hook(self._marker(i)) for i, param in enumerate(self.params)
            ]

    def _marker(self, index: int) -> Callable[[Tensor], None]:
        reached = self.reached

        def mark(param: Tensor) -> None:
            reached[index] = True

        return mark

    def scale_sum(self, factor: float) -> None:
        self.flat.mul_(factor)

    def release(self) -> None:
        """Take the store's hooks off the parameters (a new store replaces it, or the fit ended)."""
        for hook in self._hooks:
            hook.remove()
        self._hooks = []

    def _restart(self, index: int) -> None:
        """Parameter ``index``'s sum starts again (a zero-grad): no backward has reached it yet."""
        if self._hooks:
            self.reached[index] = False

    def begin_micro_step(self, window_ends: bool = False) -> None:
        """Prepare ``.grad`` for a backward that adds into the window's fp32 sum.

        The sum follows ``zero_grad`` as a plain ``.grad`` would: a gradient set to ``None`` since the last backward
        (``optimizer.zero_grad()``) starts again from zero, a view zeroed in place (``set_to_none=False``) is zero
        already, and a gradient left alone keeps accumulating. Without ``follows_zero_grad`` (windows that run
        across Lightning's own zero-grad points) only ``clear`` resets the sum. A parameter no backward of the window
        has reached yet keeps ``.grad`` at ``None``, as with a plain ``.grad`` (its sum is zero): the backward that
        reaches it gives it a fresh gradient, which ``end_micro_step`` takes into the sum.
        """
        for index, (param, view, aliased) in enumerate(zip(self.params, self.views, self._aliased)):
            grad = param.grad
            if aliased:
                if grad is view:
                    continue
                if grad is not None:
                    view.copy_(grad)  # a gradient assigned by hand joins the window
                    self.reached[index] = True
                elif self.follows_zero_grad:
                    view.zero_()
                    self._restart(index)
                param.grad = view if self.reached[index] else None
            else:
                if grad is None and self.follows_zero_grad:
                    view.zero_()
                    self._restart(index)
                param.grad = None  # a fresh low-precision gradient, added in fp32 by end_micro_step

    def end_micro_step(self) -> None:
        """Take this micro-step's fresh gradients into the sum (low-precision ones added in fp32, a first one of a
        parameter copied), and a gradient that a hook after the backward (``on_after_backward``) assigned by hand,
        or set to ``None``, as the window's sum so far.

        Low-precision ``.grad`` keeps a tensor afterwards (never ``None``), so that ``begin_micro_step`` can tell a
        ``zero_grad(set_to_none=True)`` from a window that goes on.
        """
        for index, (param, view, aliased) in enumerate(zip(self.params, self.views, self._aliased)):
            grad = param.grad
            if aliased:
                if grad is view:
                    continue
                if grad is None:
                    view.zero_()  # not reached yet, or the sum was discarded: the next backward starts it again
                    self._restart(index)
                    if not self._hooks:
                        param.grad = view
                    continue
                view.copy_(grad)
                self.reached[index] = True
                param.grad = view
                continue
            if grad is not None:
                view.add_(grad)
            else:
                param.grad = torch.zeros_like(param)  # unused this micro-step: still inside the window
        self.micro_steps += 1

    def zero_grad(self) -> None:
        """What ``optimizer.zero_grad()`` followed by ``begin_micro_step`` amounts to, in one kernel."""
        self.flat.zero_()
        for index, (param, view, aliased) in enumerate(zip(self.params, self.views, self._aliased)):
            self._restart(index)
            if aliased and not self._hooks:
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
        """Hand the (already unscaled, averaged) window gradient to the optimizer as ``param.grad``; ``None`` for a
        parameter no backward of the window reached."""
        for param, view, aliased, reached in zip(self.params, self.views, self._aliased, self.reached):
            if not reached:
                param.grad = None
            elif not aliased:
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
        for index, (param, aliased) in enumerate(zip(self.params, self._aliased)):
            self._restart(index)
            if not aliased or self._hooks:
                param.grad = None

    def state_dict(self) -> dict[str, Any]:
        """The window position, and the buffer only when the window is open (it is all zeros otherwise), with the
        parameters its backward passes reached where the store tracks them."""
        state: dict[str, Any] = {
            "micro_steps": self.micro_steps,
            "buffer": self.flat.clone() if self.micro_steps else None,
        }
        if self._hooks and self.micro_steps:
            state["reached"] = list(self.reached)
        return state

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
        reached = state.get("reached")
        if self._hooks and isinstance(reached, list) and len(reached) == len(self.reached):
            self.reached[:] = [bool(value) for value in reached]
            self._attach_grads()

    def attach(self) -> None:
        """The sum, written from elsewhere (a checkpoint, the compiled programs' buffers), as the open window's:
        attached to ``.grad``, so that the next backward adds to it (``begin_micro_step`` would take a ``.grad`` of
        ``None`` for a ``zero_grad`` and start the sum again)."""
        # an open window's sum came from elsewhere, so which parameters its backward passes reached is not known:
        # every parameter takes its sum (a resume restores what was saved); an empty one has reached none yet
        self.reached[:] = [bool(self.micro_steps) or not self._hooks] * len(self.reached)
        self._attach_grads()

    def _attach_grads(self) -> None:
        """``.grad`` as the window's state says: the sum's view for a parameter reached, ``None`` for the others."""
        for param, view, aliased, reached in zip(self.params, self.views, self._aliased, self.reached):
            if not reached:
                param.grad = None
            else:
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

    def scale_sum(self, factor: float) -> None:
        """A window of one micro-step is never open between programs: nothing to scale."""

    def release(self) -> None:
        """Nothing attached: ``.grad`` is the parameters' own."""

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
