"""Where a dynamic loss scale should start: windows skipped at the start of a standard fp16 run, per initial scale.

    python benchmarks/loss_scale_start.py [--seeds 3] [--epochs 4]

LeNet-5 on scikit-learn's bundled digits (offline; 1x32x32 inputs), micro-batch 32, 4 micro-batches per update,
Momentum(0.01, 0.9), ``LossScalePrecision("16-mixed", DynamicLossScale(init_scale=S))`` under
``SinkStrategy(accumulation_steps=4)``, fp16 autocast on the CPU (or CUDA when present). For each initial scale S
(MindSpore's 2**24, torch GradScaler's 2**16 and others) and each seed: the windows skipped among the first 24
updates (all of them when the run is shorter: 2 epochs are 23), the scale after them, and the test accuracy after the run; fp32 without scaling is the anchor for accuracy.
This is a numerics measurement, not a timing: nothing here depends on the machine's load. The last line is one JSON
object.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))

import lightning.pytorch as pl

from lightning_sink import DynamicLossScale, LossScalePrecision, SinkStrategy

from digits import DigitsDataModule
from lenet import LeNet5Classifier

FIRST_WINDOWS = 24
SCALES = (2.0**24, 2.0**20, 2.0**18, 2.0**16, 2.0**14, 2.0**12)


class SkipRecorder(pl.Callback):
    """The skipped-update count after each of the first ``FIRST_WINDOWS`` updates (reads the device: a sync)."""

    def __init__(self) -> None:
        self.skipped_after: list[int] = []
        self.scale_after: float = 0.0

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        plugin = trainer.precision_plugin
        new_update = len(self.skipped_after) < trainer.global_step <= FIRST_WINDOWS
        if isinstance(plugin, LossScalePrecision) and plugin.scale is not None and new_update:
            self.skipped_after.append(plugin.skipped_updates)
            self.scale_after = plugin.scale


def run(init_scale: float | None, seed: int, epochs: int, device: str) -> dict[str, float]:
    pl.seed_everything(seed, verbose=False)
    data = DigitsDataModule(source="digits", batch_size=32, seed=seed)
    recorder = SkipRecorder()
    plugin = (
        LossScalePrecision("32-true", None)
        if init_scale is None
        else LossScalePrecision("16-mixed", DynamicLossScale(init_scale=init_scale), device=device)
    )
    trainer = pl.Trainer(
        accelerator=device,
        devices=1,
        max_epochs=epochs,
        strategy=SinkStrategy(accumulation_steps=4),
        plugins=[plugin],
        callbacks=[recorder],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        limit_val_batches=0,
    )
    model = LeNet5Classifier(lr=0.01)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(model, datamodule=data)
        accuracy = trainer.test(model, datamodule=data, verbose=False)[0]["test_accuracy"]
    skipped = recorder.skipped_after[-1] if recorder.skipped_after else 0
    return {
        "skipped_in_first_windows": skipped,
        "scale_after_first_windows": recorder.scale_after,
        "accuracy": accuracy,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--epochs", type=int, default=4, help="46 micro-batches each: 4 epochs are 46 updates")
    args = parser.parse_args()
    torch.set_num_threads(min(2, os.cpu_count() or 1))
    device = "cuda" if torch.cuda.is_available() else "cpu"

    results: dict[str, dict[str, object]] = {}
    for label, scale in [("fp32", None), *((f"2**{int(s).bit_length() - 1}", s) for s in SCALES)]:
        runs = [run(scale, seed, args.epochs, device) for seed in range(args.seeds)]
        results[label] = {
            "skipped_in_first_windows": [r["skipped_in_first_windows"] for r in runs],
            "scale_after_first_windows": [r["scale_after_first_windows"] for r in runs],
            "median_accuracy": round(statistics.median(r["accuracy"] for r in runs), 4),
            "accuracies": [round(r["accuracy"], 4) for r in runs],
        }
        print(label, results[label], flush=True)
    print(
        json.dumps(
            {
                "benchmark": "loss_scale_start",
                "machine": f"{platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}, {device} fp16 autocast",
                "setting": f"LeNet-5, sklearn digits, micro-batch 32, 4 per update, {args.epochs} epochs",
                "first_windows": FIRST_WINDOWS,
                "seeds": args.seeds,
                "results": results,
            }
        )
    )


if __name__ == "__main__":
    main()
