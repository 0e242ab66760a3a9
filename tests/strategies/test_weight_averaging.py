"""Lightning's ``StochasticWeightAveraging`` callback, stock Lightning and the sink strategy side by side.

The callback swaps in its own LR scheduler at ``swa_epoch_start``, averages the parameters at every epoch's start,
and, for a module with BatchNorm, adds one epoch after the last one that recomputes the statistics with a forward
pass and no backward (``fit_loop._skip_backward``, which it clears at every epoch's end).
"""

from __future__ import annotations

import copy
import warnings
from typing import Any

import pytest
import torch
from lightning.pytorch.callbacks import Callback, StochasticWeightAveraging
from torch import nn

from lightning_sink import SinkStrategy
from tests.helpers import TinyClassifier, loader, make_dataset, quiet_trainer

SAMPLES, BATCH = 64, 8  # a data pass of 8 batches


class BatchNormClassifier(TinyClassifier):
    def __init__(self) -> None:
        super().__init__(optimizer="sgd", lr=0.1)
        torch.manual_seed(1)
        self.net = nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.Tanh(), nn.Linear(16, 4))


class ParametersAtEpochStart(Callback):
    """The first layer's weight at each epoch's start (after the averaging callback's own epoch-start work)."""

    def __init__(self) -> None:
        self.weights: list[torch.Tensor] = []

    def on_train_epoch_start(self, trainer: Any, module: Any) -> None:
        self.weights.append(module.net[0].weight.detach().clone())


def fit(module: TinyClassifier, strategy: Any, epochs: int = 4, **kwargs: Any) -> tuple[Any, ParametersAtEpochStart]:
    averaging = StochasticWeightAveraging(swa_lrs=0.05, swa_epoch_start=2)
    seen = ParametersAtEpochStart()
    trainer = quiet_trainer(strategy=strategy, max_epochs=epochs, callbacks=[averaging, seen], **kwargs)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(module, loader(make_dataset(num_samples=SAMPLES), BATCH))
    return trainer, seen


def state(module: nn.Module) -> dict[str, torch.Tensor]:
    return {name: tensor.detach().clone() for name, tensor in module.state_dict().items()}


@pytest.mark.parametrize(
    "strategy, accumulate",
    [
        (lambda: SinkStrategy(), 1),
        (lambda: SinkStrategy(sink_size=SAMPLES // BATCH), 1),  # a sink is a data pass: the same epochs as stock
        (lambda: SinkStrategy(sink_size=SAMPLES // BATCH), 2),
    ],
)
def test_weight_averaging_trains_as_stock(strategy, accumulate):
    """The callback clears Lightning's backward switch at every epoch's end; a sink's closure must still skip
    the backward (the sink ran it per micro-step): the second sink stopped with "element 0 of tensors does not
    require grad" before."""
    stock_module = TinyClassifier()
    sink_module = copy.deepcopy(stock_module)
    stock, _ = fit(stock_module, "auto", accumulate_grad_batches=accumulate)
    sink, _ = fit(sink_module, strategy(), accumulate_grad_batches=accumulate)
    assert sink.global_step == stock.global_step == 4 * SAMPLES // BATCH // accumulate
    for name, tensor in state(stock_module).items():
        assert torch.equal(state(sink_module)[name], tensor), name
    assert sink_module.seen_lrs == stock_module.seen_lrs  # the callback's SWALR swapped in at the same epoch


def test_weight_averaging_with_batch_norm_recomputes_the_statistics_as_stock():
    stock_module = BatchNormClassifier()
    sink_module = copy.deepcopy(stock_module)
    stock, _ = fit(stock_module, "auto")
    sink, _ = fit(sink_module, SinkStrategy())
    assert sink.current_epoch == stock.current_epoch
    for name, tensor in state(stock_module).items():
        assert torch.equal(state(sink_module)[name], tensor), name


def test_the_batch_norm_epoch_makes_no_update_with_accumulation():
    """The documented difference: stock Lightning's forward-only epoch ends with an optimizer step on the ``.grad``
    the last window of the epoch before left behind; the sink strategy's windows sum into their own buffers, and
    a window with no backward makes no update, so the averaged parameters stay as the callback put them."""
    stock_module = BatchNormClassifier()
    sink_module = copy.deepcopy(stock_module)
    _, stock_seen = fit(stock_module, "auto", accumulate_grad_batches=2)
    _, sink_seen = fit(sink_module, SinkStrategy(), accumulate_grad_batches=2)
    averaged = stock_seen.weights[-1]  # the batch-norm epoch's start: the average moved into the module
    assert torch.equal(sink_seen.weights[-1], averaged)
    assert torch.equal(sink_module.net[0].weight.detach(), averaged)
    assert not torch.equal(stock_module.net[0].weight.detach(), averaged)  # stock's step on the stale gradient
    for name in ("running_mean", "running_var", "num_batches_tracked"):  # the statistics: the same forward pass
        assert torch.equal(getattr(sink_module.net[1], name), getattr(stock_module.net[1], name)), name


def test_weight_averaging_with_batch_norm_in_sink_mode_is_refused_before_training():
    module = BatchNormClassifier()
    before = state(module)
    with pytest.raises(
        ValueError, match=r"StochasticWeightAveraging .* SinkStrategy\(sink_size=8\) .*swa_utils\.update_bn"
    ):
        fit(module, SinkStrategy(sink_size=8))
    for name, tensor in before.items():
        assert torch.equal(state(module)[name], tensor), name
