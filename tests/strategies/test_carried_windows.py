"""``partial_window="carry"``: windows run across epochs, so a fit makes ``epochs * batches // N`` updates, and
``trainer.estimated_stepping_batches`` says so (Lightning counts each epoch's last partial window as an update)."""

from __future__ import annotations

import warnings
from typing import Any

import pytest
import torch

from lightning_sink import SinkStrategy
from tests.helpers import TinyClassifier, loader, make_dataset, quiet_trainer


class SizedSchedule(TinyClassifier):
    """OneCycleLR sized from ``estimated_stepping_batches``, as recipes size it."""

    def configure_optimizers(self) -> Any:
        optimizer = torch.optim.SGD(self.parameters(), lr=0.1)
        self.total_steps = int(self.trainer.estimated_stepping_batches)
        scheduler = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=0.1, total_steps=self.total_steps)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


@pytest.mark.parametrize("max_steps", [-1, 5])
def test_carried_windows_estimate_the_updates_the_fit_makes(max_steps):
    module = SizedSchedule()
    trainer = quiet_trainer(
        strategy=SinkStrategy(partial_window="carry"), max_epochs=2, max_steps=max_steps, accumulate_grad_batches=2
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(module, loader(make_dataset(num_samples=36), 4))  # 9 micro-batches an epoch
    assert module.total_steps == trainer.global_step == (9 if max_steps == -1 else 5)  # Lightning's own count: 10
    schedule = trainer.lr_scheduler_configs[0].scheduler
    assert schedule.last_epoch == module.total_steps  # the schedule ran to its end, no further
