"""The window's state saved whole: a resume inside a window where some ``training_step`` returned ``None`` continues
exactly as the uninterrupted run, in and out of sinks; and a window without trainable parameters under
``skip_window_on_overflow``."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from lightning.pytorch.callbacks import Callback
from torch.utils.data import DataLoader, TensorDataset

from lightning_sink import DynamicLossScale, LossScalePrecision, SinkStrategy
from tests.helpers import TinyClassifier, flat_params, quiet_trainer

MICRO_BATCH = 2


class SkipsOneMicroBatch(TinyClassifier):
    """Returns ``None`` for one micro-batch, recognized by its data (so a resumed run skips the same one)."""

    def __init__(self, skip: int, **kwargs):
        super().__init__(**kwargs)
        self.skip = skip

    def training_step(self, batch, batch_idx):
        x, y, index = batch
        if int(index[0]) // MICRO_BATCH == self.skip:
            return None
        return F.cross_entropy(self(x), y)


def indexed_loader(micro_batches: int) -> DataLoader:
    samples = micro_batches * MICRO_BATCH
    generator = torch.Generator().manual_seed(3)
    dataset = TensorDataset(
        torch.randn(samples, 8, generator=generator),
        torch.randint(0, 4, (samples,), generator=generator),
        torch.arange(samples),
    )
    return DataLoader(dataset, batch_size=MICRO_BATCH, shuffle=False)


class SaveInsideTheWindow(Callback):
    def __init__(self, path, at_batch=None, at_epoch_end=None):
        self.path, self.at_batch, self.at_epoch_end = path, at_batch, at_epoch_end

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if trainer.fit_loop.total_batch_idx == self.at_batch:
            trainer.save_checkpoint(self.path)

    def on_train_epoch_end(self, trainer, pl_module):
        if trainer.current_epoch == self.at_epoch_end:
            trainer.save_checkpoint(self.path)


# (strategy arguments, micro-batches a pass, epochs, where the checkpoint is taken). Every run is 12 micro-batches
# in windows of 4; the checkpoint falls after micro-batch 5, two micro-batches into the window of micro-batches 4-7.
RUNS = {
    "sinks of 6": (dict(sink_size=6), 12, 2, dict(at_epoch_end=0)),
    "no sinks, mid-epoch": (dict(), 12, 1, dict(at_batch=5)),
    "no sinks, carried across epochs": (dict(partial_window="carry"), 6, 2, dict(at_epoch_end=0)),
}


@pytest.mark.parametrize("skip", [4, 5, 6, 7])  # every position of the interrupted window
@pytest.mark.parametrize("run", RUNS.values(), ids=RUNS.keys())
def test_resume_inside_a_window_with_a_none_step_is_the_uninterrupted_run(tmp_path, run, skip):
    arguments, micro_batches, epochs, save_at = run
    path = tmp_path / "inside.ckpt"

    uninterrupted = SkipsOneMicroBatch(skip, optimizer="adamw", lr=0.01)
    straight = quiet_trainer(
        strategy=SinkStrategy(accumulation_steps=4, **arguments),
        max_epochs=epochs,
        callbacks=[SaveInsideTheWindow(path, **save_at)],
    )
    straight.fit(uninterrupted, indexed_loader(micro_batches))

    resumed = SkipsOneMicroBatch(skip, optimizer="adamw", lr=0.01, seed=7)  # another init: it must load
    again = quiet_trainer(strategy=SinkStrategy(accumulation_steps=4, **arguments), max_epochs=epochs)
    again.fit(resumed, indexed_loader(micro_batches), ckpt_path=path)

    assert again.global_step == straight.global_step == 3
    assert torch.equal(flat_params(resumed), flat_params(uninterrupted))


class OptimizesFrozenParameters(TinyClassifier):
    """The optimizer holds only the first layer, which is frozen: nothing is accumulated, the step changes nothing."""

    def configure_optimizers(self):
        first = self.net[0]
        first.requires_grad_(False)
        return torch.optim.SGD(first.parameters(), lr=0.1)


@pytest.mark.parametrize("sink_size", [None, 8])  # 8: one pass per sink, as one epoch
def test_an_optimizer_of_frozen_parameters_under_skip_window_on_overflow_trains_as_stock(sink_size):
    dataset = indexed_loader(8).dataset
    two_columns = TensorDataset(dataset.tensors[0], dataset.tensors[1])

    def fit(strategy, **kwargs):
        model = OptimizesFrozenParameters()
        plugin = LossScalePrecision("32-true", DynamicLossScale(init_scale=2.0**10), skip_window_on_overflow=True)
        trainer = quiet_trainer(strategy=strategy, plugins=[plugin], max_epochs=2, **kwargs)
        trainer.fit(model, DataLoader(two_columns, batch_size=MICRO_BATCH))
        return model, trainer

    stock, stock_trainer = fit("auto", accumulate_grad_batches=2)
    sink, sink_trainer = fit(SinkStrategy(accumulation_steps=2, sink_size=sink_size))
    assert sink_trainer.global_step == stock_trainer.global_step == 8
    assert torch.equal(flat_params(sink), flat_params(stock))


def test_a_resume_at_a_window_boundary_takes_the_new_accumulation_steps(tmp_path):
    """The saved window is closed, so the resumed run divides as its own accumulation_steps says: windows of 4 in the
    first epoch and of 2 in the second are a plain loop's updates over those windows."""
    from tests.helpers import make_dataset, reference_train, reference_windows, relative_error

    dataset = make_dataset(num_samples=32)
    model = TinyClassifier(optimizer="sgd", lr=0.05)
    reference = TinyClassifier(optimizer="sgd", lr=0.05)
    first = quiet_trainer(strategy=SinkStrategy(accumulation_steps=4), max_epochs=1)
    first.fit(model, DataLoader(dataset, batch_size=4))
    first.save_checkpoint(tmp_path / "boundary.ckpt")

    resumed = quiet_trainer(strategy=SinkStrategy(accumulation_steps=2), max_epochs=2)
    resumed.fit(model, DataLoader(dataset, batch_size=4), ckpt_path=tmp_path / "boundary.ckpt")
    windows = reference_windows(32, 4, 4, 1, "scale") + reference_windows(32, 4, 2, 1, "scale")
    reference_train(reference, dataset, windows)
    assert resumed.global_step == len(windows) == 6
    assert relative_error(flat_params(model), flat_params(reference)) <= 1e-6
