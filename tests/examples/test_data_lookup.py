"""Where the examples look for MNIST without ``--data-dir``: ``$LIGHTNING_SINK_DATA``, then ``./data``; nowhere else
(in particular no folder beside the checkout)."""

from __future__ import annotations

import importlib.util
import shutil
from pathlib import Path

import pytest

from tests.examples.environment import REPO

FILES = ("train-images-idx3-ubyte", "train-labels-idx1-ubyte", "t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte")


def fake_mnist(root: Path) -> Path:
    (root / "MNIST" / "raw").mkdir(parents=True)
    for name in FILES:
        (root / "MNIST" / "raw" / name).write_bytes(b"")
    return root


def copied_digits(checkout: Path):
    """examples/digits.py as it sits in a checkout at ``checkout``, imported from there."""
    (checkout / "examples").mkdir(parents=True)
    shutil.copy(REPO / "examples" / "digits.py", checkout / "examples" / "digits.py")
    spec = importlib.util.spec_from_file_location("copied_digits", checkout / "examples" / "digits.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_mnist_beside_the_checkout_is_not_looked_at(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    digits = copied_digits(tmp_path / "checkout")
    for sibling in ("shared/data", "data"):  # folders beside the checkout, not inside the working directory
        fake_mnist(tmp_path / sibling)
    (tmp_path / "elsewhere").mkdir()
    monkeypatch.chdir(tmp_path / "elsewhere")
    monkeypatch.delenv("LIGHTNING_SINK_DATA", raising=False)
    assert digits.find_mnist(None) is None


def test_the_variable_then_the_working_directorys_data(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    digits = copied_digits(tmp_path / "checkout")
    work = tmp_path / "work"
    fake_mnist(work / "data")
    monkeypatch.chdir(work)
    monkeypatch.delenv("LIGHTNING_SINK_DATA", raising=False)
    assert digits.find_mnist(None) == Path("data")
    monkeypatch.setenv("LIGHTNING_SINK_DATA", str(fake_mnist(tmp_path / "named")))
    assert digits.find_mnist(None) == tmp_path / "named"  # read when called, not when imported
