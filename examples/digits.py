"""Handwritten-digit data for the examples, offline: MNIST from a local folder, else scikit-learn's 8x8 digits.

MNIST is prepared as in MindSpore's LeNet recipe: resized to 32x32 (bilinear), scaled to [0, 1],
normalised with mean 0.1307 and std 0.3081. The whole split is turned into one tensor up front, so an epoch costs
no per-sample Python work.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

__all__ = [
    "DATA_VARIABLE",
    "DigitsDataModule",
    "MissingDataError",
    "exit_on_missing_data",
    "find_mnist",
    "find_mnist_quietly",
]

MNIST_MEAN, MNIST_STD = 0.1307, 0.3081
# The variable naming a folder that holds MNIST/raw, looked at (then ./data) when no --data-dir is given.
DATA_VARIABLE = "LIGHTNING_SINK_DATA"


class MissingDataError(FileNotFoundError):
    """MNIST was required but is not where the example looked; the message says where to put it."""


def exit_on_missing_data(main: Callable[[], Any]) -> None:
    """Run an example's ``main``; missing data ends it with the one-line message instead of a traceback."""
    try:
        main()
    except MissingDataError as error:
        raise SystemExit(f"error: {error}") from None


def _has_mnist(root: Path) -> bool:
    raw = root / "MNIST" / "raw"
    return all(
        (raw / f"{name}-idx{dim}-ubyte").exists()
        for name, dim in (("train-images", 3), ("train-labels", 1), ("t10k-images", 3), ("t10k-labels", 1))
    )


def find_mnist(data_dir: str | None) -> Path | None:
    """The folder holding ``MNIST/raw`` (torchvision's layout), or None. A given ``data_dir`` must hold it."""
    if data_dir is not None:
        root = Path(data_dir)
        if not _has_mnist(root):
            raise MissingDataError(
                f"--data-dir {data_dir!r} does not hold MNIST in torchvision's layout: expected"
                f" {root / 'MNIST' / 'raw'}/{{train,t10k}}-{{images-idx3,labels-idx1}}-ubyte."
            )
        return root
    # Read when called, not at import: a test or a launcher may set the variable after importing this module.
    for candidate in filter(None, (os.environ.get(DATA_VARIABLE, ""), "data")):
        if _has_mnist(Path(candidate)):
            return Path(candidate)
    return None


def find_mnist_quietly(data_dir: str | None) -> Path | None:
    """Like ``find_mnist``, but a ``data_dir`` without MNIST is not an error (it is where a download goes)."""
    try:
        return find_mnist(data_dir)
    except MissingDataError:
        return None


def _to_lenet_input(images: torch.Tensor, max_value: float) -> torch.Tensor:
    x = images.float().unsqueeze(1) / max_value
    x = F.interpolate(x, size=(32, 32), mode="bilinear", align_corners=False)
    return (x - MNIST_MEAN) / MNIST_STD


def _load_mnist(root: Path, download: bool = False) -> tuple[TensorDataset, TensorDataset]:
    from torchvision.datasets import MNIST

    splits = []
    for train in (True, False):
        data = MNIST(str(root), train=train, download=download)
        splits.append(TensorDataset(_to_lenet_input(data.data, 255.0), data.targets.clone()))
    return splits[0], splits[1]


def _load_sklearn_digits(seed: int = 0) -> tuple[TensorDataset, TensorDataset]:
    from sklearn.datasets import load_digits

    digits = load_digits()
    images = torch.from_numpy(digits.images)
    labels = torch.from_numpy(digits.target).long()
    order = torch.randperm(len(labels), generator=torch.Generator().manual_seed(seed))
    x, y = _to_lenet_input(images[order], 16.0), labels[order]
    cut = len(y) * 5 // 6
    return TensorDataset(x[:cut], y[:cut]), TensorDataset(x[cut:], y[cut:])


class DigitsDataModule(pl.LightningDataModule):
    """MNIST (60k/10k) when found, else scikit-learn's bundled digits (1497/300); 1x32x32 inputs, 10 classes.

    Args:
        data_dir: a folder holding ``MNIST/raw``; None looks in ``$LIGHTNING_SINK_DATA`` and ``./data``, then
            falls back to scikit-learn's digits.
        batch_size: micro-batch size.
        max_train_samples: keep only the first this-many training samples (quick runs and tests).
        max_test_samples: the same for the test split.
        drop_last: drop the last incomplete batch, as MindSpore's ``drop_remainder=True``.
        source: ``"auto"`` (MNIST when found, else digits), ``"mnist"`` (an error when not found) or ``"digits"``.
        download: with ``source="mnist"``, download MNIST with torchvision into ``data_dir`` (or ``./data``) when it
            is not found (needs internet).
    """

    def __init__(
        self,
        data_dir: str | None = None,
        batch_size: int = 32,
        max_train_samples: int | None = None,
        drop_last: bool = True,
        shuffle: bool = True,
        seed: int = 0,
        source: str = "auto",
        download: bool = False,
        max_test_samples: int | None = None,
    ) -> None:
        super().__init__()
        if source not in ("auto", "mnist", "digits"):
            raise ValueError(f"source={source!r} is not valid: choose 'auto', 'mnist' or 'digits'.")
        self.source_choice = source
        self.data_dir, self.batch_size, self.max_train_samples = data_dir, batch_size, max_train_samples
        self.drop_last, self.shuffle, self.seed, self.download = drop_last, shuffle, seed, download
        self.max_test_samples = max_test_samples
        self.source = ""

    def setup(self, stage: str | None = None) -> None:
        if getattr(self, "train_set", None) is not None:
            return
        if self.source_choice == "mnist" and self.download and find_mnist_quietly(self.data_dir) is None:
            root = Path(self.data_dir or "data")
            self.train_set, self.test_set = _load_mnist(root, download=True)
            self.source = f"MNIST downloaded to {root}"
            self._keep()
            return
        root = None if self.source_choice == "digits" else find_mnist(self.data_dir)
        if root is None and self.source_choice == "mnist":
            raise MissingDataError(
                "source='mnist' but no MNIST folder was found: pass --data-dir (a folder holding MNIST/raw), set"
                " LIGHTNING_SINK_DATA, or allow a torchvision download (--download, needs internet)."
            )
        if root is not None:
            self.train_set, self.test_set = _load_mnist(root)
            self.source = f"MNIST from {root}"
        else:
            self.train_set, self.test_set = _load_sklearn_digits(self.seed)
            self.source = "scikit-learn's bundled 8x8 digits (no MNIST folder found)"
        self._keep()

    def _keep(self) -> None:
        """Cut the splits to their requested prefixes."""
        if self.max_train_samples is not None:
            self.train_set = TensorDataset(*(t[: self.max_train_samples] for t in self.train_set.tensors))
        if self.max_test_samples is not None:
            self.test_set = TensorDataset(*(t[: self.max_test_samples] for t in self.test_set.tensors))

    def train_dataloader(self) -> DataLoader:
        generator = torch.Generator().manual_seed(self.seed)
        return DataLoader(
            self.train_set,
            batch_size=self.batch_size,
            shuffle=self.shuffle,
            drop_last=self.drop_last,
            generator=generator,
        )

    def test_dataloader(self) -> DataLoader:
        return DataLoader(self.test_set, batch_size=256)

    val_dataloader = test_dataloader
