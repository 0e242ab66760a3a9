"""Sink throughput: training steps per second on CPU, one process, configurations alternating.

    python benchmarks/sink_throughput.py [--repeats 3] [--steps 1500]

Models: (a) a tiny MLP 64-64-10, batch 32; (b) LeNet-5 on 1x32x32, batch 32. Configurations: a hand-written
PyTorch loop (the anchor), stock Lightning, and ``SinkStrategy(sink_size=K)`` in eager mode, with its prefetch
thread (``prefetch_depth=2``, the default) and reading in the training thread (``prefetch_depth=0``). All read the same
``DataLoader`` over in-memory tensors with SGD. Each run trains ``--steps`` optimizer steps after a warm-up;
figures are medians of the repeats. The last line is one JSON object.
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
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import lightning.pytorch as pl  # noqa: E402

from common import NetClassifier, quiet_trainer  # noqa: E402
from lenet import LeNet5  # noqa: E402
from lightning_sink import SinkStrategy  # noqa: E402

BATCH, SINK, WARMUP = 32, 500, 50
CONFIGS = ("hand_written", "stock_lightning", "sink_eager", "sink_eager_inline")


def make_model(name: str) -> nn.Module:
    torch.manual_seed(0)
    if name == "tiny_mlp":
        return nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 10))
    return LeNet5()


def make_loader(name: str, steps: int) -> DataLoader:
    shape = (64,) if name == "tiny_mlp" else (1, 32, 32)
    samples = BATCH * 512
    generator = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(samples, *shape, generator=generator),
                         torch.randint(0, 10, (samples,), generator=generator))
    return DataLoader(data, batch_size=BATCH, shuffle=True, drop_last=True)


class StepTimer(pl.Callback):
    def __init__(self, warmup_batches: int) -> None:
        self.warmup_batches, self.start = warmup_batches, None

    def on_train_batch_start(self, trainer, module, batch, batch_idx):
        if self.start is None and trainer.global_step >= self.warmup_batches:
            self.start, self.start_step = time.perf_counter(), trainer.global_step

    def on_train_end(self, trainer, module):
        self.seconds, self.steps = time.perf_counter() - self.start, trainer.global_step - self.start_step


def hand_written(model_name: str, steps: int) -> float:
    model, loader = make_model(model_name), make_loader(model_name, steps)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    done, start = 0, None
    while done < steps + WARMUP:
        for x, y in loader:
            if done == WARMUP:
                start = time.perf_counter()
            optimizer.zero_grad()
            F.cross_entropy(model(x), y).backward()
            optimizer.step()
            done += 1
            if done == steps + WARMUP:
                break
    return steps / (time.perf_counter() - start)


def lightning(model_name: str, steps: int, strategy) -> float:
    sink = strategy is not None
    timer = StepTimer(warmup_batches=SINK if sink else WARMUP)  # sinks are timed from the second sink on
    trainer = quiet_trainer(strategy=strategy or "auto", max_steps=steps + timer.warmup_batches, max_epochs=-1,
                            callbacks=[timer])
    trainer.fit(NetClassifier(make_model(model_name)), make_loader(model_name, steps))
    return timer.steps / timer.seconds


def run(config: str, model_name: str, steps: int) -> float:
    if config == "hand_written":
        return hand_written(model_name, steps)
    if config == "stock_lightning":
        return lightning(model_name, steps, None)
    depth = 0 if config.endswith("inline") else 2  # inline: read in the training thread, no prefetch thread
    return lightning(model_name, steps, SinkStrategy(sink_size=SINK, prefetch_depth=depth))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--steps", type=int, default=1500)
    args = parser.parse_args()
    torch.set_num_threads(min(2, os.cpu_count() or 1))
    result = {"benchmark": "sink_throughput", "machine": f"{platform.machine()}, {os.cpu_count()} cores, torch "
              f"{torch.__version__}, CPU", "batch": BATCH, "sink_size": SINK, "repeats": args.repeats}
    for model_name in ("tiny_mlp", "lenet5"):
        rates: dict[str, list[float]] = {config: [] for config in CONFIGS}
        for repeat in range(args.repeats):
            order = CONFIGS[repeat % len(CONFIGS):] + CONFIGS[: repeat % len(CONFIGS)]
            for config in order:
                rates[config].append(run(config, model_name, args.steps))
        medians = {config: statistics.median(values) for config, values in rates.items()}
        result[model_name] = {
            **{f"{config}_steps_per_s": round(medians[config], 1) for config in CONFIGS},
            **{f"{config}_ms_per_step": round(1000 / medians[config], 3) for config in CONFIGS},
            **{f"{sink}_vs_{anchor}": round(medians[sink] / medians[anchor], 3)
               for sink in ("sink_eager", "sink_eager_inline") for anchor in ("hand_written", "stock_lightning")},
        }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
