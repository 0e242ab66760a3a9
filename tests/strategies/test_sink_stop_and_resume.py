"""Stop and resume inside a sink: the resumed run continues the interrupted sink to its planned end, so sink
boundaries, validation, checkpoints by steps, the final ``global_step`` and the parameters are the uninterrupted
run's. The run is the issue's scenario at a small size: sinks of 6 micro-batches in windows of 2 (3 updates per sink),
a data pass of 10, validation at sink ends, ``ModelCheckpoint(every_n_train_steps=2)``."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

from lightning_sink import SinkStrategy
from tests.helpers import flat_params, make_dataset, quiet_trainer
from tests.strategies.test_sink_loop import SAMPLES, shuffled_loader
from tests.strategies.test_sink_schedules import Validations

SINK, STEPS, EPOCHS = 6, 2, 5  # 30 micro-batches, 15 updates


def run(directory, max_steps=-1, ckpt_path=None, validated_from=(), callbacks=(), sink_size=SINK, epochs=EPOCHS):
    model = Validations(seed=0)
    model.validated_at = list(validated_from)
    checkpoint = ModelCheckpoint(
        dirpath=directory, filename="{step}", every_n_train_steps=2, save_top_k=-1, save_on_train_epoch_end=False
    )
    trainer = quiet_trainer(
        strategy=SinkStrategy(accumulation_steps=STEPS, sink_size=sink_size),
        max_epochs=epochs,
        max_steps=max_steps,
        callbacks=[checkpoint, *callbacks],
        enable_checkpointing=True,
    )
    trainer.fit(model, shuffled_loader(make_dataset(num_samples=SAMPLES)), ckpt_path=ckpt_path)
    return trainer, model


def saved_steps(directory) -> list[int]:
    return sorted(torch.load(path, weights_only=False)["global_step"] for path in directory.glob("*.ckpt"))


def validated_steps(model) -> list[int]:
    return [step for step, _ in model.validated_at]


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    directory = tmp_path_factory.mktemp("uninterrupted")
    trainer, model = run(directory)
    return trainer, model, saved_steps(directory), directory


def test_the_uninterrupted_run_is_the_run_without_sinking(uninterrupted, tmp_path):
    trainer, model, saved, _directory = uninterrupted
    stock_trainer, stock_model = run(tmp_path, sink_size=None, epochs=3)
    assert trainer.global_step == stock_trainer.global_step == 15
    assert saved == saved_steps(tmp_path) == [2, 4, 6, 8, 10, 12, 14]
    assert validated_steps(model) == [3, 6, 9, 12, 15]  # sink ends (the run without sinking: pass ends)
    assert torch.equal(flat_params(model), flat_params(stock_model))


def test_a_max_steps_stop_inside_a_sink_then_resume_with_max_epochs_is_the_uninterrupted_run(uninterrupted, tmp_path):
    trainer, model, saved, _directory = uninterrupted
    first_trainer, first = run(tmp_path / "first", max_steps=4)  # stops after 8 micro-batches: 2 into sink 2
    first_trainer.save_checkpoint(tmp_path / "stop.ckpt")
    resumed_trainer, resumed = run(
        tmp_path / "resumed", ckpt_path=tmp_path / "stop.ckpt", validated_from=first.validated_at
    )
    assert saved_steps(tmp_path / "first") + saved_steps(tmp_path / "resumed") == saved
    assert validated_steps(resumed) == validated_steps(model)
    assert resumed_trainer.global_step == trainer.global_step == 15
    assert torch.equal(flat_params(resumed), flat_params(model))


KILLED_RUN = """
import os, signal, sys
from lightning.pytorch.callbacks import Callback
from tests.strategies.test_sink_stop_and_resume import run

class KillAfterSaving(Callback):
    def on_train_batch_start(self, trainer, module, batch, batch_idx):
        if trainer.global_step == 8:  # ModelCheckpoint saved step 8 at the last batch end, 4 micro-batches into sink 3
            os.kill(os.getpid(), signal.SIGKILL)

run(sys.argv[1], callbacks=[KillAfterSaving()])
"""


def test_kill_9_after_a_mid_sink_checkpoint_then_resume_is_the_uninterrupted_run(uninterrupted, tmp_path):
    trainer, model, saved, _directory = uninterrupted
    killed = subprocess.run(
        [sys.executable, "-c", KILLED_RUN, str(tmp_path / "killed")],
        env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)},
        capture_output=True,
        timeout=300,
    )
    assert killed.returncode == -signal.SIGKILL, killed.stderr.decode()[-2000:]
    assert saved_steps(tmp_path / "killed") == [2, 4, 6, 8]
    # validation ran after sinks 1 and 2 (steps 3 and 6) before the kill
    resumed_trainer, resumed = run(
        tmp_path / "resumed", ckpt_path=tmp_path / "killed" / "step=8.ckpt", validated_from=[(3, 6), (6, 12)]
    )
    assert saved_steps(tmp_path / "resumed") == [10, 12, 14]
    assert saved_steps(tmp_path / "killed") + saved_steps(tmp_path / "resumed") == saved
    assert validated_steps(resumed) == validated_steps(model)
    assert resumed_trainer.global_step == trainer.global_step == 15
    assert torch.equal(flat_params(resumed), flat_params(model))


def test_resume_from_a_checkpoint_saved_at_a_sinks_end_starts_the_next_sink(uninterrupted, tmp_path):
    trainer, model, saved, directory = uninterrupted
    # step 6 ends sink 2 (and epoch 1); ModelCheckpoint saved it at that batch's end, before the validation
    resumed_trainer, resumed = run(tmp_path, ckpt_path=directory / "step=6.ckpt")
    assert [step for step in saved if step <= 6] + saved_steps(tmp_path) == saved
    # Lightning does not repeat the validation that followed the save; every later one is the uninterrupted run's
    assert validated_steps(resumed) == [step for step in validated_steps(model) if step > 6]
    assert resumed_trainer.global_step == trainer.global_step == 15
    assert torch.equal(flat_params(resumed), flat_params(model))


def test_a_max_steps_stop_inside_a_pass_long_sink_then_resume_is_the_uninterrupted_run(tmp_path):
    """``sink_size=-1``: a sink is the rest of a data pass, so the interrupted sink ends where its pass ends."""
    trainer, model = run(tmp_path / "uninterrupted", sink_size=-1, epochs=3)
    assert trainer.global_step == 15 and validated_steps(model) == [5, 10, 15]  # pass ends
    first_trainer, first = run(tmp_path / "first", max_steps=7, sink_size=-1, epochs=3)  # 4 into pass 2
    first_trainer.save_checkpoint(tmp_path / "stop.ckpt")
    resumed_trainer, resumed = run(
        tmp_path / "resumed",
        ckpt_path=tmp_path / "stop.ckpt",
        validated_from=first.validated_at,
        sink_size=-1,
        epochs=3,
    )
    assert saved_steps(tmp_path / "first") + saved_steps(tmp_path / "resumed") == saved_steps(
        tmp_path / "uninterrupted"
    )
    assert validated_steps(resumed) == validated_steps(model)
    assert resumed_trainer.global_step == 15
    assert torch.equal(flat_params(resumed), flat_params(model))
