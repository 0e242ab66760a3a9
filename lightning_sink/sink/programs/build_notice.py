"""What a fit with compiled step programs says about their build, so that a user knows before waiting for it.

- At the fit's start, one line: what the first sink compiles, and how long the last build of the same module,
  optimizer and settings took, with what it gained per micro-step (``compiled/build_record.py``, kept beside
  Inductor's on-disk cache), or that none is recorded.
- After the build, in the build's own line: what Inductor's on-disk cache did (``cache_note``) and the step times
  measured (``step_times``); its figures recorded for the next fit (rank 0 writes).
- Where the fit has fewer micro-batches left than the build needs to repay itself (its seconds over the gain per
  micro-step), one warning saying so and that ``graph_mode="eager"`` would finish sooner: at the start from the last
  build's figures, or, where none is recorded, after this fit's build from its own (one judgment per fit). Where
  the last build kept its loop on disk, this fit's build is most likely that loop loaded, not the last build's
  cost again, so the judgment waits for this fit's own figures.
"""

from __future__ import annotations

import math
from typing import Any

from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn

from lightning_sink._torch_compat import inductor_cache_folder
from lightning_sink.compiled.build_record import BuildFigures, BuildRecord, build_key
from lightning_sink.compiled.step_programs import StepPrograms
from lightning_sink.sink.staging import StagedData
from lightning_sink.strategies.engine import StepEngine

__all__ = ["BuildNotice", "cache_note", "data_note", "length_note", "step_times"]


class BuildNotice:
    """One fit's notices about its compiled programs' build."""

    def __init__(
        self, engine: StepEngine, graph_mode: str, settings: dict[str, Any], record: BuildRecord | None = None
    ) -> None:
        """``settings``: what besides the module and optimizer makes two builds the same (``build_key``)."""
        self.engine, self.graph_mode = engine, graph_mode
        self.record = record if record is not None else BuildRecord(inductor_cache_folder())
        module = engine.trainer.lightning_module
        assert module is not None
        self._module_name = type(module).__name__
        self.key = build_key(module, engine.optimizer(), settings)
        self._judged = False  # whether the fit's length was judged against a build's figures already

    def at_fit_start(self) -> None:
        figures = self.record.load(self.key)
        rank_zero_info(self._plan_line(figures))
        if figures is not None and not figures.loop_kept:
            self._judged = True
            self._warn_if_too_short(figures, "the last build")

    def after_build(self, figures: BuildFigures) -> None:
        if self.engine.trainer.is_global_zero:
            self.record.save(self.key, figures)
        if not self._judged:  # (a first build: nothing was known at the start)
            self._judged = True
            self._warn_if_too_short(figures, "its build")

    def _prefix(self) -> str:
        return f"{type(self.engine.host).__name__}(graph_mode={self.graph_mode!r})"

    def _plan_line(self, figures: BuildFigures | None) -> str:
        plan = (
            f"{self._prefix()}: the first sink compiles the step programs of {self._module_name} with"
            f" {type(self.engine.optimizer()).__name__}"
        )
        if figures is None:
            return (
                f"{plan}; no earlier build of the same module, optimizer and settings is recorded (a first build"
                " on a CPU can take minutes; an identical later one takes its graphs from Inductor's on-disk cache)"
            )
        kept = (
            " and kept its loop on disk, which this fit loads unless the module, its code or its settings changed"
            if figures.loop_kept
            else ""
        )
        return (
            f"{plan}; the last build of the same module, optimizer and settings took {figures.build_seconds:.1f} s"
            f"{step_times(figures)}{kept}"
        )

    def _warn_if_too_short(self, figures: BuildFigures, whose: str) -> None:
        repays_after, left = figures.repays_after(), self._micro_batches_left()
        if repays_after is None or left is None or left >= repays_after:
            return
        if math.isinf(repays_after):
            why = f"compiled micro-steps were no faster than eager ones at {whose}{step_times(figures)}"
        else:
            why = (
                f"{whose} took {figures.build_seconds:.1f} s and repays after about {repays_after:,.0f} micro-batches"
                f"{step_times(figures)}"
            )
        rank_zero_warn(
            f"{self._prefix()}: this fit's {left:,} micro-batches left are too short to repay the build ({why});"
            " graph_mode='eager' would finish sooner."
        )

    def _micro_batches_left(self) -> int | None:
        """The fit's micro-batches still to train (None: no limit, ``max_steps=-1`` and ``max_epochs=-1``)."""
        trainer = self.engine.trainer
        updates = trainer.estimated_stepping_batches
        if not math.isfinite(updates):
            return None
        return max(0, int(updates) - trainer.global_step) * self.engine.accumulation_steps


def step_times(figures: BuildFigures) -> str:
    """`` (one micro-step E ms eager, C ms compiled)``, where measured."""
    if figures.eager_step_seconds is None or figures.compiled_step_seconds is None:
        return ""
    return (
        f" (one micro-step {figures.eager_step_seconds * 1e3:.3g} ms eager,"
        f" {figures.compiled_step_seconds * 1e3:.3g} ms compiled)"
    )


def cache_note(before: tuple[int, int], after: tuple[int, int]) -> str:
    """What Inductor's on-disk cache of compiled graphs did for this build (it outlives the process: an identical
    fit, in this process or a later one, takes its graphs from there)."""
    hits, misses = after[0] - before[0], after[1] - before[1]
    if hits and not misses:
        return f" (all {hits} graphs from Inductor's on-disk cache: an identical build ran before)"
    if hits:
        return f" ({hits} of {hits + misses} graphs from Inductor's on-disk cache)"
    if misses:
        return f" ({misses} graphs compiled and kept in Inductor's on-disk cache: an identical fit builds faster)"
    return ""


def length_note(built: StepPrograms, several: int | None, not_scheduled: str | None, asked: int | None) -> str:
    """The build line's micro-steps per call: ``several`` built (None: the build's choice, with its reason), why a
    step scheduler keeps one per call (``not_scheduled``), and the user's ``micro_steps_per_call`` (``asked``)."""
    if not_scheduled is not None and asked is None:
        return f", one micro-step per call ({not_scheduled})"
    if several is None:
        return f", and {built.call_note}"
    return f", and {several} micro-steps per call (one loop over its windows)" if several > 1 else ""


def data_note(staging: StagedData | None, not_staged: str | None) -> str:
    """The build line's account of how the batches reach the programs."""
    if staging is not None:
        return (
            f"each batch gathered on the device from the training set staged there"
            f" ({staging.staged_bytes / 2**20:.1f} MiB)"
        )
    if not_staged is not None:
        return f"batches read by the loader path (not staged on the device: {not_staged})"
    return "batches read by the loader path"
