"""Sink mode draws the same random numbers as the run without sinking: with shuffled data, ``sink_size`` on or off
gives the same batches in the same order, the same losses (with dropout drawing from torch's global generator) and
the same parameters, bit for bit, over three data passes.

The reference is the same fit without ``sink_size`` (``SinkStrategy(accumulation_steps=2)``, itself bit-identical
to stock Lightning's ``accumulate_grad_batches=2``), where each Lightning epoch is one data pass. In sink mode a
Lightning epoch is one sink, so the sink runs train the same 18 micro-batches (3 passes of 6) with ``max_steps``.
"""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import (
    DataLoader,
    DistributedSampler,
    SubsetRandomSampler,
    TensorDataset,
    WeightedRandomSampler,
)

from lightning_sink import SinkStrategy
from tests.helpers import quiet_trainer

SAMPLES, BATCH, STEPS = 24, 4, 2  # 6 batches per pass, windows of 2 micro-batches
PASSES = 3
UPDATES = SAMPLES // BATCH * PASSES // STEPS


def dataset() -> TensorDataset:
    generator = torch.Generator().manual_seed(0)
    ids = torch.arange(SAMPLES)
    return TensorDataset(
        ids, torch.randn(SAMPLES, 8, generator=generator), torch.randint(0, 4, (SAMPLES,), generator=generator)
    )


def make_loader(kind: str) -> DataLoader:
    data = dataset()
    generator = torch.Generator().manual_seed(7)
    weights = torch.rand(SAMPLES, generator=torch.Generator().manual_seed(1))
    if kind == "random_generator":
        return DataLoader(data, batch_size=BATCH, shuffle=True, generator=generator)
    if kind == "random_global":  # the permutation's seed and the base seed from torch's global generator
        return DataLoader(data, batch_size=BATCH, shuffle=True)
    if kind == "weighted":
        return DataLoader(data, batch_size=BATCH, sampler=WeightedRandomSampler(weights, SAMPLES, generator=generator))
    if kind == "weighted_global":
        return DataLoader(data, batch_size=BATCH, sampler=WeightedRandomSampler(weights, SAMPLES))
    if kind == "subset":
        sampler = SubsetRandomSampler(list(range(SAMPLES)), generator=generator)
        return DataLoader(data, batch_size=BATCH, sampler=sampler)
    if kind == "distributed":
        sampler = DistributedSampler(data, num_replicas=1, rank=0, shuffle=True, seed=3)
        return DataLoader(data, batch_size=BATCH, sampler=sampler)
    if kind == "workers":  # the workers' base seed drawn from torch's global generator, as stock draws it
        return DataLoader(data, batch_size=BATCH, shuffle=True, num_workers=2)
    if kind == "workers_generator":
        return DataLoader(data, batch_size=BATCH, shuffle=True, num_workers=2, generator=generator)
    raise ValueError(kind)


class DropoutRecorder(pl.LightningModule):
    """Dropout draws from torch's global generator in every step; records each micro-batch's ids and loss."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Dropout(0.3), nn.Linear(16, 4))
        self.seen: list[list[int]] = []
        self.losses: list[torch.Tensor] = []

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        ids, x, y = batch
        loss = F.cross_entropy(self.net(x), y)
        self.seen.append(ids.tolist())
        self.losses.append(loss.detach().clone())
        return loss

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def fit(kind: str, sink_size: int | None, prefetch_depth: int | None = None) -> dict[str, Any]:
    loader = make_loader(kind)
    torch.manual_seed(1234)  # what the global generator holds at fit start, the same for every run
    module = DropoutRecorder()
    strategy = SinkStrategy(accumulation_steps=STEPS, sink_size=sink_size, prefetch_depth=prefetch_depth)
    if sink_size is None:
        trainer = quiet_trainer(strategy=strategy, max_epochs=PASSES)
    else:
        trainer = quiet_trainer(strategy=strategy, max_epochs=-1, max_steps=UPDATES)
    trainer.fit(module, loader)
    return {
        "global_step": trainer.global_step,
        "seen": module.seen,
        "losses": torch.stack(module.losses),
        "params": torch.cat([p.detach().reshape(-1) for p in module.parameters()]),
        "global_generator_after": torch.get_rng_state(),
    }


_REFERENCES: dict[str, dict[str, Any]] = {}


def reference(kind: str) -> dict[str, Any]:
    if kind not in _REFERENCES:
        _REFERENCES[kind] = fit(kind, sink_size=None)
    return _REFERENCES[kind]


def assert_same_run(actual: dict[str, Any], expected: dict[str, Any]) -> None:
    assert actual["global_step"] == expected["global_step"] == UPDATES
    assert len(expected["seen"]) == SAMPLES // BATCH * PASSES
    assert actual["seen"] == expected["seen"]
    assert torch.equal(actual["losses"], expected["losses"])
    assert torch.equal(actual["params"], expected["params"])
    # the same number of draws from the global generator (dropout, unseeded samplers, base seeds) as without sinks
    assert torch.equal(actual["global_generator_after"], expected["global_generator_after"])


KINDS = ["random_generator", "random_global", "weighted", "weighted_global", "subset", "distributed"]
# 3 divides the pass of 6, 4 does not (the last sink stops at max_steps), 9 is longer than a pass
SINK_SIZES = [3, 4, 9]


@pytest.mark.parametrize("sink_size", SINK_SIZES)
@pytest.mark.parametrize("kind", KINDS)
def test_sink_mode_trains_the_same_shuffled_batches_as_without_sinks(kind, sink_size):
    expected = reference(kind)
    assert expected["seen"][:6] != expected["seen"][6:12], "the passes must be shuffled differently"
    assert_same_run(fit(kind, sink_size), expected)


@pytest.mark.slow
@pytest.mark.parametrize("sink_size", SINK_SIZES)
@pytest.mark.parametrize("kind", ["workers", "workers_generator"])
def test_loader_workers_get_the_same_base_seed_and_batches_as_without_sinks(kind, sink_size):
    assert_same_run(fit(kind, sink_size), reference(kind))


@pytest.mark.parametrize("kind", ["random_generator", "random_global"])
def test_a_reading_thread_draws_the_pass_start_while_the_training_thread_waits(kind):
    """With ``prefetch_depth=2`` a thread reads the batches; each pass starts (base seed, unseeded permutation) only
    when training asks for it, so its draws from the global generator come between the same dropout draws."""
    assert_same_run(fit(kind, sink_size=4, prefetch_depth=2), reference(kind))


def test_the_reference_is_stock_lightnings_run():
    """The run without sinks that the tests above compare against is stock Lightning's, batch for batch."""
    loader = make_loader("random_generator")
    torch.manual_seed(1234)
    module = DropoutRecorder()
    quiet_trainer(max_epochs=PASSES, accumulate_grad_batches=STEPS).fit(module, loader)
    expected = reference("random_generator")
    assert module.seen == expected["seen"]
    assert torch.equal(torch.stack(module.losses), expected["losses"])
