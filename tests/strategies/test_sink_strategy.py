"""SinkStrategy against a plain PyTorch loop with an N times larger batch (the independent reference)."""

from __future__ import annotations

import copy
import csv
from pathlib import Path

import pytest
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.loggers import CSVLogger

from lightning_sink import SinkStrategy
from tests.helpers import (
    TinyClassifier,
    flat_params,
    loader,
    make_dataset,
    quiet_trainer,
    reference_train,
    reference_windows,
    relative_error,
)

MICRO_BATCH = 4


def fit_sink(model, dataset, steps, epochs, partial_window="scale", **trainer_kwargs):
    strategy = SinkStrategy(accumulation_steps=steps, partial_window=partial_window)
    trainer = quiet_trainer(strategy=strategy, max_epochs=epochs, **trainer_kwargs)
    trainer.fit(model, loader(dataset, MICRO_BATCH))
    return trainer


@pytest.mark.parametrize("optimizer", ["sgd", "adamw"])
@pytest.mark.parametrize("steps", [1, 4])
def test_windows_equal_one_large_batch(optimizer, steps):
    dataset = make_dataset(num_samples=96)  # 24 micro-batches: whole windows
    model = TinyClassifier(optimizer=optimizer, lr=0.05)
    reference = copy.deepcopy(model)
    trainer = fit_sink(model, dataset, steps, epochs=3)
    windows = reference_windows(96, MICRO_BATCH, steps, 3, "scale")
    reference_train(reference, dataset, windows)
    assert trainer.global_step == len(windows) == 3 * 24 // steps
    assert relative_error(flat_params(model), flat_params(reference)) <= 1e-6


@pytest.mark.parametrize("partial_window", ["scale", "drop", "carry"])
def test_partial_window_modes(partial_window):
    dataset = make_dataset(num_samples=40)  # 10 micro-batches per epoch, windows of 4: 2 whole + 2 left over
    model = TinyClassifier(optimizer="sgd", lr=0.05)
    reference = copy.deepcopy(model)
    trainer = fit_sink(model, dataset, steps=4, epochs=3, partial_window=partial_window)
    windows = reference_windows(40, MICRO_BATCH, 4, 3, partial_window)
    reference_train(reference, dataset, windows)
    assert trainer.global_step == len(windows) == {"scale": 9, "drop": 6, "carry": 7}[partial_window]
    assert relative_error(flat_params(model), flat_params(reference)) <= 1e-6


def test_drop_shortens_the_epoch_to_whole_windows():
    dataset = make_dataset(num_samples=40)
    model = TinyClassifier()
    trainer = fit_sink(model, dataset, steps=4, epochs=1, partial_window="drop")
    assert trainer.num_training_batches == 8


@pytest.mark.parametrize("algorithm, value", [("norm", 0.05), ("value", 0.01)])
def test_clipping_applies_once_to_the_window_gradient(algorithm, value):
    dataset = make_dataset(num_samples=64)
    model = TinyClassifier(optimizer="sgd", lr=0.5)
    reference = copy.deepcopy(model)
    fit_sink(model, dataset, steps=4, epochs=2, gradient_clip_val=value, gradient_clip_algorithm=algorithm)
    reference_train(reference, dataset, reference_windows(64, MICRO_BATCH, 4, 2, "scale"), clip=(value, algorithm))
    assert relative_error(flat_params(model), flat_params(reference)) <= 1e-6


def test_clip_threshold_bites():
    """The clipping test above is only meaningful if clipping changes the result."""
    dataset = make_dataset(num_samples=64)
    clipped, unclipped = TinyClassifier(lr=0.5), TinyClassifier(lr=0.5)
    fit_sink(clipped, dataset, steps=4, epochs=1, gradient_clip_val=0.05)
    fit_sink(unclipped, dataset, steps=4, epochs=1)
    assert relative_error(flat_params(clipped), flat_params(unclipped)) > 1e-3


def test_max_steps_schedulers_and_logging(tmp_path):
    dataset = make_dataset(num_samples=80)  # 20 micro-batches per epoch
    model = TinyClassifier(optimizer="sgd", lr=0.1, step_lr_gamma=0.8)
    reference = copy.deepcopy(model)
    logger = CSVLogger(tmp_path, name="run", version=0)
    trainer = fit_sink(model, dataset, steps=3, epochs=10, max_steps=8, logger=logger, log_every_n_steps=1)
    assert trainer.global_step == 8
    expected_lrs = reference_train(reference, dataset, reference_windows(80, MICRO_BATCH, 3, 10, "scale")[:8])
    assert model.seen_lrs == pytest.approx(expected_lrs, rel=1e-12)
    assert trainer.lr_scheduler_configs[0].scheduler.last_epoch == 8
    assert relative_error(flat_params(model), flat_params(reference)) <= 1e-6
    # self.log in training_step reaches the logger once per optimizer update, at steps 0..7 as stock Lightning.
    with open(Path(logger.log_dir) / "metrics.csv") as handle:
        rows = list(csv.DictReader(handle))
    logged_steps = [int(row["step"]) for row in rows if row.get("train_loss")]
    assert logged_steps == list(range(8))


def test_trainer_accumulate_grad_batches_is_taken_over():
    dataset = make_dataset(num_samples=64)
    model = TinyClassifier()
    reference = copy.deepcopy(model)
    trainer = quiet_trainer(strategy="sink", accumulate_grad_batches=4, max_epochs=2)
    trainer.fit(model, loader(dataset, MICRO_BATCH))
    assert isinstance(trainer.strategy, SinkStrategy) and trainer.strategy.accumulation_steps == 4
    reference_train(reference, dataset, reference_windows(64, MICRO_BATCH, 4, 2, "scale"))
    assert trainer.global_step == 8
    assert relative_error(flat_params(model), flat_params(reference)) <= 1e-6


class SaveAtBatch(Callback):
    """Saves a checkpoint after a chosen global micro-batch (mid-window) or at the end of an epoch."""

    def __init__(self, path: Path, at_batch: int | None = None, at_epoch_end: int | None = None):
        self.path, self.at_batch, self.at_epoch_end, self.window_position = path, at_batch, at_epoch_end, None

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if trainer.fit_loop.total_batch_idx == self.at_batch:
            trainer.save_checkpoint(self.path)
            self.window_position = trainer.strategy._accumulator.micro_steps

    def on_train_epoch_end(self, trainer, pl_module):
        if trainer.current_epoch == self.at_epoch_end:
            trainer.save_checkpoint(self.path)
            self.window_position = trainer.strategy._accumulator.micro_steps


@pytest.mark.parametrize(
    "partial_window, save",
    [("scale", {"at_batch": 14}), ("carry", {"at_epoch_end": 0}), ("drop", {"at_batch": 5})],
)
def test_resume_mid_window_is_bit_identical(tmp_path, partial_window, save):
    dataset = make_dataset(num_samples=40)  # 10 micro-batches per epoch
    ckpt = tmp_path / "mid.ckpt"
    saver = SaveAtBatch(ckpt, **save)
    uninterrupted = TinyClassifier(optimizer="adamw", lr=0.01, step_lr_gamma=0.9)
    resumed = TinyClassifier(optimizer="adamw", lr=0.01, step_lr_gamma=0.9, seed=123)  # different init: must load
    trainer = fit_sink(uninterrupted, dataset, steps=4, epochs=3, partial_window=partial_window, callbacks=[saver])
    assert saver.window_position not in (None, 0), "the checkpoint must be taken inside a window"

    strategy = SinkStrategy(accumulation_steps=4, partial_window=partial_window)
    resumed_trainer = quiet_trainer(strategy=strategy, max_epochs=3)
    resumed_trainer.fit(resumed, loader(dataset, MICRO_BATCH), ckpt_path=ckpt)
    assert torch.equal(flat_params(resumed), flat_params(uninterrupted))
    assert resumed_trainer.global_step == trainer.global_step


def test_lightning_module_sees_the_usual_hooks():
    calls: dict[str, int] = {"before_backward": 0, "after_backward": 0, "before_optimizer_step": 0, "batch_end": 0}

    class Counting(Callback):
        def on_before_backward(self, *args):
            calls["before_backward"] += 1

        def on_after_backward(self, *args):
            calls["after_backward"] += 1

        def on_before_optimizer_step(self, *args):
            calls["before_optimizer_step"] += 1

        def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
            calls["batch_end"] += 1
            assert outputs["loss"].requires_grad is False

    fit_sink(TinyClassifier(), make_dataset(num_samples=48), steps=4, epochs=1, callbacks=[Counting()])
    assert calls == {"before_backward": 12, "after_backward": 12, "before_optimizer_step": 3, "batch_end": 12}


def test_model_checkpoint_every_n_train_steps_counts_updates(tmp_path):
    from lightning.pytorch.callbacks import ModelCheckpoint

    every = ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=2, save_top_k=-1, filename="{step}")
    fit_sink(
        TinyClassifier(), make_dataset(num_samples=64), steps=4, epochs=1, callbacks=[every], enable_checkpointing=True
    )
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step=2.ckpt", "step=4.ckpt"]


def test_bf16_true_run_accumulates_in_fp32():
    """A bf16 model trained with precision='bf16-true' receives the fp32 window sum rounded once to bf16."""
    dataset = make_dataset(num_samples=64 * 2)
    grads_seen = []

    class Grab(Callback):
        def on_before_optimizer_step(self, trainer, module, optimizer):
            grads_seen.append([p.grad.clone() for p in module.parameters()])

    model = TinyClassifier(optimizer="sgd", lr=0.0)
    trainer = quiet_trainer(
        strategy=SinkStrategy(accumulation_steps=64), precision="bf16-true", max_epochs=1, callbacks=[Grab()]
    )
    trainer.fit(model, loader(dataset, 2))
    assert len(grads_seen) == 1 and all(g.dtype == torch.bfloat16 for g in grads_seen[0])
    # Reference: the same bf16 model's per-micro-batch gradients summed in float64; and, for contrast, the
    # plain PyTorch way of accumulating them in bf16 param.grad.
    exact = [torch.zeros(p.shape, dtype=torch.float64) for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    for x, y in loader(dataset, 2):
        plain = [None if p.grad is None else p.grad.clone() for p in model.parameters()]
        model.zero_grad(set_to_none=True)
        (torch.nn.functional.cross_entropy(model(x.bfloat16()), y) / 64).backward()
        for index, (total, p) in enumerate(zip(exact, model.parameters())):
            total += p.grad.double()
            p.grad = p.grad if plain[index] is None else plain[index] + p.grad  # bf16 + bf16, rounded to bf16
    ours = torch.cat([g.double().reshape(-1) for g in grads_seen[0]])
    naive = torch.cat([p.grad.double().reshape(-1) for p in model.parameters()])
    truth = torch.cat([t.reshape(-1) for t in exact])
    rounded_once = truth.to(torch.bfloat16).double()
    assert torch.allclose(ours, rounded_once, rtol=2**-7, atol=0)  # at most one bf16 rounding away
    assert relative_error(ours, truth) * 4 < relative_error(naive, truth)  # plain bf16 accumulation drifts


def test_overridden_backward_and_clipping_hooks_are_still_called():
    """The step programs skip dispatching hooks nobody overrides; overridden ones must still run."""
    calls = {"backward": 0, "clip": 0}

    class Custom(TinyClassifier):
        def backward(self, loss, *args, **kwargs):
            calls["backward"] += 1
            (loss * 0.5).backward()  # a custom backward that changes the gradient

        def configure_gradient_clipping(self, optimizer, gradient_clip_val=None, gradient_clip_algorithm=None):
            calls["clip"] += 1

    dataset = make_dataset(num_samples=32)
    model, reference = Custom(lr=0.1), TinyClassifier(lr=0.05)  # half the gradient = half the SGD rate
    fit_sink(model, dataset, steps=4, epochs=1, gradient_clip_val=1e-6)  # clipping replaced by the no-op hook
    reference_train(reference, dataset, reference_windows(32, MICRO_BATCH, 4, 1, "scale"))
    assert calls == {"backward": 8, "clip": 2}
    # momentum SGD is linear in the gradient: rate lr with g/2 equals rate lr/2 with g. Had the no-op clipping
    # override been skipped, clip_val=1e-6 would have shrunk every update.
    assert relative_error(flat_params(model), flat_params(reference)) <= 1e-6


@pytest.mark.parametrize(
    "steps, scaled, store",
    [(1, False, "SingleStepGradients"), (4, False, "GradientAccumulator"), (1, True, "GradientAccumulator")],
)
def test_a_window_of_one_micro_step_needs_no_buffer_unless_its_loss_is_scaled(steps, scaled, store):
    """N=1 on one process: the micro-step's own gradients go to the optimizer (as a plain loop's); a loss scale
    still needs the fp32 buffer to unscale and check for overflow. Either way the result is the reference's."""
    from lightning_sink import DynamicLossScale, LossScalePrecision

    dataset = make_dataset(num_samples=48)
    model = TinyClassifier(optimizer="sgd", lr=0.05)
    reference = copy.deepcopy(model)
    plugins = [LossScalePrecision("32-true", DynamicLossScale(init_scale=2.0**10))] if scaled else []
    trainer = fit_sink(model, dataset, steps, epochs=2, plugins=plugins)
    assert type(trainer.strategy._accumulator).__name__ == store
    reference_train(reference, dataset, reference_windows(48, MICRO_BATCH, steps, 2, "scale"))
    assert relative_error(flat_params(model), flat_params(reference)) <= 1e-6


@pytest.mark.parametrize(
    "setting, message",
    [
        ("two loaders", r"SinkStrategy\(sink_size=4\) trains from one training loader, but the fit has 2"),
        ("overfit_batches", r"Trainer\(overfit_batches=2\) trains the same batches in every epoch"),
    ],
)
def test_a_fit_sinks_cannot_read_as_one_stream_is_refused(setting: str, message: str):
    """Stock trains a dict of loaders as one combined batch, and ``overfit_batches`` on the same batches each epoch;
    a sink had trained on the last loader only, and read on through the data."""
    data = loader(make_dataset(num_samples=32), 4)
    trainer = quiet_trainer(
        strategy=SinkStrategy(sink_size=4), max_epochs=1, overfit_batches=2 if setting == "overfit_batches" else 0.0
    )
    with pytest.raises(ValueError, match=message):
        trainer.fit(TinyClassifier(), {"a": data, "b": data} if setting == "two loaders" else data)
