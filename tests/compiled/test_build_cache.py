"""The programs' build is cached across processes: Inductor keeps each compiled graph in its on-disk cache
(``TORCHINDUCTOR_CACHE_DIR``), so a second identical fit in a new process takes every graph from there, trains to
the same parameters, and its build line says so. Two fresh Python processes, each a whole fit."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

FIT = """
import sys
import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset
from lightning_sink import SinkStrategy


class Net(pl.LightningModule):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.cross_entropy(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


generator = torch.Generator().manual_seed(1)
data = TensorDataset(torch.randn(32, 8, generator=generator), torch.randint(0, 4, (32,), generator=generator))
trainer = pl.Trainer(
    accelerator="cpu", strategy=SinkStrategy(sink_size=4, graph_mode="compile", micro_steps_per_call=1),
    max_epochs=2, logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
)
module = Net()
trainer.fit(module, DataLoader(data, batch_size=4))
torch.save(module.state_dict(), sys.argv[1])
"""


def _fit_in_a_new_process(script: Path, cache: Path, out: Path) -> str:
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(cache), "PYTHONPATH": str(Path.cwd())}
    done = subprocess.run(
        [sys.executable, str(script), str(out)], env=env, capture_output=True, text=True, timeout=600, check=False
    )
    assert done.returncode == 0, done.stderr[-3000:]
    lines = [line for line in (done.stdout + done.stderr).splitlines() if "programs are compiled whole" in line]
    assert len(lines) == 1, done.stdout[-3000:] + done.stderr[-3000:]
    return lines[0]


@pytest.mark.slow
def test_a_second_identical_fit_in_a_new_process_takes_every_graph_from_the_cache(tmp_path: Path):
    script = tmp_path / "fit.py"
    script.write_text(FIT)
    cache = tmp_path / "inductor_cache"
    first = _fit_in_a_new_process(script, cache, tmp_path / "first.pt")
    assert "graphs compiled and kept in Inductor's on-disk cache" in first, first
    second = _fit_in_a_new_process(script, cache, tmp_path / "second.pt")
    assert "graphs from Inductor's on-disk cache: an identical build ran before" in second, second
    assert any(cache.iterdir())  # the cache is where the variable said, nowhere else needed
    first_state, second_state = torch.load(tmp_path / "first.pt"), torch.load(tmp_path / "second.pt")
    for name, value in first_state.items():
        assert torch.equal(value, second_state[name]), name
