"""The quick-start job, run as a user runs it (a subprocess), on both offline data sources."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from tests.conftest import clean_subprocess_env
from tests.examples.environment import MNIST_SKIP_REASON, REPO, SUBPROCESS_TIMEOUT_S, mnist_root
from tests.examples.output_checks import unexpected_warnings

MNIST = mnist_root()


def run_quickstart(tmp_path: Path, *args: str) -> str:
    env = clean_subprocess_env(PYTHONPATH=str(REPO), OMP_NUM_THREADS="2")
    command = [sys.executable, str(REPO / "examples" / "quickstart.py"), "--log-dir", str(tmp_path / "tb"), *args]
    done = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=SUBPROCESS_TIMEOUT_S)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    assert unexpected_warnings(done.stdout + done.stderr) == []
    return done.stdout


def final_accuracy(stdout: str) -> float:
    return float(re.search(r"^final test accuracy: ([0-9.]+)$", stdout, re.MULTILINE).group(1))


def quoted_digits_accuracy() -> set[str]:
    """The digits run's accuracy as README.md and examples/README.md quote it (the run above checks it)."""
    readme = (REPO / "README.md").read_text()
    examples = (REPO / "examples" / "README.md").read_text()
    return {
        re.search(r"([0-9.]+) after 20 epochs of the\s+digits", readme).group(1),
        re.search(r"20 epochs of the digits: `([0-9.]+)`", examples).group(1),
    }


def logged(tmp_path: Path, name: str = "train_loss") -> list:
    # fit and test each open an event file in the run's folder; read the folder, not one file.
    run_dir = next((tmp_path / "tb").rglob("events.out.tfevents.*")).parent
    accumulator = EventAccumulator(str(run_dir))
    accumulator.Reload()
    return accumulator.Scalars(name)


@pytest.mark.slow
def test_quickstart_on_sklearn_digits(tmp_path):
    stdout = run_quickstart(tmp_path, "--data", "digits")  # the default recipe a fresh machine without MNIST runs
    assert "data: scikit-learn's bundled 8x8 digits" in stdout and "; 20 epochs" in stdout
    assert final_accuracy(stdout) > 0.9  # 10 classes: chance is 0.1
    assert quoted_digits_accuracy() == {re.search(r"^final test accuracy: (\S+)$", stdout, re.MULTILINE).group(1)}
    # 1497 samples // 32 = 46 micro-batches per pass, one pass per sink; windows of 4 run on across sinks:
    # 20 x 46 = 920 micro-batches = 230 updates.
    assert "trained 230 updates" in stdout
    assert re.findall(r"^epoch: (\d+) step: 46, loss is [0-9.e-]+$", stdout, re.MULTILINE) == [
        str(e) for e in range(1, 21)
    ]
    # log_every_n_steps=1: a point per update u at u - 1, as without sinking.
    assert [event.step for event in logged(tmp_path)] == list(range(230))
    assert {event.value for event in logged(tmp_path, "loss_scale")} == {2.0**16}  # fp32: never overflows


@pytest.mark.slow
@pytest.mark.skipif(MNIST is None, reason=MNIST_SKIP_REASON)
def test_quickstart_on_mnist(tmp_path):
    stdout = run_quickstart(
        tmp_path, "--data", "mnist", "--data-dir", str(MNIST), "--epochs", "1", "--max-train-samples", "8192"
    )
    assert f"data: MNIST from {MNIST}" in stdout
    assert final_accuracy(stdout) > 0.6  # 64 updates; chance is 0.1
    assert "trained 64 updates" in stdout  # 8192 // 32 // 4, one sink
    assert re.search(r"^epoch: 1 step: 256, loss is [0-9.e-]+$", stdout, re.MULTILINE)
    assert [event.step for event in logged(tmp_path)] == list(range(64))


@pytest.mark.slow
def test_mnist_required_but_missing_is_a_clear_error(tmp_path):
    env = clean_subprocess_env(PYTHONPATH=str(REPO))
    command = [sys.executable, str(REPO / "examples" / "quickstart.py"), "--data-dir", str(tmp_path)]
    done = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=SUBPROCESS_TIMEOUT_S)
    assert done.returncode != 0
    # One line saying where MNIST is expected, no traceback.
    assert done.stderr.startswith(f"error: --data-dir {str(tmp_path)!r} does not hold MNIST in torchvision's layout")
    assert done.stderr.count("\n") == 1 and "Traceback" not in done.stderr
