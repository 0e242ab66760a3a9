"""LossMonitor: MindSpore's line verbatim, the loss each step produced, the print rule, NaN/inf handling, resume."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

from lightning_sink import SinkStrategy
from lightning_sink.callbacks import LossMonitor, NonFiniteLossError
from tests.callbacks.common import (
    LOSS_LINE,
    MICRO,
    MINDSPORE_LINES,
    SAMPLES,
    RecordingClassifier,
    epoch_windows,
    loss_lines,
    reference_losses,
)
from tests.helpers import loader, make_dataset, quiet_trainer

STEPS_PER_EPOCH = SAMPLES // MICRO


def printed_at(steps_per_batch: list[int], per_print_times: int) -> list[int]:
    """The documented (MindSpore) rule: after each Lightning batch, print when >= per_print_times steps have
    passed since the last line. Returns the run's step count at each printed line."""
    total, last, printed = 0, 0, []
    for steps in steps_per_batch:
        total += steps
        if total - last >= per_print_times:
            printed.append(total)
            last = total
    return printed


def fit(model, strategy, epochs, monitor, **kwargs):
    trainer = quiet_trainer(strategy=strategy, max_epochs=epochs, callbacks=[monitor], **kwargs)
    trainer.fit(model, loader(make_dataset(num_samples=SAMPLES), MICRO))
    return trainer


def test_the_line_format_is_mindspores():
    for line in MINDSPORE_LINES:  # the pattern and the number format reproduce MindSpore's own output
        _epoch, _step, value = LOSS_LINE.match(line).groups()
        assert str(np.float32(float(value))) == value


@pytest.mark.parametrize(
    "strategy, accumulation, per_print_times",
    [
        ("sink", 1, 3),
        ("sink", 4, 5),
        ("sink", 2, 1),
        ("stock", 2, 3),  # Lightning's own strategy and accumulate_grad_batches
    ],
)
def test_per_batch_lines_show_each_steps_loss_by_the_print_rule(capsys, strategy, accumulation, per_print_times):
    epochs = 2
    model = RecordingClassifier()
    reference = reference_losses(
        copy.deepcopy(model), make_dataset(num_samples=SAMPLES), epoch_windows(STEPS_PER_EPOCH, accumulation, epochs)
    )
    if strategy == "sink":
        fit(model, SinkStrategy(accumulation_steps=accumulation), epochs, LossMonitor(per_print_times))
    else:
        fit(model, "auto", epochs, LossMonitor(per_print_times), accumulate_grad_batches=accumulation)

    totals = printed_at([1] * (STEPS_PER_EPOCH * epochs), per_print_times)
    expected = [
        ((t - 1) // STEPS_PER_EPOCH + 1, (t - 1) % STEPS_PER_EPOCH + 1, model.step_losses[t - 1]) for t in totals
    ]
    lines = [line for line in capsys.readouterr().out.splitlines() if LOSS_LINE.match(line)]
    assert lines == [f"epoch: {e} step: {s}, loss is {np.float32(loss.item())!s}" for e, s, loss in expected]
    for (_, _, printed), t in zip(loss_lines("\n".join(lines)), totals):  # vs the plain PyTorch loop
        assert float(printed) == pytest.approx(reference[t - 1].item(), rel=1e-5)


def test_accumulation_of_three_prints_the_step_loss_within_one_rounding(capsys):
    # Lightning hands callbacks loss / accumulate_grad_batches; multiplying back is exact only for powers of two.
    model = RecordingClassifier()
    fit(model, SinkStrategy(accumulation_steps=3), 1, LossMonitor(1))
    printed = [np.float32(value) for _, _, value in loss_lines(capsys.readouterr().out)]
    produced = [np.float32(loss.item()) for loss in model.step_losses]
    assert len(printed) == len(produced) == STEPS_PER_EPOCH
    assert all(abs(p - q) <= np.spacing(q) for p, q in zip(printed, produced))


@pytest.mark.parametrize("per_print_times", [1, 7])
def test_sink_mode_prints_once_per_sink_with_the_step_within_the_epoch(capsys, per_print_times):
    sink, accumulation, epochs = 5, 2, 6
    model = RecordingClassifier()
    reference = reference_losses(
        copy.deepcopy(model), make_dataset(num_samples=SAMPLES), [accumulation] * (sink * epochs // accumulation)
    )
    fit(model, SinkStrategy(accumulation_steps=accumulation, sink_size=sink), epochs, LossMonitor(per_print_times))

    totals = printed_at([sink] * epochs, per_print_times)  # 7 > K: every second sink, as MindSpore
    assert totals == ([5, 10, 15, 20, 25, 30] if per_print_times == 1 else [10, 20, 30])
    out = capsys.readouterr().out
    assert loss_lines(out) == [(t // sink, sink, str(np.float32(model.step_losses[t - 1].item()))) for t in totals]
    for (_, _, printed), t in zip(loss_lines(out), totals):
        assert float(printed) == pytest.approx(reference[t - 1].item(), rel=1e-5)


def test_max_steps_inside_a_sink_prints_the_steps_it_ran(capsys):
    model = RecordingClassifier()
    fit(model, SinkStrategy(accumulation_steps=1, sink_size=4), 5, LossMonitor(), max_steps=6)
    assert [(e, s) for e, s, _ in loss_lines(capsys.readouterr().out)] == [(1, 4), (2, 2)]


# ---------------------------------------------------------------------------------------------- NaN / inf losses
@pytest.mark.parametrize(
    "sink_size, per_print_times, nan_at, detected_after, where",
    [
        (None, 1, 5, 6, "epoch: 1 step: 6"),  # checked at every printed line
        (None, 4, 5, 8, "epoch: 1 step: 6"),  # found at the next print point (step 8), named by its own step
        (None, 7, 15, 20, "epoch: 2 step: 6"),  # found at the end of epoch 2 (the next print point is step 21)
        (5, 1, 7, 10, "epoch: 2 step: 3"),  # sink mode: at the end of the sink that produced it
    ],
)
def test_nonfinite_loss_raises_naming_epoch_step_and_value(sink_size, per_print_times, nan_at, detected_after, where):
    model = RecordingClassifier(nan_at=nan_at)
    with pytest.raises(NonFiniteLossError, match=f"the loss is nan at {where} .*on_nonfinite='raise'"):
        fit(model, SinkStrategy(accumulation_steps=1, sink_size=sink_size), 4, LossMonitor(per_print_times))
    assert len(model.step_losses) == detected_after


def test_infinite_loss_is_named_too():
    class Inf(RecordingClassifier):
        def training_step(self, batch, batch_idx):
            loss = super().training_step(batch, batch_idx)
            return loss * float("inf") if len(self.step_losses) == 3 else loss

    with pytest.raises(NonFiniteLossError, match="the loss is inf at epoch: 1 step: 3 "):
        fit(Inf(), SinkStrategy(accumulation_steps=1), 1, LossMonitor())


@pytest.mark.parametrize("sink_size, where", [(None, "epoch: 1 step: 6"), (5, "epoch: 2 step: 1")])
def test_nonfinite_stop_ends_training_after_the_batch(sink_size, where):
    model = RecordingClassifier(nan_at=5)  # the 6th step
    with pytest.warns(UserWarning, match=f"the loss is nan at {where} .*on_nonfinite='stop'"):
        trainer = fit(
            model, SinkStrategy(accumulation_steps=1, sink_size=sink_size), 4, LossMonitor(on_nonfinite="stop")
        )
    ran = 6 if sink_size is None else 10  # the step's batch, or the whole sink, then stop
    assert len(model.step_losses) == ran and trainer.global_step == ran and trainer.should_stop


def test_nonfinite_stop_and_warn_differ():
    model = RecordingClassifier(nan_at=5)
    with pytest.warns(UserWarning, match="the loss is nan at epoch: 1 step: 6 .*on_nonfinite='warn'"):
        trainer = fit(model, SinkStrategy(accumulation_steps=1), 2, LossMonitor(on_nonfinite="warn"))
    assert len(model.step_losses) == 2 * STEPS_PER_EPOCH and trainer.global_step == 2 * STEPS_PER_EPOCH


# ---------------------------------------------------------------------------------------------- resume
@pytest.mark.parametrize("sink_size, per_print_times", [(None, 4), (3, 4)])
def test_print_schedule_survives_a_checkpoint_resume(tmp_path, capsys, sink_size, per_print_times):
    def run(epochs, callbacks, seed=0, **kwargs):
        strategy = SinkStrategy(accumulation_steps=2, sink_size=sink_size)
        trainer = quiet_trainer(
            strategy=strategy,
            max_epochs=epochs,
            callbacks=callbacks,
            enable_checkpointing=any(isinstance(c, ModelCheckpoint) for c in callbacks),
        )
        trainer.fit(RecordingClassifier(seed=seed), loader(make_dataset(num_samples=SAMPLES), MICRO), **kwargs)

    run(6, [LossMonitor(per_print_times)])
    uninterrupted = loss_lines(capsys.readouterr().out)

    run(3, [LossMonitor(per_print_times), ModelCheckpoint(dirpath=tmp_path, save_last=True, save_top_k=0)])
    first_half = loss_lines(capsys.readouterr().out)
    state = torch.load(tmp_path / "last.ckpt", weights_only=False)["callbacks"][
        f"LossMonitor{{'per_print_times': {per_print_times}}}"
    ]
    steps_per_epoch = sink_size or STEPS_PER_EPOCH
    assert state["steps"]["total"] == 3 * steps_per_epoch
    assert (
        state["last_print_step"]
        == printed_at([sink_size or 1] * (3 * steps_per_epoch // (sink_size or 1)), per_print_times)[-1]
    )
    run(6, [LossMonitor(per_print_times)], seed=5, ckpt_path=tmp_path / "last.ckpt")  # weights from the checkpoint
    second_half = loss_lines(capsys.readouterr().out)
    assert first_half + second_half == uninterrupted
    # The test can tell: a schedule restarted from zero at the resume would print other steps.
    batches = [sink_size] * 3 if sink_size else [1] * (3 * STEPS_PER_EPOCH)
    restarted = [
        (3 + (t - 1) // steps_per_epoch + 1, (t - 1) % steps_per_epoch + 1)
        for t in printed_at(batches, per_print_times)
    ]
    assert [(e, s) for e, s, _ in second_half] != restarted


def test_bad_arguments_are_clear_errors():
    with pytest.raises(ValueError, match=r"per_print_times=0 is not valid: pass an int >= 1"):
        LossMonitor(0)
    with pytest.raises(ValueError, match=r"on_nonfinite='ignore' is not valid: choose one of 'raise', 'stop', 'warn'"):
        LossMonitor(on_nonfinite="ignore")
