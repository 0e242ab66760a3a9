"""LossScaleMonitor: the loss scale, last overflow flag and skipped updates, against the documented scale rule."""

from __future__ import annotations

import re

import pytest

from callbacks import LossScaleMonitor
from lightning_sink import DynamicLossScale, LossScalePrecision, SinkStrategy
from tests.callbacks.common import MICRO, SAMPLES, InfAtSteps, dynamic_scale_rule
from tests.helpers import loader, make_dataset, quiet_trainer

SCALE_LINE = re.compile(r"^epoch: \d+ step: \d+, loss scale is .*$")
STEPS_PER_EPOCH = SAMPLES // MICRO


def fit(capsys, strategy, epochs, monitor, inf_at, **kwargs):
    plugin = LossScalePrecision("32-true", DynamicLossScale(init_scale=1024.0, scale_window=3))
    trainer = quiet_trainer(strategy=strategy, max_epochs=epochs, plugins=[plugin], callbacks=[monitor], **kwargs)
    trainer.fit(InfAtSteps(inf_at=inf_at), loader(make_dataset(num_samples=SAMPLES), MICRO))
    return [line for line in capsys.readouterr().out.splitlines() if SCALE_LINE.match(line)], trainer


def line(epoch, step, state):
    scale, overflow, skipped = state
    return f"epoch: {epoch} step: {step}, loss scale is {scale}, overflow is {overflow}, skipped updates is {skipped}"


@pytest.mark.parametrize("per_print_times", [1, 3])
def test_per_batch_lines_follow_the_scale_rule(capsys, per_print_times):
    accumulation, epochs = 2, 2
    lines, trainer = fit(capsys, SinkStrategy(accumulation_steps=accumulation), epochs,
                         LossScaleMonitor(per_print_times), inf_at=(3, 12))  # updates 2 and 7 overflow
    updates = epochs * STEPS_PER_EPOCH // accumulation
    states = dynamic_scale_rule(updates, {2, 7}, 1024.0, 3)
    printed = range(per_print_times, updates + 1, per_print_times)
    expected = [line((2 * u - 1) // STEPS_PER_EPOCH + 1, (2 * u - 1) % STEPS_PER_EPOCH + 1, states[u - 1])
                for u in printed]
    assert lines == expected
    assert (trainer.precision_plugin.scale, trainer.precision_plugin.skipped_updates) == states[-1][::2]


def test_sink_mode_prints_once_per_sink_with_its_last_update(capsys):
    sink, accumulation, epochs = 4, 2, 3  # two updates per sink
    lines, _ = fit(capsys, SinkStrategy(accumulation_steps=accumulation, sink_size=sink), epochs, LossScaleMonitor(),
                   inf_at=(7,))  # update 4, the last of sink 2
    states = dynamic_scale_rule(6, {4}, 1024.0, 3)
    assert lines == [line(epoch, sink, states[2 * epoch - 1]) for epoch in (1, 2, 3)]


def test_without_a_loss_scale_plugin_is_a_clear_error():
    trainer = quiet_trainer(strategy=SinkStrategy(accumulation_steps=1), max_epochs=1, callbacks=[LossScaleMonitor()])
    with pytest.raises(TypeError, match="LossScaleMonitor reads a LossScalePrecision plugin, but the Trainer's"
                                        " precision plugin is Precision"):
        trainer.fit(InfAtSteps(), loader(make_dataset(num_samples=SAMPLES), MICRO))


def test_bad_per_print_times_is_a_clear_error():
    with pytest.raises(ValueError, match=r"per_print_times=-1 is not valid: pass an int >= 1"):
        LossScaleMonitor(-1)
