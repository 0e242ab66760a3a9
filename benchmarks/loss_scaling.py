"""Loss-scaling benchmark: host syncs and time per optimizer update, lightning-sink vs Lightning's GradScaler.

    python benchmarks/loss_scaling.py [--repeats 5] [--windows 30]

LeNet-5 on random 1x32x32 inputs, micro-batch 32, 4 micro-batches per update, fp16 autocast on CPU, AdamW fused
(skips on the device) and SGD with momentum, foreach (cannot). The anchor is stock Lightning: ``MixedPrecision("16-mixed")``
with ``torch.amp.GradScaler`` and ``accumulate_grad_batches=4`` (on CUDA this is what ``precision="16-mixed"``
builds; on CPU Lightning would silently switch to bf16, so it is built explicitly). Host syncs are counted in a
separate pass (the Tensor methods that read a value back, inside training batches); times are per update window,
accumulate steps included, configurations alternating, median of the repeats. The last line is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))

import lightning.pytorch as pl
from lightning.pytorch.plugins.precision import MixedPrecision
from torch.utils.data import DataLoader, TensorDataset

from lightning_sink import DynamicLossScale, LossScalePrecision, SinkStrategy

from lenet import LeNet5

MICRO, STEPS, WARMUP = 32, 4, 3
CONFIGS = ("sink_fused", "stock_fused", "sink_sgd", "stock_sgd")
SYNC_METHODS = ("item", "tolist", "cpu", "numpy", "__bool__", "__float__", "__int__")


class Model(pl.LightningModule):
    def __init__(self, fused: bool) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net, self.fused = LeNet5(), fused

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.cross_entropy(self.net(x), y)

    def configure_optimizers(self):
        if self.fused:  # can skip an update on the device
            return torch.optim.AdamW(self.parameters(), lr=1e-3, fused=True)
        # cannot; SGD reads nothing back itself (foreach AdamW would read its step counters every update)
        return torch.optim.SGD(self.parameters(), lr=0.01, momentum=0.9, foreach=True)


class WindowTimer(pl.Callback):
    """Wall time of the batches after warm-up, and host syncs inside batches when counting."""

    def __init__(self, count_syncs: bool) -> None:
        self.count_syncs, self.syncs, self.in_batch = count_syncs, 0, False
        self.start = self.end = 0.0

    def on_train_start(self, trainer, module):
        if self.count_syncs:
            self.originals = {name: getattr(torch.Tensor, name) for name in SYNC_METHODS}
            for name, original in self.originals.items():

                def counting(tensor, *args, _original=original, **kwargs):
                    self.syncs += self.in_batch
                    return _original(tensor, *args, **kwargs)

                setattr(torch.Tensor, name, counting)

    def on_train_end(self, trainer, module):
        if self.count_syncs:
            for name, original in self.originals.items():
                setattr(torch.Tensor, name, original)

    def on_train_batch_start(self, trainer, module, batch, batch_idx):
        if batch_idx == WARMUP * STEPS:
            self.start = time.perf_counter()
        self.in_batch = batch_idx >= WARMUP * STEPS

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        self.in_batch = False
        self.end = time.perf_counter()


def run(config: str, windows: int, count_syncs: bool) -> dict[str, float]:
    samples = MICRO * STEPS * (windows + WARMUP)
    generator = torch.Generator().manual_seed(0)
    data = TensorDataset(
        torch.randn(samples, 1, 32, 32, generator=generator), torch.randint(0, 10, (samples,), generator=generator)
    )
    timer = WindowTimer(count_syncs)
    common = dict(
        accelerator="cpu",
        max_epochs=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[timer],
    )
    if config.startswith("sink"):
        # init_scale 2**16 like GradScaler's default, so both start from the same scale
        plugin = LossScalePrecision("16-mixed", DynamicLossScale(init_scale=2.0**16), device="cpu")
        trainer = pl.Trainer(strategy=SinkStrategy(accumulation_steps=STEPS), plugins=[plugin], **common)
    else:
        plugin = MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu", init_scale=2.0**16))
        trainer = pl.Trainer(accumulate_grad_batches=STEPS, plugins=[plugin], **common)
    trainer.fit(Model(fused=config.endswith("fused")), DataLoader(data, batch_size=MICRO))
    return {"ms_per_update": 1000 * (timer.end - timer.start) / windows, "syncs_per_update": timer.syncs / windows}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--windows", type=int, default=30)
    args = parser.parse_args()
    torch.set_num_threads(min(2, os.cpu_count() or 1))

    syncs = {config: run(config, args.windows, count_syncs=True)["syncs_per_update"] for config in CONFIGS}
    times: dict[str, list[float]] = {config: [] for config in CONFIGS}
    for repeat in range(args.repeats):
        order = CONFIGS[repeat % len(CONFIGS) :] + CONFIGS[: repeat % len(CONFIGS)]
        for config in order:
            times[config].append(run(config, args.windows, count_syncs=False)["ms_per_update"])

    result = {
        "benchmark": "loss_scaling",
        "machine": f"{platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}, CPU fp16 autocast",
        "model": f"LeNet-5, micro-batch {MICRO}, {STEPS} micro-batches per update",
        "repeats": args.repeats,
        **{
            config: {
                "syncs_per_update": round(syncs[config], 3),
                "ms_per_update": round(statistics.median(times[config]), 3),
            }
            for config in CONFIGS
        },
    }
    for kind in ("fused", "sgd"):
        result[f"sink_speedup_{kind}"] = round(
            result[f"stock_{kind}"]["ms_per_update"] / result[f"sink_{kind}"]["ms_per_update"], 3
        )
    print(json.dumps(result))


if __name__ == "__main__":
    main()
