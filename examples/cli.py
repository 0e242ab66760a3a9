"""LightningCLI over the examples: LeNet-5 on handwritten digits, strategy, precision and callbacks from YAML.

    python examples/cli.py fit --config examples/configs/sink.yaml
    python examples/cli.py fit --config examples/configs/accumulate.yaml --print_config > my.yaml
    python examples/cli.py fit --config my.yaml                              # runs the printed config unchanged
    python examples/cli.py fit --trainer.strategy=sink --trainer.accumulate_grad_batches=4 \\
        --trainer.callbacks+=callbacks.LossMonitor --trainer.callbacks.per_print_times=10

Data: ``DigitsDataModule`` (MNIST when found, else scikit-learn's digits; ``--data.source=digits`` forces the
latter, ``--data.max_train_samples=N`` trains on a prefix). Offline: nothing is downloaded.
"""

from __future__ import annotations

import sys
from pathlib import Path

from lightning.pytorch.cli import LightningCLI

sys.path.insert(0, str(Path(__file__).resolve().parent))  # digits.py and lenet.py sit next to this file

import lightning_sink  # noqa: F401  (registers the "sink", "sink_ddp" and "sink_ddp_spawn" strategy names)

from digits import DigitsDataModule, exit_on_missing_data
from lenet import LeNet5Classifier

__all__ = ["main"]


def main(args: list[str] | None = None) -> LightningCLI:
    # seed 0 unless the config says otherwise, so that a printed config reproduces the run it came from.
    return LightningCLI(
        LeNet5Classifier, DigitsDataModule, seed_everything_default=0, args=args, save_config_kwargs={"overwrite": True}
    )


if __name__ == "__main__":
    exit_on_missing_data(main)
