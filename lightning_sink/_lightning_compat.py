"""Every use of a private Lightning attribute, in one place.

Lightning's fit loop assumes that one Lightning batch is one optimizer step (or one micro-batch of its own
accumulation). The sink strategies decide themselves when an update happens, so they tell the loop through the
functions below. ``tests/test_lightning_compat.py`` fails loudly when a Lightning release moves any of these.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import lightning.pytorch as pl
from lightning.fabric.utilities.load import _METADATA_FILENAME
from lightning.pytorch.loops.fetchers import _DataFetcher, _PrefetchDataFetcher
from lightning.pytorch.trainer import call
from lightning.pytorch.utilities.combined_loader import _shutdown_workers_and_reset_iterator

__all__ = [
    "install_loop_overrides",
    "remove_loop_overrides",
    "is_last_batch_of_epoch",
    "record_optimizer_update",
    "finish_lightning_batch",
    "run_before_optimizer_step",
    "call_lightning_module_hook",
    "checkpoint_every_n_train_steps",
    "DCP_METADATA_FILE_NAME",
    "set_module_device_mesh",
    "saves_distributed_checkpoint",
    "skip_training_batches",
    "shut_down_loader_workers",
    "forget_saved_loader_states",
]

# The file in which Lightning's ModelParallelStrategy keeps the non-tensor part (loops, callbacks, ...) of a DCP folder.
DCP_METADATA_FILE_NAME: str = _METADATA_FILENAME

# Names of the instance attributes we shadow on the epoch loop; deleting them restores Lightning's methods.
_SHADOWED = ("_should_accumulate", "update_lr_schedulers")


def _epoch_loop(trainer: pl.Trainer) -> Any:
    return trainer.fit_loop.epoch_loop


def install_loop_overrides(trainer: pl.Trainer, batch_has_no_update: Callable[[], bool]) -> None:
    """Hand the decisions 'is this an optimizer step' and 'step the LR schedulers' to the strategy.

    ``batch_has_no_update`` answers, for the Lightning batch in flight, whether it performs no optimizer update.
    Lightning asks ``_should_accumulate()`` before and after the optimizer hook, before logging and before
    zeroing gradients for validation; answering from the strategy keeps all of those consistent. Step-interval
    LR schedulers are stepped by the strategy after each real update, so the loop's own call is dropped.
    """
    loop = _epoch_loop(trainer)
    original_update = type(loop).update_lr_schedulers.__get__(loop)

    def update_lr_schedulers(interval: str, update_plateau_schedulers: bool) -> None:
        if interval == "step" and not update_plateau_schedulers:
            return  # stepped by the strategy, once per real optimizer update
        if interval == "step" and batch_has_no_update():
            return
        original_update(interval, update_plateau_schedulers)

    loop._should_accumulate = batch_has_no_update
    loop.update_lr_schedulers = update_lr_schedulers
    # The strategy runs backward itself inside its step programs; Lightning's closure must not zero the
    # gradients or run a second backward.
    trainer.fit_loop._skip_backward = True


def remove_loop_overrides(trainer: pl.Trainer) -> None:
    loop = _epoch_loop(trainer)
    for name in _SHADOWED:
        loop.__dict__.pop(name, None)
    trainer.fit_loop._skip_backward = False


def is_last_batch_of_epoch(trainer: pl.Trainer) -> bool:
    """Whether the Lightning batch in flight is the last one of this epoch (known before it runs)."""
    return bool(type(_epoch_loop(trainer))._num_ready_batches_reached(_epoch_loop(trainer)))


def _step_progress(trainer: pl.Trainer) -> Any:
    return _epoch_loop(trainer).automatic_optimization.optim_progress.optimizer.step


def record_optimizer_update(trainer: pl.Trainer) -> None:
    """Count one optimizer update now, so that ``trainer.global_step`` is true inside a Lightning batch."""
    progress = _step_progress(trainer)
    for tracker in (progress.total, progress.current):
        tracker.ready += 1
        tracker.completed += 1


def finish_lightning_batch(trainer: pl.Trainer, lightning_counts_one: bool) -> None:
    """Make Lightning's counters agree with the updates recorded one by one during this Lightning batch.

    If Lightning was told the batch updates (``lightning_counts_one``), it counted ``ready`` before the optimizer
    hook and will count ``completed`` right after it: take that one back, since every update was recorded. The
    logging step is set so that, after Lightning's own increment at the end of the batch (made only when it
    counts one), it equals ``global_step``, as in stock Lightning without accumulation.
    """
    progress = _step_progress(trainer)
    if lightning_counts_one:
        for tracker in (progress.total, progress.current):
            tracker.ready -= 1
            tracker.completed -= 1
    _epoch_loop(trainer)._batches_that_stepped = progress.total.completed


def run_before_optimizer_step(trainer: pl.Trainer, optimizer: Any) -> None:
    """Call the ``on_before_optimizer_step`` hooks and clip gradients, as Lightning does after its closure."""
    module = trainer.lightning_module
    trainer.strategy.precision_plugin._after_closure(module, optimizer)


def call_lightning_module_hook(trainer: pl.Trainer, name: str, *args: Any) -> Any:
    return call._call_lightning_module_hook(trainer, name, *args)


def checkpoint_every_n_train_steps(callback: Any) -> int:
    """``ModelCheckpoint(every_n_train_steps=n)``'s n (0 when it does not save by steps); Lightning keeps it private."""
    return int(callback._every_n_train_steps or 0)


def set_module_device_mesh(module: pl.LightningModule, mesh: Any) -> None:
    """What ``ModelParallelStrategy.setup_environment`` does, so ``configure_model`` sees ``self.device_mesh``."""
    module._device_mesh = mesh


def saves_distributed_checkpoint(strategy: Any) -> bool:
    """``ModelParallelStrategy(save_distributed_checkpoint=...)``'s value (a DCP folder, not one full file)."""
    return bool(strategy._save_distributed_checkpoint)


def skip_training_batches(trainer: pl.Trainer, count: int) -> int:
    """Fetch and discard the first ``count`` batches of the training pass Lightning is about to start; returns how
    many there were (fewer when the pass is shorter).

    For a mid-epoch resume: Lightning restores its batch counters (so the epoch ends where it would have) but
    restarts a plain loader's iterator from its first batch. Skipping goes through Lightning's fetcher, so a batch it
    prefetched is dropped too, and its fetch count is put back: Lightning adds the restored batches to it itself.
    """
    fetcher = trainer.fit_loop._data_fetcher
    assert fetcher is not None, "the training loader's iterator is created before on_train_start"
    fetch = fetcher.__next__ if isinstance(fetcher, _PrefetchDataFetcher) else lambda: _DataFetcher.__next__(fetcher)
    fetched, skipped = fetcher.fetched, 0
    try:
        for _ in range(count):
            fetch()
            skipped += 1
    except StopIteration:
        pass
    fetcher.fetched = fetched
    return skipped


def shut_down_loader_workers(loader: object) -> None:
    """What Lightning does to a training loader at the end of fit: stop its (persistent) workers, drop its iterator."""
    _shutdown_workers_and_reset_iterator(loader)


def forget_saved_loader_states(trainer: pl.Trainer) -> None:
    """Keep Lightning from loading the checkpoint's state into a stateful training loader (the strategy resumes the
    loader itself); Lightning reads these states right after ``Strategy.process_dataloader``."""
    trainer.fit_loop._combined_loader_states_to_load = []
