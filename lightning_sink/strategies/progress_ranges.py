"""A training checkpoint's progress counters within what a run can produce.

``sink_state_check.py`` checks the ``lightning_sink`` state's own fields; this module checks the counters that place
the run in its training: Lightning's ``epoch`` and ``global_step``, the data position's ``pass_index``, and the
``sink_size`` a sink was saved under. Out of their ranges they would not fail: a step count of 10**18 or of -1
shifts every schedule that reads it (learning rates, checkpoints, validation), a pass index of 10**12 seeds a
shuffle no run reaches. Two checks, each one line naming the file and the field:

- ``check_lightning_counters`` when the checkpoint is read: ``epoch`` and ``global_step`` are ints in
  ``[0, MAX_COUNT]``;
- ``check_progress_against_fit`` at train start: the counters within what the saved data position and this fit's
  data allow, and the saved ``sink_size`` the one the data position's sink was trained under.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from lightning_sink import _lightning_compat as compat
from lightning_sink.counts import MAX_COUNT
from lightning_sink.strategies.sink_state_check import FitFacts, refuse_field

__all__ = ["LIGHTNING_COUNTERS", "check_lightning_counters", "check_progress_against_fit", "whole_count"]

LIGHTNING_COUNTERS = ("epoch", "global_step")


def _is_count(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= MAX_COUNT


def check_lightning_counters(checkpoint: dict[str, Any], checkpoint_path: Any) -> None:
    """Lightning's ``epoch`` and ``global_step`` (where the checkpoint has them): ints in ``[0, MAX_COUNT]``, and the
    ``global_step`` the one its loop state records (from which Lightning restores the run's step count)."""
    for name in LIGHTNING_COUNTERS:
        if name in checkpoint and not _is_count(checkpoint[name]):
            raise ValueError(
                f"{checkpoint_path}: the checkpoint is not valid: {name} is {checkpoint[name]!r}, expected an int in"
                f" [0, {MAX_COUNT}]"
            )
    recorded = compat.recorded_step_counts(checkpoint)
    if "global_step" in checkpoint and recorded and checkpoint["global_step"] not in recorded:
        raise ValueError(
            f"{checkpoint_path}: the checkpoint is not valid: global_step is {checkpoint['global_step']}, expected"
            f" {' or '.join(map(str, sorted(recorded)))} (the optimizer steps its loop state records)"
        )


def _updates_bound(fit: FitFacts) -> int | None:
    """The most optimizer updates the fit's epochs up to ``fit.epoch`` hold: one per micro-batch at most."""
    if fit.micro_batches_per_epoch is None or fit.epoch is None:
        return None
    return (fit.epoch + 1) * fit.micro_batches_per_epoch


def check_progress_against_fit(state: Mapping[str, Any], fit: FitFacts, checkpoint_path: Any) -> None:
    """At train start (Lightning has restored its counters into ``fit``): ``global_step`` within the updates the
    restored epochs can hold, ``pass_index`` within the micro-batches the state says were trained, and the saved
    ``sink_size`` the size of the sink the data position records."""
    bound = _updates_bound(fit)
    if fit.automatic and fit.global_step is not None and bound is not None and fit.global_step > bound:
        raise ValueError(
            f"{checkpoint_path}: the checkpoint is not valid: global_step is {fit.global_step}, expected an int in"
            f" [0, {bound}] (at most one update per micro-batch: epoch {fit.epoch}, {fit.micro_batches_per_epoch}"
            " micro-batches per epoch)"
        )
    data = state["data"]
    _check_pass_index(data, fit, checkpoint_path)
    _check_saved_sink(state, checkpoint_path)


def _check_pass_index(data: Mapping[str, Any], fit: FitFacts, checkpoint_path: Any) -> None:
    passes = data.get("pass_index", 0)
    if "trained_total" not in data:  # saved outside sink mode, where Lightning's epoch is the data pass
        if fit.epoch is None:
            return
        limit, why = fit.epoch + 1, f"a pass per epoch outside sink mode, at epoch {fit.epoch}"
    elif fit.batches_per_pass:
        limit = data["trained_total"] // fit.batches_per_pass + 1
        why = f"each pass is {fit.batches_per_pass} micro-batches and data.trained_total={data['trained_total']}"
    else:
        limit, why = (
            data["trained_total"],
            f"each pass is a micro-batch or more, data.trained_total={data['trained_total']}",
        )
    if passes > limit:
        raise refuse_field(checkpoint_path, "data.pass_index", passes, f"an int in [0, {limit}] ({why})")


def _check_saved_sink(state: Mapping[str, Any], checkpoint_path: Any) -> None:
    """The saved ``sink_size`` agrees with the sink the data position records: the sink loop saves ``sink_open`` as
    ``trained_in_sink < sink_size``, so a sink recorded as ended after t micro-batches was a sink of t."""
    saved, data = state.get("sink_size"), state["data"]
    trained = data.get("trained_in_sink", 0)
    if not isinstance(saved, int) or saved < 1 or "sink_open" not in data or trained == 0:
        return
    if trained > saved:
        raise refuse_field(
            checkpoint_path, "data.trained_in_sink", trained, f"an int in [0, {saved}] (a sink of sink_size={saved})"
        )
    if data["sink_open"] != (trained < saved):
        expected = f"an int > {trained}" if data["sink_open"] else str(trained)
        raise refuse_field(
            checkpoint_path,
            "sink_size",
            saved,
            f"{expected} (data.trained_in_sink={trained} with data.sink_open={data['sink_open']}: the sink"
            f" {'was still open' if data['sink_open'] else 'ended'} after {trained} micro-batches)",
        )


def whole_count(count: int | float | None) -> int | None:
    """A length Lightning reports (an int, a float such as ``inf``), as an int where it is a finite whole number."""
    if isinstance(count, int) or (isinstance(count, float) and count.is_integer()):
        return int(count)
    return None
