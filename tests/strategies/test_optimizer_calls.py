"""How the optimizer and ``Strategy.backward`` are called, side by side with stock Lightning.

An optimizer subclass that records its own ``step`` and ``zero_grad`` sees stock Lightning's order: the step is
entered first and runs the closure (the window's last ``training_step`` and backward) from inside. A wrapper around
Lightning's ``Strategy.backward`` (a mock counting backward calls) sees every backward, as with stock Lightning.
"""

from __future__ import annotations

import copy
import warnings
from typing import Any
from unittest import mock

import pytest
import torch
from lightning.pytorch.strategies import Strategy

from lightning_sink import SinkStrategy
from tests.helpers import TinyClassifier, flat_params, loader, make_dataset, quiet_trainer, relative_error

MICRO = 4


def fit(module: Any, strategy: Any, samples: int, **kwargs: Any) -> Any:
    trainer = quiet_trainer(strategy=strategy, max_epochs=1, **kwargs)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(module, loader(make_dataset(num_samples=samples), MICRO))
    return trainer


class RecordingSGD(torch.optim.SGD):
    def __init__(self, params: Any, calls: list[str], **kwargs: Any) -> None:
        super().__init__(params, **kwargs)
        self.calls = calls

    def step(self, closure: Any = None) -> Any:
        self.calls.append("step")
        return super().step(closure)

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.calls.append("zero_grad")
        super().zero_grad(set_to_none)


class Recording(TinyClassifier):
    def __init__(self) -> None:
        super().__init__()
        self.calls: list[str] = []

    def configure_optimizers(self) -> Any:
        return RecordingSGD(self.parameters(), self.calls, lr=self.lr, momentum=0.9)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        self.calls.append("training_step")
        return super().training_step(batch, batch_idx)

    def backward(self, *args: Any, **kwargs: Any) -> None:
        self.calls.append("backward")
        super().backward(*args, **kwargs)

    def on_before_optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        self.calls.append("on_before_optimizer_step")


@pytest.mark.parametrize(
    "sink", [lambda: SinkStrategy(), lambda: SinkStrategy(accumulation_steps=3)], ids=["from_trainer", "explicit"]
)
def test_the_optimizer_sees_stocks_order_of_step_closure_and_zero_grad(sink):
    stock = Recording()
    ours = copy.deepcopy(stock)
    fit(stock, "auto", samples=6 * MICRO, accumulate_grad_batches=3)
    fit(ours, sink(), samples=6 * MICRO, accumulate_grad_batches=3)

    window = ["training_step", "zero_grad", "backward", "training_step", "backward"]
    last = ["step", "training_step", "backward", "on_before_optimizer_step"]
    assert stock.calls == (window + last) * 2
    assert ours.calls == stock.calls
    assert relative_error(flat_params(ours), flat_params(stock)) < 1e-6


class ManualTwoBackwards(TinyClassifier):
    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False

    def training_step(self, batch: Any, batch_idx: int) -> None:
        optimizer = self.optimizers()
        loss = super().training_step(batch, batch_idx)
        self.manual_backward(loss, retain_graph=True)
        self.manual_backward(loss)
        optimizer.step()
        optimizer.zero_grad()


def backward_calls(module: Any, strategy: Any, **kwargs: Any) -> int:
    """Lightning's own tests count backward calls so (e.g. its stochastic weight averaging test)."""
    trainer = quiet_trainer(strategy=strategy, max_epochs=1, **kwargs)
    with (
        mock.patch.object(Strategy, "backward", wraps=trainer.strategy.backward),
        warnings.catch_warnings(),
    ):
        warnings.simplefilter("ignore")
        trainer.fit(module, loader(make_dataset(num_samples=4 * MICRO), MICRO))
        return trainer.strategy.backward.call_count


@pytest.mark.parametrize(
    ("module", "kwargs", "sink_kwargs"),
    [
        (ManualTwoBackwards, {}, {}),
        (TinyClassifier, {"accumulate_grad_batches": 2}, {}),
        (TinyClassifier, {}, {}),
        (
            TinyClassifier,
            {"accumulate_grad_batches": 2},
            {"accumulation_steps": 2, "sink_size": 4},
        ),  # one sink: the epoch
    ],
    ids=["manual", "automatic_windows", "automatic_one_micro_step", "sink"],
)
def test_a_wrapper_around_strategy_backward_counts_every_backward_as_stock(module, kwargs, sink_kwargs):
    stock = module()
    ours = copy.deepcopy(stock)
    stock_calls = backward_calls(stock, "auto", **kwargs)
    assert stock_calls == (8 if module is ManualTwoBackwards else 4)
    our_trainer_kwargs = {} if sink_kwargs else kwargs
    assert backward_calls(ours, SinkStrategy(**sink_kwargs), **our_trainer_kwargs) == stock_calls
    assert relative_error(flat_params(ours), flat_params(stock)) < 1e-6


def backward_calls_on_the_object(strategy: Any, **kwargs: Any) -> int:
    """The same count, with the wrapper on this strategy object rather than on the class."""
    trainer = quiet_trainer(strategy=strategy, max_epochs=1, **kwargs)
    with mock.patch.object(trainer.strategy, "backward", wraps=trainer.strategy.backward), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(TinyClassifier(), loader(make_dataset(num_samples=4 * MICRO), MICRO))
        return trainer.strategy.backward.call_count


def test_a_wrapper_on_the_strategy_object_counts_every_backward_as_stock():
    stock_calls = backward_calls_on_the_object("auto", accumulate_grad_batches=2)
    assert stock_calls == 4
    assert backward_calls_on_the_object(SinkStrategy(), accumulate_grad_batches=2) == stock_calls
    assert backward_calls_on_the_object(SinkStrategy(accumulation_steps=2, sink_size=4)) == stock_calls


def test_the_direct_backward_is_this_fits_only():
    """Without backward hooks the strategy skips Lightning's dispatch for the fit, then is its plain self again."""
    strategy = SinkStrategy()
    trainer = fit(TinyClassifier(), strategy, samples=4 * MICRO, accumulate_grad_batches=2)
    assert "backward" not in vars(trainer.strategy)
    assert trainer.strategy.backward.__func__ is Strategy.backward
