"""LossScaleMonitor: the loss scale, last overflow flag and skipped updates, against the documented scale rule."""

from __future__ import annotations

import re

import pytest

from lightning_sink import DynamicLossScale, LossScalePrecision, SinkStrategy
from lightning_sink.callbacks import LossScaleMonitor
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
    lines, trainer = fit(
        capsys, SinkStrategy(accumulation_steps=accumulation), epochs, LossScaleMonitor(per_print_times), inf_at=(3, 12)
    )  # updates 2 and 7 overflow
    updates = epochs * STEPS_PER_EPOCH // accumulation
    states = dynamic_scale_rule(updates, {2, 7}, 1024.0, 3)
    printed = range(per_print_times, updates + 1, per_print_times)
    expected = [
        line((2 * u - 1) // STEPS_PER_EPOCH + 1, (2 * u - 1) % STEPS_PER_EPOCH + 1, states[u - 1]) for u in printed
    ]
    assert lines == expected
    assert (trainer.precision_plugin.scale, trainer.precision_plugin.skipped_updates) == states[-1][::2]


def test_sink_mode_prints_once_per_sink_with_its_last_update(capsys):
    sink, accumulation, epochs = 4, 2, 3  # two updates per sink
    lines, _ = fit(
        capsys, SinkStrategy(accumulation_steps=accumulation, sink_size=sink), epochs, LossScaleMonitor(), inf_at=(7,)
    )  # update 4, the last of sink 2
    states = dynamic_scale_rule(6, {4}, 1024.0, 3)
    assert lines == [line(epoch, sink, states[2 * epoch - 1]) for epoch in (1, 2, 3)]


def test_without_a_loss_scale_plugin_is_a_clear_error():
    trainer = quiet_trainer(strategy=SinkStrategy(accumulation_steps=1), max_epochs=1, callbacks=[LossScaleMonitor()])
    with pytest.raises(
        TypeError,
        match="LossScaleMonitor reads a LossScalePrecision plugin, but the Trainer's precision plugin is Precision",
    ):
        trainer.fit(InfAtSteps(), loader(make_dataset(num_samples=SAMPLES), MICRO))


def test_bad_per_print_times_is_a_clear_error():
    with pytest.raises(ValueError, match=r"per_print_times=-1 is not valid: pass an int >= 1"):
        LossScaleMonitor(-1)


def test_print_period_survives_a_checkpoint_resume(tmp_path, capsys):
    from lightning.pytorch.callbacks import ModelCheckpoint

    def run(epochs, callbacks, inf_at=(3,), **kwargs):  # the overflow is in epoch 1
        plugin = LossScalePrecision("32-true", DynamicLossScale(init_scale=1024.0, scale_window=3))
        trainer = quiet_trainer(
            strategy=SinkStrategy(accumulation_steps=2),
            max_epochs=epochs,
            plugins=[plugin],
            callbacks=callbacks,
            enable_checkpointing=len(callbacks) > 1,
        )
        trainer.fit(InfAtSteps(inf_at=inf_at), loader(make_dataset(num_samples=SAMPLES), MICRO), **kwargs)
        return [line for line in capsys.readouterr().out.splitlines() if SCALE_LINE.match(line)]

    uninterrupted = run(2, [LossScaleMonitor(4)])  # 5 updates per epoch: lines at updates 4 and 8
    first = run(1, [LossScaleMonitor(4), ModelCheckpoint(dirpath=tmp_path, save_last=True, save_top_k=0)])
    second = run(2, [LossScaleMonitor(4)], inf_at=(), ckpt_path=tmp_path / "last.ckpt")
    assert first + second == uninterrupted
    # Update 8 is step 6 of epoch 2; a period restarted at the resume would print at update 6 (step 2) instead.
    assert [line.split(",")[0] for line in second] == ["epoch: 2 step: 6"]
