"""The overrides of Lightning's loop methods a fit installs and removes as one unit."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import lightning.pytorch as pl

from lightning_sink._lightning_compat.loop_access import automatic_optimization, epoch_loop

# Names of the instance attributes we shadow on the epoch loop; deleting them restores Lightning's methods.
_SHADOWED = ("_should_accumulate", "update_lr_schedulers", "_num_ready_batches_reached", "_should_check_val_fx")
# The same on the automatic optimization: the closure's zero-grad and backward functions, where sinks skip them.
_SHADOWED_CLOSURE = ("_make_zero_grad_fn", "_make_backward_fn")


@dataclass(frozen=True)
class LoopOverrides:
    """Every override of a Lightning loop method a fit needs, installed and removed as one unit.

    - ``batch_has_no_update`` answers Lightning's "does this batch accumulate?" (``_should_accumulate``). Needed only
      where windows do not follow Lightning's ``batch_idx % accumulate_grad_batches`` rule: windows that run across
      epochs (``partial_window="carry"``), a last partial window that is dropped, and sinks (a Lightning batch holds
      many updates, which the strategy counts itself). Lightning asks before and after the optimizer hook, for LR
      schedulers, logging and validation zero-grad; one answer keeps them consistent.
    - ``hold_step_schedulers`` skips Lightning's step-interval LR scheduler step when it returns True (an update
      skipped on overflow, or in sink mode, where the strategy steps them once per update itself). Plateau
      schedulers are left alone.
    - ``skip_backward``: in sink mode the strategy runs zero-grad and backward per micro-step; Lightning's closure
      around a whole sink must do neither. Lightning's own switch for that (``fit_loop._skip_backward``) is set, and
      the closure's two functions are shadowed too: callbacks set the switch for their own reasons
      (``StochasticWeightAveraging`` clears it at every epoch's end), and a sink's closure must skip them whatever
      it says.
    """

    batch_has_no_update: Callable[[], bool] | None = None
    hold_step_schedulers: Callable[[], bool] | None = None
    skip_backward: bool = False
    epoch_ends: Callable[[], bool] | None = None
    validates: Callable[[Callable[[], bool]], bool] | None = None

    @classmethod
    def for_sinks(
        cls,
        made_no_update: Callable[[], bool],
        sink_finished: Callable[[], bool],
        validates: Callable[[Callable[[], bool]], bool],
    ) -> LoopOverrides:
        """A segment of a sink is one Lightning batch: it accumulates when it made no update; the sink steps the
        schedulers; the epoch ends with the sink (``epoch_ends``: after the epoch's first batch, Lightning's
        "last batch of the epoch reached"); ``validates`` answers Lightning's "validate after this batch?"
        (``_should_check_val_fx``), given Lightning's own decision as a function."""
        return cls(
            batch_has_no_update=made_no_update,
            hold_step_schedulers=lambda: True,
            skip_backward=True,
            epoch_ends=sink_finished,
            validates=validates,
        )


def install_loop_overrides(trainer: pl.Trainer, overrides: LoopOverrides) -> None:
    """Put every override in place (instance attributes shadowing the loop's methods); ``remove_loop_overrides``
    takes all of them away again."""
    remove_loop_overrides(trainer)
    loop = epoch_loop(trainer)
    if overrides.batch_has_no_update is not None:
        loop._should_accumulate = overrides.batch_has_no_update
    hold = overrides.hold_step_schedulers
    if hold is not None:
        original_update = type(loop).update_lr_schedulers.__get__(loop)

        def update_lr_schedulers(interval: str, update_plateau_schedulers: bool) -> None:
            if interval == "step" and not update_plateau_schedulers and hold():
                return
            original_update(interval, update_plateau_schedulers)

        loop.update_lr_schedulers = update_lr_schedulers
    epoch_ends = overrides.epoch_ends
    if epoch_ends is not None:
        loop._num_ready_batches_reached = lambda: loop.batch_progress.current.ready > 0 and epoch_ends()
    validates = overrides.validates
    if validates is not None:
        lightning_decides = type(loop)._should_check_val_fx
        loop._should_check_val_fx = lambda data_fetcher: validates(lambda: lightning_decides(loop, data_fetcher))
    trainer.fit_loop._skip_backward = overrides.skip_backward
    if overrides.skip_backward:
        closure_parts = automatic_optimization(trainer)
        closure_parts._make_zero_grad_fn = _nothing
        closure_parts._make_backward_fn = _nothing


def _nothing(*args: object) -> None:
    """A closure part that is skipped (Lightning's closure takes ``None`` as "not this part")."""
    return None


def remove_loop_overrides(trainer: pl.Trainer) -> None:
    """Lightning's own loop methods back (deleting the shadowing attributes restores them)."""
    loop = epoch_loop(trainer)
    for name in _SHADOWED:
        loop.__dict__.pop(name, None)
    closure_parts = automatic_optimization(trainer)
    for name in _SHADOWED_CLOSURE:
        closure_parts.__dict__.pop(name, None)
    trainer.fit_loop._skip_backward = False
