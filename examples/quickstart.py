"""Quick start: LeNet-5 on handwritten digits with lightning-sink's accumulation, loss scaling and sinking.

    python examples/quickstart.py                      # MNIST if found (see digits.py), else sklearn digits
    python examples/quickstart.py --data-dir DIR --epochs 2

What it shows, all from one ``Trainer``:

- ``SinkStrategy(accumulation_steps=4, sink_size=-1)``: every update averages 4 micro-batches (two step programs,
  fp32 window buffer), and each epoch is one sink of one data pass run inside one Lightning batch;
- ``LossScalePrecision`` with a ``DynamicLossScale``: fp16 autocast on CUDA; on CPU fp32 with the same scaler
  (PyTorch's fp16 CPU kernels are slow), so the scale, overflow checks and skips still run on the device;
- ``LossMonitor`` (MindSpore's ``epoch: 1 step: 1875, loss is ...`` line, once per sink) and ``TimeMonitor``;
- TensorBoard logs (``tensorboard --logdir runs``): loss, loss scale, skipped updates, step time, throughput.

Offline: nothing is downloaded. Prints which data it used and the final test accuracy (torchmetrics).
"""

from __future__ import annotations

import argparse
import time

import lightning.pytorch as pl
import torch
from lightning.pytorch.loggers import TensorBoardLogger

from lightning_sink import DynamicLossScale, LossScalePrecision, SinkStrategy
from lightning_sink.callbacks import LossMonitor, LossScaleMonitor, TimeMonitor

from digits import DigitsDataModule, exit_on_missing_data
from lenet import LeNet5Classifier


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data-dir", default=None, help="folder holding MNIST/raw (torchvision layout)")
    parser.add_argument(
        "--data",
        choices=["auto", "mnist", "digits"],
        default="auto",
        help="auto: MNIST when found, else sklearn digits; mnist: require it; digits: force sklearn",
    )
    parser.add_argument(
        "--epochs",
        type=int,
        default=None,
        help="default: 2 on MNIST (60k samples), 20 on sklearn digits (1.5k samples)",
    )
    parser.add_argument("--batch-size", type=int, default=32, help="micro-batch size")
    parser.add_argument("--accumulation-steps", type=int, default=4, help="micro-batches per optimizer update")
    parser.add_argument("--lr", type=float, default=0.01)
    parser.add_argument("--max-train-samples", type=int, default=None, help="train on a prefix (quick runs)")
    parser.add_argument("--log-dir", default="runs", help="TensorBoard log folder")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--accelerator", default="auto")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> float:
    args = parse_args(argv)
    pl.seed_everything(args.seed, verbose=False)
    data = DigitsDataModule(
        args.data_dir,
        batch_size=args.batch_size,
        max_train_samples=args.max_train_samples,
        seed=args.seed,
        source=args.data,
    )
    data.setup()
    epochs = args.epochs or (2 if data.source.startswith("MNIST") else 20)
    print(f"data: {data.source}; {len(data.train_set)} train / {len(data.test_set)} test samples; {epochs} epochs")

    model = LeNet5Classifier(lr=args.lr)
    cuda = args.accelerator in ("auto", "gpu", "cuda") and torch.cuda.is_available()
    precision = LossScalePrecision(
        "16-mixed" if cuda else "32-true", DynamicLossScale(init_scale=2.0**16), device="cuda" if cuda else "cpu"
    )
    trainer = pl.Trainer(
        accelerator="gpu" if cuda else "cpu",
        devices=1,
        strategy=SinkStrategy(accumulation_steps=args.accumulation_steps, sink_size=-1),
        plugins=[precision],
        callbacks=[LossMonitor(), LossScaleMonitor(), TimeMonitor()],
        max_epochs=epochs,
        logger=TensorBoardLogger(args.log_dir, name="quickstart"),
        log_every_n_steps=1,  # every update's self.log values (Lightning's default is every 50th)
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        limit_val_batches=0,
    )
    started = time.perf_counter()
    trainer.fit(model, datamodule=data)
    seconds = time.perf_counter() - started
    accuracy = trainer.test(model, datamodule=data, verbose=False)[0]["test_accuracy"]
    print(
        f"trained {trainer.global_step} updates ({args.accumulation_steps} micro-batches of {args.batch_size} each)"
        f" in {seconds:.1f} s; TensorBoard logs in {trainer.logger.log_dir}"
    )
    print(f"final test accuracy: {accuracy:.4f}")
    return accuracy


if __name__ == "__main__":
    exit_on_missing_data(main)
