"""2-process ``SinkDDPStrategy(sink_size=K, graph_mode="compile")`` fits on gloo, each against a plain PyTorch DDP
loop (``DistributedDataParallel``, ``no_sync`` inside a window, each loss / N) run on the same per-rank data in the
same processes.

Run as ``python -m tests.compiled.ddp_worker OUT_DIR SCENARIO`` (Lightning's own launcher re-runs it for rank 1);
rank 0 writes ``OUT_DIR/SCENARIO.pt`` for the test. The programs are built with the ``aot_eager`` backend (the same
graphs, eager kernels: fast to build).
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import warnings
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

import lightning_sink.sink.programs.compiled_choice as compiled_choice
from lightning_sink import DynamicLossScale, LossScalePrecision, SinkDDPStrategy
from tests.distributed import leave_the_group_and_exit
from tests.helpers import quiet_trainer

WORLD, MICRO, PER_RANK = 2, 4, 48  # micro-batches per rank in the data pass
SAMPLES = WORLD * MICRO * PER_RANK

OPTIMIZERS = {
    "sgd": lambda params: torch.optim.SGD(params, lr=0.05, momentum=0.9),
    "adamw": lambda params: torch.optim.AdamW(params, lr=1e-2, betas=(0.8, 0.99)),
}


def dataset(poison_at: tuple[int, ...] = ()) -> TensorDataset:
    generator = torch.Generator().manual_seed(0)
    x, y = torch.randn(SAMPLES, 8, generator=generator), torch.randint(0, 4, (SAMPLES,), generator=generator)
    for sample in poison_at:
        x[sample, 0] = float("inf")  # the micro-batch holding it has a non-finite gradient
    return TensorDataset(x, y)


def make_net() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))


class Net(pl.LightningModule):
    """Overrides nothing between forward and update."""

    def __init__(self, optimizer: str, one_cycle: bool = False) -> None:
        super().__init__()
        self.net, self.optimizer_kind, self.one_cycle = make_net(), optimizer, one_cycle

    def training_step(self, batch: Any, batch_idx: Any) -> torch.Tensor:
        x, y = batch
        return F.cross_entropy(self.net(x), y)

    def configure_optimizers(self) -> Any:
        optimizer = OPTIMIZERS[self.optimizer_kind](self.parameters())
        if not self.one_cycle:
            return optimizer
        total = int(self.trainer.estimated_stepping_batches)
        scheduler = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=0.05, total_steps=total)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


def plain_ddp(optimizer_kind: str, steps: int, updates: int, data: TensorDataset, clip: float | None) -> dict:
    """The DDP loop a user writes: this rank's share of the data as ``DistributedSampler`` gives it, ``no_sync`` on
    all but a window's last micro-batch (whose backward averages the window over the ranks), a window with a
    non-finite gradient skipped, norm clipping of the averaged gradient."""
    net = make_net()
    model = DistributedDataParallel(net)
    optimizer = OPTIMIZERS[optimizer_kind](model.parameters())
    micro_batches = rank_micro_batches(dist.get_rank())
    x, y = data.tensors
    skipped, clipped = 0, 0
    for update in range(updates):
        optimizer.zero_grad()
        for k, rows in enumerate(micro_batches[update * steps : (update + 1) * steps]):
            with model.no_sync() if k < steps - 1 else contextlib.nullcontext():
                (F.cross_entropy(model(x[rows]), y[rows]) / steps).backward()
        if not all(torch.isfinite(p.grad).all() for p in net.parameters()):
            skipped += 1
            continue
        if clip is not None:
            clipped += int(torch.nn.utils.clip_grad_norm_(net.parameters(), clip) > clip)
        optimizer.step()
    return {"params": flat(net), "skipped": skipped, "clipped": clipped}


def rank_micro_batches(rank: int) -> list[list[int]]:
    """The rank's micro-batches (sample indices) of the first data pass, from the sampler Lightning puts on the
    training loader: ``DistributedSampler``, shuffled with seed 0."""
    indices = list(DistributedSampler(range(SAMPLES), num_replicas=WORLD, rank=rank, shuffle=True, seed=0))
    return [indices[i : i + MICRO] for i in range(0, len(indices), MICRO)]


def flat(module: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1).double() for p in module.parameters()])


class Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def compiled_fit(
    optimizer: str, steps: int, data: TensorDataset, strategy_options: dict | None = None, **kwargs: Any
) -> dict:
    """The fit, with what it said at its start: the info lines and the warnings."""
    model = Net(optimizer, one_cycle=kwargs.pop("one_cycle", False))
    strategy = SinkDDPStrategy(
        accumulation_steps=steps,
        sink_size=12,
        graph_mode="compile",
        process_group_backend="gloo",
        **(strategy_options or {}),
    )
    # an epoch is one sink of 12 micro-batches here: 4 of them read the data pass once
    trainer = quiet_trainer(strategy=strategy, devices=WORLD, max_epochs=4, **kwargs)
    return fit_and_say(trainer, model, DataLoader(data, batch_size=MICRO, shuffle=False))


def fit_and_say(trainer: pl.Trainer, model: Net, loader: DataLoader) -> dict:
    """``trainer.fit``, then both ranks' parameters, the step, the learning rate and betas, and what the fit said:
    its info lines and warnings."""
    lines = Lines()
    rank_zero = logging.getLogger("lightning.pytorch.utilities.rank_zero")
    rank_zero.addHandler(lines)
    rank_zero.setLevel(logging.INFO)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            trainer.fit(model, loader)
    finally:
        rank_zero.removeHandler(lines)
    params = flat(model.net)
    gathered = [torch.empty_like(params) for _ in range(WORLD)]
    dist.all_gather(gathered, params)
    return {
        "ranks": gathered,
        "global_step": trainer.global_step,
        "lr": trainer.optimizers[0].param_groups[0]["lr"],
        "betas": trainer.optimizers[0].param_groups[0].get("betas"),
        "said": lines.lines + [str(warning.message) for warning in caught],
    }


def exactness(out_dir: Path) -> None:
    """12 updates: SGD with momentum, windows of 1, norm clipping; AdamW, windows of 4."""
    result = {}
    for optimizer, steps, clip in (("sgd", 1, 0.3), ("adamw", 4, None)):
        clipping = {} if clip is None else {"gradient_clip_val": clip, "gradient_clip_algorithm": "norm"}
        fit = compiled_fit(optimizer, steps, dataset(), max_steps=12, **clipping)
        fit["reference"] = plain_ddp(optimizer, steps, 12, dataset(), clip)
        result[f"{optimizer}_{steps}"] = fit
    if dist.get_rank() == 0:
        torch.save(result, out_dir / "exactness.pt")


def overflow(out_dir: Path) -> None:
    """A non-finite gradient in window 1 on rank 1 only, under dynamic loss scaling: both ranks skip that window."""
    data = dataset(poison_at=(rank_micro_batches(1)[5][2],))  # rank 1's micro-batch 5: window 1
    plugin = LossScalePrecision("32-true", DynamicLossScale(init_scale=2.0**10))
    fit = compiled_fit("adamw", 4, data, plugins=[plugin])
    scaler = torch.stack([plugin.scaler.scale.reshape(()), plugin.scaler.skipped.float().reshape(())])
    scalers = [torch.empty_like(scaler) for _ in range(WORLD)]
    dist.all_gather(scalers, scaler)
    fit["scalers"] = scalers
    fit["reference"] = plain_ddp("adamw", 4, PER_RANK // 4, data, None)
    if dist.get_rank() == 0:
        torch.save(fit, out_dir / "overflow.pt")


def several_per_call(out_dir: Path) -> None:
    """AdamW in windows of 4 under dynamic loss scaling, 12 updates: 8 micro-batches (two windows) per compiled call
    with a device-data budget, and one call per micro-batch, in the same two processes."""
    result = {}
    for name, options in (
        ("one_per_call", {"micro_steps_per_call": 1}),
        ("eight_per_call", {"micro_steps_per_call": 8, "device_data_budget": 2**30}),
    ):
        plugin = LossScalePrecision("32-true", DynamicLossScale(init_scale=2.0**10))
        fit = compiled_fit("adamw", 4, dataset(), options, max_steps=12, plugins=[plugin])
        fit["scale"] = plugin.scaler.scale.reshape(()).clone()
        result[name] = fit
    if dist.get_rank() == 0:
        torch.save(result, out_dir / "several_per_call.pt")


def scheduled_per_call(out_dir: Path) -> None:
    """AdamW in windows of 2 with OneCycleLR stepped per update (its learning rate and beta1 move every update),
    sized from ``estimated_stepping_batches``: 8 micro-batches (four windows) per compiled call, and one call per
    micro-batch, in the same two processes."""
    result = {}
    for name, options in (
        ("one_per_call", {"micro_steps_per_call": 1}),
        ("eight_per_call", {"micro_steps_per_call": 8, "device_data_budget": 2**30}),
    ):
        result[name] = compiled_fit("adamw", 2, dataset(), options, one_cycle=True)
    if dist.get_rank() == 0:
        torch.save(result, out_dir / "scheduled_per_call.pt")


def default_per_call(out_dir: Path) -> None:
    """AdamW in windows of 2 with OneCycleLR stepped per update: the call's length left to the build (the default:
    the data staged, a whole sink per call), one call per micro-batch, and one call per micro-batch read by the
    loader path (``device_data_budget=0``), in the same two processes. With ``fail_loop_on_rank_1`` the loop over windows does
    not build on rank 1 (as an operation torch's ``scan`` cannot hold would): every process then runs one micro-step
    per call."""
    result = {}
    for name, options in (
        ("one_per_call", {"micro_steps_per_call": 1}),
        ("loader_path", {"micro_steps_per_call": 1, "device_data_budget": 0}),
        ("default", {}),
    ):
        result[name] = compiled_fit("adamw", 2, dataset(), options, one_cycle=True, max_steps=18)
    if dist.get_rank() == 0:
        torch.save(result, out_dir / f"{sys.argv[2]}.pt")


class LoggingNet(Net):
    def training_step(self, batch: Any, batch_idx: Any) -> torch.Tensor:
        loss = super().training_step(batch, batch_idx)
        self.log("train_loss", loss)
        return loss


def against_stock(out_dir: Path) -> None:
    """The same run with and without sinking: stock Lightning's ``DDPStrategy`` (``accumulate_grad_batches=2``, no
    sinking, eager) and ``SinkDDPStrategy(sink_size=12, graph_mode="compile")`` with nothing else set (staged data,
    the build's call length), a shuffled loader, AdamW with OneCycleLR stepped per update, the loss logged."""
    from lightning.pytorch.strategies import DDPStrategy

    result = {}
    for name in ("stock", "sink"):
        model = LoggingNet("adamw", one_cycle=True)
        if name == "stock":
            strategy: Any = DDPStrategy(process_group_backend="gloo")
            options: dict[str, Any] = {"accumulate_grad_batches": 2}
        else:
            strategy = SinkDDPStrategy(
                accumulation_steps=2, sink_size=12, graph_mode="compile", process_group_backend="gloo"
            )
            options = {}
        trainer = quiet_trainer(strategy=strategy, devices=WORLD, max_steps=18, **options)
        result[name] = fit_and_say(trainer, model, DataLoader(dataset(), batch_size=MICRO, shuffle=True))
        result[name]["train_loss"] = float(trainer.callback_metrics["train_loss"])
    if dist.get_rank() == 0:
        torch.save(result, out_dir / "against_stock.pt")


def partial_against_stock(out_dir: Path) -> None:
    """``against_stock`` over a data pass that ends with a partial batch on each process (22 samples a process:
    5 batches of 4 and one of 2), windows of one, sinks of two passes: the eager pair trains each partial batch in the compiled
    sinks."""
    from lightning.pytorch.strategies import DDPStrategy

    samples = WORLD * (5 * MICRO + 2)
    data = TensorDataset(*(tensor[:samples] for tensor in dataset().tensors))
    result = {}
    for name in ("stock", "sink"):
        model = LoggingNet("adamw", one_cycle=True)
        if name == "stock":
            strategy: Any = DDPStrategy(process_group_backend="gloo")
            options: dict[str, Any] = {}
        else:
            strategy = SinkDDPStrategy(sink_size=12, graph_mode="compile", process_group_backend="gloo")
            options = {}
        trainer = quiet_trainer(strategy=strategy, devices=WORLD, max_steps=18, **options)
        result[name] = fit_and_say(trainer, model, DataLoader(data, batch_size=MICRO, shuffle=True))
        result[name]["train_loss"] = float(trainer.callback_metrics["train_loss"])
    if dist.get_rank() == 0:
        torch.save(result, out_dir / "partial_against_stock.pt")


def fail_loop_on_rank_1(out_dir: Path) -> None:
    from lightning_sink.compiled import traced_programs

    if os.environ.get("LOCAL_RANK") == "1":  # (Lightning's launcher runs this module again for rank 1)

        def refused(*args: Any) -> Any:
            raise RuntimeError("no loop on this process")

        traced_programs.scan_loop = refused
    default_per_call(out_dir)


def pair_when_needed(out_dir: Path) -> None:
    """AdamW in windows of 2 with OneCycleLR, ``max_steps=17`` (34 micro-batches a rank, sinks of 12): the default
    runs the first two sinks as one call each and the third as a call of 8 and two micro-batches one per call, for
    which the one-micro-step programs are built then (agreed across the processes); once more with their build
    refused on rank 1 only (every process then runs the eager step from there); and one call per micro-batch."""
    from lightning_sink.compiled import StepPrograms

    result = {}
    for name, options in (("one_per_call", {"micro_steps_per_call": 1}), ("default", {}), ("refused", {})):
        if name == "refused" and os.environ.get("LOCAL_RANK") == "1":

            def refused(self: StepPrograms) -> float:
                raise RuntimeError("no pair on this process")

            StepPrograms.build_pair = refused  # type: ignore[method-assign]
        result[name] = compiled_fit("adamw", 2, dataset(), options, one_cycle=True, max_steps=17)
    if dist.get_rank() == 0:
        torch.save(result, out_dir / "pair_when_needed.pt")


if __name__ == "__main__":
    compiled_choice.COMPILE_BACKEND = "aot_eager"
    workers = {
        "exactness": exactness,
        "overflow": overflow,
        "several_per_call": several_per_call,
        "scheduled_per_call": scheduled_per_call,
        "default_per_call": default_per_call,
        "fail_loop_on_rank_1": fail_loop_on_rank_1,
        "against_stock": against_stock,
        "partial_against_stock": partial_against_stock,
        "pair_when_needed": pair_when_needed,
    }
    workers[sys.argv[2]](Path(sys.argv[1]))
    leave_the_group_and_exit()  # (tests/distributed.py: the group torn down before the process ends)
