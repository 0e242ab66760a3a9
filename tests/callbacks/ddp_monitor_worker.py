"""A 2-process SinkDDPStrategy run on gloo with the monitors, launched by Lightning's own subprocess launcher.

Run as ``python -m tests.callbacks.ddp_monitor_worker OUT_DIR SCENARIO``: ``print`` (plain run) or ``nan`` (rank 1's
third step returns NaN; ``on_nonfinite="stop"``). Every rank writes what it trained to ``OUT_DIR/rank{r}.pt``.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

from lightning_sink import DynamicLossScale, LossScalePrecision, SinkDDPStrategy
from lightning_sink.callbacks import LossMonitor, LossScaleMonitor, TimeMonitor
from tests.callbacks.common import MICRO, RecordingClassifier
from tests.helpers import loader, make_dataset, quiet_trainer

SAMPLES = 32  # 4 micro-batches of 4 per rank per epoch


class NanOnRankOne(RecordingClassifier):
    def training_step(self, batch, batch_idx):
        self.nan_at = 2 if self.global_rank == 1 else None
        return super().training_step(batch, batch_idx)


def main(out_dir: Path, scenario: str) -> None:
    model = NanOnRankOne() if scenario == "nan" else RecordingClassifier()
    loss_monitor = LossMonitor(1, on_nonfinite="stop" if scenario == "nan" else "raise")
    strategy = SinkDDPStrategy(accumulation_steps=2, process_group_backend="gloo")
    plugin = LossScalePrecision("32-true", DynamicLossScale(init_scale=1024.0))
    trainer = quiet_trainer(
        strategy=strategy,
        devices=2,
        max_epochs=2,
        plugins=[plugin],
        callbacks=[loss_monitor, TimeMonitor(), LossScaleMonitor()],
    )
    trainer.fit(model, loader(make_dataset(num_samples=SAMPLES), MICRO))
    torch.save(
        {
            "losses": torch.stack(model.step_losses),
            "global_step": trainer.global_step,
            "monitor_steps": loss_monitor.steps.total,
        },
        out_dir / f"rank{trainer.global_rank}.pt",
    )


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2])
