"""MindSpore's gradient-accumulation tutorial (parallel mode): ResNet-50, data-parallel with gradient accumulation over 6 micro-batches and dynamic
loss scaling, the data sunk one pass per sink (``dataset_sink_mode=True``).

    python examples/resnet_ddp_accumulation.py --data-dir DIR          # small run: 2 CPU processes, gloo
    python examples/resnet_ddp_accumulation.py --data-dir DIR --full   # the tutorial's setting (slow on CPU)

MindSpore's tutorial trains ResNet-50 (10 classes) with ``grad_accumulation_step=6``, batch 32 per device,
Momentum(0.01, 0.9), and prints one ``LossMonitor`` line per sink. Here ``SinkDDPStrategy(accumulation_steps=6,
sink_size=-1)`` runs the accumulate and update step programs on every rank, reduces the fp32 window buffer once per
window, and ``LossScalePrecision("16-mixed", DynamicLossScale())`` skips a window whose gradients overflowed on any
rank. ``LossMonitor`` prints MindSpore's ``epoch: 1 step: 234, loss is 1.7588712`` once per sink (rank 0). The data is MNIST (the only dataset available offline), resized to 32x32 and repeated over 3 channels. On
CUDA the processes use nccl and fp16 autocast; on CPU gloo and, by default, fp32 with the same dynamic loss scale
(``--precision 16-mixed`` works on CPU too, but PyTorch's fp16 CPU kernels are many times slower than fp32). The
loss scale starts at 2**16 (GradScaler's default): from MindSpore's 2**24 a fresh ResNet-50's fp16 gradients
overflowed in each of the first 8 windows of a small run here (the scale halving each time), so no update landed.
"""

from __future__ import annotations

import argparse
import time
from typing import Any

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
import torchvision
from torchmetrics.classification import MulticlassAccuracy

from lightning_sink import DynamicLossScale, LossScalePrecision, SinkDDPStrategy
from lightning_sink.callbacks import LossMonitor, LossScaleMonitor

from digits import DigitsDataModule, exit_on_missing_data

# The small default keeps a CPU run to about a minute; --full is the tutorial's recipe.
SMALL = dict(epochs=1, batch_size=8, max_train_samples=192, max_test_samples=256)
FULL = dict(epochs=10, batch_size=32, max_train_samples=None, max_test_samples=None)


class ResNetClassifier(pl.LightningModule):
    """torchvision's ResNet-50 with 10 classes; grey 32x32 digits are repeated over its 3 input channels."""

    def __init__(self, lr: float = 0.01, momentum: float = 0.9, num_classes: int = 10) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.net = torchvision.models.resnet50(num_classes=num_classes)
        self.test_accuracy = MulticlassAccuracy(num_classes=num_classes, average="micro")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x.expand(-1, 3, -1, -1))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return F.cross_entropy(self(x), y)

    def test_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        self.test_accuracy(self(x), y)
        self.log("test_accuracy", self.test_accuracy, sync_dist=True)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=self.hparams.lr, momentum=self.hparams.momentum)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data-dir", default=None, help="folder holding MNIST/raw (default: searched, see digits.py)")
    parser.add_argument("--download", action="store_true", help="download MNIST with torchvision if not found")
    parser.add_argument("--full", action="store_true", help="the tutorial's setting: 10 epochs, batch 32, all data")
    parser.add_argument("--epochs", type=int, default=None)
    parser.add_argument("--batch-size", type=int, default=None, help="micro-batch per process")
    parser.add_argument("--max-train-samples", type=int, default=None)
    parser.add_argument("--max-test-samples", type=int, default=None)
    parser.add_argument("--accumulation-steps", type=int, default=6)
    parser.add_argument("--devices", type=int, default=2, help="processes (one per GPU on CUDA)")
    parser.add_argument("--accelerator", default="auto")
    parser.add_argument("--precision", default=None, help="default: 16-mixed on CUDA, 32-true on CPU")
    parser.add_argument("--init-scale", type=float, default=2.0**16, help="initial dynamic loss scale")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    for name, value in (FULL if args.full else SMALL).items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    pl.seed_everything(args.seed, verbose=False)
    data = DigitsDataModule(
        args.data_dir,
        batch_size=args.batch_size,
        max_train_samples=args.max_train_samples,
        seed=args.seed,
        source="mnist",
        download=args.download,
        max_test_samples=args.max_test_samples,
    )
    cuda = args.accelerator in ("auto", "gpu", "cuda") and torch.cuda.is_available()
    strategy = SinkDDPStrategy(
        accumulation_steps=args.accumulation_steps, sink_size=-1, process_group_backend="nccl" if cuda else "gloo"
    )
    precision = LossScalePrecision(
        args.precision or ("16-mixed" if cuda else "32-true"),
        DynamicLossScale(init_scale=args.init_scale),
        device="cuda" if cuda else "cpu",
    )
    trainer = pl.Trainer(
        accelerator="gpu" if cuda else "cpu",
        devices=args.devices,
        strategy=strategy,
        plugins=[precision],
        callbacks=[LossMonitor(), LossScaleMonitor()],
        max_epochs=args.epochs,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        limit_val_batches=0,
    )
    model = ResNetClassifier()
    started = time.perf_counter()
    trainer.fit(model, datamodule=data)
    seconds = time.perf_counter() - started
    accuracy = trainer.test(model, datamodule=data, verbose=False)[0]["test_accuracy"]
    if trainer.is_global_zero:
        print(
            f"trained {trainer.global_step} updates on {trainer.world_size} processes"
            f" ({args.accumulation_steps} micro-batches of {args.batch_size} per process each) in {seconds:.1f} s;"
            f" loss scale {precision.scale:g}, skipped updates {precision.skipped_updates}"
        )
        print(f"final test accuracy: {accuracy:.4f}")


if __name__ == "__main__":
    exit_on_missing_data(main)
