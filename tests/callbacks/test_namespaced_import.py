"""A user's own ``callbacks.py`` beside the training script shadows the top-level ``callbacks`` alias; the canonical
``lightning_sink.callbacks`` import still works and trains."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tests.callbacks.common import LOSS_LINE
from tests.conftest import clean_subprocess_env

USER_CALLBACKS = "MARKER = 'the project own callbacks module'\n"

TRAIN_SCRIPT = textwrap.dedent("""
    import callbacks  # the project's own module, first on sys.path because it sits beside this script
    assert callbacks.MARKER == "the project own callbacks module", callbacks.__file__

    import lightning.pytorch as pl
    import torch
    import torch.nn.functional as F
    from torch.utils.data import DataLoader, TensorDataset

    from lightning_sink.callbacks import LossMonitor


    class Model(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.layer = torch.nn.Linear(4, 2)

        def training_step(self, batch, batch_idx):
            x, y = batch
            return F.cross_entropy(self.layer(x), y)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)


    torch.manual_seed(0)
    data = TensorDataset(torch.randn(32, 4), torch.randint(0, 2, (32,)))
    trainer = pl.Trainer(max_epochs=1, accelerator="cpu", logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, callbacks=[LossMonitor(per_print_times=2)])
    trainer.fit(Model(), DataLoader(data, batch_size=4))
""")


@pytest.mark.slow
def test_canonical_import_works_beside_a_user_callbacks_module(tmp_path: Path) -> None:
    (tmp_path / "callbacks.py").write_text(USER_CALLBACKS)
    (tmp_path / "train.py").write_text(TRAIN_SCRIPT)
    result = subprocess.run(
        [sys.executable, "train.py"],
        cwd=tmp_path,
        env=clean_subprocess_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr
    lines = [LOSS_LINE.match(line) for line in result.stdout.splitlines()]
    steps = [int(match.group(2)) for match in lines if match]
    assert steps == [2, 4, 6, 8], result.stdout  # 8 batches, one line every 2 steps
