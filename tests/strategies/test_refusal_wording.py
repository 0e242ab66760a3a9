"""Refusals that name what the user did: a sink strategy from the other Lightning namespace, and an optimizer that
needs a closure, refused in the terms of the setting that prevents it (no talk of windows when the window is 1)."""

from __future__ import annotations

import re
import warnings

import lightning.pytorch as pl
import pytest
import torch

from lightning_sink import DynamicLossScale, LossScalePrecision, SinkStrategy
from tests.helpers import TinyClassifier, loader, make_dataset, quiet_trainer

pytorch_lightning = pytest.importorskip("pytorch_lightning")


def test_a_lightning_sink_strategy_given_to_pytorch_lightning_names_the_right_import():
    with pytest.raises(ValueError) as refused:
        pytorch_lightning.Trainer(strategy=SinkStrategy(), logger=False, enable_progress_bar=False)
    message = str(refused.value)
    assert "from lightning_sink.pytorch_lightning import SinkStrategy" in message
    assert "this Trainer is pytorch_lightning's" in message and "\n" not in message


def test_a_pytorch_lightning_strategy_given_to_lightning_names_the_right_import():
    from lightning_sink.pytorch_lightning import SinkDDPStrategy

    with pytest.raises(ValueError, match=r"use `from lightning_sink import SinkDDPStrategy`"):
        pl.Trainer(strategy=SinkDDPStrategy(), logger=False, enable_progress_bar=False)


def test_the_right_namespace_and_other_strategies_are_untouched():
    from lightning_sink.pytorch_lightning import SinkStrategy as PLSinkStrategy

    assert isinstance(pytorch_lightning.Trainer(strategy=PLSinkStrategy(), logger=False).strategy, PLSinkStrategy)
    assert isinstance(pl.Trainer(strategy=SinkStrategy(), logger=False).strategy, SinkStrategy)
    with pytest.raises(ValueError, match=r"invalid strategy name"):  # Lightning's own refusal for anything else
        pytorch_lightning.Trainer(strategy=object(), logger=False)


class WithLBFGS(TinyClassifier):
    def configure_optimizers(self):
        return torch.optim.LBFGS(self.parameters(), lr=0.1, max_iter=3)


@pytest.mark.parametrize(
    "strategy, plugins, reason",
    [
        (lambda: SinkStrategy(sink_size=4), [], r"runs the micro-batches inside a sink \(sink_size=4\)"),
        (
            lambda: SinkStrategy(),
            [LossScalePrecision("32-true", DynamicLossScale())],
            r"checks them for overflow before each step \(a loss scale\)",
        ),
    ],
)
def test_a_closure_optimizer_with_a_window_of_one_is_refused_without_talk_of_windows(strategy, plugins, reason):
    trainer = quiet_trainer(strategy=strategy(), plugins=plugins, max_epochs=1)
    with pytest.raises(ValueError) as refused, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(WithLBFGS(), loader(make_dataset(num_samples=16), 4))
    message = str(refused.value)
    assert re.search(reason, message), message
    assert "window" not in message, message


def test_a_closure_optimizer_with_windows_is_refused_in_windows():
    trainer = quiet_trainer(strategy=SinkStrategy(accumulation_steps=2), max_epochs=1)
    with pytest.raises(ValueError, match=r"steps once per window of 2 micro-batches"), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(WithLBFGS(), loader(make_dataset(num_samples=16), 4))
