"""Fails loudly when a Lightning release moves a private attribute that ``_lightning_compat`` relies on."""

from __future__ import annotations

import inspect
from datetime import timedelta

import lightning.pytorch as pl
import pytest
import torch
import torchmetrics
from lightning.pytorch.callbacks import Callback, ModelCheckpoint, Timer
from lightning.pytorch.loops.optimization.automatic import _AutomaticOptimization
from lightning.pytorch.loops.training_epoch_loop import _TrainingEpochLoop
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.trainer import call

from lightning_sink import SinkStrategy
from lightning_sink import _lightning_compat as compat
from tests.helpers import TinyClassifier, loader, make_dataset, quiet_trainer


def test_private_lightning_attributes_still_exist():
    assert list(inspect.signature(_TrainingEpochLoop._should_accumulate).parameters) == ["self"]
    assert list(inspect.signature(_TrainingEpochLoop.update_lr_schedulers).parameters) == [
        "self",
        "interval",
        "update_plateau_schedulers",
    ]
    assert callable(_TrainingEpochLoop._num_ready_batches_reached)
    assert list(inspect.signature(_AutomaticOptimization._on_before_zero_grad).parameters) == ["self", "optimizer"]
    assert list(inspect.signature(_AutomaticOptimization._optimizer_zero_grad).parameters) == [
        "self",
        "batch_idx",
        "optimizer",
    ]
    assert callable(Precision._after_closure)
    assert callable(call._call_lightning_module_hook)
    assert list(inspect.signature(pl.LightningModule._on_before_batch_transfer).parameters) == [
        "self",
        "batch",
        "dataloader_idx",
    ]
    trainer = pl.Trainer(logger=False)
    loop = trainer.fit_loop.epoch_loop
    progress = loop.automatic_optimization.optim_progress.optimizer
    for tracker in (progress.step.total, progress.step.current):
        assert isinstance(tracker.ready, int) and isinstance(tracker.completed, int)
    for name in ("increment_ready", "increment_started", "increment_completed"):
        assert callable(getattr(progress.zero_grad, name))
    assert isinstance(loop._batches_that_stepped, int)
    assert trainer.fit_loop._skip_backward is False
    assert isinstance(trainer.fit_loop.total_batch_idx, int)
    assert trainer.fit_loop._combined_loader_states_to_load == []  # forget_saved_loader_states empties it
    assert trainer.fit_loop._data_fetcher is None  # skip_training_batches reads it once fit has created it
    assert compat.first_batch_flag(trainer) is None  # between epochs
    compat.set_first_batch_flag(trainer, False)
    assert not trainer._logger_connector.should_reset_tensors("training_step")  # what the flag is for
    compat.set_first_batch_flag(trainer, True)
    assert trainer._logger_connector.should_reset_tensors("training_step")
    module = pl.LightningModule()
    assert module._current_fx_name is None  # what swap_hook_name sets and returns
    assert compat.swap_hook_name(module, "training_step") is None
    assert module._current_fx_name == "training_step"
    assert compat.swap_hook_name(module, None) == "training_step" and module._current_fx_name is None

    mean = torchmetrics.MeanMetric()
    assert compat.metric_step_value(mean) is None  # no forward call yet
    mean(torch.tensor([1.0, 3.0]))
    assert float(compat.metric_step_value(mean)) == 2.0  # the latest forward call's own value
    mean(torch.tensor([6.0]))
    with compat.metric_step_value_set_to(mean, torch.tensor(5.0)):
        assert float(compat.metric_step_value(mean)) == 5.0
    assert float(compat.metric_step_value(mean)) == 6.0
    # sink schedules: the validation decision, early stopping's permission, the time limit, the epoch's state
    assert list(inspect.signature(_TrainingEpochLoop._should_check_val_fx).parameters) == ["self", "data_fetcher"]
    assert isinstance(trainer.fit_loop._can_stop_early, bool)
    timer = Timer(duration=timedelta(seconds=5))
    assert timer._interval == "step" and timer._duration == 5
    assert isinstance(vars(pl.Trainer)["estimated_stepping_batches"], property)
    state = trainer.fit_loop.state_dict()
    assert {"ready", "completed", "started", "processed"} <= set(state["epoch_progress"]["total"])
    assert set(state["epoch_progress"]) >= {"total", "current"}


def test_process_group_backend_is_read_from_the_parent_strategy():
    from lightning.pytorch.strategies import DDPStrategy

    assert compat.process_group_backend(DDPStrategy(process_group_backend="gloo")) == "gloo"
    assert compat.process_group_backend(DDPStrategy()) is None


class _Probe(Callback):
    """Records, inside a fit, which loop overrides are live and what the compat functions see."""

    def __init__(self):
        self.seen = {}

    def on_train_batch_end(self, trainer, *args):
        loop = trainer.fit_loop.epoch_loop
        self.seen.setdefault("shadowed", {name for name in compat._SHADOWED if name in loop.__dict__})
        self.seen.setdefault("skip_backward", trainer.fit_loop._skip_backward)
        self.seen["optimizer_is_lightnings"] = (
            compat.lightning_optimizer(trainer.strategy) is (trainer.strategy._lightning_optimizers[0])
        )


@pytest.mark.parametrize(
    "strategy, shadowed, skip_backward",
    [
        (lambda: SinkStrategy(accumulation_steps=2), set(), False),  # Lightning's own loop decides everything
        (lambda: SinkStrategy(accumulation_steps=2, partial_window="carry"), {"_should_accumulate"}, False),
        (
            lambda: SinkStrategy(accumulation_steps=2, sink_size=4),
            {"_should_accumulate", "update_lr_schedulers", "_num_ready_batches_reached", "_should_check_val_fx"},
            True,
        ),
    ],
)
def test_loop_overrides_only_where_needed_and_removed_after(strategy, shadowed, skip_backward):
    probe = _Probe()
    trainer = quiet_trainer(strategy=strategy(), max_epochs=2, callbacks=[probe])
    trainer.fit(TinyClassifier(), loader(make_dataset(num_samples=16), 4))
    assert probe.seen == {"shadowed": shadowed, "skip_backward": skip_backward, "optimizer_is_lightnings": True}
    loop = trainer.fit_loop.epoch_loop
    assert not any(name in loop.__dict__ for name in compat._SHADOWED)
    assert trainer.fit_loop._skip_backward is False


def test_zero_grad_and_step_counters_move_as_lightnings_own():
    """The counters the compat layer moves are the ones stock Lightning moves (and saves in the loop state)."""
    trainer = quiet_trainer(max_epochs=1, limit_train_batches=3)
    trainer.fit(TinyClassifier(), loader(make_dataset(num_samples=16), 4))
    progress = trainer.fit_loop.epoch_loop.automatic_optimization.optim_progress.optimizer
    before = (progress.zero_grad.total.completed, progress.step.total.completed, trainer.global_step)
    counters = compat.UpdateCounters(trainer)
    counters.zero_grad()
    counters.update_ready()
    counters.update_completed()
    assert (progress.zero_grad.total.completed, progress.step.total.completed, trainer.global_step) == (
        before[0] + 1,
        before[1] + 1,
        before[2] + 1,
    )
    assert progress.zero_grad.total.ready == progress.zero_grad.total.started == progress.zero_grad.total.completed
    compat.set_logging_step(trainer, updated=True)
    assert trainer.fit_loop.epoch_loop._batches_that_stepped == trainer.global_step - 1
    calls = []

    class Recording(TinyClassifier):
        def on_before_zero_grad(self, optimizer):
            calls.append("module.on_before_zero_grad")

        def optimizer_zero_grad(self, epoch, batch_idx, optimizer):
            calls.append(("optimizer_zero_grad", batch_idx))

    module = Recording()
    trainer = quiet_trainer(max_epochs=1, limit_train_batches=1)
    trainer.fit(module, loader(make_dataset(num_samples=16), 4))
    calls.clear()
    compat.run_zero_grad(trainer, 5, trainer.optimizers[0])
    assert calls == ["module.on_before_zero_grad", ("optimizer_zero_grad", 5)]


def test_model_checkpoint_keeps_every_n_train_steps_where_the_compat_layer_reads_it():
    assert compat.checkpoint_every_n_train_steps(ModelCheckpoint(every_n_train_steps=7)) == 7
    assert compat.checkpoint_every_n_train_steps(ModelCheckpoint()) == 0


def test_model_parallel_private_names_still_mean_the_same():
    from lightning.pytorch.strategies import ModelParallelStrategy

    from lightning_sink.checkpoint_format.dcp_folder import LIGHTNING_META_FILE

    # The checkpoint formats name Lightning's meta.pt without importing Lightning: the two names must agree.
    assert compat.DCP_METADATA_FILE_NAME == LIGHTNING_META_FILE == "meta.pt"
    assert "_METADATA_FILENAME" in inspect.getsource(ModelParallelStrategy.save_checkpoint)
    assert "lightning_module._device_mesh" in inspect.getsource(ModelParallelStrategy.setup_environment)
    module = TinyClassifier()
    compat.set_module_device_mesh(module, "mesh")
    assert module.device_mesh == "mesh"


def test_model_parallel_strategy_keeps_save_distributed_checkpoint_where_the_compat_layer_reads_it():
    from lightning.pytorch.strategies import ModelParallelStrategy

    assert compat.saves_distributed_checkpoint(ModelParallelStrategy(save_distributed_checkpoint=True)) is True
    assert compat.saves_distributed_checkpoint(ModelParallelStrategy(save_distributed_checkpoint=False)) is False


def test_logging_step_set_to_is_the_step_lightnings_log_every_n_steps_and_lr_monitor_use():
    from lightning.pytorch.callbacks import LearningRateMonitor

    from tests.helpers import RecordingLogger

    monitor, seen = LearningRateMonitor(), {}

    class Probe(Callback):
        def on_train_batch_end(self, trainer, module, *args):
            if seen:
                return
            before, logger = trainer.fit_loop.epoch_loop._batches_that_stepped, trainer.logger
            logger.points.clear()
            for step in (40, 41):  # log_every_n_steps=7: Lightning writes at the batch whose step + 1 is a multiple
                with compat.logging_step_set_to(trainer, step):
                    seen[step] = trainer._logger_connector.should_update_logs
                    monitor.on_train_batch_start(trainer, module, None, 0)
            seen["points"] = [(step, sorted(metrics)) for step, metrics in logger.points]
            seen["restored"] = trainer.fit_loop.epoch_loop._batches_that_stepped == before

    trainer = quiet_trainer(logger=RecordingLogger(), log_every_n_steps=7, max_steps=1, callbacks=[monitor, Probe()])
    trainer.fit(TinyClassifier(), loader(make_dataset(num_samples=16), 4))
    assert seen == {40: False, 41: True, "points": [(41, ["lr-SGD"])], "restored": True}


def test_skip_training_batches_drops_the_start_of_the_pass_lightning_is_about_to_run():
    dataset = make_dataset(num_samples=24)
    seen, skipped = [], []

    class SkipTwo(Callback):
        def on_train_start(self, trainer, pl_module):
            skipped.append(compat.skip_training_batches(trainer, 2))

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            seen.append(batch[0])

    trainer = quiet_trainer(max_epochs=1, callbacks=[SkipTwo()])
    trainer.fit(TinyClassifier(), loader(dataset, 4))
    assert skipped == [2]
    expected = [dataset.tensors[0][i : i + 4] for i in range(8, 24, 4)]
    assert len(seen) == len(expected) and all(a.equal(b) for a, b in zip(seen, expected))


def test_shut_down_loader_workers_is_lightnings_end_of_fit_shutdown():
    from torch.utils.data import DataLoader

    data_loader = DataLoader(make_dataset(num_samples=8), batch_size=4, num_workers=1, persistent_workers=True)
    list(data_loader)
    assert data_loader._iterator is not None and data_loader._iterator._workers[0].is_alive()
    workers = data_loader._iterator._workers
    compat.shut_down_loader_workers(data_loader)
    assert data_loader._iterator is None and not any(worker.is_alive() for worker in workers)


def test_single_device_strategy_keeps_its_device_where_the_compat_layer_reads_and_writes_it():
    from lightning.pytorch.strategies import SingleDeviceStrategy

    strategy = SingleDeviceStrategy(device="cpu")
    assert compat.single_device(strategy) == torch.device("cpu") == strategy.root_device
    compat.set_single_device(strategy, torch.device("meta"))
    assert strategy.root_device == torch.device("meta")


def test_model_parallel_strategy_keeps_its_sizes_where_the_compat_layer_reads_them():
    from lightning.pytorch.strategies import ModelParallelStrategy

    assert compat.model_parallel_sizes(ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=3)) == (2, 3)
    assert compat.model_parallel_sizes(ModelParallelStrategy()) == ("auto", "auto")


class _Stop(Exception):
    pass


def test_precision_after_closure_runs_the_before_optimizer_step_hooks_then_clips():
    calls = []

    class Recording(TinyClassifier):
        def on_before_optimizer_step(self, optimizer):
            calls.append(("hook", float(self.net[0].weight.grad.norm())))

    class Probe(Callback):
        def on_train_start(self, trainer, pl_module):
            pl_module.net[0].weight.grad = torch.full_like(pl_module.net[0].weight, 10.0)
            compat.precision_after_closure(trainer.precision_plugin, pl_module, trainer.optimizers[0])
            calls.append(("clipped", float(pl_module.net[0].weight.grad.norm())))
            raise _Stop

    trainer = quiet_trainer(max_steps=1, gradient_clip_val=1.0, callbacks=[Probe()])
    with pytest.raises(_Stop):
        trainer.fit(Recording(), loader(make_dataset(), 4))
    assert calls[0][0] == "hook" and calls[0][1] > 1.0
    assert calls[1] == ("clipped", pytest.approx(1.0))


def test_callback_state_key_is_lightnings_format():
    assert compat.callback_state_key(ModelCheckpoint(), per_print_times=3) == "ModelCheckpoint{'per_print_times': 3}"
    checkpoint = ModelCheckpoint(monitor="loss", every_n_epochs=2)
    settings = dict(monitor="loss", mode="min", every_n_train_steps=0, every_n_epochs=2, train_time_interval=None)
    assert compat.callback_state_key(checkpoint, **settings) == checkpoint.state_key


def test_strategy_registry_is_the_one_strategies_register_in():
    from lightning.pytorch.strategies import StrategyRegistry

    assert isinstance(StrategyRegistry, compat.StrategyRegistry)
    assert "sink" in StrategyRegistry


class _IterableNoLength(torch.utils.data.IterableDataset):
    def __init__(self, samples: int) -> None:
        self.data = make_dataset(samples)

    def __iter__(self):
        return iter(self.data)


class _RecordsBatchPosition(TinyClassifier):
    """Reads the batch position both ways at every ``training_step``, where the engine reads it."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[tuple[bool, bool, int, int]] = []

    def training_step(self, batch, batch_idx):
        trainer = self.trainer
        loop = trainer.fit_loop.epoch_loop
        self.seen.append(
            (
                compat.is_last_batch_of_epoch(trainer),
                bool(loop._num_ready_batches_reached()),
                compat.batch_index_in_epoch(trainer),
                trainer.fit_loop.batch_idx,
            )
        )
        return super().training_step(batch, batch_idx)


@pytest.mark.parametrize(
    "data, limit",
    [("sized", 1.0), ("sized", 5), ("iterable", 1.0), ("iterable", 4)],
    ids=["sized", "sized-limited", "iterable", "iterable-limited"],
)
def test_batch_position_reads_equal_lightnings_own(data, limit):
    """``is_last_batch_of_epoch`` and ``batch_index_in_epoch`` read Lightning's progress attributes instead of calling
    its private method and property: both ways agree at every batch of every epoch."""
    dataset = make_dataset(56) if data == "sized" else _IterableNoLength(56)
    module = _RecordsBatchPosition()
    trainer = quiet_trainer(max_epochs=2, limit_train_batches=limit, strategy=SinkStrategy(accumulation_steps=3))
    trainer.fit(module, torch.utils.data.DataLoader(dataset, batch_size=8))
    assert len(module.seen) >= 8
    assert sum(last for last, *_ in module.seen) == 2  # one last batch per epoch
    for ours_last, lightnings_last, ours_index, lightnings_index in module.seen:
        assert (ours_last, ours_index) == (lightnings_last, lightnings_index)


def test_check_before_resume_sees_every_resolved_path_before_lightning_loads(tmp_path):
    """The resume agreement's hook: Lightning's restore starts in ``resume_start`` on every rank, with the path it
    resolved (``None`` where none, as a ``ckpt_path="last"`` with no last checkpoint), before anything is loaded."""
    data = loader(make_dataset(num_samples=16), 4)
    first = quiet_trainer(strategy=SinkStrategy(accumulation_steps=2), max_epochs=1)
    first.fit(TinyClassifier(), data)
    first.save_checkpoint(tmp_path / "saved.ckpt")
    seen = []

    class Installing(SinkStrategy):  # installs the check where the multi-process strategies do
        def setup_environment(self):
            super().setup_environment()
            compat.check_before_resume(
                self, lambda path: seen.append((path, self.lightning_module.trainer.global_step))
            )

    for ckpt_path in (tmp_path / "saved.ckpt", "last", None):
        quiet_trainer(strategy=Installing(accumulation_steps=2), max_epochs=2).fit(
            TinyClassifier(), data, ckpt_path=ckpt_path
        )
    assert seen == [(tmp_path / "saved.ckpt", 0), (None, 0), (None, 0)]  # nothing restored yet when it runs
    assert compat.recorded_step_counts(torch.load(tmp_path / "saved.ckpt", weights_only=True)) == {2, 0}
