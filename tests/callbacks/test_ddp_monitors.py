"""The monitors on 2 gloo processes (SinkDDPStrategy): only rank 0 prints; a NaN on one rank stops both."""

from __future__ import annotations

import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch

from tests.callbacks.common import loss_lines
from tests.distributed import run_launched


def launch(out_dir: Path, scenario: str) -> subprocess.CompletedProcess:
    return run_launched("tests.callbacks.ddp_monitor_worker", out_dir, scenario, timeout=180)


@pytest.mark.slow
def test_only_rank_zero_prints_its_own_losses(tmp_path):
    done = launch(tmp_path, "print")  # both ranks share the launcher's stdout
    rank0, rank1 = (torch.load(tmp_path / f"rank{r}.pt") for r in (0, 1))
    assert rank0["monitor_steps"] == rank1["monitor_steps"] == 8  # the callback ran on both ranks
    expected = [
        (e, s, str(np.float32(loss.item())))
        for (e, s), loss in zip([(1, s) for s in range(1, 5)] + [(2, s) for s in range(1, 5)], rank0["losses"])
    ]
    assert loss_lines(done.stdout) == expected  # every step once, rank 0's loss
    assert not torch.equal(rank0["losses"], rank1["losses"])  # (rank 1's lines would differ)
    assert sum(line.startswith("epoch time: ") for line in done.stdout.splitlines()) == 2
    scale_lines = [line for line in done.stdout.splitlines() if ", loss scale is " in line]
    assert scale_lines == [
        f"epoch: {e} step: {s}, loss scale is 1024.0, overflow is False, skipped updates is 0"
        for e in (1, 2)
        for s in (2, 4)
    ]  # one per update (2 micro-batches each), rank 0 only


@pytest.mark.slow
def test_nonfinite_loss_on_one_rank_stops_both(tmp_path):
    done = launch(tmp_path, "nan")
    rank0, rank1 = (torch.load(tmp_path / f"rank{r}.pt") for r in (0, 1))
    assert len(rank0["losses"]) == len(rank1["losses"]) == 3  # both stopped after the NaN step's batch
    assert rank0["global_step"] == rank1["global_step"] == 1
    assert torch.isfinite(rank0["losses"]).all() and torch.isnan(rank1["losses"][2])
    assert "LossMonitor: the loss is nan at epoch: 1 step: 3 (global rank 1)" in done.stderr
