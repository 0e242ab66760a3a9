"""ModelCheckpoint(every_n_train_steps) and log_every_n_steps in sink mode: every multiple of n ends a segment of the
sink (sink/step_triggers.py, sink/schedule.py), so they fire at the same updates as without sinking."""

from __future__ import annotations

import copy
import csv

import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.loggers import CSVLogger

from lightning_sink import SinkStrategy
from tests.helpers import TinyClassifier, make_dataset, quiet_trainer, reference_train, relative_error
from tests.strategies.test_sink_loop import SAMPLES, PerSink, continuous_micro_batches, shuffled_loader, windows_of


def fit_with(callbacks, sink_size, steps, epochs, **kwargs):
    model = TinyClassifier(optimizer="sgd", lr=0.05)
    initial = copy.deepcopy(model)
    trainer = quiet_trainer(
        strategy=SinkStrategy(accumulation_steps=steps, sink_size=sink_size),
        max_epochs=epochs,
        callbacks=callbacks,
        **kwargs,
    )
    trainer.fit(model, shuffled_loader(make_dataset(num_samples=SAMPLES)))
    return trainer, initial


def saved_steps(directory) -> dict[int, dict[str, torch.Tensor]]:
    saved = {}
    for path in directory.glob("*.ckpt"):
        checkpoint = torch.load(path, weights_only=False)
        saved[checkpoint["global_step"]] = checkpoint["state_dict"]
    return saved


def reference_after(initial, updates: int, steps: int) -> torch.Tensor:
    reference = copy.deepcopy(initial)
    reference_train(
        reference, make_dataset(num_samples=SAMPLES), windows_of(continuous_micro_batches(updates * steps), steps)
    )
    return torch.cat([p.detach().flatten() for p in reference.parameters()])


def flat_state(state_dict) -> torch.Tensor:
    return torch.cat([value.flatten() for value in state_dict.values()])


@pytest.mark.parametrize(
    "sink_size, steps, every_n, expected_steps",
    [
        (4, 2, 4, [4, 8]),  # 2 updates per sink, n a multiple of 2: at sink ends
        (4, 1, 2, [2, 4, 6, 8, 10, 12, 14, 16]),  # 4 updates per sink, n divides 4: a segment ends at each multiple
        (4, 2, 3, [3, 6]),  # neither: the multiples inside sinks end segments too (warned and skipped before)
    ],
)
def test_model_checkpoint_every_n_train_steps_fires_at_every_multiple(
    tmp_path, sink_size, steps, every_n, expected_steps
):
    checkpoint = ModelCheckpoint(
        dirpath=tmp_path, filename="{step}", every_n_train_steps=every_n, save_top_k=-1, save_on_train_epoch_end=False
    )
    _trainer, initial = fit_with([checkpoint], sink_size, steps, epochs=4, enable_checkpointing=True)
    saved = saved_steps(tmp_path)
    assert sorted(saved) == expected_steps
    for updates, state in saved.items():  # each file holds the parameters after exactly that many updates
        assert relative_error(flat_state(state), reference_after(initial, updates, steps)) <= 1e-6


class OwnLog(TinyClassifier):
    """Defines its own ``log`` (as pytorch-forecasting's base model does): the sink's log buffer cannot stand in."""

    def log(self, *args, **kwargs):
        return super().log(*args, **kwargs)


def test_log_every_n_steps_of_a_module_with_its_own_log_writes_at_the_steps_without_sinking(tmp_path):
    rows = {}
    for name, sink_size in (("stock", None), ("sink", 4)):
        logger = CSVLogger(tmp_path, name=name)
        model = OwnLog(optimizer="sgd", lr=0.05)
        trainer = quiet_trainer(
            strategy=SinkStrategy(accumulation_steps=2, sink_size=sink_size),
            max_epochs=2 if sink_size is None else 5,  # 20 micro-batches, 10 updates
            logger=logger,
            log_every_n_steps=3,  # not a multiple of the sink's 2 updates
        )
        trainer.fit(model, shuffled_loader(make_dataset(num_samples=SAMPLES)))
        with open(logger.log_dir + "/metrics.csv") as file:
            rows[name] = [(row["step"], row["train_loss"]) for row in csv.DictReader(file) if row.get("train_loss")]
    assert rows["stock"]  # logged at steps 3, 6, 9 (logger step global_step - 1)
    assert rows["sink"] == rows["stock"]


def test_log_every_n_steps_writes_the_sinks_last_values_at_the_documented_steps(tmp_path):
    per_sink = PerSink()
    logger = CSVLogger(tmp_path, name="run")
    fit_with([per_sink], sink_size=4, steps=2, epochs=4, logger=logger, log_every_n_steps=4)
    with open(logger.log_dir + "/metrics.csv") as file:
        rows = [row for row in csv.DictReader(file) if row.get("train_loss")]
    # Written at sink ends where global_step % 4 == 0 (sinks end at 2, 4, 6, 8), at logger step global_step - 1,
    # as stock Lightning does; the value is the sink's last micro-step loss.
    assert [int(row["step"]) for row in rows] == [3, 7]
    last_losses = {step: out["loss"].item() for step, out in zip(per_sink.steps, per_sink.outputs)}
    assert [float(row["train_loss"]) for row in rows] == pytest.approx([last_losses[4], last_losses[8]], rel=1e-6)


def test_lightnings_one_batch_epoch_logging_warning_is_not_raised_in_sink_mode(tmp_path):
    """Every sink epoch is one Lightning batch; log_every_n_steps (here 10, a divisor of the 10 updates per sink)
    counts updates, so Lightning's "(1) is smaller than the logging interval" would be wrong."""
    import warnings

    trainer = quiet_trainer(
        strategy=SinkStrategy(sink_size=10), max_epochs=2, log_every_n_steps=10, logger=CSVLogger(tmp_path, name="run")
    )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(TinyClassifier(), shuffled_loader(make_dataset(num_samples=SAMPLES)))
    messages = [str(warning.message) for warning in caught]
    assert not [m for m in messages if "smaller than the logging interval" in m], messages
    assert trainer.global_step == 20
