"""TimeMonitor: per-epoch and per-step time and throughput, checked against clocks read around it."""

from __future__ import annotations

import re
import time

import pytest
from lightning.pytorch.callbacks import Callback

from lightning_sink import SinkStrategy
from lightning_sink.callbacks import TimeMonitor
from tests.callbacks.common import MICRO, SAMPLES, RecordingClassifier
from tests.helpers import loader, make_dataset, quiet_trainer

TIME_LINE = re.compile(r"^epoch time: ([0-9.]+) ms, per step time: ([0-9.]+) ms(?:, throughput: ([0-9.]+) samples/s)?$")
SLEEP_S = 0.004  # each step sleeps, so that step times are well above clock noise


class SlowClassifier(RecordingClassifier):
    def training_step(self, batch, batch_idx):
        time.sleep(SLEEP_S)
        return super().training_step(batch, batch_idx)


class Clock(Callback):
    """Reads the clock at epoch start, each batch end and epoch end (placed before and after the monitor)."""

    def __init__(self):
        self.epochs: list[dict] = []

    def on_train_epoch_start(self, trainer, pl_module):
        self.epochs.append({"start": time.perf_counter(), "batch_ends": []})

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.epochs[-1]["batch_ends"].append(time.perf_counter())

    def on_train_epoch_end(self, trainer, pl_module):
        self.epochs[-1]["end"] = time.perf_counter()


def run(capsys, strategy, epochs, monitor):
    before, after = Clock(), Clock()
    trainer = quiet_trainer(strategy=strategy, max_epochs=epochs, callbacks=[before, monitor, after])
    trainer.fit(SlowClassifier(), loader(make_dataset(num_samples=SAMPLES), MICRO))
    lines = [TIME_LINE.match(line) for line in capsys.readouterr().out.splitlines()]
    return [tuple(float(g) if g else None for g in m.groups()) for m in lines if m], before, after


def assert_within_clocks(lines, before, after, steps_per_epoch):
    """The monitor's readings lie between the clocks read just before and just after its own."""
    rounding = 0.0005  # the line prints 3 decimals
    for (epoch_ms, step_ms, _throughput), outer, inner in zip(lines, before.epochs, after.epochs):
        epoch_low, epoch_high = outer["end"] - inner["start"], inner["end"] - outer["start"]
        assert epoch_low * 1e3 - rounding <= epoch_ms <= epoch_high * 1e3 + rounding
        train_low = outer["batch_ends"][-1] - inner["start"]
        train_high = inner["batch_ends"][-1] - outer["start"]
        assert train_low * 1e3 - rounding <= step_ms * steps_per_epoch <= train_high * 1e3 + rounding * steps_per_epoch
        assert step_ms >= SLEEP_S * 1e3


@pytest.mark.parametrize("data_size", [None, 12])
def test_per_batch_epoch_and_step_times_and_throughput(capsys, data_size):
    lines, before, after = run(capsys, SinkStrategy(accumulation_steps=2), 2, TimeMonitor(data_size))
    steps = SAMPLES // MICRO
    assert len(lines) == 2  # once per epoch
    assert_within_clocks(lines, before, after, steps)
    samples_per_step = data_size or MICRO  # None: read from the batch
    for _, step_ms, throughput in lines:  # samples/s == data_size * steps / training time
        assert throughput == pytest.approx(samples_per_step * steps / (step_ms * steps / 1e3), rel=1e-3)


def test_sink_mode_per_step_time_is_the_sink_time_over_its_steps(capsys):
    sink = 5
    lines, before, after = run(capsys, SinkStrategy(accumulation_steps=1, sink_size=sink), 3, TimeMonitor())
    assert len(lines) == 3  # one sink per epoch: one line per sink
    assert_within_clocks(lines, before, after, sink)
    for (_, step_ms, throughput), outer, _inner in zip(lines, before.epochs, after.epochs):
        assert len(outer["batch_ends"]) == 1  # the sink is one Lightning batch
        assert throughput == pytest.approx(MICRO * 1e3 / step_ms, rel=1e-3)  # batch size from the sink's loader


def test_mid_epoch_validation_is_not_step_time(capsys):
    class Validating(SlowClassifier):
        def validation_step(self, batch, batch_idx):
            time.sleep(0.05)

        def val_dataloader(self):
            return loader(make_dataset(num_samples=8), 4)  # 2 batches: 100 ms per validation

    monitor, clock = TimeMonitor(), Clock()
    trainer = quiet_trainer(
        strategy=SinkStrategy(accumulation_steps=1), max_epochs=1, val_check_interval=2, callbacks=[monitor, clock]
    )
    trainer.fit(Validating(), loader(make_dataset(num_samples=SAMPLES), MICRO))
    ((epoch_ms, step_ms, _),) = [
        tuple(map(float, m.groups()[:2])) + (None,)
        for m in map(TIME_LINE.match, capsys.readouterr().out.splitlines())
        if m
    ]
    epoch = clock.epochs[0]
    wall_ms = (epoch["batch_ends"][-1] - epoch["start"]) * 1e3
    assert wall_ms > 400 and step_ms * 10 < wall_ms - 350  # 4 validations inside the epoch, 100 ms each
    assert epoch_ms > wall_ms


def test_step_count_survives_a_checkpoint_resume(tmp_path):
    from lightning.pytorch.callbacks import ModelCheckpoint

    first, second = TimeMonitor(), TimeMonitor()
    checkpoints = ModelCheckpoint(dirpath=tmp_path, save_last=True, save_top_k=0)
    data = loader(make_dataset(num_samples=SAMPLES), MICRO)
    quiet_trainer(
        strategy=SinkStrategy(accumulation_steps=1),
        max_epochs=1,
        enable_checkpointing=True,
        callbacks=[first, checkpoints],
    ).fit(RecordingClassifier(), data)
    quiet_trainer(strategy=SinkStrategy(accumulation_steps=1), max_epochs=2, callbacks=[second]).fit(
        RecordingClassifier(), data, ckpt_path=tmp_path / "last.ckpt"
    )
    steps = SAMPLES // MICRO
    assert (first.steps.total, second.steps.total) == (steps, 2 * steps)  # the logging step runs on


def test_bad_data_size_is_a_clear_error():
    with pytest.raises(ValueError, match=r"data_size=0 is not valid: pass an int >= 1"):
        TimeMonitor(0)
