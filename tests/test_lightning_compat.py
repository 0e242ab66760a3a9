"""Fails loudly when a Lightning release moves a private attribute that ``_lightning_compat`` relies on."""

from __future__ import annotations

import inspect

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from lightning.pytorch.loops.training_epoch_loop import _TrainingEpochLoop
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.trainer import call

from lightning_sink import SinkStrategy
from lightning_sink import _lightning_compat as compat
from tests.helpers import TinyClassifier, loader, make_dataset, quiet_trainer


def test_private_lightning_attributes_still_exist():
    assert list(inspect.signature(_TrainingEpochLoop._should_accumulate).parameters) == ["self"]
    assert list(inspect.signature(_TrainingEpochLoop.update_lr_schedulers).parameters) == [
        "self", "interval", "update_plateau_schedulers"]
    assert callable(_TrainingEpochLoop._num_ready_batches_reached)
    assert callable(Precision._after_closure)
    assert callable(call._call_lightning_module_hook)
    trainer = pl.Trainer(logger=False)
    loop = trainer.fit_loop.epoch_loop
    step = loop.automatic_optimization.optim_progress.optimizer.step
    for tracker in (step.total, step.current):
        assert isinstance(tracker.ready, int) and isinstance(tracker.completed, int)
    assert isinstance(loop._batches_that_stepped, int)
    assert trainer.fit_loop._skip_backward is False
    assert isinstance(trainer.fit_loop.total_batch_idx, int)
    assert trainer.fit_loop._combined_loader_states_to_load == []  # forget_saved_loader_states empties it
    assert trainer.fit_loop._data_fetcher is None  # skip_training_batches reads it once fit has created it


def test_overrides_are_live_during_fit_and_removed_after():
    seen = {}

    class Probe(Callback):
        def on_train_batch_end(self, trainer, *args):
            loop = trainer.fit_loop.epoch_loop
            seen["shadowed"] = all(name in loop.__dict__ for name in compat._SHADOWED)
            seen["skip_backward"] = trainer.fit_loop._skip_backward

    trainer = quiet_trainer(strategy=SinkStrategy(accumulation_steps=2), max_epochs=1, callbacks=[Probe()])
    trainer.fit(TinyClassifier(), loader(make_dataset(num_samples=16), 4))
    assert seen == {"shadowed": True, "skip_backward": True}
    loop = trainer.fit_loop.epoch_loop
    assert not any(name in loop.__dict__ for name in compat._SHADOWED)
    assert trainer.fit_loop._skip_backward is False


def test_model_checkpoint_keeps_every_n_train_steps_where_the_compat_layer_reads_it():
    assert compat.checkpoint_every_n_train_steps(ModelCheckpoint(every_n_train_steps=7)) == 7
    assert compat.checkpoint_every_n_train_steps(ModelCheckpoint()) == 0


def test_model_parallel_private_names_still_mean_the_same():
    from lightning.pytorch.strategies import ModelParallelStrategy

    assert compat.DCP_METADATA_FILE_NAME == "meta.pt"
    assert "_METADATA_FILENAME" in inspect.getsource(ModelParallelStrategy.save_checkpoint)
    assert "lightning_module._device_mesh" in inspect.getsource(ModelParallelStrategy.setup_environment)
    module = TinyClassifier()
    compat.set_module_device_mesh(module, "mesh")
    assert module.device_mesh == "mesh"


def test_model_parallel_strategy_keeps_save_distributed_checkpoint_where_the_compat_layer_reads_it():
    from lightning.pytorch.strategies import ModelParallelStrategy

    assert compat.saves_distributed_checkpoint(ModelParallelStrategy(save_distributed_checkpoint=True)) is True
    assert compat.saves_distributed_checkpoint(ModelParallelStrategy(save_distributed_checkpoint=False)) is False


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
