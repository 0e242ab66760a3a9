"""The training loader as Lightning and the user see it, side by side with stock Lightning."""

from __future__ import annotations

import multiprocessing
import warnings

import pytest
from lightning.pytorch.callbacks import Callback
from torch.utils.data import DataLoader, IterableDataset

from lightning_sink import SinkStrategy
from lightning_sink.sink_data import SinkLoader
from tests.helpers import TinyClassifier, make_dataset, quiet_trainer

ATTRIBUTES = (
    "batch_size",
    "dataset",
    "sampler",
    "batch_sampler",
    "drop_last",
    "num_workers",
    "generator",
    "persistent_workers",
    "collate_fn",
)


def fitted(strategy, data_loader, **kwargs):
    trainer = quiet_trainer(strategy=strategy, max_epochs=kwargs.pop("max_epochs", 1), **kwargs)
    trainer.fit(TinyClassifier(), data_loader)
    return trainer


def test_train_dataloader_is_the_users_loader_as_with_stock_lightning():
    dataset = make_dataset(num_samples=24)
    stock_loader, sink_loader = DataLoader(dataset, batch_size=4), DataLoader(dataset, batch_size=4)
    stock = fitted("auto", stock_loader, accumulate_grad_batches=2)
    sink = fitted(SinkStrategy(accumulation_steps=2), sink_loader)
    assert type(sink.train_dataloader) is type(stock.train_dataloader) is DataLoader
    assert (sink.train_dataloader is sink_loader) == (stock.train_dataloader is stock_loader) is True
    for name in ATTRIBUTES:
        assert getattr(sink.train_dataloader, name) is getattr(sink_loader, name), name


class BatchIndices(Callback):
    def __init__(self):
        self.seen = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.seen.append((trainer.current_epoch, batch_idx, trainer.num_training_batches))


@pytest.mark.parametrize("limit", [1.0, 0.75, 9])
def test_drop_shortens_the_epoch_as_lightnings_limit_train_batches_would(limit):
    # 11 batches per epoch (after the limit: 11, 8, 9), windows of 4: "drop" trains 8 per epoch.
    dataset = make_dataset(num_samples=44)
    sink_batches, stock_batches = BatchIndices(), BatchIndices()
    sink = fitted(
        SinkStrategy(accumulation_steps=4, partial_window="drop"),
        DataLoader(dataset, batch_size=4),
        max_epochs=2,
        limit_train_batches=limit,
        callbacks=[sink_batches],
    )
    stock = fitted(
        "auto",
        DataLoader(dataset, batch_size=4),
        max_epochs=2,
        limit_train_batches=8,
        accumulate_grad_batches=4,
        callbacks=[stock_batches],
    )
    assert sink_batches.seen == stock_batches.seen
    assert [index for _, index, _ in sink_batches.seen] == list(range(8)) * 2
    assert sink.global_step == stock.global_step == 4
    assert sink.limit_train_batches == limit  # the Trainer's own setting is given back after fit


def test_sink_mode_stands_in_for_the_loader_and_forwards_its_attributes():
    data_loader = DataLoader(make_dataset(num_samples=24), batch_size=4, shuffle=True)
    trainer = fitted(SinkStrategy(accumulation_steps=2, sink_size=3), data_loader, max_epochs=2)
    seen = trainer.train_dataloader
    assert isinstance(seen, SinkLoader) and seen.loader is data_loader
    for name in ("batch_size", "dataset", "drop_last", "num_workers", "collate_fn", "generator"):
        assert getattr(seen, name) is getattr(data_loader, name), name
    for name in ("sampler", "batch_sampler", "state_dict", "_iterator"):  # the stream owns them (sink_data.py)
        with pytest.raises(AttributeError, match=name):
            getattr(seen, name)
    seen.worker_init_fn = print  # what Lightning does with PL_SEED_WORKERS=1 reaches the user's loader
    assert data_loader.worker_init_fn is print


def _worker_processes() -> list:
    return multiprocessing.active_children()  # DataLoader workers are multiprocessing children of this process


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["auto", "sink_accumulating", "sink_sinking"])
def test_persistent_workers_are_shut_down_at_fit_end_as_with_stock_lightning(strategy):
    strategies = {
        "auto": "auto",
        "sink_accumulating": SinkStrategy(accumulation_steps=2),
        "sink_sinking": SinkStrategy(accumulation_steps=2, sink_size=3),
    }
    data_loader = DataLoader(make_dataset(num_samples=24), batch_size=4, num_workers=2, persistent_workers=True)
    assert not _worker_processes()
    alive = {}

    class Probe(Callback):
        def on_train_epoch_end(self, trainer, pl_module):
            alive["during"] = len(_worker_processes())

    fitted(strategies[strategy], data_loader, max_epochs=2, callbacks=[Probe()])
    assert alive["during"] == 2  # the workers ran (and persisted across epochs) ...
    assert data_loader._iterator is None and not _worker_processes()  # ... and are gone after fit


class Rows(IterableDataset):
    """A stream of (x, y) rows without a length."""

    def __init__(self, num_samples: int = 24) -> None:
        self.data = make_dataset(num_samples=num_samples)

    def __iter__(self):
        return iter(zip(*self.data.tensors))


class SizedRows(Rows):
    def __len__(self) -> int:
        return len(self.data)


def length_warnings(strategy, dataset: IterableDataset) -> list[str]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fitted(strategy, DataLoader(dataset, batch_size=4), max_epochs=2)
    return [str(warning.message) for warning in caught if "has `__len__` defined" in str(warning.message)]


@pytest.mark.parametrize("dataset_type", [Rows, SizedRows])
def test_an_iterable_dataset_gets_lightnings_length_warning_only_where_stock_gives_it(dataset_type):
    """In sink mode Lightning iterates a placeholder without a length; the strategy runs Lightning's length checks on
    the user's loader instead: an IterableDataset without a length gets no warning that it has one (stock gives
    none), and one with a length gets Lightning's warning, as from stock."""
    stock = length_warnings("auto", dataset_type())
    sink = length_warnings(SinkStrategy(sink_size=4), dataset_type())
    assert bool(stock) == (dataset_type is SizedRows)
    assert bool(sink) == bool(stock)
