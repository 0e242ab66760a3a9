"""LossScalePrecision in real Lightning runs, against plain PyTorch references and documented rules."""

from __future__ import annotations

import copy
import csv
import math
import threading
from pathlib import Path

import pytest
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.loggers import CSVLogger
from lightning.pytorch.plugins.precision import MixedPrecision

from lightning_sink import DynamicLossScale, FixedLossScale, LossScalePrecision, SinkStrategy
from tests.helpers import (
    InjectingClassifier,
    TinyClassifier,
    flat_params,
    loader,
    make_dataset,
    quiet_trainer,
    reference_train,
    reference_windows,
    relative_error,
)
from tests.strategies.test_sink_strategy import SaveAtBatch

MICRO, STEPS = 4, 4


def fit(model, plugin, epochs=2, num_samples=64, ckpt_path=None, sink_size=None, **kwargs):
    strategy = SinkStrategy(accumulation_steps=STEPS, sink_size=sink_size)
    trainer = quiet_trainer(strategy=strategy, plugins=[plugin], max_epochs=epochs, **kwargs)
    trainer.fit(model, loader(make_dataset(num_samples=num_samples), MICRO), ckpt_path=ckpt_path)
    return trainer


def test_fp16_without_overflow_matches_fp32_reference():
    model = TinyClassifier(optimizer="sgd", lr=0.05)
    reference = copy.deepcopy(model)
    plugin = LossScalePrecision("16-mixed", DynamicLossScale(init_scale=2.0**8), device="cpu")
    fit(model, plugin, epochs=3)
    reference_train(reference, make_dataset(num_samples=64), reference_windows(64, MICRO, STEPS, 3, "scale"))
    assert plugin.skipped_updates == 0 and plugin.scale == 2.0**8
    assert relative_error(flat_params(model), flat_params(reference)) <= 2e-3  # fp16 activations


@pytest.mark.parametrize("optimizer", ["sgd", "adamw_fused"])  # host-side skip and device-side skip
def test_injected_overflow_skips_the_window_lowers_the_scale_and_holds_the_schedule(optimizer):
    model = InjectingClassifier(inf_at=(5,), optimizer=optimizer, lr=0.02, step_lr_gamma=0.9)  # window 1
    reference = copy.deepcopy(model)
    plugin = LossScalePrecision("32-true", DynamicLossScale(init_scale=2.0**10))
    trainer = fit(model, plugin)
    windows = reference_windows(64, MICRO, STEPS, 2, "scale")
    reference_train(reference, make_dataset(num_samples=64), windows, skip={1})
    assert trainer.global_step == len(windows) == 8  # global_step counts windows, skipped ones included
    assert plugin.skipped_updates == 1 and plugin.scale == 2.0**9
    assert trainer.lr_scheduler_configs[0].scheduler.last_epoch == 7  # not advanced by the skipped window
    assert relative_error(flat_params(model), flat_params(reference)) <= 1e-6


def test_clipping_sees_unscaled_gradients():
    model = TinyClassifier(optimizer="sgd", lr=0.5)
    reference = copy.deepcopy(model)
    fit(model, LossScalePrecision("32-true", FixedLossScale(1024.0)), gradient_clip_val=0.05)
    windows = reference_windows(64, MICRO, STEPS, 2, "scale")
    reference_train(reference, make_dataset(num_samples=64), windows, clip=(0.05, "norm"))
    assert relative_error(flat_params(model), flat_params(reference)) <= 1e-6


@pytest.mark.parametrize("drop", [True, False])
def test_fixed_scale_drop_overflow_update(drop):
    model = InjectingClassifier(inf_at=(2,), optimizer="sgd", lr=0.02)
    plugin = LossScalePrecision("32-true", FixedLossScale(128.0, drop_overflow_update=drop))
    fit(model, plugin)
    if drop:  # MindSpore's default: the window is dropped, training goes on
        reference = InjectingClassifier(optimizer="sgd", lr=0.02)
        reference_train(
            reference, make_dataset(num_samples=64), reference_windows(64, MICRO, STEPS, 2, "scale"), skip={0}
        )
        assert plugin.skipped_updates == 1
        assert relative_error(flat_params(model), flat_params(reference)) <= 1e-6
    else:  # drop_overflow_update=False applies the overflowed update, as MindSpore does
        assert plugin.skipped_updates == 0
        assert not torch.isfinite(flat_params(model)).all()


def test_resume_mid_window_after_an_overflow_still_skips_it(tmp_path):
    ckpt = tmp_path / "mid.ckpt"
    config = DynamicLossScale(init_scale=2.0**10, scale_window=3)
    uninterrupted = InjectingClassifier(inf_at=(5,), optimizer="adamw_fused", lr=0.01)
    saver = SaveAtBatch(ckpt, at_batch=6)  # the overflow happened at micro-step 1 of this window; now at 3
    plugin = LossScalePrecision("32-true", config)
    fit(uninterrupted, plugin, epochs=3, callbacks=[saver])
    assert saver.window_position == 3

    resumed = InjectingClassifier(optimizer="adamw_fused", lr=0.01, seed=5)  # no injection: must come from state
    resumed_plugin = LossScalePrecision("32-true", config)
    fit(resumed, resumed_plugin, epochs=3, ckpt_path=ckpt)
    assert torch.equal(flat_params(resumed), flat_params(uninterrupted))
    assert resumed_plugin.skipped_updates == plugin.skipped_updates == 1
    assert resumed_plugin.scale == plugin.scale


class SyncCounter(Callback):
    """Counts host synchronizations (CPU: the Tensor methods that read a value back) inside the step programs."""

    METHODS = ("item", "tolist", "cpu", "numpy", "__bool__", "__float__", "__int__")

    def __init__(self) -> None:
        self.per_update: list[int] = []
        self.per_accumulate: list[int] = []
        self._count, self._phase = 0, None

    def setup(self, trainer, pl_module, stage):
        self._originals = {name: getattr(torch.Tensor, name) for name in self.METHODS}
        for name, original in self._originals.items():

            def counting(tensor, *args, _original=original, **kwargs):
                # only the training thread: a data prefetch thread's CPU-side work is not a device sync
                self._count += self._phase is not None and threading.current_thread() is threading.main_thread()
                return _original(tensor, *args, **kwargs)

            setattr(torch.Tensor, name, counting)
        strategy = trainer.strategy
        for name, record in (("update_step", self.per_update), ("accumulate_step", self.per_accumulate)):
            original = getattr(strategy, name)

            def wrapped(*args, _original=original, _record=record, _name=name, **kwargs):
                outer = self._phase is None
                if outer:
                    self._phase, self._count = _name, 0
                try:
                    return _original(*args, **kwargs)
                finally:
                    if outer:
                        _record.append(self._count)
                        self._phase = None

            setattr(strategy, name, wrapped)

    def teardown(self, trainer, pl_module, stage):
        for name, original in self._originals.items():
            setattr(torch.Tensor, name, original)


class Unlogged(InjectingClassifier):
    def log(self, *args, **kwargs):  # keep the model's own logging out of the count
        pass


@pytest.mark.parametrize(
    "optimizer, schedule, syncs_per_update",
    [
        ("adamw_fused", None, 0),  # the optimizer skips on the device: no sync at all
        ("sgd", None, 1),  # the optimizer cannot: exactly one read of the flag
        ("adamw_fused", 0.9, 1),  # a step LR schedule must know whether the update happened
    ],
)
def test_host_syncs_per_step(optimizer, schedule, syncs_per_update):
    counter = SyncCounter()
    model = Unlogged(inf_at=(5,), optimizer=optimizer, lr=0.01, step_lr_gamma=schedule)
    plugin = LossScalePrecision("32-true", DynamicLossScale(init_scale=2.0**10))
    fit(model, plugin, callbacks=[counter])
    assert len(counter.per_update) == 8 and len(counter.per_accumulate) == 24
    assert counter.per_accumulate == [0] * 24
    assert counter.per_update == [syncs_per_update] * 8
    assert plugin.skipped_updates == 1


def test_sync_counter_sees_syncs():
    """Guard for the test above: skip_window_on_overflow is documented to sync once per micro-step."""
    counter = SyncCounter()
    plugin = LossScalePrecision("32-true", DynamicLossScale(init_scale=2.0**10), skip_window_on_overflow=True)
    fit(Unlogged(optimizer="adamw_fused"), plugin, callbacks=[counter])
    assert counter.per_accumulate == [0, 1, 1] * 8


@pytest.mark.parametrize("sink_size", [None, 16], ids=["no sinks", "one pass per sink"])
def test_skip_window_on_overflow_skips_the_rest_of_the_window_backward(sink_size):
    """The skip reaches the precision plugin as an argument of Lightning's backward (the hooked path: a module
    ``backward`` and ``on_after_backward`` are overridden), in and out of sinks."""
    backwards, hooks = [], []

    class CountBackward(TinyClassifier):
        micro_batch = -1  # counted here: in sink mode Lightning's batch index counts sinks

        def training_step(self, batch, batch_idx):
            self.micro_batch += 1
            loss = super().training_step(batch, batch_idx)
            return loss * float("inf") if self.micro_batch == 4 else loss  # first micro-step of window 1

        def backward(self, loss, *args, **kwargs):
            backwards.append(self.micro_batch)
            super().backward(loss, *args, **kwargs)

        def on_after_backward(self):
            hooks.append(self.micro_batch)

    model = CountBackward(optimizer="sgd", lr=0.02)
    reference = InjectingClassifier(optimizer="sgd", lr=0.02)
    plugin = LossScalePrecision("32-true", DynamicLossScale(init_scale=2.0**10), skip_window_on_overflow=True)
    fit(model, plugin, sink_size=sink_size)
    assert not hasattr(plugin, "skip_backward")  # no flag set on the plugin from outside
    assert [index for index in range(32) if index not in backwards] == [5, 6, 7]
    assert hooks == list(range(32))  # Lightning's backward hooks run for every micro-batch, as with stock
    reference_train(reference, make_dataset(num_samples=64), reference_windows(64, MICRO, STEPS, 2, "scale"), skip={1})
    assert relative_error(flat_params(model), flat_params(reference)) <= 1e-6


def test_loss_scale_overflow_and_skips_are_logged(tmp_path):
    logger = CSVLogger(tmp_path, name="run", version=0)
    model = InjectingClassifier(inf_at=(5, 9), optimizer="sgd", lr=0.02)
    plugin = LossScalePrecision("32-true", DynamicLossScale(init_scale=2.0**10, scale_window=2))
    fit(model, plugin, logger=logger, log_every_n_steps=1)
    with open(Path(logger.log_dir) / "metrics.csv") as handle:
        rows = [row for row in csv.DictReader(handle) if row.get("loss_scale")]
    overflow = [float(row["overflow"]) for row in rows]
    assert overflow == [0, 1, 1, 0, 0, 0, 0, 0]
    assert [float(row["skipped_updates"]) for row in rows] == [0, 1, 2, 2, 2, 2, 2, 2]
    # documented rule, window 2: 1024 -> 512 -> 256 -> (2 good) 512 -> (2 good) 1024 ...
    assert [float(row["loss_scale"]) for row in rows] == [1024, 512, 256, 256, 512, 512, 1024, 1024]
    assert [int(row["step"]) for row in rows] == list(range(8))


def test_stock_16_mixed_grad_scaler_is_replaced_by_the_accumulating_scaler():
    # On CUDA, Trainer(precision="16-mixed") builds this GradScaler plugin; on CPU build it explicitly.
    stock = MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu"))
    trainer = fit(TinyClassifier(), stock, epochs=1)
    plugin = trainer.precision_plugin
    assert isinstance(plugin, LossScalePrecision) and plugin.precision == "16-mixed"
    assert plugin.loss_scale == DynamicLossScale()
    assert trainer.global_step == 4 and math.isfinite(plugin.scale)


def test_bf16_mixed_trains_without_a_scale():
    model = TinyClassifier(optimizer="sgd", lr=0.05)
    reference = copy.deepcopy(model)
    plugin = LossScalePrecision("bf16-mixed", device="cpu")
    fit(model, plugin)
    reference_train(reference, make_dataset(num_samples=64), reference_windows(64, MICRO, STEPS, 2, "scale"))
    assert plugin.scaler is None and plugin.scale == 1.0
    assert relative_error(flat_params(model), flat_params(reference)) <= 2e-2  # bf16 activations


def test_stock_lightning_strategy_uses_the_plugin_too():
    model = InjectingClassifier(inf_at=(3,), optimizer="sgd", lr=0.02)
    reference = InjectingClassifier(optimizer="sgd", lr=0.02)
    plugin = LossScalePrecision("32-true", DynamicLossScale(init_scale=2.0**10))
    trainer = quiet_trainer(plugins=[plugin], max_epochs=1)  # Lightning's own single-device strategy
    trainer.fit(model, loader(make_dataset(num_samples=32), MICRO))
    reference_train(reference, make_dataset(num_samples=32), reference_windows(32, MICRO, 1, 1, "scale"), skip={3})
    assert plugin.skipped_updates == 1 and plugin.scale == 2.0**9
    assert relative_error(flat_params(model), flat_params(reference)) <= 1e-6


def test_precision_flag_and_plugin_together_is_an_error():
    # Lightning's accelerator connector refuses it, naming both.
    with pytest.raises(ValueError, match=r"Received both `precision=bf16-mixed` and `plugins=LossScalePrecision"):
        quiet_trainer(strategy="sink", precision="bf16-mixed", plugins=[LossScalePrecision("16-mixed")])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (CI has no GPU)")
def test_cuda_step_programs_never_sync_with_a_fused_optimizer():
    """On the GPU, torch's sync debug mode raises on any host synchronization inside the step programs."""
    model = Unlogged(inf_at=(5,), optimizer="adamw_fused", lr=0.01)
    plugin = LossScalePrecision("16-mixed", DynamicLossScale(init_scale=2.0**10), device="cuda")
    strategy = SinkStrategy(accumulation_steps=STEPS)
    for name in ("accumulate_step", "update_step"):
        original = getattr(strategy, name)

        def strict(*args, _original=original, **kwargs):
            torch.cuda.set_sync_debug_mode("error")
            try:
                return _original(*args, **kwargs)
            finally:
                torch.cuda.set_sync_debug_mode("default")

        setattr(strategy, name, strict)
    trainer = quiet_trainer(accelerator="cuda", devices=1, strategy=strategy, plugins=[plugin], max_epochs=2)
    trainer.fit(model, loader(make_dataset(num_samples=64), MICRO))
    assert trainer.global_step == 8 and plugin.skipped_updates == 1
