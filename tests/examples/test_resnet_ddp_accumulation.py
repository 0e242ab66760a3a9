"""Example 3 (MindSpore's accumulation tutorial, parallel mode): ResNet-50 on 2 gloo processes, run as a user runs it."""

from __future__ import annotations

import math
import re
import subprocess
import sys

import pytest

from tests.conftest import clean_subprocess_env
from tests.examples.environment import MNIST_SKIP_REASON, REPO, SUBPROCESS_TIMEOUT_S, mnist_root

MNIST = mnist_root()


@pytest.mark.slow
@pytest.mark.skipif(MNIST is None, reason=MNIST_SKIP_REASON)
def test_small_run_on_two_processes(tmp_path):
    env = clean_subprocess_env(PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
    command = [
        sys.executable,
        str(REPO / "examples" / "resnet_ddp_accumulation.py"),
        "--data-dir",
        str(MNIST),
        "--accelerator",
        "cpu",
    ]
    done = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=SUBPROCESS_TIMEOUT_S)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    # 192 samples over 2 ranks in micro-batches of 8: 12 per rank, one sink (one data pass), 2 windows of 6.
    lines = re.findall(r"^epoch: 1 step: 12, loss is ([0-9.e+-]+)$", done.stdout, re.MULTILINE)
    assert len(lines) == 1  # printed by rank 0 only, once per sink
    assert math.isfinite(float(lines[0])) and 0 < float(lines[0]) < 20
    assert "epoch: 1 step: 12, loss scale is 65536.0, overflow is False, skipped updates is 0" in done.stdout
    assert "trained 2 updates on 2 processes (6 micro-batches of 8 per process each)" in done.stdout
    assert re.search(r"^final test accuracy: [0-9.]+$", done.stdout, re.MULTILINE)
