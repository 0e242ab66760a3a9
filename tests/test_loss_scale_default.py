"""``DynamicLossScale()``'s defaults: where torch's GradScaler starts, so a standard fp16 run skips no window at its
start; MindSpore's start is one argument away (``init_scale=2**24``)."""

from __future__ import annotations

import warnings

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_sink import DynamicLossScale, LossScalePrecision, SinkStrategy

WINDOWS, MICRO, STEPS = 6, 32, 4


def test_the_default_starts_and_grows_as_torchs_grad_scaler():
    scaler = torch.amp.GradScaler("cpu")
    default = DynamicLossScale()
    assert default.init_scale == scaler.get_scale()
    assert (default.scale_factor, 1 / default.scale_factor) == (scaler.get_growth_factor(), scaler.get_backoff_factor())
    assert default.scale_window == scaler.get_growth_interval()


def test_mindspores_start_is_one_argument_away():
    mindspore = DynamicLossScale(init_scale=2.0**24)  # DynamicLossScaleManager(init_loss_scale=2**24, 2, 2000)
    assert (mindspore.init_scale, mindspore.scale_factor, mindspore.scale_window) == (2.0**24, 2.0, 2000)


class SmallCNN(pl.LightningModule):
    """LeNet-5's shape (two conv-pool stages, three linear layers) on scikit-learn's 8x8 digits, upsampled."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(
            nn.Conv2d(1, 6, 5), nn.ReLU(), nn.MaxPool2d(2), nn.Conv2d(6, 16, 5), nn.ReLU(), nn.MaxPool2d(2),
            nn.Flatten(), nn.Linear(400, 120), nn.ReLU(), nn.Linear(120, 84), nn.ReLU(), nn.Linear(84, 10),
        )  # fmt: skip

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.cross_entropy(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01, momentum=0.9)


def digits() -> DataLoader:
    from sklearn.datasets import load_digits

    data = load_digits()
    x = torch.from_numpy(data.images).float().unsqueeze(1) / 16.0
    x = (F.interpolate(x, size=(32, 32), mode="bilinear") - 0.1307) / 0.3081
    samples = WINDOWS * STEPS * MICRO
    return DataLoader(TensorDataset(x[:samples], torch.from_numpy(data.target[:samples]).long()), batch_size=MICRO)


def skipped_at_the_start(loss_scale: DynamicLossScale) -> int:
    plugin = LossScalePrecision("16-mixed", loss_scale, device="cpu")  # fp16 autocast, on the CPU here
    trainer = pl.Trainer(
        accelerator="cpu",
        max_epochs=1,
        strategy=SinkStrategy(accumulation_steps=STEPS),
        plugins=[plugin],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(SmallCNN(), digits())
    assert trainer.global_step == WINDOWS
    return plugin.skipped_updates


@pytest.mark.slow
def test_a_standard_fp16_run_skips_no_window_at_its_start_with_the_default():
    assert skipped_at_the_start(DynamicLossScale()) == 0
    # the same run from MindSpore's start overflows until the scale has halved down to what the gradients allow
    assert skipped_at_the_start(DynamicLossScale(init_scale=2.0**24)) > 0
