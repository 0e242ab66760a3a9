"""Lightning's progress bar counted in micro-batches during sink mode.

A sink is one Lightning batch (or a few segments) and the placeholder loader has no length, so Lightning's own bar
would show ``1/-- 0.00it/s`` for a sink of hundreds of micro-batches. While a sink fit runs, the training bar of
Lightning's ``TQDMProgressBar`` or ``RichProgressBar`` (either package's) is told the epoch's micro-batches instead:
its total at each epoch's start, its count after each step call of the sink loop (one micro-batch, or one compiled
call of several) and at each segment's end, so it shows micro-batches done out of the epoch's, their rate per second
and the time left. The bar itself draws as configured (its refresh rate, its theme); a progress bar of another kind
is left alone. The bar's hooks are wrapped on the instance for the fit and given back at its end.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

__all__ = ["SinkProgress", "epoch_micro_batches"]

_RICH_REDRAW_SECONDS = 0.1  # Rich redraws on request only (tqdm throttles itself): at most 10 redraws a second


def epoch_micro_batches(sink_size: int, pass_length: int | None) -> int | None:
    """Micro-batches in a sink-mode epoch: the sink's size, or a data pass's (``sink_size=-1``; None: unsized)."""
    return pass_length if sink_size == -1 else sink_size


def _training_bar(callback: Any) -> Any:
    """Lightning's ``tqdm`` training bar of a ``TQDMProgressBar``, None until it exists (or for another bar)."""
    try:
        return callback.train_progress_bar
    except (TypeError, AssertionError):  # (TQDMProgressBar / RichProgressBar: not made yet)
        return None


def _kind(callback: Any) -> str | None:
    names = {cls.__name__ for cls in type(callback).__mro__}
    if "TQDMProgressBar" in names:
        return "tqdm"
    if "RichProgressBar" in names:
        return "rich"
    return None


class SinkProgress:
    """Drives one fit's training progress bar in micro-batches.

    Args:
        callback: the Trainer's ``progress_bar_callback`` (a ``TQDMProgressBar`` or ``RichProgressBar``).
        epoch_total: micro-batches per epoch (``epoch_micro_batches``), or None where unknown.
        done_in_epoch: micro-batches of the epoch trained so far (a resumed epoch counts those before the resume).
    """

    def __init__(self, callback: Any, epoch_total: int | None, done_in_epoch: Callable[[], int]) -> None:
        self._callback = callback
        self._kind = _kind(callback)
        self._epoch_total = epoch_total
        self._done = done_in_epoch
        self._redrawn_at = 0.0
        self._wrapped: dict[str, Any] = {}

    @classmethod
    def install(cls, trainer: Any, epoch_total: int | None, done_in_epoch: Callable[[], int]) -> SinkProgress | None:
        """Wrap the Trainer's progress bar for this fit; None when it has none this module knows."""
        callback = getattr(trainer, "progress_bar_callback", None)
        if callback is None or _kind(callback) is None:
            return None
        progress = cls(callback, epoch_total, done_in_epoch)
        progress._wrap("on_train_epoch_start", progress._epoch_started)
        progress._wrap("on_train_batch_end", progress._segment_ended)
        progress._set_total()  # (the bar exists from its own train start on; an epoch a resume continues has no start)
        return progress

    def _wrap(self, hook: str, replacement: Callable[..., None]) -> None:
        self._wrapped[hook] = getattr(self._callback, hook)
        setattr(self._callback, hook, replacement)  # (an instance attribute: Lightning looks hooks up by name)

    def remove(self) -> None:
        """Give the bar its own hooks back (fit end)."""
        for hook in self._wrapped:
            delattr(self._callback, hook)
        self._wrapped.clear()

    def _epoch_started(self, trainer: Any, *args: Any, **kwargs: Any) -> None:
        self._wrapped["on_train_epoch_start"](trainer, *args, **kwargs)
        self._set_total()

    def _set_total(self) -> None:
        """The epoch's micro-batches as the bar's total. Also at segment ends: Lightning does not start an epoch
        that a resume continues, so the bar has no total for it until then."""
        if self._kind == "tqdm":
            bar = _training_bar(self._callback)
            if bar is not None and bar.total != self._epoch_total:
                bar.total = self._epoch_total
                bar.refresh()
        elif self._task() is not None:
            self._callback.progress.update(self._task(), total=self._epoch_total)

    def _segment_ended(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        """The bar's own end of batch (postfix metrics and all), told the micro-batches instead of the segments."""
        self._set_total()
        self._wrapped["on_train_batch_end"](trainer, pl_module, outputs, batch, self._done() - 1)

    def _task(self) -> Any:
        callback = self._callback
        return callback.train_progress_bar_id if getattr(callback, "progress", None) is not None else None

    def advance(self) -> None:
        """After each step call of the sink loop: the count moves (the bar redraws at its own pace)."""
        if self._kind == "tqdm":
            bar = _training_bar(self._callback)
            if bar is not None and not bar.disable:
                if bar.total != self._epoch_total:
                    self._set_total()  # (a resumed epoch's first call)
                bar.update(self._done() - bar.n)  # (tqdm redraws only after its own minimum interval)
            return
        task = self._task()
        if task is None or not self._callback.is_enabled:
            return
        self._callback.progress.update(task, completed=self._done())
        now = time.monotonic()
        if now - self._redrawn_at >= _RICH_REDRAW_SECONDS:
            self._redrawn_at = now
            self._callback.refresh()
