"""A realistic LightningModule under ``SinkStrategy(sink_size=K, graph_mode="compile")``: a small CNN with BatchNorm
and two dropouts, AdamW with OneCycleLR sized from ``estimated_stepping_batches``, a torchmetrics ``Accuracy``
updated in ``training_step`` and logged on step and epoch, a validation loop with its own metric and a sanity check.
Held to the same fit with ``graph_mode="eager"``: parameters, BatchNorm statistics, every logged point.

The whole-step programs are built with ``aot_eager`` here (the same graphs run by eager kernels: fast to build);
the random numbers of Inductor-built code are checked on the forward-compiled step, where Inductor's defaults
differ from eager (its own random kernels)."""

from __future__ import annotations

import warnings
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from lightning.pytorch.callbacks import Callback
from torch import nn
from torch.utils.data import DataLoader, TensorDataset
from torchmetrics import MetricCollection
from torchmetrics.classification import MulticlassAccuracy, MulticlassF1Score
from torchmetrics.functional import accuracy

import lightning_sink.compiled.forward_compile as forward_compile
import lightning_sink.sink.programs.compiled_choice as compiled_choice
from lightning_sink import SinkStrategy
from lightning_sink._torch_compat import compiled_graph_count
from tests.helpers import RecordingLogger, quiet_trainer


@pytest.fixture(autouse=True)
def quick_backends(monkeypatch):
    monkeypatch.setattr(compiled_choice, "COMPILE_BACKEND", "aot_eager")
    monkeypatch.setattr(forward_compile, "FORWARD_BACKEND", "aot_eager")
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


class RealisticCNN(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(
            nn.Conv2d(1, 4, 3, bias=False),  # (a bias before BatchNorm has no gradient: AdamW would amplify noise)
            nn.BatchNorm2d(4),
            nn.ReLU(),
            nn.Dropout(0.2),
            nn.Flatten(),
            nn.Linear(4 * 6 * 6, 16),
            nn.ReLU(),
            nn.Dropout(0.2),
            nn.Linear(16, 4),
        )
        self.train_acc = MulticlassAccuracy(num_classes=4)
        self.val_acc = MulticlassAccuracy(num_classes=4)

    def training_step(self, batch: Any, batch_idx: Any) -> torch.Tensor:
        x, y = batch
        logits = self.net(x)
        loss = F.cross_entropy(logits, y)
        self.train_acc(logits, y)
        self.log("train_acc", self.train_acc, on_step=True, on_epoch=True)
        self.log("loss", loss, prog_bar=True)
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        self.val_acc(self.net(x), y)
        self.log("val_acc", self.val_acc)

    def configure_optimizers(self) -> Any:
        optimizer = torch.optim.AdamW(self.parameters(), lr=1e-3)
        total = self.trainer.estimated_stepping_batches
        scheduler = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=1e-2, total_steps=total)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


class ComputesInStep(RealisticCNN):
    """Also reads the metric's running value in the step: what the programs cannot hold."""

    def training_step(self, batch: Any, batch_idx: Any) -> torch.Tensor:
        loss = super().training_step(batch, batch_idx)
        self.log("acc_so_far", self.train_acc.compute())
        return loss


class LogsACollection(RealisticCNN):
    """A MetricCollection logged with ``log_dict``, one of its members logged on its own, and a torchmetrics
    functional metric computed in the step (its lazy package checks must not reach a trace)."""

    def __init__(self) -> None:
        super().__init__()
        kinds = {"acc": MulticlassAccuracy(num_classes=4), "f1": MulticlassF1Score(num_classes=4)}
        self.train_metrics = MetricCollection(kinds, prefix="train_")

    def training_step(self, batch: Any, batch_idx: Any) -> torch.Tensor:
        x, y = batch
        logits = self.net(x)
        loss = F.cross_entropy(logits, y)
        self.train_metrics(logits, y)
        self.log_dict(self.train_metrics, on_step=True, on_epoch=True)
        self.log("f1_alone", self.train_metrics["f1"], on_epoch=True, on_step=False)
        self.log("batch_acc", accuracy(logits, y, task="multiclass", num_classes=4), prog_bar=True)
        self.log("loss", loss)
        return loss


class GraphCounts(Callback):
    def __init__(self) -> None:
        self.counts: list[int] = []

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        self.counts.append(compiled_graph_count())


def loaders() -> tuple[DataLoader, DataLoader]:
    generator = torch.Generator().manual_seed(1)
    x, y = torch.randn(48, 1, 8, 8, generator=generator), torch.randint(0, 4, (48,), generator=generator)
    train = DataLoader(TensorDataset(x, y), batch_size=4)  # 12 micro-batches per pass
    return train, DataLoader(TensorDataset(x[:8], y[:8]), batch_size=4)


def fit(
    module_class: type[RealisticCNN], graph_mode: str, **options: Any
) -> tuple[RealisticCNN, RecordingLogger, list, GraphCounts]:
    logger, counts = RecordingLogger(), GraphCounts()
    trainer = quiet_trainer(
        strategy=SinkStrategy(sink_size=4, graph_mode=graph_mode, **options),
        max_epochs=6,  # 24 micro-batches, two data passes, validation after every sink
        logger=logger,
        log_every_n_steps=1,
        num_sanity_val_steps=2,
        callbacks=[counts],
    )
    module = module_class()
    torch.manual_seed(3)  # the dropouts' numbers: the same generator state for both fits
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(module, *loaders())
    said = [str(w.message) for w in caught if "whole-step programs" in str(w.message)]
    return module, logger, said, counts


def assert_same_fit(compiled: tuple, eager: tuple) -> None:
    for (name, value), expected in zip(compiled[0].state_dict().items(), eager[0].state_dict().values()):
        assert torch.allclose(value.double(), expected.double(), rtol=1e-5, atol=1e-6), name
    points, eager_points = compiled[1].values(), eager[1].values()
    assert [(step, name) for step, name, _ in points] == [(step, name) for step, name, _ in eager_points]
    assert [value for *_, value in points] == pytest.approx([value for *_, value in eager_points], rel=1e-5)


@pytest.mark.slow
def test_the_realistic_module_compiles_and_trains_as_the_eager_sink_run():
    eager = fit(RealisticCNN, "eager")
    compiled = fit(RealisticCNN, "compile")
    assert compiled[2] == []  # no fallback: the Metric, dropout and BatchNorm are in the programs
    counts = compiled[3].counts
    assert counts == [counts[0]] * len(counts)  # nothing compiled after the first sink
    assert_same_fit(compiled, eager)
    names = {name for _, name, _ in compiled[1].values()}
    assert {"train_acc_step", "train_acc_epoch", "val_acc", "loss"} <= names


@pytest.mark.slow
def test_the_realistic_module_built_by_inductor_runs_its_dropouts_in_the_loop_as_one_call_per_micro_batch(
    monkeypatch, caplog
):
    """Inductor's programs (random numbers eager's, in eager's order): the default runs each sink as one loop over
    its windows, two dropouts, BatchNorm, the Metric and OneCycleLR inside: the fit of one call per micro-batch
    within float32 rounding (parameters, BatchNorm statistics, every logged point), and within 1e-5 of the eager
    sink run."""
    monkeypatch.setattr(compiled_choice, "COMPILE_BACKEND", "inductor")
    with caplog.at_level("INFO"):
        default = fit(RealisticCNN, "compile")
    said = [record.getMessage() for record in caplog.records if "compiled whole" in record.getMessage()]
    assert len(said) == 1 and "4 micro-steps per call, one loop over its windows" in said[0], said
    one = fit(RealisticCNN, "compile", micro_steps_per_call=1)
    assert default[2] == one[2] == []
    for (name, value), expected in zip(default[0].state_dict().items(), one[0].state_dict().values()):
        # (the loop's body is built apart from the one-micro-step programs: Inductor may fuse a reduction in another
        # order, a rounding's difference; a mask drawn differently would move the fit by orders of magnitude more)
        assert torch.allclose(value.double(), expected.double(), rtol=1e-6, atol=1e-7), name
    points, one_points = default[1].values(), one[1].values()
    assert [(step, name) for step, name, _ in points] == [(step, name) for step, name, _ in one_points]
    assert [value for *_, value in points] == pytest.approx([value for *_, value in one_points], rel=1e-6)
    counts = default[3].counts
    assert counts == [counts[0]] * len(counts)  # nothing compiled after the first sink
    assert_same_fit(default, fit(RealisticCNN, "eager"))


@pytest.mark.slow
def test_a_metric_pattern_the_programs_cannot_hold_falls_back_once_naming_it():
    eager = fit(ComputesInStep, "eager")
    compiled = fit(ComputesInStep, "compile")
    assert len(compiled[2]) == 1, compiled[2]
    assert "training_step calls torchmetrics Metric `self.train_acc.compute()`" in compiled[2][0]
    counts = compiled[3].counts  # the forward-compiled step runs the Metric eagerly: no recompile storm
    assert counts == [counts[0]] * len(counts)
    assert_same_fit(compiled, eager)


@pytest.mark.slow
def test_a_metric_collection_and_a_functional_metric_compile_and_log_as_the_eager_sink_run():
    eager = fit(LogsACollection, "eager")
    compiled = fit(LogsACollection, "compile")
    assert compiled[2] == []  # whole-step programs: no fallback
    counts = compiled[3].counts
    assert counts == [counts[0]] * len(counts)
    assert_same_fit(compiled, eager)
    names = {name for _, name, _ in compiled[1].values()}
    assert {"train_acc_step", "train_f1_epoch", "f1_alone", "batch_acc"} <= names


class DropoutMLP(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Dropout(0.2), nn.Linear(32, 4))

    def training_step(self, batch: Any, batch_idx: Any) -> torch.Tensor:
        x, y = batch
        loss = F.cross_entropy(self.net(x), y)
        self.log("loss", loss)
        return loss

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.0)  # the losses differ only by the dropout masks


def losses_by_graph_mode(module_class: type[DropoutMLP], epochs: int, **strategy_options: Any) -> dict[str, list]:
    """The logged loss of every micro-step of the same fit with eager and compiled steps, the same seeds."""
    generator = torch.Generator().manual_seed(1)
    data = TensorDataset(torch.randn(24, 8, generator=generator), torch.randint(0, 4, (24,), generator=generator))
    losses = {}
    for graph_mode in ("eager", "compile"):
        logger = RecordingLogger()
        strategy = SinkStrategy(graph_mode=graph_mode, **strategy_options)
        trainer = quiet_trainer(strategy=strategy, max_epochs=epochs, logger=logger, log_every_n_steps=1)
        torch.manual_seed(3)
        trainer.fit(module_class(), DataLoader(data, batch_size=4))
        losses[graph_mode] = [value for _, name, value in logger.values() if name == "loss"]
    return losses


@pytest.mark.slow
def test_inductor_compiled_steps_draw_eagers_dropout_masks(monkeypatch):
    monkeypatch.setattr(forward_compile, "FORWARD_BACKEND", "inductor")
    losses = losses_by_graph_mode(DropoutMLP, 1)  # no sinks: the forward-compiled training_step
    assert len(losses["eager"]) == 6
    assert losses["compile"] == pytest.approx(losses["eager"], rel=1e-6, abs=1e-6)


class TwoDropoutMLP(DropoutMLP):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(
            nn.Linear(8, 32), nn.ReLU(), nn.Dropout(0.2), nn.Linear(32, 32), nn.Dropout(0.2), nn.Linear(32, 4)
        )


@pytest.mark.slow
@pytest.mark.parametrize(
    "module_class, calls",
    [
        (DropoutMLP, "6 micro-steps per call, one loop over its windows"),
        (TwoDropoutMLP, "6 micro-steps per call, one loop over its windows"),
    ],
)
def test_inductor_sinks_draw_eagers_dropout_masks_in_a_loop(monkeypatch, caplog, module_class, calls):
    """Sinks of 6 with the default call length, Inductor's whole-step programs against eager sinks: one dropout a
    window and two (which Inductor keeps in eager's order with an operation the loop holds by
    ``let_loops_order_random_draws``) run in the loop over windows and draw eager's masks (lr 0: the losses differ
    only by the masks)."""
    monkeypatch.setattr(compiled_choice, "COMPILE_BACKEND", "inductor")
    with caplog.at_level("INFO"):
        losses = losses_by_graph_mode(module_class, 2, sink_size=6)
    said = [record.getMessage() for record in caplog.records if "compiled whole" in record.getMessage()]
    assert len(said) == 1 and calls in said[0], said
    assert len(losses["eager"]) == 12
    assert losses["compile"] == pytest.approx(losses["eager"], rel=1e-6, abs=1e-6)
