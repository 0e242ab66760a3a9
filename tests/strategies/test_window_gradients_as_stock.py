"""What the optimizer sees at a window's update, side by side with stock Lightning's accumulation
(``accumulate_grad_batches``): a parameter no backward of the window reached has no gradient, a gradient a hook
assigns by hand counts, a float64 model sums in float64."""

from __future__ import annotations

import copy
import warnings
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from lightning_sink import SinkStrategy
from tests.helpers import loader, make_dataset, quiet_trainer

SAMPLES, BATCH = 64, 8  # 8 micro-batches a pass


class Branches(pl.LightningModule):
    """A trunk, a branch used only by even micro-batches (``batch_idx``), and one never used; AdamW with weight
    decay, which moves a parameter with a zero gradient but leaves one with no gradient alone."""

    def __init__(self, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.trunk = nn.Linear(8, 4).to(dtype)
        self.sometimes = nn.Linear(8, 4).to(dtype)
        self.never = nn.Linear(8, 4).to(dtype)
        self.grads_at_step: list[dict[str, bool]] = []

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        x = x.to(self.trunk.weight.dtype)
        logits = self.trunk(x) + (self.sometimes(x) if batch_idx % 4 == 0 else 0)
        return F.cross_entropy(logits, y)

    def on_before_optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        self.grads_at_step.append({name: p.grad is not None for name, p in self.named_parameters()})

    def configure_optimizers(self) -> Any:
        return torch.optim.AdamW(self.parameters(), lr=0.05, weight_decay=0.1)


class HalvesGradients(Branches):
    """``on_after_backward`` replaces each gradient by half of it (a new tensor, not in place)."""

    def on_after_backward(self) -> None:
        for param in self.parameters():
            if param.grad is not None:
                param.grad = param.grad * 0.5


def fit(module: pl.LightningModule, strategy: Any, **kwargs: Any) -> pl.Trainer:
    trainer = quiet_trainer(strategy=strategy, max_epochs=2, accumulate_grad_batches=2, **kwargs)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(module, loader(make_dataset(num_samples=SAMPLES), BATCH))
    return trainer


def assert_same(stock: pl.LightningModule, sink: pl.LightningModule) -> None:
    for (name, expected), (_, actual) in zip(stock.state_dict().items(), sink.state_dict().items()):
        assert torch.equal(actual, expected), name
    stock_state = stock.trainer.optimizers[0].state_dict()["state"]
    sink_state = sink.trainer.optimizers[0].state_dict()["state"]
    assert sorted(sink_state) == sorted(stock_state)  # no optimizer state for a parameter that never had a gradient
    for index, expected in stock_state.items():
        for key, value in expected.items():
            assert torch.equal(sink_state[index][key], value), (index, key)


@pytest.mark.parametrize(
    "module_class, strategy",
    [
        (Branches, lambda: SinkStrategy()),
        (Branches, lambda: SinkStrategy(sink_size=SAMPLES // BATCH)),  # a sink is a pass: the same windows
        (HalvesGradients, lambda: SinkStrategy()),
    ],
)
def test_the_update_sees_the_gradients_stock_lightning_gives_it(module_class, strategy):
    """Before, the store gave every parameter a zero gradient (the unused branch decayed and gained Adam state, the
    sometimes-used one kept moving on its momentum), and a gradient ``on_after_backward`` replaced at a window's last
    micro-batch was lost."""
    stock_module = module_class()
    sink_module = copy.deepcopy(stock_module)
    fit(stock_module, "auto")
    fit(sink_module, strategy())
    assert sink_module.grads_at_step == stock_module.grads_at_step
    assert {
        name: had for name, had in stock_module.grads_at_step[1].items() if name in ("never.weight", "sometimes.weight")
    } == {
        "never.weight": False,
        "sometimes.weight": False,
    }  # (the test's premise: the second window reaches neither branch)
    assert_same(stock_module, sink_module)


def test_a_float64_model_sums_its_window_in_float64():
    stock_module = Branches(dtype=torch.float64)
    sink_module = copy.deepcopy(stock_module)
    fit(stock_module, "auto")
    fit(sink_module, SinkStrategy())
    assert_same(stock_module, sink_module)


def test_the_store_takes_its_hooks_off_the_parameters_when_the_fit_ends():
    module = Branches()
    fit(module, SinkStrategy())
    for param in module.parameters():
        assert not param._post_accumulate_grad_hooks, "a hook of the fit's store is still on a parameter"


class SparseEmbedding(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embedding = nn.Embedding(10, 4, sparse=True)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, _ = batch
        rows = (x[:, 0].abs() * 3).long().clamp(max=9)
        return self.embedding(rows).pow(2).mean()

    def configure_optimizers(self) -> Any:
        return torch.optim.SparseAdam(self.parameters(), lr=0.1)


def test_sparse_gradients_train_as_stock_without_a_window_sum_and_are_refused_with_one():
    stock_module = SparseEmbedding()
    sink_module = copy.deepcopy(stock_module)
    trainer = quiet_trainer(strategy="auto", max_epochs=1)
    trainer.fit(stock_module, loader(make_dataset(num_samples=SAMPLES), BATCH))
    trainer = quiet_trainer(strategy=SinkStrategy(), max_epochs=1)
    trainer.fit(sink_module, loader(make_dataset(num_samples=SAMPLES), BATCH))
    assert torch.equal(sink_module.embedding.weight, stock_module.embedding.weight)
    # with a window sum SparseAdam stopped the fit with "SparseAdam does not support dense gradients" before
    with pytest.raises(ValueError, match=r"embedding \(Embedding\(sparse=True\)\) .* \(accumulation_steps=2\)"):
        fit(SparseEmbedding(), SinkStrategy())


def test_the_store_and_the_sparse_check_read_one_rule_of_when_windows_are_summed(monkeypatch):
    """Whether a window's gradients are summed is decided in one place (``UpdateMakeup.sums_windows``): changed
    there, both the store the fit builds and the refusal of sparse gradients follow."""
    from lightning_sink.accumulation import GradientAccumulator, SingleStepGradients
    from lightning_sink.strategies.fit_checks import UpdateMakeup

    def store_of(module: pl.LightningModule) -> type:
        trainer = quiet_trainer(strategy=SinkStrategy(), max_epochs=1, limit_train_batches=1)
        trainer.fit(module, loader(make_dataset(num_samples=SAMPLES), BATCH))
        return type(trainer.strategy.sink_fit.engine.window.store)

    assert store_of(Branches()) is SingleStepGradients
    monkeypatch.setattr(UpdateMakeup, "sums_windows", property(lambda update: True))
    assert store_of(Branches()) is GradientAccumulator
    with pytest.raises(ValueError, match=r"embedding \(Embedding\(sparse=True\)\)"):
        store_of(SparseEmbedding())


def test_a_window_of_three_in_sinks_sums_its_gradients_as_stock_lightning_rounds_them():
    """Lightning's closure divides each loss by N before its backward; the sink's direct programs summed the whole
    losses' gradients and divided once, which rounds otherwise for an N that is not a power of two (about 3e-8)."""
    from tests.helpers import TinyClassifier

    stock_module = TinyClassifier(optimizer="adamw", lr=0.01)
    sink_module = copy.deepcopy(stock_module)
    for module, strategy in ((stock_module, "auto"), (sink_module, SinkStrategy(sink_size=6))):
        trainer = quiet_trainer(strategy=strategy, max_epochs=3, accumulate_grad_batches=3)
        trainer.fit(module, loader(make_dataset(num_samples=48), 8))  # 6 micro-batches a pass: two windows
    for name, tensor in stock_module.state_dict().items():
        assert torch.equal(sink_module.state_dict()[name], tensor), name


class SavesInsideAWindow(pl.Callback):
    """A checkpoint after micro-batch 2 of the first epoch, inside the window (2, 3), which reaches the trunk only."""

    def __init__(self, path: str) -> None:
        self.path = path

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        if trainer.fit_loop.total_batch_idx == 2:
            trainer.save_checkpoint(self.path)


def test_a_resume_inside_a_window_keeps_which_parameters_it_reached(tmp_path):
    """The flags ride in the checkpoint: assumed all reached after a resume, the sometimes-used branch took a zero
    gradient at the window's update (and AdamW moved it on its momentum), unlike the uninterrupted fit."""
    path = str(tmp_path / "inside.ckpt")
    uninterrupted = Branches()
    fit(uninterrupted, SinkStrategy(), callbacks=[SavesInsideAWindow(path)])
    resumed = Branches()
    trainer = quiet_trainer(strategy=SinkStrategy(), max_epochs=2, accumulate_grad_batches=2)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(resumed, loader(make_dataset(num_samples=SAMPLES), BATCH), ckpt_path=path)
    assert resumed.grads_at_step == uninterrupted.grads_at_step[1:]  # (the resumed fit's first update is the second)
    for name, tensor in uninterrupted.state_dict().items():
        assert torch.equal(resumed.state_dict()[name], tensor), name
