"""Resuming with other window settings, and a sink strategy's checkpoint resumed by stock Lightning."""

from __future__ import annotations

import pytest
import torch
from lightning.pytorch.callbacks import Callback

from lightning_sink import SinkStrategy
from tests.helpers import TinyClassifier, loader, make_dataset, quiet_trainer

DATASET = make_dataset(num_samples=40)  # 10 batches of 4


class Save(Callback):
    def __init__(self, path, at_batch=None, at_epoch_end=None):
        self.path, self.at_batch, self.at_epoch_end, self.window_position = path, at_batch, at_epoch_end, None

    def _save(self, trainer):
        trainer.save_checkpoint(self.path)
        self.window_position = (
            trainer.strategy._accumulator.micro_steps if isinstance(trainer.strategy, SinkStrategy) else None
        )

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if trainer.fit_loop.total_batch_idx == self.at_batch:
            self._save(trainer)

    def on_train_epoch_end(self, trainer, pl_module):
        if trainer.current_epoch == self.at_epoch_end:
            self._save(trainer)


def save_sink_checkpoint(tmp_path, strategy_kwargs, epochs, **save):
    saver = Save(tmp_path / "saved.ckpt", **save)
    trainer = quiet_trainer(strategy=SinkStrategy(**strategy_kwargs), max_epochs=epochs, callbacks=[saver])
    trainer.fit(TinyClassifier(), loader(DATASET, 4))
    return saver


CHANGES = [
    # (saved with, resumed with, where, the changed argument)
    (dict(accumulation_steps=4), dict(accumulation_steps=2), dict(at_batch=1), "accumulation_steps", 4, 2),
    (
        dict(accumulation_steps=4, sink_size=3),
        dict(accumulation_steps=4, sink_size=5),
        dict(at_epoch_end=0),
        "sink_size",
        3,
        5,
    ),
    (dict(accumulation_steps=4), dict(accumulation_steps=4, sink_size=3), dict(at_batch=1), "sink_size", None, 3),
    (
        dict(accumulation_steps=4, partial_window="carry"),
        dict(accumulation_steps=4, partial_window="scale"),
        dict(at_epoch_end=0),
        "partial_window",
        "carry",
        "scale",
    ),
]


@pytest.mark.parametrize("saved, resumed, where, name, old, new", CHANGES)
def test_resuming_inside_a_window_with_other_settings_names_both_values(
    tmp_path, saved, resumed, where, name, old, new
):
    saver = save_sink_checkpoint(tmp_path, saved, epochs=2, **where)
    assert saver.window_position not in (None, 0), "the checkpoint must be taken inside a window"
    trainer = quiet_trainer(strategy=SinkStrategy(**resumed), max_epochs=3)
    message = (
        rf"saved.ckpt: the checkpoint was saved inside an accumulation window .* with {name}={old!r}, but this"
        rf" run has {name}={new!r}"
    )
    with pytest.raises(ValueError, match=message):
        trainer.fit(TinyClassifier(), loader(DATASET, 4), ckpt_path=saver.path)


def test_at_a_window_boundary_the_settings_may_change(tmp_path):
    saver = save_sink_checkpoint(tmp_path, dict(accumulation_steps=4), epochs=1, at_batch=3)  # 4 of 4: closed
    assert saver.window_position == 0
    trainer = quiet_trainer(strategy=SinkStrategy(accumulation_steps=2), max_epochs=1)
    trainer.fit(TinyClassifier(), loader(DATASET, 4), ckpt_path=saver.path)
    assert trainer.global_step == 1 + 3  # one window of 4 before, the remaining 6 batches in windows of 2


def flat(model):
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def test_stock_lightning_resumes_a_sink_checkpoint_at_a_window_boundary_as_its_own(tmp_path):
    # A sink strategy without sinking saves Lightning's own loop state: stock Lightning resumes from it as from its
    # own checkpoint (the lightning_sink entry is ignored), and ends where an uninterrupted stock run ends.
    saver = save_sink_checkpoint(tmp_path, dict(accumulation_steps=2), epochs=1, at_epoch_end=0)
    assert saver.window_position == 0
    stock_resumed = TinyClassifier()
    resumed = quiet_trainer(accumulate_grad_batches=2, max_epochs=3)
    resumed.fit(stock_resumed, loader(DATASET, 4), ckpt_path=saver.path)

    stock_model, stock_saver = TinyClassifier(), Save(tmp_path / "stock.ckpt", at_epoch_end=0)
    stock = quiet_trainer(accumulate_grad_batches=2, max_epochs=3, callbacks=[stock_saver])
    stock.fit(stock_model, loader(DATASET, 4))
    from_stock = TinyClassifier()
    quiet_trainer(accumulate_grad_batches=2, max_epochs=3).fit(
        from_stock, loader(DATASET, 4), ckpt_path=stock_saver.path
    )
    assert resumed.global_step == stock.global_step == 15
    # The first epoch's updates sum gradients in another order (fp32 window buffer): equal up to rounding.
    torch.testing.assert_close(flat(stock_resumed), flat(stock_model), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(flat(stock_resumed), flat(from_stock), rtol=1e-5, atol=1e-6)


def test_stock_lightning_resumes_a_mid_window_sink_checkpoint_as_its_own_mid_window_checkpoint(tmp_path):
    # Inside a window stock Lightning keeps no gradients in its checkpoints; it drops the sink window's partial sums
    # the same way, and counts on from the saved loop state.
    saver = save_sink_checkpoint(tmp_path, dict(accumulation_steps=2), epochs=1, at_batch=4)
    assert saver.window_position == 1
    stock_saver = Save(tmp_path / "stock.ckpt", at_batch=4)
    quiet_trainer(accumulate_grad_batches=2, max_epochs=1, callbacks=[stock_saver]).fit(
        TinyClassifier(), loader(DATASET, 4)
    )
    steps = {}
    for name, path in (("from_sink", saver.path), ("from_stock", stock_saver.path)):
        trainer = quiet_trainer(accumulate_grad_batches=2, max_epochs=2)
        trainer.fit(TinyClassifier(), loader(DATASET, 4), ckpt_path=path)
        steps[name] = trainer.global_step
    assert steps["from_sink"] == steps["from_stock"]
