"""What a run with the default TensorBoardLogger shows, read back from the event files: names, steps and values.

Every scalar is on Lightning's step axis, optimizer updates: a value that belongs to the u-th update is at step
u - 1, as ``self.log`` writes it. ``loss`` (LossMonitor) is the loss of the last printed line among the micro-batches
of an update's window; ``time/*`` (TimeMonitor) are at the step of the epoch's last micro-batch; ``loss_scale``,
``overflow`` and ``skipped_updates`` are written once per update by the sink strategies' ``self.log`` (in sink mode
too) or, under a stock strategy, by ``LossScaleMonitor`` at its printed lines; never both.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import numpy as np
import pytest
from lightning.pytorch.callbacks import LearningRateMonitor
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from lightning_sink import DynamicLossScale, LossScalePrecision, SinkStrategy
from lightning_sink.callbacks import LossMonitor, LossScaleMonitor, TimeMonitor
from tests.callbacks.common import MICRO, SAMPLES, InfAtSteps, RecordingClassifier, dynamic_scale_rule
from tests.helpers import loader, make_dataset, quiet_trainer

EPOCHS, STEPS_PER_EPOCH = 2, SAMPLES // MICRO
OVERFLOW_STEP = 3  # the 4th training step's scaled loss overflows (the loss itself stays finite)


def run(tmp_path: Path, strategy) -> tuple[InfAtSteps, dict[str, list]]:
    model = InfAtSteps(inf_at=(OVERFLOW_STEP,), factor=1e36, step_lr_gamma=0.9)
    plugin = LossScalePrecision("32-true", DynamicLossScale(init_scale=1024.0, scale_window=3))
    trainer = quiet_trainer(
        strategy=strategy,
        max_epochs=EPOCHS,
        logger=True,
        default_root_dir=tmp_path,
        log_every_n_steps=1,
        plugins=[plugin],
        callbacks=[LossMonitor(3), TimeMonitor(), LossScaleMonitor(), LearningRateMonitor(logging_interval="step")],
    )
    trainer.fit(model, loader(make_dataset(num_samples=SAMPLES), MICRO))
    events = EventAccumulator(trainer.logger.log_dir)  # the default logger: TensorBoardLogger
    events.Reload()
    return model, {tag: events.Scalars(tag) for tag in events.Tags()["scalars"]}


def steps(scalars, tag):
    return [event.step for event in scalars[tag]]


def on_update_axis(totals, steps_per_update: int) -> dict[int, int]:
    """Step of each printed line's micro-batch (the n-th micro-batch is in window ceil(n / N)), the last line per
    step; windows are aligned with the epochs here (10 micro-batches an epoch, N = 1 or 2)."""
    return {(total - 1) // steps_per_update: total for total in totals}


def assert_loss_and_times(model, scalars, printed_totals, epoch_end_totals, steps_per_update=1):
    printed = on_update_axis(printed_totals, steps_per_update)
    assert steps(scalars, "loss") == sorted(printed)
    assert [e.value for e in scalars["loss"]] == [
        np.float32(model.step_losses[printed[s] - 1].item()) for s in sorted(printed)
    ]
    for tag in ("time/epoch_ms", "time/step_ms", "time/samples_per_s"):
        assert steps(scalars, tag) == sorted(on_update_axis(epoch_end_totals, steps_per_update))
    for step_ms, throughput in zip(scalars["time/step_ms"], scalars["time/samples_per_s"]):
        assert throughput.value == pytest.approx(MICRO * 1e3 / step_ms.value, rel=1e-5)  # batch of 4 per step


def assert_scale_scalars(scalars, updates, overflow_update, at_updates):
    """Each name once per listed update (no name written twice), values by the documented scale rule."""
    states = dynamic_scale_rule(updates, {overflow_update}, 1024.0, 3)
    for tag, index in (("loss_scale", 0), ("overflow", 1), ("skipped_updates", 2)):
        assert steps(scalars, tag) == [u - 1 for u in at_updates]
        assert [e.value for e in scalars[tag]] == [float(states[u - 1][index]) for u in at_updates]


def test_per_batch_accumulation(tmp_path):
    model, scalars = run(tmp_path, SinkStrategy(accumulation_steps=2))
    total = EPOCHS * STEPS_PER_EPOCH
    # lines at micro-batches 3, 6, 9, ...: 3 and 6 are in windows 2 and 3 (steps 1, 2), 9 in window 5 (step 4), ...
    assert_loss_and_times(model, scalars, range(3, total + 1, 3), [STEPS_PER_EPOCH, total], steps_per_update=2)
    assert steps(scalars, "loss") == [1, 2, 4, 5, 7, 8]
    updates = total // 2
    assert_scale_scalars(scalars, updates, OVERFLOW_STEP // 2 + 1, range(1, updates + 1))  # by the strategy
    # LearningRateMonitor (Lightning's rule): at every batch start, at Lightning's step, so each update's step
    # appears once per micro-batch; the schedule does not advance on the skipped (overflowed) update 2.
    assert Counter(steps(scalars, "lr-SGD")) == dict.fromkeys(range(updates), 2)
    assert [e.value for e in scalars["lr-SGD"][::2]] == pytest.approx(learning_rates(updates))


def learning_rates(updates: int) -> list[float]:
    """The rate of each update: StepLR(gamma=0.9) after every update but the skipped update 2."""
    return [0.1 * 0.9 ** sum(1 for v in range(1, u + 1) if v != 2) for u in range(updates)]


def test_sink_mode(tmp_path):
    sink = 5
    model, scalars = run(tmp_path, SinkStrategy(accumulation_steps=2, sink_size=sink))
    # One line of each per sink; the first sink ends inside window 3 (step 2), the second closes window 5 (step 4).
    assert_loss_and_times(model, scalars, [sink, 2 * sink], [sink, 2 * sink], steps_per_update=2)
    assert steps(scalars, "loss") == steps(scalars, "time/step_ms") == [2, 4]
    # Every update's values, although Lightning sees only each sink's end (windows run on across sinks).
    assert_scale_scalars(scalars, 5, OVERFLOW_STEP // 2 + 1, range(1, 6))
    # Every update's learning rate, although Lightning starts only two batches.
    assert steps(scalars, "lr-SGD") == [0, 1, 2, 3, 4]
    assert [e.value for e in scalars["lr-SGD"]] == pytest.approx(learning_rates(5))


def test_stock_strategy_gets_the_scale_from_the_monitor(tmp_path):
    model, scalars = run(tmp_path, "auto")  # Lightning's own strategy: no self.log of the scale
    total = EPOCHS * STEPS_PER_EPOCH
    assert_loss_and_times(model, scalars, range(3, total + 1, 3), [STEPS_PER_EPOCH, total])
    assert_scale_scalars(scalars, total, OVERFLOW_STEP + 1, range(1, total + 1))
    assert steps(scalars, "lr-SGD") == list(range(total))


class LogsItsLoss(RecordingClassifier):
    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        self.log("train_loss", loss)
        return loss


@pytest.mark.parametrize("strategy", ["auto", "sink", "sink_mode"])
def test_the_callbacks_scalars_lie_on_the_self_log_curve(tmp_path, strategy):
    """One step axis: the package's scalars are at steps where self.log wrote, and LossMonitor's loss there equals
    the logged train_loss (its lines, every 4 micro-batches, end windows of 2)."""
    if strategy == "auto":  # Lightning's own accumulation
        kwargs = {"strategy": "auto", "accumulate_grad_batches": 2}
    else:
        kwargs = {"strategy": SinkStrategy(accumulation_steps=2, sink_size=4 if strategy == "sink_mode" else None)}
    epochs = 5 if strategy == "sink_mode" else 2  # 20 micro-batches: two data passes, or five sinks of 4
    trainer = quiet_trainer(
        max_epochs=epochs,
        logger=True,
        default_root_dir=tmp_path,
        log_every_n_steps=1,
        plugins=[LossScalePrecision("32-true", DynamicLossScale(init_scale=1024.0))],
        callbacks=[LossMonitor(4), TimeMonitor(), LossScaleMonitor()],
        **kwargs,
    )
    trainer.fit(LogsItsLoss(), loader(make_dataset(num_samples=SAMPLES), MICRO))
    events = EventAccumulator(trainer.logger.log_dir)
    events.Reload()
    logged = {e.step: e.value for e in events.Scalars("train_loss")}
    assert sorted(logged) == list(range(trainer.global_step))  # every update, at u - 1
    assert {e.step: e.value for e in events.Scalars("loss")} == {s: logged[s] for s in (1, 3, 5, 7, 9)}
    for tag in ("time/step_ms", "loss_scale", "overflow", "skipped_updates"):
        assert {e.step for e in events.Scalars(tag)} <= set(logged), tag
