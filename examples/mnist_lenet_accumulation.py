"""MindSpore's gradient-accumulation tutorial (standalone mode): LeNet-5 on MNIST, 4 micro-batches of 32 per update, Momentum(0.01, 0.9), 10 epochs.

    python examples/mnist_lenet_accumulation.py --data-dir DIR              # lightning-sink
    python examples/mnist_lenet_accumulation.py --data-dir DIR --compare-stock   # and stock Lightning
    python examples/mnist_lenet_accumulation.py --eval-only --ckpt runs/mnist_lenet_accumulation/lenet5.ckpt

MindSpore's tutorial reports about 96.31% test accuracy after 10 epochs. Here the two step programs of
``SinkStrategy(accumulation_steps=4)`` train the same recipe (MNIST resized to 32x32 and normalised as in the tutorial,
``drop_remainder=True``); ``--compare-stock`` trains it again with stock Lightning's ``accumulate_grad_batches=4``
from the same seed. The checkpoint is saved; ``--eval-only --ckpt PATH`` evaluates it.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import lightning.pytorch as pl

from lightning_sink import SinkStrategy

from digits import DigitsDataModule, exit_on_missing_data
from lenet import LeNet5Classifier

MINDSPORE_ACCURACY = 0.9631  # the MindSpore tutorial's figure


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data-dir", default=None, help="folder holding MNIST/raw (default: searched, see digits.py)")
    parser.add_argument("--download", action="store_true", help="download MNIST with torchvision if not found")
    parser.add_argument("--epochs", type=int, default=10)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--accumulation-steps", type=int, default=4)
    parser.add_argument("--lr", type=float, default=0.01)
    parser.add_argument("--momentum", type=float, default=0.9)
    parser.add_argument("--max-train-samples", type=int, default=None, help="train on a prefix (quick runs)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--accelerator", default="auto")
    parser.add_argument("--out", default="runs/mnist_lenet_accumulation", help="where checkpoints go")
    parser.add_argument("--compare-stock", action="store_true", help="also train with stock accumulate_grad_batches")
    parser.add_argument("--eval-only", action="store_true", help="evaluate --ckpt on the test set and exit")
    parser.add_argument("--ckpt", default=None, help="checkpoint to evaluate with --eval-only")
    return parser.parse_args(argv)


def trainer_for(args: argparse.Namespace, stock: bool) -> pl.Trainer:
    if stock:  # Lightning's own accumulation: the anchor
        strategy, accumulate = "auto", args.accumulation_steps
    else:
        strategy, accumulate = SinkStrategy(accumulation_steps=args.accumulation_steps), 1
    return pl.Trainer(
        accelerator=args.accelerator,
        devices=1,
        strategy=strategy,
        accumulate_grad_batches=accumulate,
        max_epochs=args.epochs,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        limit_val_batches=0,
    )


def train(args: argparse.Namespace, data: DigitsDataModule, stock: bool) -> tuple[float, Path]:
    name = "stock_lightning" if stock else "lightning_sink"
    pl.seed_everything(args.seed, verbose=False)  # the same initial weights and data order for both
    model = LeNet5Classifier(lr=args.lr, momentum=args.momentum)
    trainer = trainer_for(args, stock)
    started = time.perf_counter()
    trainer.fit(model, datamodule=data)
    seconds = time.perf_counter() - started
    accuracy = trainer.test(model, datamodule=data, verbose=False)[0]["test_accuracy"]
    checkpoint = Path(args.out) / ("lenet5_stock.ckpt" if stock else "lenet5.ckpt")
    trainer.save_checkpoint(checkpoint, weights_only=False)
    print(
        f"{name}: {trainer.global_step} updates in {seconds:.1f} s, test accuracy {accuracy:.4f},"
        f" checkpoint {checkpoint}"
    )
    return accuracy, checkpoint


def evaluate(args: argparse.Namespace, data: DigitsDataModule) -> float:
    model = LeNet5Classifier.load_from_checkpoint(args.ckpt, map_location="cpu")
    trainer = pl.Trainer(
        accelerator=args.accelerator, devices=1, logger=False, enable_progress_bar=False, enable_model_summary=False
    )
    accuracy = trainer.test(model, datamodule=data, verbose=False)[0]["test_accuracy"]
    print(f"checkpoint {args.ckpt}: test accuracy {accuracy:.4f}")
    return accuracy


def main(argv: list[str] | None = None) -> dict[str, float]:
    args = parse_args(argv)
    if args.eval_only and (args.ckpt is None or not Path(args.ckpt).is_file()):
        raise SystemExit(f"--eval-only needs --ckpt PATH of an existing checkpoint; got {args.ckpt!r}.")
    data = DigitsDataModule(
        args.data_dir,
        batch_size=args.batch_size,
        max_train_samples=args.max_train_samples,
        seed=args.seed,
        source="mnist",
        download=args.download,
    )
    data.setup()
    print(f"data: {data.source}; {len(data.train_set)} train / {len(data.test_set)} test samples")
    if args.eval_only:
        return {"eval": evaluate(args, data)}
    results = {"lightning_sink": train(args, data, stock=False)[0]}
    if args.compare_stock:
        results["stock_lightning"] = train(args, data, stock=True)[0]
        gap = 100 * (results["lightning_sink"] - results["stock_lightning"])
        print(f"lightning-sink minus stock Lightning: {gap:+.2f} percentage points")
    print(
        f"final test accuracy: {results['lightning_sink']:.4f} (MindSpore's tutorial reports {MINDSPORE_ACCURACY:.4f})"
    )
    return results


if __name__ == "__main__":
    exit_on_missing_data(main)
