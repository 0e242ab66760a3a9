"""Where a sink-mode fit validates, saves and logs around a cut sink and a resume, side by side with stock
Lightning over the same epochs (a sink is a data pass of 8 batches)."""

from __future__ import annotations

import os
import warnings
from typing import Any

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from lightning.pytorch.callbacks import LearningRateMonitor, ModelCheckpoint
from torch import nn

from lightning_sink import SinkStrategy
from tests.helpers import RecordingLogger, loader, make_dataset, quiet_trainer

SAMPLES, BATCH = 64, 8


class Net(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Linear(8, 4)
        self.validated_at: list[int] = []

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return F.cross_entropy(self.net(x), y)

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        self.log("val_loss", F.cross_entropy(self.net(x), y))

    def on_validation_epoch_start(self) -> None:
        self.validated_at.append(self.trainer.global_step)

    def configure_optimizers(self) -> Any:
        optimizer = torch.optim.SGD(self.parameters(), lr=0.1)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda update: 1.0 / (update + 1))
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


def fit(strategy: Any, ckpt_path: str | None = None, **kwargs: Any) -> tuple[Net, pl.Trainer]:
    module = Net()
    trainer = quiet_trainer(strategy=strategy, **kwargs)
    data = loader(make_dataset(num_samples=SAMPLES), BATCH)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(module, data, loader(make_dataset(num_samples=16), BATCH), ckpt_path=ckpt_path)
    return module, trainer


def test_max_steps_inside_a_sink_does_not_validate_where_stock_does_not():
    """Lightning reads a sink's end ahead, so a sink cut short by max_steps looked like its epoch's last batch and
    validated at the stop (at global step 13 here, besides 8)."""
    stock, _ = fit("auto", max_epochs=5, max_steps=13)
    sink, trainer = fit(SinkStrategy(sink_size=8), max_epochs=5, max_steps=13)
    assert trainer.global_step == 13
    assert sink.validated_at == stock.validated_at == [8]


def test_a_monitored_checkpoint_saves_after_each_validation_of_an_int_val_check_interval(tmp_path):
    """The sink's schedule holds ``trainer.val_check_interval`` at 1.0 during the fit, which ModelCheckpoint read as
    "save at each epoch's end": it saved at steps 8 and 16 only, and kept other best models."""
    saved = {}
    for name, strategy in (("stock", "auto"), ("sink", SinkStrategy(sink_size=8))):
        folder = tmp_path / name
        callback = ModelCheckpoint(dirpath=folder, monitor="val_loss", save_top_k=-1, filename="{step}")
        fit(strategy, max_epochs=2, val_check_interval=4, callbacks=[callback], enable_checkpointing=True)
        saved[name] = sorted(os.listdir(folder))
    assert saved["sink"] == saved["stock"] == ["step=12.ckpt", "step=16.ckpt", "step=4.ckpt", "step=8.ckpt"]


def test_the_first_points_after_a_resume_inside_a_sink_are_written_at_stock_lightning_steps(tmp_path):
    """A checkpoint saved at a segment's end holds the loggers' step one behind the updates; Lightning's restart adds
    it back only for a batch it saw update, so the learning rate after the resume was written at step 1, not 2."""
    points = {}
    for name, strategy in (("stock", lambda: "auto"), ("sink", lambda: SinkStrategy(sink_size=8))):
        folder = tmp_path / name
        saving = ModelCheckpoint(dirpath=folder, every_n_train_steps=2, save_top_k=-1, filename="{step}")
        fit(strategy(), max_epochs=1, callbacks=[saving], enable_checkpointing=True)
        logger = RecordingLogger()
        fit(
            strategy(),
            ckpt_path=str(folder / "step=2.ckpt"),
            max_epochs=1,
            logger=logger,
            log_every_n_steps=1,
            callbacks=[LearningRateMonitor("step")],
        )
        points[name] = [(step, round(value, 6)) for step, metrics in logger.points for value in metrics.values()]
    assert points["sink"][:3] == points["stock"][:3] == [(2, 0.033333), (3, 0.025), (4, 0.02)]
