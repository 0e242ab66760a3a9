"""What a run with the default TensorBoardLogger shows, read back from the event files: names, steps, values.

The documented rule (docs/callbacks.md): ``loss`` and ``time/*`` are written by the callbacks at
step = (training steps so far) - 1, a training step being one batch through the network (MindSpore's step); the loss
at each printed line, the times once per epoch. ``loss_scale``, ``overflow`` and ``skipped_updates`` are on
Lightning's step (optimizer updates so far - 1), once per update, written by the sink strategies' ``self.log`` or,
under a stock strategy, by ``LossScaleMonitor`` at its printed lines; never both. Without accumulation the two step
axes are the same.
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
from tests.callbacks.common import MICRO, SAMPLES, InfAtSteps, dynamic_scale_rule
from tests.helpers import loader, make_dataset, quiet_trainer

EPOCHS, STEPS_PER_EPOCH = 2, SAMPLES // MICRO
OVERFLOW_STEP = 3  # the 4th training step's scaled loss overflows (the loss itself stays finite)


def run(tmp_path: Path, strategy) -> tuple[InfAtSteps, dict[str, list]]:
    model = InfAtSteps(inf_at=(OVERFLOW_STEP,), factor=1e36, step_lr_gamma=0.9)
    plugin = LossScalePrecision("32-true", DynamicLossScale(init_scale=1024.0, scale_window=3))
    trainer = quiet_trainer(
        strategy=strategy, max_epochs=EPOCHS, logger=True, default_root_dir=tmp_path, log_every_n_steps=1,
        plugins=[plugin], callbacks=[LossMonitor(3), TimeMonitor(), LossScaleMonitor(),
                                     LearningRateMonitor(logging_interval="step")],
    )
    trainer.fit(model, loader(make_dataset(num_samples=SAMPLES), MICRO))
    events = EventAccumulator(trainer.logger.log_dir)  # the default logger: TensorBoardLogger
    events.Reload()
    return model, {tag: events.Scalars(tag) for tag in events.Tags()["scalars"]}


def steps(scalars, tag):
    return [event.step for event in scalars[tag]]


def assert_loss_and_times(model, scalars, printed_totals, epoch_end_totals):
    assert steps(scalars, "loss") == [t - 1 for t in printed_totals]
    assert [e.value for e in scalars["loss"]] == [np.float32(model.step_losses[t - 1].item()) for t in printed_totals]
    for tag in ("time/epoch_ms", "time/step_ms", "time/samples_per_s"):
        assert steps(scalars, tag) == [t - 1 for t in epoch_end_totals]
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
    assert_loss_and_times(model, scalars, range(3, total + 1, 3), [STEPS_PER_EPOCH, total])
    updates = total // 2
    assert_scale_scalars(scalars, updates, OVERFLOW_STEP // 2 + 1, range(1, updates + 1))  # by the strategy
    # LearningRateMonitor (Lightning's rule): at every batch start, at Lightning's step, so each update's step
    # appears once per micro-batch; the schedule does not advance on the skipped (overflowed) update 2.
    assert Counter(steps(scalars, "lr-SGD")) == dict.fromkeys(range(updates), 2)
    not_skipped_before = [sum(1 for v in range(1, u + 1) if v != 2) for u in range(updates)]
    assert [e.value for e in scalars["lr-SGD"][::2]] == pytest.approx([0.1 * 0.9**k for k in not_skipped_before])


def test_sink_mode(tmp_path):
    sink = 5
    model, scalars = run(tmp_path, SinkStrategy(accumulation_steps=2, sink_size=sink))
    assert_loss_and_times(model, scalars, [sink, 2 * sink], [sink, 2 * sink])  # one of each per sink
    # Lightning's step after each sink: 2 updates after 5 steps, 5 after 10 (windows run on across sinks).
    assert_scale_scalars(scalars, 5, OVERFLOW_STEP // 2 + 1, [2, 5])
    assert steps(scalars, "lr-SGD") == [0, 2]  # Lightning's step at each sink's start


def test_stock_strategy_gets_the_scale_from_the_monitor(tmp_path):
    model, scalars = run(tmp_path, "auto")  # Lightning's own strategy: no self.log of the scale
    total = EPOCHS * STEPS_PER_EPOCH
    assert_loss_and_times(model, scalars, range(3, total + 1, 3), [STEPS_PER_EPOCH, total])
    assert_scale_scalars(scalars, total, OVERFLOW_STEP + 1, range(1, total + 1))
    assert steps(scalars, "lr-SGD") == list(range(total))
