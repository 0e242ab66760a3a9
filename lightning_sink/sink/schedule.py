"""Where a sink ends early: the micro-batches at which Lightning, without sinking, would validate, save a
checkpoint by steps or write a module's own logs.

A sink epoch of ``sink_size`` micro-batches is then run as several Lightning batches ("segments"): each ends at the
next schedule point or at the sink's planned end, so Lightning's own batch-end machinery (validation,
``ModelCheckpoint(every_n_train_steps)``, ``log_every_n_steps``, the time limit) runs at the same micro-batch and
``global_step`` as without sinking, and the epoch still trains ``sink_size`` micro-batches. The points are
integers known ahead (micro-batch counts and update counts), so the sink reads nothing back to decide them:

- ``val_check_interval=v`` (an int) with ``check_val_every_n_epoch=None``: after every v-th micro-batch of the fit;
  with ``check_val_every_n_epoch=c``: after every v-th micro-batch of a data pass, in every c-th pass (Lightning's
  epoch without sinking is a data pass);
- ``val_check_interval=f`` (a float below 1): after every ``max(1, int(P * f))``-th micro-batch of a data pass of P,
  as Lightning computes it; ``1.0`` (the default) keeps validation at sink ends (``check_val_every_n_epoch`` sinks);
- ``ModelCheckpoint(every_n_train_steps=n)``, and ``log_every_n_steps=n`` for a module that defines its own ``log``
  (the sink's log buffer writes every other module's values at the right steps itself): after the update that makes
  ``global_step`` a multiple of n.

``max_time`` is not a point known ahead: the sink loop compares a host clock with the deadline after each
call (one micro-batch, or several with ``micro_steps_per_call``) instead (``SinkLoop``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

__all__ = ["SchedulePoints", "SinkSchedule", "Segment", "validation_points"]


@dataclass(frozen=True)
class SchedulePoints:
    """The schedule points of a fit, as counts."""

    validate_every_in_fit: int | None = None  # micro-batches of the fit
    validate_every_in_pass: int | None = None  # micro-batches of a data pass
    validate_every_n_passes: int | None = None  # in which passes the in-pass points count (None: every pass)
    update_multiples: tuple[int, ...] = ()  # global_step multiples

    @property
    def any(self) -> bool:
        return bool(self.validate_every_in_fit or self.validate_every_in_pass or self.update_multiples)


@dataclass(frozen=True)
class Segment:
    """The micro-batches the next Lightning batch of a sink trains, and whether Lightning validates after them."""

    length: float  # math.inf: until the data pass ends (sink_size=-1 over a loader without a length)
    validates: bool
    ends_sink: bool


def validation_points(
    val_check_interval: int | float | None, check_every_n_epoch: int | None, pass_length: int | None
) -> tuple[int | None, int | None, int | None]:
    """``(every_in_fit, every_in_pass, every_n_passes)`` for a Trainer's step-based ``val_check_interval``, as
    Lightning reads it without sinking (a data pass is its epoch); all ``None`` for the default ``1.0``."""
    if val_check_interval is None or isinstance(val_check_interval, bool):
        return None, None, None
    if isinstance(val_check_interval, int):
        if check_every_n_epoch is None:
            return val_check_interval, None, None
        if pass_length is not None and val_check_interval > pass_length:
            raise ValueError(
                f"val_check_interval={val_check_interval} must be less than or equal to the number of micro-batches"
                f" in a data pass ({pass_length}), as without sinking. To validate every {val_check_interval}"
                " micro-batches of the whole fit, set check_val_every_n_epoch=None; to disable validation, set"
                " limit_val_batches=0."
            )
        return None, val_check_interval, check_every_n_epoch
    if val_check_interval == 1.0:
        return None, None, None
    if pass_length is None:
        raise ValueError(
            f"val_check_interval={val_check_interval} is a fraction of a data pass, and the training loader has no"
            " length: use an int (micro-batches) or 1.0, as without sinking."
        )
    return None, max(1, int(pass_length * val_check_interval)), check_every_n_epoch


class SinkSchedule:
    """Plans each segment of a sink from where the data and the window stand (pure arithmetic on counts)."""

    def __init__(
        self,
        points: SchedulePoints,
        sink_size: int,
        accumulation_steps: int,
        pass_length: int | None,
        whole_in_pass: int | None = None,
    ) -> None:
        """``whole_in_pass``: the pass's batches before a partial last one (None: ``pass_length``, none partial)."""
        self.points = points
        self.sink_size = sink_size
        self.accumulation_steps = accumulation_steps
        self.pass_length = pass_length
        self.whole_in_pass = pass_length if whole_in_pass is None else whole_in_pass

    def next_segment(
        self, trained_in_sink: int, trained_in_pass: int, pass_index: int, trained_total: int, in_window: int, step: int
    ) -> Segment:
        """The segment starting after ``trained_in_sink`` micro-batches of the sink (0: a new sink), the other
        counts as the data position and the window stand (``in_window``: micro-batches of the open window,
        ``step``: ``global_step``)."""
        size, length = self.sink_size, self.pass_length
        if size == -1 and length is None:
            return Segment(math.inf, False, True)  # one segment: the sink ends where the pass does
        points = self.points
        remaining = size - trained_in_sink if size != -1 else None
        if not points.any and remaining is not None:
            return Segment(remaining, False, True)
        # Simulate the micro-batches up to the first point (a few integer operations each).
        every_fit, every_pass = points.validate_every_in_fit, points.validate_every_in_pass
        n_passes, multiples, steps = points.validate_every_n_passes, points.update_multiples, self.accumulation_steps
        count = 0
        while True:
            if length is not None and trained_in_pass >= length:  # this pass ended: the next batch starts another
                if size == -1 and count:
                    return Segment(count, False, True)
                pass_index, trained_in_pass = pass_index + 1, 0
            count += 1
            trained_in_pass += 1
            trained_total += 1
            in_window += 1
            updated = in_window == steps
            if updated:
                in_window, step = 0, step + 1
            validates = bool(
                (every_fit and trained_total % every_fit == 0)
                or (
                    every_pass
                    and trained_in_pass % every_pass == 0
                    and (n_passes is None or (pass_index + 1) % n_passes == 0)
                )
            )
            if remaining is not None:
                ends = count == remaining
            else:
                ends = length is not None and trained_in_pass == length
            if ends or validates or (updated and any(step % n == 0 for n in multiples)):
                return Segment(count, validates, ends)
