"""``SinkStrategy(sink_size=K, graph_mode="compile")``: a Lightning fit through the whole-step compiled programs,
against a plain eager PyTorch loop written here (numerics), against the same fit with ``graph_mode="eager"``
(``self.log`` values), by torch's own recompile counter, and resumed from its own checkpoints.

The programs are built with the ``aot_eager`` backend (the same graphs, eager kernels: much faster to compile than
Inductor's generated code, which ``tests/compiled/test_step_programs.py`` checks against the plain loop)."""

from __future__ import annotations

import copy
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from lightning.pytorch.callbacks import Callback
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import lightning_sink.sink.programs.compiled_choice as compiled_choice
from lightning_sink import SinkStrategy
from lightning_sink._torch_compat import compiled_graph_count
from lightning_sink.loss_scale import DynamicLossScale
from lightning_sink.precision import LossScalePrecision
from tests.helpers import RecordingLogger, quiet_trainer

SAMPLES, MICRO = 40, 4  # 10 micro-batches per data pass, read in order (no shuffling)

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="the CUDA programs need a CUDA device")


@pytest.fixture(autouse=True)
def quick_backend(monkeypatch):
    monkeypatch.setattr(compiled_choice, "COMPILE_BACKEND", "aot_eager")
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def dataset(poison_at: tuple[int, ...] = ()) -> TensorDataset:
    generator = torch.Generator().manual_seed(0)
    x, y = torch.randn(SAMPLES, 8, generator=generator), torch.randint(0, 4, (SAMPLES,), generator=generator)
    for sample in poison_at:
        x[sample, 0] = float("inf")  # the micro-batch holding it overflows: its gradient is not finite
    return TensorDataset(x, y)


def loader(data: TensorDataset) -> DataLoader:
    return DataLoader(data, batch_size=MICRO, shuffle=False)


OPTIMIZERS = {
    "sgd": lambda params: torch.optim.SGD(params, lr=0.05, momentum=0.9, weight_decay=1e-3),
    "adam": lambda params: torch.optim.Adam(params, lr=1e-2, weight_decay=1e-3),
    "adamw": lambda params: torch.optim.AdamW(params, lr=1e-2, betas=(0.8, 0.99)),
}


def make_net(batch_norm: bool) -> nn.Sequential:
    torch.manual_seed(0)
    # Before BatchNorm a bias has no effect, so its true gradient is zero and Adam would turn the float noise in it
    # into full steps (compiled and eager noise differ): that layer has none.
    layers: list[nn.Module] = [nn.Linear(8, 16, bias=not batch_norm)]
    if batch_norm:
        layers.append(nn.BatchNorm1d(16))
    return nn.Sequential(*layers, nn.Tanh(), nn.Linear(16, 4))


class Net(pl.LightningModule):
    """Overrides nothing between forward and update; logs its loss and twice its logits' mean."""

    def __init__(self, optimizer: str = "adamw", batch_norm: bool = False, step_lr: float | None = None) -> None:
        super().__init__()
        self.net = make_net(batch_norm)
        self.optimizer_kind, self.step_lr = optimizer, step_lr

    def training_step(self, batch: Any, batch_idx: Any) -> torch.Tensor:
        x, y = batch
        logits = self.net(x)
        loss = F.cross_entropy(logits, y)
        self.log("train_loss", loss, prog_bar=True)
        self.log("logits_double", 2 * logits.mean(), on_epoch=True)
        return loss

    def configure_optimizers(self) -> Any:
        optimizer = OPTIMIZERS[self.optimizer_kind](self.parameters())
        if self.step_lr is None:
            return optimizer
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=self.step_lr)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


def plain_loop(
    net: nn.Module,
    optimizer_kind: str,
    micro_batches: int,
    steps: int,
    data: TensorDataset,
    clip: tuple[str, float] | None = None,
    step_lr: float | None = None,
) -> dict[str, Any]:
    """The loop a user would write: micro-batches read in order over endless passes, each loss / N backpropagated,
    an update per full window (a window with a non-finite gradient is skipped and the scheduler holds), the open
    last window's micro-batches run without an update."""
    optimizer = OPTIMIZERS[optimizer_kind](net.parameters())
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, 1, step_lr) if step_lr is not None else None
    device = next(net.parameters()).device
    x, y = (tensor.to(device) for tensor in data.tensors)
    per_pass = SAMPLES // MICRO
    updates = skipped = 0
    net.train()
    for first in range(0, micro_batches, steps):
        optimizer.zero_grad()
        for micro in range(first, min(first + steps, micro_batches)):
            start = (micro % per_pass) * MICRO
            (F.cross_entropy(net(x[start : start + MICRO]), y[start : start + MICRO]) / steps).backward()
        if first + steps > micro_batches:
            break  # the open last window: its forwards ran (BatchNorm's statistics moved), no update
        grads = [p.grad for p in net.parameters()]
        if not all(torch.isfinite(g).all() for g in grads):
            skipped += 1
            continue
        if clip is not None:
            algorithm, value = clip
            if algorithm == "norm":
                torch.nn.utils.clip_grad_norm_(net.parameters(), value)
            else:
                torch.nn.utils.clip_grad_value_(net.parameters(), value)
        optimizer.step()
        updates += 1
        if scheduler is not None:
            scheduler.step()
    return {"updates": updates, "skipped": skipped, "lr": optimizer.param_groups[0]["lr"]}


def flat(module: nn.Module) -> torch.Tensor:
    tensors = [p.detach().reshape(-1) for p in module.parameters()] + [b.reshape(-1) for b in module.buffers()]
    return torch.cat([t.double() for t in tensors])


def relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return float((actual - expected).norm() / expected.norm())


def fit(trainer: pl.Trainer, model: pl.LightningModule, data: TensorDataset, caplog: Any, **kwargs: Any) -> None:
    """``trainer.fit``; under ``graph_mode="compile"`` it must report the whole-step programs compiled (no fallback)."""
    caplog.clear()
    with caplog.at_level("INFO"):
        trainer.fit(model, loader(data), **kwargs)
    if trainer.strategy.graph_mode == "compile":
        reports = [r.getMessage() for r in caplog.records if "whole" in r.getMessage()]
        name = type(trainer.optimizers[0]).__name__
        assert len(reports) == 1, reports
        assert f"programs are compiled whole (forward, backward, accumulation, {name}" in reports[0]


def trainer_for(graph_mode: str, steps: int, sink_size: int, epochs: int, **kwargs: Any) -> pl.Trainer:
    plugins = kwargs.pop("plugins", None)
    strategy = SinkStrategy(accumulation_steps=steps, sink_size=sink_size, graph_mode=graph_mode)
    return quiet_trainer(strategy=strategy, plugins=plugins, **{"max_epochs": epochs, **kwargs})


# (optimizer, accumulation, sink size, epochs, clipping, step LR, BatchNorm); sinks whose size is not a multiple of
# the window leave windows open across sinks and passes, and an open window at the fit's end (not applied)
CASES = [
    ("sgd", 1, 7, 4, ("value", 0.05), None, True),
    ("adam", 4, 7, 5, ("norm", 0.5), 0.95, False),
    pytest.param("adamw", 4, 6, 5, None, 0.9, True, marks=pytest.mark.slow),
    pytest.param("adamw", 1, 6, 3, ("norm", 0.3), 0.97, False, marks=pytest.mark.slow),
    pytest.param("sgd", 4, 5, 5, None, 0.9, False, marks=pytest.mark.slow),
]


@pytest.mark.parametrize("optimizer, steps, sink_size, epochs, clip, step_lr, batch_norm", CASES)
def test_a_compiled_fit_matches_the_plain_loop(optimizer, steps, sink_size, epochs, clip, step_lr, batch_norm, caplog):
    model = Net(optimizer, batch_norm, step_lr)
    reference = copy.deepcopy(model.net)
    clip_kwargs = {} if clip is None else {"gradient_clip_algorithm": clip[0], "gradient_clip_val": clip[1]}
    trainer = trainer_for("compile", steps, sink_size, epochs, **clip_kwargs)
    fit(trainer, model, dataset(), caplog)
    expected = plain_loop(reference, optimizer, sink_size * epochs, steps, dataset(), clip, step_lr)
    assert trainer.global_step == expected["updates"]
    assert trainer.optimizers[0].param_groups[0]["lr"] == pytest.approx(expected["lr"], rel=1e-12)
    assert relative_error(flat(model.net), flat(reference)) <= 1e-5


def test_dynamic_loss_scaling_skips_overflowing_windows_and_holds_the_scheduler(caplog):
    """Samples 5 and 22 hold an inf: each pass, the windows holding their micro-batches overflow and are skipped;
    the step scheduler holds for them and the scale halves per overflow (hysteresis 1)."""
    poisoned = dataset(poison_at=(5, 22))
    runs = {}
    for graph_mode in ("eager", "compile"):
        model = Net("adam", step_lr=0.9)
        reference = copy.deepcopy(model.net)
        scale = LossScalePrecision("32-true", DynamicLossScale(init_scale=2.0**8, scale_window=1000))
        trainer = trainer_for(graph_mode, 3, 7, 4, plugins=[scale])
        fit(trainer, model, poisoned, caplog)
        runs[graph_mode] = (model, trainer, scale.scaler)
    model, trainer, scaler = runs["compile"]
    expected = plain_loop(reference, "adam", 28, 3, poisoned, step_lr=0.9)
    assert expected["skipped"] >= 3 and expected["updates"] >= 3  # the test covers both
    assert relative_error(flat(model.net), flat(reference)) <= 1e-5
    assert trainer.optimizers[0].param_groups[0]["lr"] == pytest.approx(expected["lr"], rel=1e-12)  # held when skipped
    assert scaler.scale.item() == 2.0**8 / 2 ** expected["skipped"]
    assert int(scaler.skipped.item()) == expected["skipped"]
    eager_trainer = runs["eager"][1]
    assert trainer.global_step == eager_trainer.global_step  # skipped windows count as Lightning counts them


def test_self_log_values_reach_lightning_as_in_the_eager_fit(caplog):
    results = {}
    for graph_mode in ("eager", "compile"):
        logger = RecordingLogger()
        trainer = trainer_for(graph_mode, 3, 7, 3, logger=logger, log_every_n_steps=1)
        fit(trainer, Net("sgd"), dataset(), caplog)
        results[graph_mode] = (logger.points, {k: float(v) for k, v in trainer.callback_metrics.items()})
    (eager_points, eager_metrics), (points, metrics) = results["eager"], results["compile"]
    assert [step for step, _ in points] == [step for step, _ in eager_points] and len(points) >= 6
    for (_, point), (_, eager_point) in zip(points, eager_points):
        assert point.keys() == eager_point.keys()
        for name, value in point.items():
            assert value == pytest.approx(eager_point[name], rel=1e-5, abs=1e-7), name
    assert metrics.keys() == eager_metrics.keys() >= {"train_loss", "logits_double_step", "logits_double_epoch"}
    assert metrics == pytest.approx(eager_metrics, rel=1e-5)


class GraphsAfterFirstSink(Callback):
    def __init__(self) -> None:
        self.counts: list[int] = []

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        self.counts.append(compiled_graph_count())


def test_no_recompilation_after_the_first_sink(caplog):
    """A step scheduler (a new learning rate every update), windows open across sinks and passes (7 micro-batches
    per sink, windows of 3), every epoch's last sink, the fit's open last window."""
    counts = GraphsAfterFirstSink()
    trainer = trainer_for("compile", 3, 7, 5, callbacks=[counts])
    fit(trainer, Net("adamw", step_lr=0.9), dataset(), caplog)
    assert trainer.global_step == 11
    assert counts.counts[0] >= 2  # the two programs were compiled in the first sink
    assert counts.counts == [counts.counts[0]] * 5  # and nothing after it


class SaveAtEpochEnd(Callback):
    def __init__(self, path: Any, epoch: int) -> None:
        self.path, self.epoch = path, epoch

    def on_train_epoch_end(self, trainer: pl.Trainer, module: pl.LightningModule) -> None:
        if trainer.current_epoch == self.epoch:
            trainer.save_checkpoint(self.path)


@pytest.mark.slow
def test_resume_inside_a_window_reaches_the_uninterrupted_compiled_run_bit_for_bit(tmp_path, caplog):
    path = tmp_path / "inside_window.ckpt"
    uninterrupted = Net("adamw", batch_norm=True, step_lr=0.9)
    fit(trainer_for("compile", 3, 7, 5, callbacks=[SaveAtEpochEnd(path, 1)]), uninterrupted, dataset(), caplog)
    resumed = Net("sgd", batch_norm=True)  # other weights and optimizer settings: all come from the checkpoint
    resumed.optimizer_kind, resumed.step_lr = "adamw", 0.9
    torch.nn.init.normal_(resumed.net[0].weight)
    trainer = trainer_for("compile", 3, 7, 5)
    fit(trainer, resumed, dataset(), caplog, ckpt_path=path)  # after 14 micro-batches: a window holds 2
    assert trainer.global_step == 11
    assert torch.equal(flat(resumed.net), flat(uninterrupted.net))


@pytest.mark.slow
def test_resume_after_a_max_steps_stop_inside_a_sink_is_bit_for_bit(tmp_path, caplog):
    uninterrupted = Net("sgd")
    fit(trainer_for("compile", 4, 6, 100, max_steps=9), uninterrupted, dataset(), caplog)
    first = Net("sgd")
    trainer = trainer_for("compile", 4, 6, 100, max_steps=4)
    fit(trainer, first, dataset(), caplog)  # stops after 16 of the third sink's 18 micro-batches
    trainer.save_checkpoint(tmp_path / "stop.ckpt")
    resumed = Net("sgd")
    torch.nn.init.normal_(resumed.net[0].weight)
    again = trainer_for("compile", 4, 6, 100, max_steps=9)
    fit(again, resumed, dataset(), caplog, ckpt_path=tmp_path / "stop.ckpt")
    assert again.global_step == 9
    assert torch.equal(flat(resumed.net), flat(uninterrupted.net))


@needs_cuda
@pytest.mark.parametrize("graph_mode", ["compile", "cuda_graph"])
def test_on_cuda_the_whole_step_programs_match_the_plain_loop(graph_mode, caplog, monkeypatch):
    """Inductor, as users get it; with "cuda_graph" both programs replayed as CUDA graphs, the sink's losses and
    logged values copied out of the graphs' outputs before the next replay."""
    monkeypatch.setattr(compiled_choice, "COMPILE_BACKEND", "inductor")
    model = Net("adamw", batch_norm=True, step_lr=0.9)
    reference = copy.deepcopy(model.net).cuda()
    losses = SinkLosses()
    trainer = trainer_for(graph_mode, 3, 7, 5, accelerator="gpu", devices=1, callbacks=[losses])
    fit(trainer, model, dataset(), caplog)
    expected = plain_loop(reference, "adamw", 35, 3, dataset(), step_lr=0.9)
    assert trainer.global_step == expected["updates"] == 11
    assert relative_error(flat(model.net).cpu(), flat(reference).cpu()) <= 1e-5
    assert len(set(losses.values)) == len(losses.values) == 5  # each sink's own last loss, not a reused buffer


class SinkLosses(Callback):
    def __init__(self) -> None:
        self.values: list[float] = []

    def on_train_batch_end(self, trainer: pl.Trainer, module: pl.LightningModule, outputs: Any, *args: Any) -> None:
        self.values.append(float(outputs["losses"][-1]))
