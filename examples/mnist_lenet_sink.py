"""MindSpore's data sinking example: LeNet-5 on MNIST, batch 32, Momentum(0.01, 0.9), K batches per sink.

    python examples/mnist_lenet_sink.py --data-dir DIR              # model.train(10, sink_size=1000)
    python examples/mnist_lenet_sink.py --data-dir DIR --mode step  # data_sink(): one step per sink
    python examples/mnist_lenet_sink.py --data-dir DIR --mode pass  # data_sink(sink_size=data_size)
    python examples/mnist_lenet_sink.py --data-dir DIR --mode all   # data_sink(sink_size=epochs*data_size)

The default reproduces ``model.train(epoch=10, ..., callbacks=[LossMonitor()], dataset_sink_mode=True,
sink_size=1000)``: each epoch is one sink of 1000 batches drawn from an endless traversal of the 1875 batches of
MNIST, so 10 epochs consume 10 x 1000 = 10,000 batches and ``LossMonitor`` prints one line per epoch,
``epoch: 1 step: 1000, loss is ...``. The other modes are MindSpore's three ``data_sink`` calls, each training
10 data passes: one step per sink (a line per step), one data pass per sink, and all 10 passes in a single sink.
"""

from __future__ import annotations

import argparse
import time

import lightning.pytorch as pl

from lightning_sink import SinkStrategy
from lightning_sink.callbacks import LossMonitor, TimeMonitor

from digits import DigitsDataModule, exit_on_missing_data
from lenet import LeNet5Classifier

MODES = ("sink1000", "step", "pass", "all")


class SinkCounter(pl.Callback):
    """Batches trained, counted from what every sink reports (one loss per batch)."""

    def __init__(self) -> None:
        self.batches = self.sinks = 0

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx) -> None:
        self.batches += len(outputs["losses"])
        self.sinks += 1


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data-dir", default=None, help="folder holding MNIST/raw (default: searched, see digits.py)")
    parser.add_argument("--download", action="store_true", help="download MNIST with torchvision if not found")
    parser.add_argument("--mode", choices=MODES, default="sink1000")
    parser.add_argument("--epochs", type=int, default=10, help="sinks (sink1000), or data passes (other modes)")
    parser.add_argument("--sink-size", type=int, default=1000, help="batches per sink in the sink1000 mode")
    parser.add_argument("--graph-mode", choices=("eager", "compile", "cuda_graph"), default="eager")
    parser.add_argument("--max-train-samples", type=int, default=None, help="train on a prefix (quick runs)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--accelerator", default="auto")
    return parser.parse_args(argv)


def sink_plan(mode: str, epochs: int, sink_size: int, batches_per_pass: int) -> tuple[int, int]:
    """(sink_size, Lightning epochs) for each mode; in the data_sink modes ``epochs`` counts data passes."""
    if mode == "sink1000":
        return sink_size, epochs
    if mode == "step":
        return 1, epochs * batches_per_pass
    if mode == "pass":
        return -1, epochs
    return epochs * batches_per_pass, 1


def main(argv: list[str] | None = None) -> dict[str, float]:
    args = parse_args(argv)
    pl.seed_everything(args.seed, verbose=False)
    model = LeNet5Classifier(lr=0.01, momentum=0.9)
    data = DigitsDataModule(
        args.data_dir,
        batch_size=32,
        max_train_samples=args.max_train_samples,
        seed=args.seed,
        source="mnist",
        download=args.download,
    )
    data.setup()
    batches_per_pass = len(data.train_dataloader())
    sink_size, epochs = sink_plan(args.mode, args.epochs, args.sink_size, batches_per_pass)
    print(
        f"data: {data.source}; {batches_per_pass} batches per pass; mode {args.mode}: {epochs} sinks of"
        f" {sink_size if sink_size > 0 else batches_per_pass} batches"
    )

    counter = SinkCounter()
    trainer = pl.Trainer(
        accelerator=args.accelerator,
        devices=1,
        max_epochs=epochs,
        strategy=SinkStrategy(sink_size=sink_size, graph_mode=args.graph_mode),
        callbacks=[LossMonitor(), TimeMonitor(), counter],
        logger=False,
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
        f"trained {counter.batches} batches in {counter.sinks} sinks ({trainer.global_step} updates) in {seconds:.1f} s"
    )
    print(f"final test accuracy: {accuracy:.4f}")
    return {"batches": counter.batches, "accuracy": accuracy}


if __name__ == "__main__":
    exit_on_missing_data(main)
