"""Step-based schedules inside sinks, side by side with the same run without sinking.

``val_check_interval``, ``ModelCheckpoint(every_n_train_steps)`` and ``max_time`` end a sink early (a segment) at the
micro-batch where Lightning without sinking validates, saves or stops; the next segment continues the sink. The run
without sinking is ``SinkStrategy(accumulation_steps=A)`` over the same loader: a data pass of P = 10 micro-batches
is its epoch, and its order (a ``DistributedSampler`` reshuffled per pass) is the sink stream's.
"""

from __future__ import annotations

import time
from datetime import timedelta

import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

from lightning_sink import SinkStrategy
from tests.helpers import TinyClassifier, flat_params, make_dataset, quiet_trainer
from tests.strategies.test_sink_loop import SAMPLES, shuffled_loader

PASS = 10  # micro-batches per data pass


class Validations(TinyClassifier):
    """Records the global_step and the micro-batches trained so far at each validation."""

    def __init__(self, **kwargs):
        super().__init__(optimizer="sgd", lr=0.05, **kwargs)
        self.micro_batches, self.validated_at = 0, []

    def training_step(self, batch, batch_idx):
        self.micro_batches += 1
        return super().training_step(batch, batch_idx)

    def validation_step(self, batch, batch_idx):
        if batch_idx == 0:
            self.validated_at.append((self.trainer.global_step, self.micro_batches))
        x, y = batch
        self.log("val_loss", torch.nn.functional.cross_entropy(self(x), y))

    def val_dataloader(self):
        return torch.utils.data.DataLoader(make_dataset(num_samples=8, seed=1), batch_size=4)


def fit(micro_batches: int, steps: int, sink_size: int | None, **trainer_kwargs):
    """``micro_batches`` in all: ``micro_batches / sink_size`` sink epochs, or ``micro_batches / PASS`` epochs."""
    model = Validations()
    strategy = SinkStrategy(accumulation_steps=steps, sink_size=sink_size)
    epochs = micro_batches // (sink_size or PASS)
    trainer = quiet_trainer(strategy=strategy, max_epochs=epochs, **trainer_kwargs)
    trainer.fit(model, shuffled_loader(make_dataset(num_samples=SAMPLES)))
    return trainer, model


@pytest.mark.parametrize(
    "settings",
    [
        dict(val_check_interval=3, check_val_every_n_epoch=None),  # every 3rd micro-batch of the fit
        dict(val_check_interval=4),  # every 4th micro-batch of a data pass (Lightning's "(1)" error before)
        dict(val_check_interval=0.3),  # every int(10 * 0.3) = 3rd micro-batch of a pass
    ],
)
def test_validation_runs_at_the_same_micro_batches_and_steps_as_without_sinking(settings):
    stock, stock_model = fit(30, steps=2, sink_size=None, **settings)
    sink, sink_model = fit(30, steps=2, sink_size=6, **settings)  # 3 updates per sink, sinks cross the passes
    assert stock_model.validated_at  # the schedule validates inside passes
    assert sink_model.validated_at == stock_model.validated_at
    assert sink.global_step == stock.global_step == 15
    assert torch.equal(flat_params(sink_model), flat_params(stock_model))


def saved_checkpoints(directory) -> dict[int, torch.Tensor]:
    saved = {}
    for path in directory.glob("*.ckpt"):
        checkpoint = torch.load(path, weights_only=False)
        saved[checkpoint["global_step"]] = torch.cat([v.flatten() for v in checkpoint["state_dict"].values()])
    return saved


def test_every_n_train_steps_not_a_multiple_of_the_sinks_updates_saves_at_the_same_steps(tmp_path):
    # 2 updates per sink of 4; n = 3 falls inside every other sink (the strategy warned and skipped those before).
    runs = {}
    for name, sink_size in (("stock", None), ("sink", 4)):
        directory = tmp_path / name
        checkpoint = ModelCheckpoint(
            dirpath=directory, filename="{step}", every_n_train_steps=3, save_top_k=-1, save_on_train_epoch_end=False
        )
        trainer, model = fit(20, steps=2, sink_size=sink_size, callbacks=[checkpoint], enable_checkpointing=True)
        runs[name] = (trainer, model, saved_checkpoints(directory))
    stock_saved, sink_saved = runs["stock"][2], runs["sink"][2]
    assert sorted(sink_saved) == sorted(stock_saved) == [3, 6, 9]
    for step, state in stock_saved.items():  # each file holds the same parameters
        assert torch.equal(sink_saved[step], state)
    assert torch.equal(flat_params(runs["sink"][1]), flat_params(runs["stock"][1]))


class SlowSteps(Validations):
    """Each micro-batch sleeps, so that a time limit falls inside the first sink; records when each one started."""

    def __init__(self):
        super().__init__()
        self.started = []

    def training_step(self, batch, batch_idx):
        self.started.append(time.monotonic())
        time.sleep(0.02)
        return super().training_step(batch, batch_idx)


def test_max_time_stops_inside_a_sink_after_the_micro_batch_that_passes_it_as_without_sinking():
    for sink_size in (None, 400):  # without sinking; then sinks far longer than the limit
        model = SlowSteps()
        trainer = quiet_trainer(
            strategy=SinkStrategy(accumulation_steps=2, sink_size=sink_size),
            max_time=timedelta(seconds=0.5),
            limit_val_batches=0,
        )
        trainer.fit(model, shuffled_loader(make_dataset(num_samples=SAMPLES)))
        timer = next(callback for callback in trainer.callbacks if type(callback).__name__ == "Timer")
        deadline = timer.start_time("train") + 0.5
        # no micro-batch starts after the one during which the limit passed (at most one micro-batch overshoot) ...
        assert sum(started >= deadline for started in model.started) <= 1, sink_size
        assert model.started[-2] < deadline, sink_size
        # ... and the fit stopped well before the sink's end
        assert 0 < model.micro_batches < 100, sink_size
