"""What the tensor digests of a ``.ckpt`` cost at save and at resume, on CPU, one process, alternating.

    python benchmarks/checkpoint_digests.py [--repeats 7] [--width 2048] [--layers 3]

A model of ``--layers`` square linear layers (2048 wide, 3 layers: 12.6 M parameters, a 50 MB checkpoint with plain
SGD, which keeps no state) is fitted for one step with ``SinkStrategy``; then, alternating, the same checkpoint is
saved (``trainer.save_checkpoint``) with and without digests (``checkpoint_digests``), and loaded as a resume loads
it (``strategy.load_checkpoint``: ``torch.load`` and the state checks) with and without checking them. The anchor of
each is the run without digests. Figures are medians of the repeats, with the spread (min and max); the last line
is one JSON object.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from lightning_sink import SinkStrategy

from common import quiet_trainer


def fitted(width: int, layers: int) -> tuple:
    import lightning.pytorch as pl
    import torch.nn.functional as F

    class Regressor(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.net = nn.Sequential(*[nn.Linear(width, width) for _ in range(layers)])

        def training_step(self, batch, batch_idx):
            return F.mse_loss(self.net(batch[0]), batch[1])

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.01)

    data = TensorDataset(torch.randn(4, width), torch.randn(4, width))
    strategy = SinkStrategy()
    trainer = quiet_trainer(strategy=strategy, max_steps=1)
    trainer.fit(Regressor(), DataLoader(data, batch_size=4))
    return trainer, strategy


def set_digests(strategy: SinkStrategy, enabled: bool) -> None:
    fit = strategy.sink_fit
    fit.sink_config = dataclasses.replace(fit.sink_config, checkpoint_digests=enabled)


def timed(action) -> float:
    started = time.perf_counter()
    action()
    return time.perf_counter() - started


def summary(times: list[float]) -> dict[str, float]:
    return {"median_s": statistics.median(times), "min_s": min(times), "max_s": max(times)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--width", type=int, default=2048)
    parser.add_argument("--layers", type=int, default=3)
    args = parser.parse_args()
    trainer, strategy = fitted(args.width, args.layers)
    times: dict[str, list[float]] = {name: [] for name in ("save", "save_digests", "load", "load_digests")}
    with tempfile.TemporaryDirectory() as folder:
        plain, sealed = Path(folder, "plain.ckpt"), Path(folder, "sealed.ckpt")
        for _ in range(args.repeats):
            for enabled in (False, True):
                set_digests(strategy, enabled)
                path = sealed if enabled else plain
                times["save_digests" if enabled else "save"].append(
                    timed(lambda path=path: trainer.save_checkpoint(path))
                )
            for enabled in (False, True):
                set_digests(strategy, enabled)  # both load the file that has digests: only the check differs
                times["load_digests" if enabled else "load"].append(timed(lambda: strategy.load_checkpoint(sealed)))
        checkpoint_bytes = sealed.stat().st_size
    result = {name: summary(values) for name, values in times.items()}
    ratios = {
        kind: {
            "median": statistics.median(d / a for d, a in zip(times[f"{kind}_digests"], times[kind])),
            "min": min(d / a for d, a in zip(times[f"{kind}_digests"], times[kind])),
            "max": max(d / a for d, a in zip(times[f"{kind}_digests"], times[kind])),
        }
        for kind in ("save", "load")
    }
    print(
        json.dumps(
            {
                "benchmark": "checkpoint_digests",
                "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs",
                "torch": torch.__version__,
                "checkpoint_mb": round(checkpoint_bytes / 2**20, 1),
                "repeats": args.repeats,
                "times": result,
                "ratio_with_digests": ratios,
            }
        )
    )


if __name__ == "__main__":
    main()
