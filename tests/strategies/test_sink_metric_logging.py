"""torchmetrics ``Metric`` objects logged with ``self.log`` inside sinks reach the loggers at the same steps, with the
same values, as stock Lightning's ``accumulate_grad_batches`` over the same data (side by side, an in-memory logger
recording every point), with ``log_every_n_steps`` not dividing a sink's updates.
"""

from __future__ import annotations

import pytest
import torch.nn.functional as F
import torchmetrics

from lightning_sink import SinkStrategy
from tests.helpers import RecordingLogger, TinyClassifier, loader, make_dataset, quiet_trainer

MICRO, STEPS, PASS = 4, 4, 8  # a data pass of 8 micro-batches: two updates
STEP_NAMES = ("acc_metric", "loss_metric_step", "acc_tensor")


class LogsMetrics(TinyClassifier):
    """An accuracy Metric on step, a mean-loss Metric on step and on epoch, and a plain tensor beside them."""

    def __init__(self) -> None:
        super().__init__(lr=0.05)
        self.accuracy = torchmetrics.classification.MulticlassAccuracy(num_classes=4)
        self.mean_loss = torchmetrics.MeanMetric()

    def training_step(self, batch, batch_idx):
        x, y = batch
        logits = self(x)
        loss = F.cross_entropy(logits, y)
        self.accuracy(logits.argmax(-1), y)
        self.mean_loss(loss)
        self.log_metrics(logits, y)
        return loss

    def log_metrics(self, logits, y):
        self.log("acc_metric", self.accuracy)
        self.log("loss_metric", self.mean_loss, on_step=True, on_epoch=True)
        self.log("acc_tensor", (logits.argmax(-1) == y).float().mean())


def points(strategy, log_every_n_steps: int, **trainer_kwargs) -> dict[tuple[int, str], list[float]]:
    logger = RecordingLogger()
    trainer = quiet_trainer(strategy=strategy, logger=logger, log_every_n_steps=log_every_n_steps, **trainer_kwargs)
    trainer.fit(LogsMetrics(), loader(make_dataset(num_samples=PASS * MICRO), MICRO))
    assert trainer.global_step == 12
    return logger.by_step_and_name()


@pytest.mark.parametrize(
    ("sink_size", "log_every_n_steps", "limits"),
    [
        (PASS, 3, {"max_epochs": 6}),  # a sink per data pass: 2 updates per sink, epochs as without sinking
        (6, 2, {"max_steps": 12, "max_epochs": -1}),  # sinks that end inside windows
    ],
)
def test_metrics_reach_the_loggers_at_the_stock_runs_steps_with_its_values(sink_size, log_every_n_steps, limits):
    stock = points("auto", log_every_n_steps, accumulate_grad_batches=STEPS, **limits)
    sink = points(SinkStrategy(sink_size=sink_size, accumulation_steps=STEPS), log_every_n_steps, **limits)
    steps = [u - 1 for u in range(1, 13) if u % log_every_n_steps == 0]
    for name in STEP_NAMES:
        assert sorted(step for step, logged in stock if logged == name) == steps, name  # (the reference is as read)
    if "max_steps" in limits:  # sinks are not data passes here (nor epochs): compare the step points only
        stock = {point: values for point, values in stock.items() if point[1] in STEP_NAMES}
        sink = {point: values for point, values in sink.items() if point[1] in STEP_NAMES}
    else:
        assert sorted(step for step, logged in stock if logged == "loss_metric_epoch") == [1, 3, 5, 7, 9, 11]
    assert sorted(sink) == sorted(stock)
    for point, values in stock.items():
        assert sink[point] == pytest.approx(values, rel=1e-6, abs=1e-7), point


class MetricOnTheProgressBar(LogsMetrics):
    """A Metric on the progress bar only (no step value for the loggers) and one for the loggers only."""

    def log_metrics(self, logits, y):
        self.log("acc_bar", self.accuracy, prog_bar=True, logger=False, on_step=True, on_epoch=True)
        self.log("mean_loss", self.mean_loss, on_step=True, on_epoch=False)


def fit_metrics(strategy, **trainer_kwargs) -> tuple[dict, dict, dict]:
    logger = RecordingLogger()
    trainer = quiet_trainer(strategy=strategy, logger=logger, log_every_n_steps=1, max_epochs=3, **trainer_kwargs)
    trainer.fit(MetricOnTheProgressBar(), loader(make_dataset(num_samples=PASS * MICRO), MICRO))
    return trainer.progress_bar_metrics, trainer.callback_metrics, logger.by_step_and_name()


def test_a_metric_lightning_gets_twice_a_sink_leaves_the_stock_runs_bar_callback_and_logged_values():
    """Inside a sink Lightning gets a logged Metric at its first and last call only: the progress bar's value, the
    callback metrics and every logged point stay those of the stock run."""
    stock = fit_metrics("auto", accumulate_grad_batches=STEPS)
    sink = fit_metrics(SinkStrategy(sink_size=PASS, accumulation_steps=STEPS))
    for ours, reference in zip(sink[:2], stock[:2]):
        assert sorted(ours) == sorted(reference)
        for name, value in reference.items():
            assert float(ours[name]) == pytest.approx(float(value), rel=1e-6), name
    assert {"acc_bar_step", "acc_bar_epoch"} <= set(stock[0])
    assert sorted(sink[2]) == sorted(stock[2])
    for point, values in stock[2].items():
        assert sink[2][point] == pytest.approx(values, rel=1e-6, abs=1e-7), point
