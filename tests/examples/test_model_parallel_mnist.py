"""The sharded-training example, run as a user runs it: 4 processes, then its checkpoint's layout vs the prediction.

It trains on whatever data it finds (MNIST when ``$LIGHTNING_SINK_DATA`` holds it, else scikit-learn's digits), so
the number of updates expected is worked out here from that data's size and the run's settings.
"""

from __future__ import annotations

import math
import re
import subprocess
import sys

import pytest

from tests.conftest import clean_subprocess_env
from tests.examples.environment import REPO, SUBPROCESS_TIMEOUT_S, mnist_root
from tests.examples.output_checks import unexpected_warnings

MAX_TRAIN_SAMPLES = 4096
DATA_PARALLEL, MICRO_BATCH, ACCUMULATION = 2, 32, 4  # the example's defaults
DIGITS_TRAIN_SAMPLES = 1797 * 5 // 6  # scikit-learn's 1797 digits, of which the first five sixths train


def expected_updates(train_samples: int) -> int:
    """Lightning's DistributedSampler pads to a multiple of the ranks; each rank's loader drops its last incomplete
    micro-batch, and the last incomplete window of the pass still makes an update (the default partial window)."""
    per_rank = math.ceil(train_samples / DATA_PARALLEL)
    return math.ceil((per_rank // MICRO_BATCH) / ACCUMULATION)


@pytest.mark.slow
def test_sharded_mnist_example_learns_and_its_layout_is_predicted(tmp_path, monkeypatch):
    from lightning_sink.layout import load_layout
    from lightning_sink.layout_inference import infer_layout

    env = clean_subprocess_env(PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
    command = [
        sys.executable,
        str(REPO / "examples" / "model_parallel_mnist.py"),
        "--max-train-samples",
        str(MAX_TRAIN_SAMPLES),
        "--checkpoint",
        str(tmp_path / "mp.ckpt"),
    ]
    done = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=SUBPROCESS_TIMEOUT_S)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    assert unexpected_warnings(done.stdout + done.stderr) == []  # e.g. FSDP2's warning about modules returning views
    mnist = mnist_root()  # the subprocess ran in tmp_path: $LIGHTNING_SINK_DATA is the only place it could find MNIST
    if mnist is not None:
        assert f"data: MNIST from {mnist};" in done.stdout
        updates = expected_updates(MAX_TRAIN_SAMPLES)  # 16
    else:
        assert "data: scikit-learn's bundled 8x8 digits" in done.stdout
        updates = expected_updates(DIGITS_TRAIN_SAMPLES)  # 6
    global_batch = DATA_PARALLEL * MICRO_BATCH * ACCUMULATION
    assert re.search(rf"mesh 2 x 2; {updates} updates of {global_batch} samples", done.stdout), done.stdout
    accuracy = float(re.search(r"final test accuracy: ([0-9.]+)", done.stdout).group(1))
    assert accuracy > 0.6  # 10 classes: chance is 0.1

    monkeypatch.syspath_prepend(str(REPO / "examples"))
    assert infer_layout("model_parallel_mnist.ShardedMLP", 2, 2) == load_layout(tmp_path / "mp.ckpt")
