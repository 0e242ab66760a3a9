"""Sink mode's indexed reads of a ``TensorDataset`` against the ``DataLoader`` itself: the same batches (values,
dtypes, shapes, strides, container), the same random draws, pass after pass; every other loader left as it is."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from torch.utils.data import (
    BatchSampler,
    DataLoader,
    Dataset,
    DistributedSampler,
    IterableDataset,
    RandomSampler,
    SubsetRandomSampler,
    TensorDataset,
    WeightedRandomSampler,
    random_split,
)

from lightning_sink import SinkStrategy
from lightning_sink.indexed_batches import indexed_batches, pass_batches, reads_by_indexing
from tests.helpers import quiet_trainer

ROWS = 23


def tensors() -> tuple[torch.Tensor, ...]:
    generator = torch.Generator().manual_seed(7)
    return (
        torch.randn(ROWS, 1, 4, 4, generator=generator),  # an image batch
        torch.randint(0, 10, (ROWS,), generator=generator),  # labels: rows are 0-d tensors
        torch.randint(0, 255, (ROWS, 3), generator=generator).to(torch.uint8),
        torch.randn(ROWS, 2, 3, generator=generator, dtype=torch.float64),
        torch.rand(ROWS, generator=generator) > 0.5,
    )


def distributed_loader(dataset: Any) -> DataLoader:
    sampler = DistributedSampler(dataset, num_replicas=2, rank=1, shuffle=True, seed=3)
    sampler.set_epoch(4)
    return DataLoader(dataset, batch_size=3, sampler=sampler)


LOADERS: dict[str, Callable[[TensorDataset], DataLoader]] = {
    "shuffled by the global generator, partial last batch": lambda d: DataLoader(d, batch_size=5, shuffle=True),
    "shuffled by its own generator, drop_last": lambda d: DataLoader(
        d, batch_size=4, shuffle=True, drop_last=True, generator=torch.Generator().manual_seed(1)
    ),
    "sequential": lambda d: DataLoader(d, batch_size=6),
    "distributed sampler": distributed_loader,
    "with replacement": lambda d: DataLoader(d, batch_size=4, sampler=RandomSampler(d, True, num_samples=17)),
    "weighted": lambda d: DataLoader(d, batch_size=4, sampler=WeightedRandomSampler(torch.linspace(1, 2, ROWS), 9)),
    "a random_split subset": lambda d: DataLoader(
        random_split(d, [15, 8], generator=torch.Generator().manual_seed(2))[0], batch_size=4, shuffle=True
    ),
}


def random_states(loader: DataLoader) -> list[torch.Tensor]:
    owners = (loader, loader.sampler, loader.batch_sampler)
    states = [torch.get_rng_state()]
    return states + [owner.generator.get_state() for owner in owners if getattr(owner, "generator", None)]


def two_passes(loader: DataLoader, read_pass: Callable[[DataLoader], Any]) -> tuple[list[Any], list[torch.Tensor]]:
    torch.manual_seed(11)
    batches = [batch for _ in range(2) for batch in read_pass(loader)]
    return batches, random_states(loader)


def assert_same_batch(ours: Any, theirs: Any) -> None:
    assert type(ours) is type(theirs) is list and len(ours) == len(theirs)
    for mine, loaders in zip(ours, theirs):
        assert mine.dtype == loaders.dtype and mine.shape == loaders.shape and mine.stride() == loaders.stride()
        assert torch.equal(mine, loaders)


@pytest.mark.parametrize("make_loader", LOADERS.values(), ids=LOADERS.keys())
def test_indexed_passes_yield_the_loaders_batches_and_draw_the_same_random_numbers(make_loader):
    loader = make_loader(TensorDataset(*tensors()))
    assert reads_by_indexing(loader)
    expected, expected_states = two_passes(loader, iter)
    # Rebuilt, so that its own generators start where the first loader's did.
    loader = make_loader(TensorDataset(*tensors()))
    batches, states = two_passes(loader, indexed_batches)
    assert len(batches) == len(expected) > 2
    for ours, theirs in zip(batches, expected):
        assert_same_batch(ours, theirs)
    assert len(states) == len(expected_states)
    assert all(torch.equal(mine, loaders) for mine, loaders in zip(states, expected_states))


class Rows(Dataset):
    def __len__(self) -> int:
        return ROWS

    def __getitem__(self, index: int) -> torch.Tensor:
        return torch.full((2,), float(index))


class Stream(IterableDataset):
    def __iter__(self):
        return iter(torch.arange(ROWS, dtype=torch.float32))


class OwnTensorDataset(TensorDataset):
    pass


class OwnLoader(DataLoader):
    pass


def _dataset(*overrides: torch.Tensor) -> TensorDataset:
    return TensorDataset(*(overrides or tensors()[:2]))


NOT_INDEXED: dict[str, Callable[[], Any]] = {
    "a collate_fn of its own": lambda: DataLoader(_dataset(), batch_size=4, collate_fn=lambda rows: rows),
    "worker processes": lambda: DataLoader(_dataset(), batch_size=4, num_workers=1),
    "pinned memory": lambda: DataLoader(_dataset(), batch_size=4, pin_memory=True),
    "no batching": lambda: DataLoader(_dataset(), batch_size=None),
    "a batch sampler of its own": lambda: DataLoader(_dataset(), batch_sampler=[[0, 2], [1, 3]]),
    "a BatchSampler subclass": lambda: DataLoader(
        _dataset(), batch_sampler=type("Own", (BatchSampler,), {})(range(ROWS), 4, False)
    ),
    "a sampler yielding its indices' elements": lambda: DataLoader(
        _dataset(), batch_size=4, sampler=SubsetRandomSampler(torch.arange(5))
    ),
    "a DataLoader subclass": lambda: OwnLoader(_dataset(), batch_size=4),
    "a TensorDataset subclass": lambda: DataLoader(OwnTensorDataset(*tensors()[:2]), batch_size=4),
    "a non-contiguous tensor": lambda: DataLoader(_dataset(torch.randn(3, ROWS).t()), batch_size=4),
    "a tensor that requires grad": lambda: DataLoader(_dataset(torch.randn(ROWS, requires_grad=True)), batch_size=4),
    "a map-style dataset": lambda: DataLoader(Rows(), batch_size=4),
    "a subset of a map-style dataset": lambda: DataLoader(random_split(Rows(), [20, 3])[0], batch_size=4),
    "an iterable dataset": lambda: DataLoader(Stream(), batch_size=4),
    "not a DataLoader": lambda: [[torch.zeros(2)]],
}


@pytest.mark.parametrize("make_loader", NOT_INDEXED.values(), ids=NOT_INDEXED.keys())
def test_any_other_loader_is_iterated_as_it_is(make_loader):
    loader = make_loader()
    assert not reads_by_indexing(loader)
    assert pass_batches(loader) is loader


class RecordsBatches(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(4, 2)
        self.seen: list[list[torch.Tensor]] = []

    def training_step(self, batch, batch_idx):
        self.seen.append([tensor.clone() for tensor in batch])
        return self.layer(batch[0]).square().mean()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def shuffled_passes() -> tuple[DataLoader, list[list[torch.Tensor]]]:
    """A shuffled loader of 7 batches a pass, and the batches Lightning's loop takes from its first three passes:
    ``len(loader)`` batches each, with no ``next()`` after the last (which would draw another permutation)."""
    dataset = TensorDataset(torch.randn(21, 4), torch.arange(21))
    loader = DataLoader(dataset, batch_size=3, shuffle=True, generator=torch.Generator().manual_seed(5))
    generator_start = loader.generator.get_state()

    def lightnings_pass() -> list[list[torch.Tensor]]:
        batches = iter(loader)
        return [next(batches) for _ in range(len(loader))]

    expected = [batch for _ in range(3) for batch in lightnings_pass()]
    loader.generator.set_state(generator_start)
    return loader, expected


def fit_sinks_of_five(loader: DataLoader, prefetch_depth: int) -> list[list[torch.Tensor]]:
    module = RecordsBatches()
    trainer = quiet_trainer(strategy=SinkStrategy(sink_size=5, prefetch_depth=prefetch_depth), max_epochs=4)
    trainer.fit(module, loader)
    return module.seen


def test_sink_mode_trains_on_the_loaders_batches_without_reading_items(monkeypatch):
    """Read in the training thread (the CPU default), over three passes: the batches a plain iteration of the loader
    yields, while a read of a single item would fail."""
    loader, expected = shuffled_passes()

    def no_item_reads(self, index):
        raise AssertionError(f"item {index} read one by one")

    monkeypatch.setattr(TensorDataset, "__getitem__", no_item_reads)
    seen = fit_sinks_of_five(loader, prefetch_depth=0)
    assert len(seen) == 20
    for ours, theirs in zip(seen, expected):
        assert_same_batch(ours, theirs)


def test_a_reading_thread_reads_as_the_loader_does(monkeypatch):
    """With a reading thread the loader's own item reads are used (indexing there would compete with the training
    thread's OpenMP threads), and the batches are the same."""
    loader, expected = shuffled_passes()
    reads = []
    item = TensorDataset.__getitem__
    monkeypatch.setattr(TensorDataset, "__getitem__", lambda self, index: reads.append(index) or item(self, index))
    seen = fit_sinks_of_five(loader, prefetch_depth=2)
    assert len(seen) == 20 and len(reads) >= 20 * 3
    for ours, theirs in zip(seen, expected):
        assert_same_batch(ours, theirs)


# Outside sink mode Lightning iterates the loader itself, one Lightning batch per micro-batch. Whole windows (8 and
# 6 batches a pass), so the updates are stock Lightning's whatever the partial-window rule.
STOCK_AND_SINK = {"stock": dict(strategy="auto", accumulate_grad_batches=2), "sink": dict(strategy="sink_n2")}


def fit_outside_sink_mode(name: str, loader: DataLoader, callbacks=()) -> tuple[pl.Trainer, RecordsBatches]:
    pl.seed_everything(3)  # the global generator: the shuffling of a loader without a generator of its own
    module = RecordsBatches()
    options = dict(STOCK_AND_SINK[name])
    if options["strategy"] == "sink_n2":
        options["strategy"] = SinkStrategy(accumulation_steps=2)
    trainer = quiet_trainer(max_epochs=3, callbacks=list(callbacks), **options)
    trainer.fit(module, loader)
    return trainer, module


def rows_of_four(count: int) -> torch.Tensor:
    return torch.randn(count, 4, generator=torch.Generator().manual_seed(0))


TRAINING_LOADERS: dict[str, Callable[[], DataLoader]] = {
    "shuffled by the global generator": lambda: DataLoader(
        TensorDataset(rows_of_four(24), torch.arange(24)),
        batch_size=3,
        shuffle=True,
    ),
    "a random_split subset, shuffled by its own generator": lambda: DataLoader(
        random_split(TensorDataset(rows_of_four(30), torch.arange(30)), [24, 6], torch.Generator().manual_seed(4))[0],
        batch_size=4,
        shuffle=True,
        generator=torch.Generator().manual_seed(5),
    ),
}


@pytest.mark.parametrize("make_loader", TRAINING_LOADERS.values(), ids=TRAINING_LOADERS.keys())
def test_outside_sink_mode_lightning_trains_on_stock_lightnings_batches_without_item_reads(make_loader, monkeypatch):
    stock_trainer, stock = fit_outside_sink_mode("stock", make_loader())

    def no_item_reads(self, index):
        raise AssertionError(f"item {index} read one by one")

    loader = make_loader()
    with monkeypatch.context() as patched:
        patched.setattr(TensorDataset, "__getitem__", no_item_reads)
        sink_trainer, sink = fit_outside_sink_mode("sink", loader)
    assert len(sink.seen) == len(stock.seen) > 10
    for ours, theirs in zip(sink.seen, stock.seen):
        assert_same_batch(ours, theirs)
    torch.testing.assert_close(sink.layer.weight, stock.layer.weight)  # the window sums in its own order
    assert sink_trainer.global_step == stock_trainer.global_step
    # After fit the loader is the user's own, reading items again.
    assert sink_trainer.train_dataloader is loader and "_get_iterator" not in vars(loader)
    reads = []
    item = TensorDataset.__getitem__
    monkeypatch.setattr(TensorDataset, "__getitem__", lambda self, index: reads.append(index) or item(self, index))
    next(iter(loader))
    assert len(reads) == loader.batch_size


class DoublesInputsFromTheSecondEpoch(pl.Callback):
    """Replaces the loader's ``collate_fn`` between passes: the next pass's iterator collates with it."""

    def on_train_epoch_end(self, trainer, pl_module):
        def doubled(rows):
            inputs, labels = torch.utils.data.default_collate(rows)
            return [2 * inputs, labels]

        trainer.train_dataloader.collate_fn = doubled


def test_a_collate_fn_set_during_fit_is_used_from_the_next_pass_as_with_stock_lightning():
    make_loader = TRAINING_LOADERS["shuffled by the global generator"]
    _, stock = fit_outside_sink_mode("stock", make_loader(), [DoublesInputsFromTheSecondEpoch()])
    _, sink = fit_outside_sink_mode("sink", make_loader(), [DoublesInputsFromTheSecondEpoch()])
    assert len(sink.seen) == len(stock.seen) == 24
    for ours, theirs in zip(sink.seen, stock.seen):
        assert_same_batch(ours, theirs)
    first, later = stock.seen[0][0], stock.seen[8][0]
    assert later.abs().sum() > 0 and not torch.equal(later, first)  # the doubling reached both runs
