"""``partial_window="lightning"``: a short last window divided as stock Lightning divides it (by N), so that a project
switching over sees bit-identical curves; stock Lightning runs side by side in each test.

The passes here are not multiples of the window (10 and 7 micro-batches with N=4), where the default ``"scale"``
differs from stock on purpose (its last window is the mean over its own micro-batches).
"""

from __future__ import annotations

import copy
import warnings
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_sink import SinkStrategy
from tests.helpers import RecordingLogger, TinyClassifier, flat_params, loader, make_dataset, quiet_trainer

WINDOW = 4


def fit_logged(module: pl.LightningModule, strategy: Any, epochs: int = 2) -> RecordingLogger:
    logger = RecordingLogger()
    trainer = quiet_trainer(
        strategy=strategy, max_epochs=epochs, accumulate_grad_batches=WINDOW, logger=logger, log_every_n_steps=1
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # loader workers, small log interval
        trainer.fit(module, loader(make_dataset(num_samples=40), 4))  # 10 micro-batches per pass: 4 + 4 + 2
    return logger


@pytest.mark.parametrize("optimizer", ["sgd", "adamw"])
def test_lightning_partial_window_is_bit_identical_to_stock_accumulation(optimizer):
    stock = TinyClassifier(optimizer=optimizer, step_lr_gamma=0.9)
    sink = copy.deepcopy(stock)
    stock_log = fit_logged(stock, "auto")
    sink_log = fit_logged(sink, SinkStrategy(partial_window="lightning"))
    assert torch.equal(flat_params(sink), flat_params(stock))
    assert sink_log.values(skip=("epoch",)) == stock_log.values(skip=("epoch",))  # logged losses, bitwise
    assert sink.seen_lrs == stock.seen_lrs


def test_the_default_scale_differs_from_stock_on_the_same_run():
    """The check above is not vacuous: the same short window divided by its own size gives other parameters."""
    stock = TinyClassifier()
    sink = copy.deepcopy(stock)
    fit_logged(stock, "auto")
    fit_logged(sink, SinkStrategy(partial_window="scale"))
    assert not torch.equal(flat_params(sink), flat_params(stock))


def test_an_unknown_partial_window_names_the_valid_ones():
    with pytest.raises(ValueError, match=r"partial_window='stock' is not valid: .*'scale'.*'lightning'"):
        SinkStrategy(partial_window="stock")


# ------------------------------------------------------------------ a forecasting library built on pytorch_lightning
class WindowForecaster(nn.Module):
    """An MLP from the last 12 points of a series to the next 4, as NHITS-style forecasters map windows."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(12, 32), nn.ReLU(), nn.Dropout(0.1), nn.Linear(32, 4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


def series_windows() -> DataLoader:
    noise = 0.1 * torch.randn(208, generator=torch.Generator().manual_seed(1))
    series = torch.sin(torch.arange(208, dtype=torch.float32) / 7) + noise
    starts = range(0, 192, 8)  # 24 windows: 6 batches of 4 per pass
    x = torch.stack([series[s : s + 12] for s in starts])
    y = torch.stack([series[s + 12 : s + 16] for s in starts])
    return DataLoader(TensorDataset(x, y), batch_size=4, shuffle=True, generator=torch.Generator().manual_seed(2))


def test_a_pytorch_lightning_forecaster_switches_over_with_equal_curves():
    """neuralforecast's shape: ``pytorch_lightning``, Adam with a per-step StepLR, dropout, a shuffled loader, and
    ``max_steps`` that ends inside a pass; 6 micro-batches per pass (not a multiple of 4)."""
    pl_ = pytest.importorskip("pytorch_lightning")
    from lightning_sink.pytorch_lightning import SinkStrategy as PLSinkStrategy

    class Forecaster(pl_.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.model = WindowForecaster()

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            x, y = batch
            loss = F.mse_loss(self.model(x), y)
            self.log("train_loss", loss, prog_bar=True)
            return loss

        def configure_optimizers(self) -> Any:
            optimizer = torch.optim.Adam(self.parameters(), lr=1e-2)
            scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=3, gamma=0.5)
            return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

    def run(strategy: Any) -> tuple[torch.Tensor, list[float]]:
        torch.manual_seed(3)  # dropout and the loader's shuffle draw the same numbers in both runs
        module = Forecaster()
        losses: list[float] = []

        class Record(pl_.Callback):
            def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, idx: int) -> None:
                losses.append(float(trainer.callback_metrics["train_loss"]))

        trainer = pl_.Trainer(
            accelerator="cpu",
            max_steps=7,
            accumulate_grad_batches=WINDOW,
            strategy=strategy,
            callbacks=[Record()],
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
        )
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            trainer.fit(module, series_windows())
        return torch.cat([p.detach().flatten() for p in module.parameters()]), losses

    stock_params, stock_losses = run("auto")
    sink_params, sink_losses = run(PLSinkStrategy(partial_window="lightning"))
    assert len(stock_losses) > 2 * 6  # more than two passes, each ending in a short window
    assert torch.equal(sink_params, stock_params)
    assert sink_losses == stock_losses
    scaled_params, _ = run(PLSinkStrategy(partial_window="scale"))
    assert not torch.equal(scaled_params, stock_params)
