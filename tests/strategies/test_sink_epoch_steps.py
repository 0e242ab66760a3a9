"""Sink mode tells Lightning the truth about steps: ``trainer.estimated_stepping_batches`` is the number of updates
the fit makes (so a scheduler sized from it runs to its end, as without sinking), and fit start says what an epoch
is."""

from __future__ import annotations

import logging

import pytest
import torch

from lightning_sink import SinkStrategy
from tests.helpers import TinyClassifier, make_dataset, quiet_trainer
from tests.strategies.test_sink_loop import SAMPLES, shuffled_loader


class OneCycle(TinyClassifier):
    """The common recipe: OneCycleLR sized by ``estimated_stepping_batches``, stepped per update."""

    def __init__(self):
        super().__init__(optimizer="sgd", lr=0.05)

    def configure_optimizers(self):
        optimizer = torch.optim.SGD(self.parameters(), lr=0.05)
        self.total_steps = self.trainer.estimated_stepping_batches
        scheduler = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=0.1, total_steps=self.total_steps)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


@pytest.mark.parametrize("sink_size, epochs", [(6, 5), (7, 4)])  # 3 updates per sink; 3.5 (windows span sinks)
def test_estimated_stepping_batches_counts_the_updates_of_the_fit_as_without_sinking(sink_size, epochs):
    runs = {}
    for name, size, max_epochs in (("stock", None, 3), ("sink", sink_size, epochs)):
        model = OneCycle()
        trainer = quiet_trainer(strategy=SinkStrategy(accumulation_steps=2, sink_size=size), max_epochs=max_epochs)
        trainer.fit(model, shuffled_loader(make_dataset(num_samples=SAMPLES)))
        runs[name] = (trainer, model)
    (stock, stock_model), (sink, sink_model) = runs["stock"], runs["sink"]
    updates = epochs * sink_size // 2  # 30 or 28 micro-batches
    assert sink_model.total_steps == sink.global_step == updates
    assert stock_model.total_steps == stock.global_step == 15
    # the schedule ran to its end: the last update used its final LR, as without sinking
    assert len(sink_model.seen_lrs) == updates
    final = sink.lr_scheduler_configs[0].scheduler
    assert sink_model.seen_lrs[-1] == pytest.approx(stock_model.seen_lrs[-1], rel=1e-12)
    assert final.last_epoch == updates


def test_fit_start_says_what_an_epoch_is(caplog):
    caplog.set_level(logging.INFO)
    trainer = quiet_trainer(strategy=SinkStrategy(accumulation_steps=2, sink_size=12), max_epochs=2)
    trainer.fit(TinyClassifier(), shuffled_loader(make_dataset(num_samples=SAMPLES)))
    lines = [record.getMessage() for record in caplog.records if record.getMessage().startswith("Sink mode:")]
    assert lines == [
        "Sink mode: epoch = sink of 12 micro-batches = 6 updates (accumulation_steps=2); a data pass is 10"
        " micro-batches; max_epochs=2 trains 24 micro-batches. sink_size=12 is larger than a data pass (10"
        " micro-batches): each sink reads on into the next pass."
    ]
