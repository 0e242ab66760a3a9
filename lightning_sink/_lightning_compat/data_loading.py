"""Lightning's training data fetcher and loader states, for a resume and the end of a fit."""

from __future__ import annotations

import lightning.pytorch as pl
from lightning.pytorch.loops.fetchers import _DataFetcher, _PrefetchDataFetcher
from lightning.pytorch.utilities.combined_loader import _shutdown_workers_and_reset_iterator


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


def training_loader_count(trainer: pl.Trainer) -> int:
    """How many loaders the fit trains from (a dict or list of them Lightning combines into one ``CombinedLoader``;
    0 before the training data is set up)."""
    combined = trainer.fit_loop._combined_loader
    return 0 if combined is None else len(combined.flattened)
