"""Example 1 (MindSpore's accumulation tutorial, standalone): run as a user runs it, then check its checkpoint with plain PyTorch."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.conftest import clean_subprocess_env
from tests.examples.environment import MNIST_SKIP_REASON, REPO, SUBPROCESS_TIMEOUT_S, mnist_root

MNIST = mnist_root()

from digits import DigitsDataModule  # noqa: E402
from lenet import LeNet5  # noqa: E402


def run_example(tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    env = clean_subprocess_env(PYTHONPATH=str(REPO), OMP_NUM_THREADS="2")
    command = [sys.executable, str(REPO / "examples" / "mnist_lenet_accumulation.py"), "--accelerator", "cpu", *args]
    return subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=SUBPROCESS_TIMEOUT_S)


def plain_test_accuracy(checkpoint: Path) -> float:
    """Accuracy of the saved weights on the MNIST test set, computed without Lightning."""
    state = torch.load(checkpoint, map_location="cpu", weights_only=False)["state_dict"]
    net = LeNet5()
    net.load_state_dict({key.removeprefix("model."): value for key, value in state.items() if key.startswith("model.")})
    data = DigitsDataModule(str(MNIST), source="mnist")
    data.setup()
    x, y = data.test_set.tensors
    with torch.no_grad():
        return (net.eval()(x).argmax(1) == y).float().mean().item()


@pytest.mark.slow
@pytest.mark.skipif(MNIST is None, reason=MNIST_SKIP_REASON)
def test_small_run_compares_with_stock_and_its_checkpoint_evaluates(tmp_path):
    done = run_example(
        tmp_path,
        "--data-dir",
        str(MNIST),
        "--epochs",
        "1",
        "--max-train-samples",
        "8192",
        "--compare-stock",
        "--out",
        str(tmp_path / "out"),
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    reports = dict(
        re.findall(
            r"^(lightning_sink|stock_lightning): 64 updates in [0-9.]+ s, test accuracy ([0-9.]+)",
            done.stdout,
            re.MULTILINE,
        )
    )  # 8192 / 32 / 4 = 64 updates each
    assert set(reports) == {"lightning_sink", "stock_lightning"}
    sink, stock = float(reports["lightning_sink"]), float(reports["stock_lightning"])
    assert sink > 0.5 and abs(sink - stock) < 0.05  # same recipe, same seed: the same model up to float rounding
    assert f"final test accuracy: {sink:.4f}" in done.stdout
    checkpoint = tmp_path / "out" / "lenet5.ckpt"
    assert plain_test_accuracy(checkpoint) == pytest.approx(sink, abs=1e-4)

    evaluated = run_example(tmp_path, "--data-dir", str(MNIST), "--eval-only", "--ckpt", str(checkpoint))
    assert evaluated.returncode == 0, evaluated.stderr[-4000:]
    assert f"checkpoint {checkpoint}: test accuracy {sink:.4f}" in evaluated.stdout


@pytest.mark.slow
def test_eval_only_without_a_checkpoint_is_a_clear_error(tmp_path):
    done = run_example(tmp_path, "--eval-only", "--ckpt", str(tmp_path / "no.ckpt"))  # refused before any data
    assert done.returncode != 0
    assert f"--eval-only needs --ckpt PATH of an existing checkpoint; got '{tmp_path / 'no.ckpt'}'" in done.stderr


@pytest.mark.slow
def test_missing_mnist_without_download_is_a_clear_error(tmp_path):
    done = run_example(tmp_path, "--data-dir", str(tmp_path))
    assert done.returncode != 0
    assert done.stderr.startswith("error: --data-dir") and "does not hold MNIST in torchvision's layout" in done.stderr
    assert done.stderr.count("\n") == 1 and "Traceback" not in done.stderr  # one line, no traceback
