"""Example 2 (MindSpore's sink mode): LossMonitor's lines against a plain PyTorch loop over the same endless traversal."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F

from tests.conftest import clean_subprocess_env
from tests.examples.environment import MNIST_SKIP_REASON, REPO, SUBPROCESS_TIMEOUT_S, mnist_root

MNIST = mnist_root()

from digits import DigitsDataModule  # noqa: E402
from lenet import LeNet5Classifier  # noqa: E402

pytestmark = pytest.mark.skipif(MNIST is None, reason=MNIST_SKIP_REASON)
SAMPLES = 640  # 20 batches of 32 per data pass
LINE = re.compile(r"^epoch: (\d+) step: (\d+), loss is ([0-9.e+-]+)$", re.MULTILINE)


def run_example(tmp_path: Path, *args: str) -> str:
    env = clean_subprocess_env(PYTHONPATH=str(REPO), OMP_NUM_THREADS="2")
    command = [
        sys.executable,
        str(REPO / "examples" / "mnist_lenet_sink.py"),
        "--accelerator",
        "cpu",
        "--data-dir",
        str(MNIST),
        "--max-train-samples",
        str(SAMPLES),
        *args,
    ]
    done = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=SUBPROCESS_TIMEOUT_S)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    return done.stdout


def plain_loop_losses(batches: int) -> list[float]:
    """The example's recipe by hand: same seed, same loader, passes one after another; every batch's loss."""
    pl.seed_everything(0, verbose=False)
    net = LeNet5Classifier(lr=0.01, momentum=0.9).model
    data = DigitsDataModule(str(MNIST), batch_size=32, max_train_samples=SAMPLES, seed=0, source="mnist")
    data.setup()
    loader = data.train_dataloader()
    optimizer = torch.optim.SGD(net.parameters(), lr=0.01, momentum=0.9)
    losses = []
    while len(losses) < batches:
        for x, y in loader:
            loss = F.cross_entropy(net(x), y)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            losses.append(loss.item())
            if len(losses) == batches:
                break
    return losses


@pytest.mark.slow
def test_sinks_of_k_batches_continue_the_traversal_across_epochs(tmp_path):
    stdout = run_example(tmp_path, "--sink-size", "15", "--epochs", "3")  # 45 batches: passes end inside sinks
    lines = LINE.findall(stdout)
    assert [(int(epoch), int(step)) for epoch, step, _ in lines] == [(1, 15), (2, 15), (3, 15)]
    assert "trained 45 batches in 3 sinks (45 updates)" in stdout
    reference = plain_loop_losses(45)
    printed = [float(loss) for _, _, loss in lines]
    assert printed == pytest.approx([reference[14], reference[29], reference[44]], rel=1e-4)


@pytest.mark.slow
@pytest.mark.parametrize(
    "mode, expected_lines, sinks",
    [
        ("pass", [(1, 20), (2, 20)], 2),  # one data pass per sink
        ("all", [(1, 40)], 1),  # every pass in a single sink
        ("step", [(epoch, 1) for epoch in range(1, 41)], 40),  # one step per sink
    ],
)
def test_mindspores_three_data_sink_modes(tmp_path, mode, expected_lines, sinks):
    stdout = run_example(tmp_path, "--mode", mode, "--epochs", "2")
    assert [(int(epoch), int(step)) for epoch, step, _ in LINE.findall(stdout)] == expected_lines
    assert f"trained 40 batches in {sinks} sinks (40 updates)" in stdout
