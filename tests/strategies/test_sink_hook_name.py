"""Lightning sees ``training_step`` as the current hook of every micro-batch's forward inside a sink, as it does
without sinking: a module that defines its own ``log`` (so every call reaches Lightning during the sink, as
pytorch-forecasting's base model does) gets epoch aggregates over the whole sink, the same as the run without
sinking. The reference is stock Lightning's ``accumulate_grad_batches`` over the same data, side by side.
"""

from __future__ import annotations

import pytest
import torch.nn.functional as F
from lightning.pytorch.callbacks import Callback

from lightning_sink import SinkStrategy
from tests.helpers import TinyClassifier, loader, make_dataset, quiet_trainer

MICRO, STEPS, PASS = 4, 4, 8  # a data pass of 8 micro-batches: two windows of 4


class EpochValues(Callback):
    """Every epoch's aggregated values, and the hook name Lightning had at each training_step."""

    def __init__(self) -> None:
        self.epochs: list[dict[str, float]] = []

    def on_train_epoch_end(self, trainer, module):
        self.epochs.append({key: value.item() for key, value in trainer.callback_metrics.items()})


class LogsPerMicroBatch(TinyClassifier):
    """Logs its loss on epoch (mean and sum) and records Lightning's hook name at every forward."""

    def __init__(self) -> None:
        super().__init__(lr=0.05)
        self.hook_names: list[str | None] = []

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.cross_entropy(self(x), y)
        self.hook_names.append(self._current_fx_name)
        # (the batch size given, as pytorch-forecasting does: a sink's own Lightning batch has none to infer)
        self.log("loss_mean", loss, on_step=False, on_epoch=True, batch_size=len(y))
        self.log("loss_sum", loss, on_step=False, on_epoch=True, reduce_fx="sum", batch_size=len(y))
        return loss


class WithHookedBackward(LogsPerMicroBatch):
    """Overrides a step hook: the sink runs the hooked step programs."""

    def on_after_backward(self):
        pass


class OwnLog(WithHookedBackward):
    """Defines its own ``log`` (delegating to Lightning's), as pytorch-forecasting's base model does."""

    def log(self, *args, **kwargs):
        super().log(*args, **kwargs)


class OwnLogAlsoInAHook(OwnLog):
    """Logs in on_after_backward too: Lightning's hook name alternates between the two hooks at every micro-batch."""

    def on_after_backward(self):
        weight = self.net[0].weight
        self.log("grad_sum", weight.grad.sum(), on_step=False, on_epoch=True, reduce_fx="sum", batch_size=MICRO)


def fit(module_class, strategy, epochs: int, **trainer_kwargs):
    module, values = module_class(), EpochValues()
    trainer = quiet_trainer(strategy=strategy, max_epochs=epochs, callbacks=[values], **trainer_kwargs)
    trainer.fit(module, loader(make_dataset(num_samples=PASS * MICRO), MICRO))
    assert trainer.global_step == epochs * PASS // STEPS
    return module, values.epochs


@pytest.mark.parametrize("module_class", [OwnLog, OwnLogAlsoInAHook, WithHookedBackward, LogsPerMicroBatch])
@pytest.mark.parametrize("sink", [True, False])
def test_epoch_aggregates_equal_the_run_without_sinking(module_class, sink):
    """One sink per data pass, so that a sink's epoch and the stock run's epoch hold the same micro-batches."""
    stock_module, stock = fit(module_class, "auto", 2, accumulate_grad_batches=STEPS)
    strategy = SinkStrategy(sink_size=PASS if sink else None, accumulation_steps=STEPS)
    module, values = fit(module_class, strategy, 2)
    assert len(stock) == len(values) == 2
    for stock_epoch, epoch in zip(stock, values):
        assert {"loss_mean", "loss_sum"} <= set(epoch) and sorted(epoch) == sorted(stock_epoch)
        for key in stock_epoch:
            assert epoch[key] == pytest.approx(stock_epoch[key], rel=1e-6), key
    assert set(stock_module.hook_names) == {"training_step"}
    assert module.hook_names == stock_module.hook_names  # every micro-batch's forward, window-ending or not
