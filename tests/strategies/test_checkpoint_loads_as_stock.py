"""Checkpoints loaded by something other than a fit's own resume, and resumes after an epoch that ended early, side
by side with stock Lightning (no sinking): what the next fit trains is what stock trains."""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.tuner import Tuner
from torch.utils.data import DataLoader, TensorDataset

from lightning_sink import SinkStrategy
from tests.helpers import quiet_trainer

_GENERATOR = torch.Generator().manual_seed(0)
X = torch.randn(96, 8, generator=_GENERATOR)
Y = (X.sum(1, keepdim=True) > 0).float()
BATCHES = 12  # per epoch, of 8


class Net(pl.LightningModule):
    """Records each trained batch's epoch and its first value; ``early`` ends epochs before their last batch."""

    def __init__(self, early: str = "", random: bool = True) -> None:
        """``random=False``: no shuffle, no dropout (a resume restores the generators, which stock leaves as the
        new process has them: side by side only a run without random draws is the same)."""
        super().__init__()
        torch.manual_seed(0)
        self.lin, self.out = torch.nn.Linear(8, 16), torch.nn.Linear(16, 1)
        self.drop = torch.nn.Dropout(0.3 if random else 0.0)
        self.early, self.random = early, random
        self.seen: list[tuple[int, float]] = []
        self.lr, self.batch_size = 0.05, 8  # (what the tuner reads and sets)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(TensorDataset(X, Y), batch_size=self.batch_size, shuffle=self.random)

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> int | None:
        return -1 if self.early == "return -1" and batch_idx == 6 else None

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        self.seen.append((self.current_epoch, round(batch[0][0, 0].item(), 4)))
        if self.early == "should_stop" and self.current_epoch == 1 and batch_idx == 5:
            self.trainer.should_stop = True
        x, y = batch
        return F.binary_cross_entropy_with_logits(self.out(self.drop(torch.tanh(self.lin(x)))), y)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(TensorDataset(X, Y), batch_size=8)

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        self.log("val_loss", F.binary_cross_entropy_with_logits(self.out(torch.tanh(self.lin(batch[0]))), batch[1]))

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=self.lr, momentum=0.9)

    def per_epoch(self, epochs: int) -> list[int]:
        return [sum(1 for epoch, _ in self.seen if epoch == e) for e in range(epochs)]


def _trainer(sink: bool, folder: Path, **kwargs: Any) -> pl.Trainer:
    strategy = SinkStrategy() if sink else "auto"
    return quiet_trainer(strategy=strategy, accumulate_grad_batches=3, default_root_dir=folder, **kwargs)


def _fit(trainer: pl.Trainer, module: Net, **kwargs: Any) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(module, **kwargs)


def _same(first: Net, second: Net) -> None:
    assert first.seen == second.seen
    for (name, a), (_, b) in zip(first.state_dict().items(), second.state_dict().items()):
        assert torch.equal(a, b), name


def _seeded_run(sink: bool, folder: Path, first: dict[str, Any], second: dict[str, Any], early: str) -> tuple:
    torch.manual_seed(1)  # (the shuffle and the dropout masks, drawn from the global generator)
    checkpoints = ModelCheckpoint(dirpath=folder, save_last=True)
    trainer = _trainer(sink, folder, enable_checkpointing=True, callbacks=[checkpoints], **first)
    _fit(trainer, Net(early, random=False))
    resumed = Net(early, random=False)
    trainer = _trainer(sink, folder, **second)
    _fit(trainer, resumed, ckpt_path=str(folder / "last.ckpt"))
    return resumed, trainer.global_step


@pytest.mark.parametrize(
    "early, first, second, expected",
    [
        ("max_steps", {"max_steps": 5}, {"max_epochs": 4}, [0, 0, BATCHES, BATCHES]),
        ("should_stop", {"max_epochs": 3}, {"max_epochs": 4}, [0, 0, BATCHES, BATCHES]),
        ("return -1", {"max_epochs": 2}, {"max_epochs": 4}, [0, 0, 6, 6]),
    ],
)
def test_a_resume_after_an_epoch_that_ended_early_starts_the_next_epoch_at_its_first_batch(
    tmp_path: Path, early: str, first: dict, second: dict, expected: list[int]
):
    """Lightning records such an epoch as finished; the strategy had kept its data position inside the pass and
    skipped that many batches of the next epoch (a whole epoch where batches were skipped by -1)."""
    stock, stock_step = _seeded_run(False, tmp_path / "stock", first, second, early)
    sink, sink_step = _seeded_run(True, tmp_path / "sink", first, second, early)
    assert stock.per_epoch(4) == expected
    assert sink.per_epoch(4) == expected and sink_step == stock_step
    _same(stock, sink)


class OwnGenerator(Net):
    """Shuffles with a generator of its own: a loader the strategy resumes exactly."""

    def train_dataloader(self) -> DataLoader:
        generator = torch.Generator().manual_seed(3)
        return DataLoader(TensorDataset(X, Y), batch_size=self.batch_size, shuffle=True, generator=generator)


def test_after_an_epoch_that_ended_early_a_checkpoint_inside_the_next_resumes_at_its_batch(tmp_path: Path):
    """After an epoch ended by ``on_train_batch_start`` returning -1, the next epoch is a new pass: a checkpoint
    inside it counts that epoch's batches only, and a resume draws that epoch's shuffle again and continues it
    where the uninterrupted run was. (Lightning itself numbers the first batch after such a resume one lower, as
    stock does.)"""
    torch.manual_seed(1)
    whole = OwnGenerator("return -1")
    _fit(_trainer(True, tmp_path / "whole", max_epochs=3), whole)
    torch.manual_seed(1)
    checkpoints = ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=3, save_top_k=-1)
    interrupted = OwnGenerator("return -1")
    _fit(_trainer(True, tmp_path, max_steps=3, enable_checkpointing=True, callbacks=[checkpoints]), interrupted)
    path = tmp_path / "epoch=1-step=3.ckpt"
    assert torch.load(path, weights_only=False)["lightning_sink"]["data"]["trained_in_pass"] == 3  # (was 9)
    resumed = OwnGenerator("return -1")
    _fit(_trainer(True, tmp_path, max_epochs=3), resumed, ckpt_path=str(path))
    assert interrupted.seen == whole.seen[:9]
    assert resumed.seen[0] == whole.seen[9]  # (the epoch's fourth batch: its shuffle drawn as before)


def _validate_then_fit(sink: bool, folder: Path) -> Net:
    torch.manual_seed(1)
    checkpoints = ModelCheckpoint(dirpath=folder, every_n_train_steps=5, save_top_k=-1)
    _fit(_trainer(sink, folder, max_epochs=2, enable_checkpointing=True, callbacks=[checkpoints]), Net())
    torch.manual_seed(2)
    module, trainer = Net(), _trainer(sink, folder / "again", max_epochs=2)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.validate(module, ckpt_path=str(folder / "epoch=1-step=5.ckpt"), verbose=False)
    _fit(trainer, module)
    return module


def test_a_checkpoint_loaded_to_validate_leaves_the_next_fit_starting_as_stock(tmp_path: Path):
    """The checkpoint's data position, open window and random state are a resume's: applied to the next fit of the
    same Trainer, they skipped batches and rewound the generators."""
    stock, sink = _validate_then_fit(False, tmp_path / "stock"), _validate_then_fit(True, tmp_path / "sink")
    assert stock.per_epoch(2) == [BATCHES, BATCHES]
    _same(stock, sink)


@pytest.mark.parametrize("tune", ["lr_find", "scale_batch_size"])
def test_a_fit_after_the_tuner_trains_as_stock(tmp_path: Path, tune: str):
    """The tuner's restore of its own temporary checkpoint was taken for a resume: the fit after it rewound the
    global generator to that file's state (other dropout masks and shuffle order than stock)."""
    modules = []
    for sink in (False, True):
        torch.manual_seed(1)
        module, trainer = Net(), _trainer(sink, tmp_path / str(sink), max_epochs=2)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            if tune == "lr_find":
                Tuner(trainer).lr_find(module, min_lr=1e-3, max_lr=0.1, num_training=8, update_attr=False)
            else:
                Tuner(trainer).scale_batch_size(module, mode="power", steps_per_trial=2, max_trials=2)
                module.batch_size = 8
        module.seen.clear()
        _fit(trainer, module)
        modules.append(module)
    assert modules[0].per_epoch(2) == [BATCHES, BATCHES]
    _same(*modules)
