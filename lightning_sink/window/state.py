"""The open window's state, one object: its gradient store (the fp32 sum and the backward passes in it), the
micro-batches it has seen, whether it is to be dropped, whether it overflowed, and the divisor of its losses.

The checkpoint saves it whole and a resume restores it whole. Micro-batches and backward passes differ when a
``training_step`` returns ``None`` (the micro-batch belongs to the window but adds no gradient); the window closes
after ``accumulation_steps`` micro-batches and its update is the mean over its backward passes.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, overload

from lightning_sink.window.protocols import GradientStore

if TYPE_CHECKING:
    from torch import Tensor

__all__ = ["Window", "window_mean_divisor"]


@overload
def window_mean_divisor(backward_passes: int, ranks_in_sum: int, loss_divisor: int) -> float: ...
@overload
def window_mean_divisor(backward_passes: Tensor, ranks_in_sum: int, loss_divisor: int) -> Tensor: ...
def window_mean_divisor(backward_passes: int | Tensor, ranks_in_sum: int, loss_divisor: int) -> float | Tensor:
    """The one rule that turns a window's reduced gradient sum into its mean: every loss was divided by
    ``loss_divisor`` already, so the mean over the backward passes (on every rank in the sum) divides by the rest.
    ``Window.mean_divisor`` calls it with ints; the compiled update program traces it with a device count."""
    return backward_passes * ranks_in_sum / loss_divisor


class Window:
    """One accumulation window.

    Args:
        store: where its gradient sum lives (``GradientStore``); replaced between windows when the optimizer's
            trainable parameters change.
        ranks_in_sum: how many ranks' gradients the reduced sum adds up (1 where the reduction already averages).
    """

    def __init__(self, store: GradientStore, ranks_in_sum: int) -> None:
        self.store = store
        self.ranks_in_sum = ranks_in_sum
        self.micro_batches = 0  # micro-batches of the open window, None-returning ones included
        self.drop = False  # the epoch ends inside this window under partial_window="drop": its sum is discarded
        self.overflowed = False  # a backward of this window overflowed (checked under skip_window_on_overflow)
        self.loss_divisor = 1  # what each micro-batch's loss was divided by before its backward
        # partial_window="lightning": every window, a short one too, is divided as stock Lightning divides it, by
        # the full window's size (loss_divisor) alone, so that a project switching over can confirm equal curves
        self.divides_as_stock = False

    @property
    def backward_passes(self) -> int:
        """Micro-batches whose loss was backpropagated into the sum (``training_step`` returned a loss)."""
        return self.store.micro_steps

    def mean_divisor(self) -> float:
        """What turns the reduced sum into the mean gradient: every loss was divided by ``loss_divisor`` already,
        so the mean over the backward passes (on every rank in the sum) divides by the rest. Divided as stock
        (``divides_as_stock``), only the sum over the ranks is left to divide."""
        if self.divides_as_stock:
            return self.ranks_in_sum
        return window_mean_divisor(self.backward_passes, self.ranks_in_sum, self.loss_divisor)

    def divide_losses_by(self, divisor: int) -> None:
        """The programs that train the next micro-batches divide each loss by ``divisor`` before its backward (the
        update divides the sum by the rest, ``mean_divisor``). An open window's sum so far, of losses divided
        otherwise (a checkpoint of other programs), is rescaled to the new division."""
        if divisor != self.loss_divisor and self.backward_passes:
            self.store.scale_sum(self.loss_divisor / divisor)
        self.loss_divisor = divisor

    def count_micro_batch(self) -> None:
        """A micro-batch of this window ran (its ``training_step`` returned a loss or ``None``)."""
        self.micro_batches += 1

    def count_backward(self) -> None:
        """A backward pass added into the sum outside the store's own micro-step (the compiled programs add it on the
        device; the store counts it on the host)."""
        self.store.micro_steps += 1

    def close(self) -> None:
        """The window's last micro-batch is in: its update runs next, and a micro-batch after it opens a new window."""
        self.micro_batches = 0

    def clear_backward_count(self) -> None:
        """The compiled programs' update reset their device sum: the store's host count of it follows."""
        self.store.micro_steps = 0

    def end(self) -> None:
        """The window's update is done (or the window is dropped): the next micro-batch opens a new one."""
        self.micro_batches = 0
        self.drop = False
        self.overflowed = False

    def state_dict(self) -> dict[str, Any]:
        """The store's state (``micro_steps``: backward passes, ``buffer``) and the window's own fields."""
        return {
            **self.store.state_dict(),
            "micro_batches": self.micro_batches,
            "drop": self.drop,
            "overflowed": self.overflowed,
            "loss_divisor": self.loss_divisor,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore a saved window. A checkpoint written before the window's own fields were saved holds only the
        backward passes: those stand in for the micro-batches, as they did when it was written."""
        saved_store = {"micro_steps": state["micro_steps"], "buffer": state.get("buffer")}
        if state.get("reached") is not None:
            saved_store["reached"] = state["reached"]  # (the parameters the open window's backward passes reached)
        self.store.load_state_dict(saved_store)
        self.micro_batches = int(state.get("micro_batches", state["micro_steps"]))
        self.drop = bool(state.get("drop", False))
        self.overflowed = bool(state.get("overflowed", False))
        if self.micro_batches or self.backward_passes:
            # an open window goes on with the division its losses had (a resume refuses other settings); a closed
            # one leaves this run's own, which may differ (accumulation_steps may change at a window boundary)
            self.loss_divisor = int(state.get("loss_divisor", self.loss_divisor))
