"""What TensorBoard shows in sink mode, read back from the event files, against the same run without sinking.

The reference is stock Lightning (its default strategy with ``accumulate_grad_batches=N``) over the same data in the
same order: every ``self.log`` point and every ``LearningRateMonitor`` point must be at the same global steps, with
the same values, whatever ``log_every_n_steps`` is. Stock Lightning writes a learning rate at the start of every
micro-batch of an update (N equal points at one step); sink mode writes it once, so steps are compared as sets.
"""

from __future__ import annotations

import copy
import warnings
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from lightning.pytorch.callbacks import LearningRateMonitor
from lightning.pytorch.loggers import TensorBoardLogger
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from lightning_sink import SinkStrategy
from tests.helpers import TinyClassifier, loader, make_dataset, quiet_trainer

MICRO, STEPS = 4, 4
SAMPLES = 64 * MICRO  # 64 micro-batches, 16 updates per data pass


class LogsOnStepAndEpoch(TinyClassifier):
    """``train_loss`` on step only (TinyClassifier), ``accuracy`` on step and epoch, ``lr_seen`` a Python number."""

    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        x, y = batch
        self.log("accuracy", (self(x).argmax(-1) == y).float().mean(), on_step=True, on_epoch=True)
        self.log("lr_seen", self.trainer.optimizers[0].param_groups[0]["lr"])
        return loss


def scalars(log_dir: str) -> dict[str, dict[int, list[float]]]:
    """Every scalar tag of a run: step -> the values written at that step."""
    events = EventAccumulator(log_dir)
    events.Reload()
    result = {}
    for tag in events.Tags()["scalars"]:
        points: dict[int, list[float]] = {}
        for event in events.Scalars(tag):
            points.setdefault(event.step, []).append(event.value)
        result[tag] = points
    return result


def fit(tmp_path: Path, name: str, strategy, log_every_n_steps: int | None, **trainer_kwargs):
    logger = TensorBoardLogger(tmp_path, name=name, version=0)
    kwargs = {} if log_every_n_steps is None else {"log_every_n_steps": log_every_n_steps}
    trainer = quiet_trainer(
        strategy=strategy, logger=logger, callbacks=[LearningRateMonitor(log_momentum=True)], **kwargs, **trainer_kwargs
    )
    trainer.fit(LogsOnStepAndEpoch(lr=0.05, step_lr_gamma=0.97), loader(make_dataset(num_samples=SAMPLES), MICRO))
    return trainer, scalars(logger.log_dir)


def stock_run(tmp_path: Path, log_every_n_steps: int, **trainer_kwargs):
    return fit(tmp_path, "stock", "auto", log_every_n_steps, accumulate_grad_batches=STEPS, **trainer_kwargs)


def assert_same_points(sink: dict, stock: dict, tags: list[str]) -> None:
    for tag in tags:
        assert tag in stock, f"the reference run wrote no {tag!r}"  # (else the comparison below proves nothing)
        assert sorted(sink.get(tag, {})) == sorted(stock[tag]), tag
        for step, values in stock[tag].items():
            if tag.startswith("lr-"):  # stock: one equal point per micro-batch of the update; sink mode: one
                assert len(set(values)) == 1, (tag, step, values)
                values = values[:1]
            assert sink[tag][step] == pytest.approx(values, rel=1e-6, abs=1e-7), (tag, step)


STEP_TAGS = ["train_loss", "accuracy_step", "lr_seen", "lr-SGD", "lr-SGD-momentum"]


@pytest.mark.slow
@pytest.mark.parametrize("log_every_n_steps", [1, 8, 50])
def test_sinks_of_eight_updates_write_the_stock_runs_points(tmp_path, log_every_n_steps):
    """The reported case: sink_size=32 with N=4 is 8 updates per sink; 64 updates in all."""
    _, stock = stock_run(tmp_path, log_every_n_steps, max_epochs=4)
    trainer, sink = fit(
        tmp_path, "sink", SinkStrategy(sink_size=32, accumulation_steps=STEPS), log_every_n_steps, max_epochs=8
    )
    assert trainer.global_step == 64
    assert sorted(stock["train_loss"]) == [u - 1 for u in range(1, 65) if u % log_every_n_steps == 0]
    assert_same_points(sink, stock, STEP_TAGS)


@pytest.mark.slow
def test_one_data_pass_per_sink_writes_every_point_of_the_stock_run(tmp_path):
    """With a sink per data pass the epochs are the same too: every tag, epoch values included, matches."""
    _, stock = stock_run(tmp_path, 8, max_epochs=2)
    _, sink = fit(tmp_path, "sink", SinkStrategy(sink_size=-1, accumulation_steps=STEPS), 8, max_epochs=2)
    assert sorted(sink) == sorted(stock)
    assert_same_points(sink, stock, sorted(stock))


@pytest.mark.slow
@pytest.mark.parametrize("log_every_n_steps", [1, 3])
def test_sinks_that_end_inside_a_window_write_the_stock_runs_points(tmp_path, log_every_n_steps):
    """sink_size=6 with N=4: sinks end inside windows (windows run on across sinks), Lightning sees 1 or 2 updates
    per sink; every update still gets its point with its own values."""
    _, stock = stock_run(tmp_path, log_every_n_steps, max_steps=30, max_epochs=-1)
    trainer, sink = fit(
        tmp_path,
        "sink",
        SinkStrategy(sink_size=6, accumulation_steps=STEPS),
        log_every_n_steps,
        max_steps=30,
        max_epochs=-1,
    )
    assert trainer.global_step == 30
    assert_same_points(sink, stock, STEP_TAGS)


@pytest.mark.slow
def test_the_default_log_every_n_steps_writes_without_a_warning(tmp_path):
    """Lightning's default log_every_n_steps=50 (not set by the user): the points are written, nothing warns."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer, sink = fit(tmp_path, "sink", SinkStrategy(sink_size=32, accumulation_steps=STEPS), None, max_epochs=8)
    assert trainer.log_every_n_steps == 50
    assert [str(w.message) for w in caught if "log_every_n_steps" in str(w.message)] == []
    assert sorted(sink["train_loss"]) == sorted(sink["lr-SGD"]) == [49]


class OverridesLog(TinyClassifier):
    def log(self, name, value, *args, **kwargs):
        super().log(name, value, *args, **kwargs)


def test_a_module_with_its_own_log_gets_a_segment_end_at_each_log_every_n_steps_multiple(tmp_path):
    """Its self.log is not recorded per micro-step; every multiple of log_every_n_steps inside a sink ends a segment
    (instead of the warning it got before), so its values reach the logger at the steps Lightning writes them."""
    logger = TensorBoardLogger(tmp_path, name="run", version=0)
    trainer = quiet_trainer(strategy=SinkStrategy(sink_size=8), logger=logger, log_every_n_steps=3, max_epochs=1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(OverridesLog(), loader(make_dataset(num_samples=32), MICRO))
    assert [str(w.message) for w in caught if "log_every_n_steps" in str(w.message)] == []
    assert sorted(scalars(logger.log_dir)["train_loss"]) == [2, 5]  # global_step 3 and 6, at logger step - 1


def test_the_loggers_get_the_values_of_the_updates_in_one_read_back(tmp_path):
    """Inside a sink nothing is read back (test_sink_logging.py); at its end one read carries every due point."""
    from tests.strategies.test_sink_loop import count_syncs_per_sink
    from tests.test_precision import SyncCounter

    counter = SyncCounter()
    logger = TensorBoardLogger(tmp_path, name="run", version=0)
    trainer = quiet_trainer(
        strategy=SinkStrategy(sink_size=8, accumulation_steps=2, prefetch_depth=2),
        logger=logger,
        log_every_n_steps=1,
        max_epochs=2,
        callbacks=[counter],
    )
    reads_per_sink = count_syncs_per_sink(trainer, counter)  # the sink and its flush
    trainer.fit(TinyClassifier(), loader(make_dataset(num_samples=64), MICRO))
    assert reads_per_sink == [1, 1]
    assert sorted(scalars(logger.log_dir)["train_loss"]) == list(range(8))


def test_values_match_a_plain_loop(tmp_path):
    """Independent of Lightning: the step values are the losses of each update's last micro-batch."""
    model = TinyClassifier(lr=0.05)
    reference = copy.deepcopy(model)
    logger = TensorBoardLogger(tmp_path, name="run", version=0)
    trainer = quiet_trainer(
        strategy=SinkStrategy(sink_size=6, accumulation_steps=2), logger=logger, log_every_n_steps=1, max_epochs=2
    )
    dataset = make_dataset(num_samples=48)
    trainer.fit(model, loader(dataset, MICRO))
    optimizer = torch.optim.SGD(reference.parameters(), lr=0.05, momentum=0.9)
    x, y = dataset.tensors
    last_losses = []
    for update in range(6):
        optimizer.zero_grad()
        for micro in range(2):
            start = (2 * update + micro) * MICRO
            loss = F.cross_entropy(reference(x[start : start + MICRO]), y[start : start + MICRO])
            (loss / 2).backward()
        last_losses.append(loss.item())
        optimizer.step()
    written = scalars(logger.log_dir)["train_loss"]
    assert sorted(written) == list(range(6))
    assert [written[step][0] for step in range(6)] == pytest.approx(last_losses, rel=1e-5)
