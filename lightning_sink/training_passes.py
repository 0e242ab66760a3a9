"""Outside sink mode: the user's training loader, iterated by Lightning one pass per epoch, and resumed exactly.

Lightning iterates the loader the user gave (``trainer.train_dataloader`` is that loader, and Lightning shuts its
workers down at the end of fit). This class adds, at the points where Lightning hands the loader over:

- ``take_loader`` (from ``Strategy.process_dataloader``, before Lightning starts the pass's iterator): the generator
  states of an interrupted pass are restored (or the pass's are noted), a ``DistributedSampler`` gets the pass's
  epoch, and under ``partial_window="drop"`` the epoch is shortened to whole windows through Lightning's own
  epoch length (``trainer.limit_train_batches``, so ``trainer.num_training_batches`` is the shortened length).
- ``skip_trained_batches`` (from ``on_train_start``, once the iterator exists): the batches of the interrupted pass
  that were already trained are fetched and discarded.
- ``batch_trained``: counts the batch; after the last batch of a pass the generators' states are those the next
  pass starts from (nothing else draws from the loader's generators in between), so they are noted then.
- An epoch that ends before its last batch (``max_steps``, ``should_stop``, ``on_train_batch_start`` returning -1)
  ends its pass too, as Lightning starts the next epoch from a new iterator: the generators' states after the
  epoch's first batch are those the next pass starts from (the sampler and the loader drew then), noted at each
  epoch's first batch; the next epoch's first batch, or a checkpoint saved once the epoch is over
  (``before_save``), ends the pass.

Only a loader whose order a second pass reproduces (``has_reproducible_order``: a ``DataLoader`` that is sequential,
uses a ``DistributedSampler``, or shuffles with a generator of its own) is resumed this way. Any other is left to
Lightning, as with its own strategies: it restores a loader that has ``state_dict``/``load_state_dict`` and replays
any other from its first batch, warning that the loader is not resumable.

A loader that saves its own position (torchdata's ``StatefulDataLoader``) is resumed the same way. Lightning still
saves its state in the checkpoint (a stock strategy can resume from it), but restoring that state resumes the
interrupted pass only: torchdata 0.11 then draws the next pass's permutation from another generator state than the
uninterrupted run did, while the recorded generator states keep every later pass identical too.
"""

from __future__ import annotations

import warnings
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.utilities.warnings import PossibleUserWarning

from lightning_sink import _lightning_compat as compat
from lightning_sink.data import (
    DataPosition,
    capture_generator_states,
    has_reproducible_order,
    is_stateful_loader,
    set_stale_sampler_epoch,
)

__all__ = ["TrainingPasses", "batches_per_epoch"]


def batches_per_epoch(length: int, limit: int | float) -> int:
    """Lightning's rule for ``limit_train_batches``: an int caps the batches, a float is a fraction of them."""
    if isinstance(limit, int):
        return min(length, limit)
    return int(length * limit)


class _NotResumableWarningIgnored:
    """Lightning warns that a loader without ``state_dict`` cannot resume mid-epoch when its epoch loop restarts,
    after ``on_train_start``; for a loader the strategy resumes itself the warning is wrong. It is ignored from
    ``on_train_start`` until the first training batch, and nowhere else."""

    def __init__(self) -> None:
        self._scope: warnings.catch_warnings | None = None

    def start(self) -> None:
        self.stop()
        self._scope = warnings.catch_warnings()
        self._scope.__enter__()
        warnings.filterwarnings(
            "ignore",
            message=r"You're resuming from a checkpoint that ended before the epoch ended",
            category=PossibleUserWarning,
        )

    def stop(self) -> None:
        if self._scope is not None:
            self._scope.__exit__(None, None, None)
            self._scope = None


class TrainingPasses:
    """The training loader's passes outside sink mode, for one strategy."""

    def __init__(self, position: DataPosition) -> None:
        self.position = position
        self.loader: Any = None
        self._trainer: pl.Trainer | None = None
        self._user_limit: int | float | None = None  # trainer.limit_train_batches as given, while "drop" sets it
        self._not_resumable_warning = _NotResumableWarningIgnored()
        self._reproducible = True  # every loader taken in this fit so far
        self._epoch: int | None = None  # Lightning's epoch of the last batch counted
        self._next_pass_states: Any = None  # the generators' states after that epoch's first batch

    def take_loader(
        self, trainer: pl.Trainer, loader: Any, whole_windows_of: int | None, counts_batches: bool = True
    ) -> None:
        """The loader Lightning is about to iterate (``whole_windows_of=N``: ``partial_window="drop"``).

        ``counts_batches=False``: ``training_step(dataloader_iter)`` draws the batches itself, so a step is not one
        batch and the position cannot be counted; Lightning resumes such a loader, as with its own strategies."""
        self.loader, self._trainer = loader, trainer
        if whole_windows_of:
            self._limit_to_whole_windows(trainer, loader, whole_windows_of)
        # With several loaders (a CombinedLoader) all must be reproducible: the skip fetches from all of them.
        self._reproducible = self._reproducible and counts_batches and has_reproducible_order(loader)
        if not self._reproducible:
            self.position.cancel_resume()  # Lightning resumes the data, as with its own strategies
            return
        if is_stateful_loader(loader):
            compat.forget_saved_loader_states(trainer)
        set_stale_sampler_epoch(loader, trainer.current_epoch)
        self.position.begin_pass(loader, self.position.pass_index)

    def _limit_to_whole_windows(self, trainer: pl.Trainer, loader: Any, steps: int) -> None:
        try:
            length = len(loader)
        except TypeError:
            return  # unsized: the last window of the epoch is dropped when it ends (plan_micro_step)
        if self._user_limit is None:
            self._user_limit = trainer.limit_train_batches
        per_epoch = batches_per_epoch(length, self._user_limit)
        whole = per_epoch - per_epoch % steps
        if whole == 0:
            raise ValueError(
                f"partial_window='drop' with accumulation_steps={steps} drops every batch: the training loader has"
                f" only {per_epoch} batches per epoch. Use partial_window='scale' or 'carry', or fewer steps."
            )
        trainer.limit_train_batches = whole

    def skip_trained_batches(self, trainer: pl.Trainer) -> None:
        """After a mid-pass resume, before the first batch: drop the batches the checkpoint had trained."""
        skip = self.position.start_pass()
        if skip == 0:
            return
        self._not_resumable_warning.start()
        available = compat.skip_training_batches(trainer, skip)
        if available < skip:
            raise ValueError(
                f"Cannot resume: the checkpoint was saved after {skip} batches of the current pass, but the training"
                f" loader now yields only {available}. Resume with the same data and batch size."
            )

    def first_batch_started(self) -> None:
        self._not_resumable_warning.stop()

    def batch_trained(self, last_of_pass: bool) -> None:
        if self._trainer is not None and self._trainer.current_epoch != self._epoch:
            self._epoch_started(self._trainer.current_epoch)
        self.position.advance()
        if not last_of_pass:
            return
        self.position.end_pass()  # a resume after this point starts a fresh pass
        if self.loader is not None:
            self.position.record_pass_start(self.position.pass_index, capture_generator_states(self.loader))

    def _epoch_started(self, epoch: int) -> None:
        """The first batch of an epoch: the pass of an epoch before it that ended early ends; the states after this
        first batch are noted, for a pass that this epoch may end early."""
        if self._epoch is not None:
            self._end_early_pass(self._next_pass_states)
        self._epoch = epoch
        self._next_pass_states = capture_generator_states(self.loader) if self.loader is not None else None

    def before_save(self) -> None:
        """A checkpoint is about to be saved: where Lightning's epoch is over but its pass is not (the epoch ended
        early), the pass ends now, so that a resume starts at the next epoch's first batch, as Lightning does."""
        if self._trainer is not None and compat.epoch_batches_over(self._trainer):
            self._end_early_pass(self._next_pass_states)

    def _end_early_pass(self, next_pass_states: Any) -> None:
        if self.position.trained_in_pass == 0:
            return  # (ended at its last batch: ``batch_trained`` noted the next pass's states then)
        self.position.end_pass()
        if next_pass_states is not None:
            self.position.record_pass_start(self.position.pass_index, next_pass_states)

    def release(self) -> None:
        """At the end of fit: give ``trainer.limit_train_batches`` back its own value."""
        self._not_resumable_warning.stop()
        if self._user_limit is not None and self._trainer is not None:
            self._trainer.limit_train_batches = self._user_limit
        self._user_limit, self._trainer, self.loader = None, None, None
        self._reproducible = True
        self._epoch, self._next_pass_states = None, None
