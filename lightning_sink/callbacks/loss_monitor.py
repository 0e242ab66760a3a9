"""``LossMonitor``: MindSpore's loss line, ``epoch: 1 step: 1000, loss is 0.5399815``, for Lightning.

Print rule (MindSpore's ``LossMonitor``): the callback looks at the loss at the end of every Lightning batch, which
is every step outside sink mode and once per sink in sink mode, and prints when at least ``per_print_times`` steps
have passed since the last line (counting steps over the whole run). So outside sink mode it prints at steps
``per_print_times``, ``2 * per_print_times``, ...; in sink mode with ``per_print_times <= K`` once per sink.
"""

from __future__ import annotations

import math
import warnings
from typing import Any, Literal

import lightning.pytorch as pl
import numpy as np
import torch
from lightning.pytorch.callbacks import Callback
from torch import Tensor
from typing_extensions import override

from lightning_sink import _lightning_compat as compat
from lightning_sink.callbacks._progress import StepCounter, UpdateAxis, batch_losses, is_sink, log_scalars
from lightning_sink.counts import check_count_fits

__all__ = ["LossMonitor", "NonFiniteLossError", "format_loss", "ON_NONFINITE"]

ON_NONFINITE = ("raise", "stop", "warn")


class NonFiniteLossError(RuntimeError):
    """A step produced a NaN or infinite loss and ``LossMonitor(on_nonfinite="raise")`` stopped training."""


def format_loss(value: float, dtype: torch.dtype) -> str:
    """The loss as MindSpore prints it: numpy's shortest round-trip form of a float32 value (``0.5399815``); a
    float64 loss keeps its float64 digits, as MindSpore prints a float64 loss."""
    return str(np.float64(value)) if dtype == torch.float64 else str(np.float32(value))


class _PendingLosses:
    """Losses of the steps since the last read, kept on the device with the (epoch, step) of their first step and
    the factor to multiply them by once read."""

    def __init__(self) -> None:
        self.chunks: list[tuple[int, int, Tensor, int]] = []

    def add(self, epoch: int, first_step: int, losses: Tensor, factor: int) -> None:
        self.chunks.append((epoch, first_step, losses, factor))

    def read(self) -> tuple[tuple[int, int, float] | None, float | None]:
        """(epoch, step, value) of the first NaN/inf loss (or None), and the last loss (or None); then forgets them.

        Host sync: one read (``tolist``) of all pending losses, at a print point or at the end of a sink or an
        epoch, never per step. (float64 holds every float32, bf16 and fp16 value exactly.)
        """
        if not self.chunks:
            return None, None
        tensors = [losses for _, _, losses, _ in self.chunks]
        if all(t.dim() == 0 for t in tensors):  # outside sink mode: one 0-d loss per step
            flat = torch.stack(tensors)
        else:
            flat = torch.cat([t.reshape(-1) for t in tensors])
        values = flat.double().tolist()
        found, start = None, 0
        for epoch, first_step, losses, factor in self.chunks:
            chunk = [value * factor for value in values[start : start + losses.numel()]]
            bad = next((offset for offset, value in enumerate(chunk) if not math.isfinite(value)), None)
            if bad is not None and found is None:
                found = (epoch, first_step + bad, chunk[bad])
            start += losses.numel()
        self.chunks.clear()
        return found, chunk[-1]


class LossMonitor(Callback):
    """Print and log the training loss as MindSpore's ``LossMonitor`` does; act on NaN/inf losses.

    Args:
        per_print_times: print (and log) when at least this many steps have passed since the last line. A step is
            one batch through the network: a micro-batch under accumulation, one of the K batches of a sink.
        on_nonfinite: what a NaN or infinite loss does. ``"raise"``: stop with ``NonFiniteLossError`` naming the
            epoch, step and value; ``"stop"``: finish the current Lightning batch and stop training cleanly
            (``trainer.should_stop``), with a warning naming them; ``"warn"``: warn and carry on.

    The line is ``epoch: E step: S, loss is L``: E is 1-based, S the step within the epoch, L the last step's loss.
    Only global rank 0 prints (its own loss); every rank checks its losses, and on several ranks they agree
    (one boolean all-reduce per check) so all raise or stop together.

    The printed loss is also logged as ``loss`` to every logger of the Trainer, on Lightning's step axis (where
    ``self.log`` puts each update's values): a loss that belongs to the u-th optimizer update (its micro-batch is
    in that update's accumulation window) is written at step u - 1. At most one point per step: when several
    printed lines fall in one window, the last one's loss is written, once that window has closed (or at the
    epoch's end).
    """

    def __init__(self, per_print_times: int = 1, on_nonfinite: Literal["raise", "stop", "warn"] = "raise") -> None:
        check_count_fits("per_print_times", per_print_times)
        if isinstance(per_print_times, bool) or not isinstance(per_print_times, int) or per_print_times < 1:
            raise ValueError(
                f"per_print_times={per_print_times!r} is not valid: pass an int >= 1 (steps between printed lines)."
            )
        if on_nonfinite not in ON_NONFINITE:
            raise ValueError(
                f"on_nonfinite={on_nonfinite!r} is not valid: choose one of {', '.join(map(repr, ON_NONFINITE))}."
            )
        self.per_print_times, self.on_nonfinite = per_print_times, on_nonfinite
        self.steps = StepCounter()
        self.last_print_step = 0  # steps.total at the last printed line
        self._pending = _PendingLosses()
        self._axis = UpdateAxis()
        self._unlogged: tuple[int, float] | None = None  # (step, loss) of a printed line whose window is still open
        self._last_logged_step = -1

    @property
    @override
    def state_key(self) -> str:
        return compat.callback_state_key(self, per_print_times=self.per_print_times)

    @override
    def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.steps.start_epoch()

    @override
    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        self._axis.batch_start(trainer)

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        losses = batch_losses(trainer, outputs, batch)
        steps = self.steps.advance(outputs, batch, batch_idx)
        epoch = trainer.current_epoch + 1
        if losses is not None:
            self._pending.add(epoch, self.steps.in_epoch - steps + 1, *losses)
        print_now = self.steps.total - self.last_print_step >= self.per_print_times
        if not (print_now or is_sink(batch)):
            return  # nothing is read back between print points (a sink is checked as it ends)
        found, last_value = self._pending.read()  # the one host read of this batch
        self._act_on_nonfinite(trainer, found)
        if print_now and losses is not None and last_value is not None:
            self.last_print_step = self.steps.total
            self._report(trainer, epoch, last_value, losses[0].dtype)

    @override
    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._pending.chunks:  # steps after the epoch's last check (the same on every rank: no collective skew)
            self._act_on_nonfinite(trainer, self._pending.read()[0])
        if self._unlogged is not None:
            self._log(trainer, *self._unlogged)

    def _report(self, trainer: pl.Trainer, epoch: int, value: float, dtype: torch.dtype) -> None:
        if trainer.is_global_zero:
            print(f"epoch: {epoch} step: {self.steps.in_epoch}, loss is {format_loss(value, dtype)}", flush=True)
        step, window_closed = self._axis.position(trainer)
        if self._unlogged is not None and self._unlogged[0] != step:
            self._log(trainer, *self._unlogged)  # a later window: the earlier line was its window's last
        self._unlogged = (step, value)
        if window_closed:
            self._log(trainer, step, value)

    def _log(self, trainer: pl.Trainer, step: int, value: float) -> None:
        self._unlogged = None
        if step > self._last_logged_step:  # (a window carried across epochs is logged at the first epoch's end)
            self._last_logged_step = step
            log_scalars(trainer, {"loss": value}, step=step)

    def _act_on_nonfinite(self, trainer: pl.Trainer, found: tuple[int, int, float] | None) -> None:
        if trainer.world_size > 1:  # every rank reaches the same check points, so this collective lines up
            if not trainer.strategy.reduce_boolean_decision(found is not None, all=False):
                return
        elif found is None:
            return
        if found is None:
            if self.on_nonfinite == "warn":
                return  # the rank that saw it warns
            message = (
                "LossMonitor: another rank's loss is NaN or infinite (by epoch:"
                f" {trainer.current_epoch + 1} step: {self.steps.in_epoch})"
            )
        else:
            epoch, step, value = found
            message = (
                f"LossMonitor: the loss is {value} at epoch: {epoch} step: {step} (global rank {trainer.global_rank})"
            )
        if self.on_nonfinite == "raise":
            raise NonFiniteLossError(f"{message}; training stopped (on_nonfinite='raise').")
        if self.on_nonfinite == "stop":
            trainer.should_stop = True
            warnings.warn(f"{message}; stopping training after this batch (on_nonfinite='stop').", stacklevel=2)
        else:
            warnings.warn(f"{message}; training goes on (on_nonfinite='warn').", stacklevel=2)

    @override
    def state_dict(self) -> dict[str, Any]:
        return {"steps": self.steps.state_dict(), "last_print_step": self.last_print_step}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.steps.load_state_dict(state_dict["steps"])
        self.last_print_step = int(state_dict["last_print_step"])
