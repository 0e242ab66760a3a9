"""self.log inside sinks: recorded per micro-step, handed to Lightning once per sink, with Lightning's results.

The references are the losses of a plain PyTorch loop over the same data and Lightning's documented reductions
(an epoch mean is weighted by batch size; the step value is the latest call's).
"""

from __future__ import annotations

import copy
import csv

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
import torchmetrics
from lightning.pytorch.loggers import CSVLogger
from torch.utils.data import DataLoader

from lightning_sink import SinkStrategy
from tests.helpers import TinyClassifier, make_dataset, quiet_trainer

SAMPLES, MICRO = 22, 4  # a data pass: 5 micro-batches of 4 and one of 2, so epoch means are really weighted


def plain_losses(model: TinyClassifier, passes: int) -> list[list[tuple[float, int]]]:
    """Per data pass, (loss, batch size) of every micro-batch of a plain SGD loop (accumulation_steps=1)."""
    optimizer = torch.optim.SGD(model.parameters(), lr=model.lr, momentum=0.9)
    result = []
    for _ in range(passes):
        losses = []
        for x, y in DataLoader(make_dataset(num_samples=SAMPLES), batch_size=MICRO):
            loss = F.cross_entropy(model(x), y)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            losses.append((loss.item(), len(y)))
        result.append(losses)
    return result


class Reductions(TinyClassifier):
    """Logs the loss with every reduction Lightning offers, on step and on epoch, plus a float and a Metric."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.metric = torchmetrics.MeanMetric()

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.cross_entropy(self(x), y)
        self.log("mean", loss, on_step=True, on_epoch=True)
        self.log_dict({"sum": loss, "doubled_sum": 2 * loss}, on_step=False, on_epoch=True, reduce_fx="sum")
        self.log("max", loss, on_step=False, on_epoch=True, reduce_fx="max")
        self.log("min", loss, on_epoch=True, reduce_fx=torch.min)
        self.log("micro_batch", float(len(y)), on_step=False, on_epoch=True, reduce_fx="sum")  # a Python number
        self.log("given_size", loss, on_step=False, on_epoch=True, batch_size=len(y))  # sizes differ per call
        self.metric.update(loss, weight=len(y))
        self.log("metric", self.metric, on_step=False, on_epoch=True)  # a Metric: passed to Lightning directly
        return loss


class Recorder(pl.Callback):
    def __init__(self):
        self.epoch_metrics, self.step_metrics = [], []

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        self.step_metrics.append({key: value.item() for key, value in trainer.callback_metrics.items()})

    def on_train_epoch_end(self, trainer, module):
        self.epoch_metrics.append({key: value.item() for key, value in trainer.callback_metrics.items()})


def test_epoch_and_step_values_equal_lightnings_reductions_of_the_plain_loops_losses():
    model = Reductions(lr=0.05)
    reference = plain_losses(copy.deepcopy(model), passes=3)
    recorder = Recorder()
    trainer = quiet_trainer(strategy=SinkStrategy(sink_size=-1), max_epochs=3, callbacks=[recorder])
    trainer.fit(model, DataLoader(make_dataset(num_samples=SAMPLES), batch_size=MICRO))
    assert len(recorder.epoch_metrics) == 3
    for losses, epoch, step in zip(reference, recorder.epoch_metrics, recorder.step_metrics):
        values = [loss for loss, _ in losses]
        weighted_mean = sum(loss * size for loss, size in losses) / sum(size for _, size in losses)
        assert epoch["mean_epoch"] == pytest.approx(weighted_mean, rel=1e-5)
        assert step["mean_step"] == pytest.approx(values[-1], rel=1e-5)  # the sink's last micro-step
        assert epoch["sum"] == pytest.approx(sum(values), rel=1e-5)
        assert epoch["doubled_sum"] == pytest.approx(2 * sum(values), rel=1e-5)
        assert epoch["max"] == pytest.approx(max(values), rel=1e-5)
        assert epoch["min_epoch"] == pytest.approx(min(values), rel=1e-5)
        assert epoch["micro_batch"] == SAMPLES
        assert epoch["given_size"] == pytest.approx(weighted_mean, rel=1e-5)
        assert epoch["metric"] == pytest.approx(weighted_mean, rel=1e-5)


@pytest.mark.parametrize("graph_mode", ["eager", "compile"])  # compiled: self.log is a graph break into the buffer
def test_the_logger_gets_a_row_per_update_with_its_loss(tmp_path, graph_mode):
    model = TinyClassifier(lr=0.05)
    reference = plain_losses(copy.deepcopy(model), passes=4)
    trainer = quiet_trainer(
        strategy=SinkStrategy(sink_size=3, graph_mode=graph_mode),
        max_epochs=8,
        log_every_n_steps=1,
        logger=CSVLogger(tmp_path, name="run", version=0),
    )
    trainer.fit(model, DataLoader(make_dataset(num_samples=SAMPLES), batch_size=MICRO))
    with open(tmp_path / "run" / "version_0" / "metrics.csv") as file:
        rows = [row for row in csv.DictReader(file) if row["train_loss"]]
    continuous = [loss for losses in reference for loss, _ in losses]  # 24 micro-batches, 8 sinks of 3
    # log_every_n_steps=1: every update at u - 1, as without sinking (sink/logging.py writes those inside a sink)
    assert [int(row["step"]) for row in rows] == list(range(24))
    assert [float(row["train_loss"]) for row in rows] == pytest.approx(continuous, rel=1e-5)


class LogsThenChangesInPlace(TinyClassifier):
    """Logs a running count, then changes that tensor in place: Lightning logs the value at the call."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.register_buffer("count", torch.zeros(()))

    def training_step(self, batch, batch_idx):
        self.log("count", self.count, on_step=True, on_epoch=True, reduce_fx="sum")
        self.count.add_(1)
        return super().training_step(batch, batch_idx)


def logged_counts(tmp_path, strategy) -> tuple[list[tuple[int, float]], list[float]]:
    trainer = quiet_trainer(
        strategy=strategy, max_epochs=4, log_every_n_steps=1, logger=CSVLogger(tmp_path, name="run", version=0)
    )
    trainer.fit(LogsThenChangesInPlace(lr=0.05), DataLoader(make_dataset(num_samples=SAMPLES), batch_size=MICRO))
    with open(tmp_path / "run" / "version_0" / "metrics.csv") as file:
        rows = list(csv.DictReader(file))
    steps = [(int(row["step"]), float(row["count_step"])) for row in rows if row["count_step"]]
    return steps, [float(row["count_epoch"]) for row in rows if row["count_epoch"]]


def test_a_logged_tensor_changed_in_place_afterwards_logs_its_value_at_the_call(tmp_path):
    stock = logged_counts(tmp_path / "stock", "auto")
    sink = logged_counts(tmp_path / "sink", SinkStrategy(sink_size=-1))  # a sink per data pass, as epochs
    assert stock[0][:3] == [(0, 0.0), (1, 1.0), (2, 2.0)]  # the reference logs what the count was at each call
    assert sink == stock


def test_lightning_is_called_at_most_twice_per_key_per_sink(monkeypatch):
    calls = []
    real_log = pl.LightningModule.log

    def counting_log(self, name, *args, **kwargs):
        calls.append(name)
        return real_log(self, name, *args, **kwargs)

    monkeypatch.setattr(pl.LightningModule, "log", counting_log)
    trainer = quiet_trainer(strategy=SinkStrategy(sink_size=50), max_epochs=2)
    trainer.fit(Reductions(), DataLoader(make_dataset(num_samples=SAMPLES), batch_size=MICRO))
    # per sink: each reduced key twice (its earlier steps, its last step); the Metric twice (its first call, which
    # registers it, and its last, which leaves its step value; Lightning holds the Metric object itself)
    assert {name: calls.count(name) for name in calls} == {
        "mean": 4,
        "sum": 4,
        "doubled_sum": 4,
        "max": 4,
        "min": 4,
        "micro_batch": 4,
        "given_size": 4,
        "metric": 4,
    }


def test_a_logging_module_has_no_host_sync_inside_a_sink():
    from tests.strategies.test_sink_loop import count_syncs_per_sink
    from tests.test_precision import SyncCounter

    counter = SyncCounter()
    # prefetch_depth=2: the loader's own CPU work (a sampler's tolist()) then runs in its thread, not counted
    trainer = quiet_trainer(
        strategy=SinkStrategy(accumulation_steps=2, sink_size=8, prefetch_depth=2), max_epochs=2, callbacks=[counter]
    )
    sink_syncs = count_syncs_per_sink(trainer, counter)
    trainer.fit(
        TinyClassifier(optimizer="adamw_fused"), DataLoader(make_dataset(num_samples=SAMPLES), batch_size=MICRO)
    )
    assert sink_syncs == [0, 0]


class ChangesItsArguments(TinyClassifier):
    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        self.log("flip", loss, prog_bar=self.trainer.strategy._accumulator is not None and bool(batch_idx % 2))
        return loss


def test_changing_a_keys_arguments_inside_a_sink_is_a_clear_error_and_restores_self_log():
    model = ChangesItsArguments()
    trainer = quiet_trainer(strategy=SinkStrategy(sink_size=4), max_epochs=1)
    with pytest.raises(ValueError, match=r"self.log\('flip', \.\.\.\) was called with different arguments"):
        trainer.fit(model, DataLoader(make_dataset(num_samples=SAMPLES), batch_size=MICRO))
    assert "log" not in model.__dict__  # the stand-in is gone: self.log is Lightning's again


class OwnLog(TinyClassifier):
    def __init__(self):
        super().__init__()
        self.own_calls = 0

    def log(self, *args, **kwargs):
        self.own_calls += 1
        super().log(*args, **kwargs)


def test_a_module_with_its_own_log_is_called_on_every_micro_step():
    model = OwnLog()
    quiet_trainer(strategy=SinkStrategy(sink_size=5), max_epochs=2).fit(
        model, DataLoader(make_dataset(num_samples=SAMPLES), batch_size=MICRO)
    )
    assert model.own_calls == 10
