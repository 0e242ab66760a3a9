"""The sharded-training example, run as a user runs it: 4 processes, then its checkpoint's layout vs the prediction."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import clean_subprocess_env
from tests.examples.output_checks import unexpected_warnings

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_sharded_mnist_example_learns_and_its_layout_is_predicted(tmp_path, monkeypatch):
    from lightning_sink.layout import load_layout
    from lightning_sink.layout_inference import infer_layout

    env = clean_subprocess_env(PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
    command = [
        sys.executable,
        str(REPO / "examples" / "model_parallel_mnist.py"),
        "--max-train-samples",
        "4096",
        "--checkpoint",
        str(tmp_path / "mp.ckpt"),
    ]
    done = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    assert unexpected_warnings(done.stdout + done.stderr) == []  # e.g. FSDP2's warning about modules returning views
    assert re.search(r"mesh 2 x 2; 16 updates of 256 samples", done.stdout)
    accuracy = float(re.search(r"final test accuracy: ([0-9.]+)", done.stdout).group(1))
    assert accuracy > 0.6  # 10 classes: chance is 0.1

    monkeypatch.syspath_prepend(str(REPO / "examples"))
    assert infer_layout("model_parallel_mnist.ShardedMLP", 2, 2) == load_layout(tmp_path / "mp.ckpt")
