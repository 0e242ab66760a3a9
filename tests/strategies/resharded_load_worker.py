"""Gloo runs for loading resharded checkpoints with ``Trainer.fit(ckpt_path=DST)``, launched by Lightning.

``python -m tests.strategies.resharded_load_worker OUT train``: 4 ranks (data_parallel=2 x tensor_parallel=2),
AdamW, windows of 2, 2 epochs; ``ReshardCheckpoint`` saves ``OUT/stage1`` and reshards it to the layout in
``OUT/target_dp1_tp2.json`` (written by the test with ``infer_layout``) into ``OUT/resharded_dp1_tp2``.

``python -m tests.strategies.resharded_load_worker OUT resume``: 2 ranks fit from ``OUT/resharded_dp1_tp2`` on a
1 x 2 mesh, then from ``OUT/resharded_dp2_tp1`` (converted by the test) on a 2 x 1 mesh, then from
``OUT/resharded_single`` (a one-device run's ``ReshardCheckpoint`` output) on a 1 x 2 mesh, 2 more epochs each,
and from ``OUT/resharded_sink`` (a one-device sink-mode run stopped in the middle of a data pass), one more sink.

Rank 0 writes what the test checks into ``OUT/<name>.pt``: the full parameters and AdamW state right after the
load, the loss on the whole data set (the "probe") at the end of stage 1, after the load and after each epoch.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from lightning.pytorch.callbacks import Callback

from lightning_sink import SinkModelParallelStrategy
from lightning_sink.callbacks import ReshardCheckpoint
from tests.distributed import leave_the_group_and_exit
from tests.helpers import loader, make_dataset, quiet_trainer
from tests.strategies.mp_models import TPClassifier, full_parameters

MICRO_BATCH, STEPS, SAMPLES, LR = 4, 2, 48, 0.01


def full_tensor(value):
    return value.full_tensor() if hasattr(value, "full_tensor") else value


def probe_loss(module) -> float:
    """The loss of the current parameters on the whole data set (same input on every rank: a valid collective)."""
    x, y = make_dataset(num_samples=SAMPLES).tensors
    with torch.no_grad():
        return F.cross_entropy(module(x), y).item()


class Record(Callback):
    """Full parameters and optimizer state after the checkpoint is restored; probe losses at epoch and fit ends."""

    def __init__(self) -> None:
        self.result: dict = {"epoch_probes": []}

    def on_train_start(self, trainer, pl_module):
        from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

        optimizer_state = get_optimizer_state_dict(pl_module, trainer.optimizers[0])["state"]
        self.result.update(
            start_global_step=trainer.global_step,
            start_epoch=trainer.current_epoch,
            start_probe=probe_loss(pl_module),
            params=full_parameters(pl_module),
            optimizer={
                f"{name}.{key}": full_tensor(value).clone()
                for name, state in optimizer_state.items()
                for key, value in state.items()
            },
            lr=trainer.optimizers[0].param_groups[0]["lr"],
        )

    def on_train_epoch_end(self, trainer, pl_module):
        self.result["epoch_probes"].append(probe_loss(pl_module))

    def on_fit_end(self, trainer, pl_module):  # (listed before ReshardCheckpoint: the state it saves)
        self.result.update(end_global_step=trainer.global_step, end_probe=probe_loss(pl_module))


class RecordingTPClassifier(TPClassifier):
    """Records the first feature of every sample it trains on (to see where in the data a run starts)."""

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self.seen: list[torch.Tensor] = []

    def training_step(self, batch, batch_idx):
        self.seen.append(batch[0][:, 0].clone())
        return super().training_step(batch, batch_idx)


def fit(dp: int, tp: int, epochs: int, callbacks=(), ckpt_path=None, sink_size=None) -> dict:
    record = Record()
    strategy = SinkModelParallelStrategy(
        data_parallel_size=dp,
        tensor_parallel_size=tp,
        accumulation_steps=STEPS,
        sink_size=sink_size,
        process_group_backend="gloo",
    )
    trainer = quiet_trainer(strategy=strategy, devices=dp * tp, max_epochs=epochs, callbacks=[record, *callbacks])
    model = RecordingTPClassifier(optimizer="adamw", lr=LR, seed=dp * 10 + tp)
    trainer.fit(model, loader(make_dataset(num_samples=SAMPLES), MICRO_BATCH), ckpt_path=ckpt_path)
    return {**record.result, "seen": torch.cat(model.seen)}


def save(out: Path, name: str, result: dict) -> None:
    if dist.get_rank() == 0:
        torch.save(result, out / f"{name}.pt")


def train(out: Path) -> None:
    reshard = ReshardCheckpoint(
        out / "target_dp1_tp2.json", out / "resharded_dp1_tp2", ckpt_prefix="ckpt_", src_dir=out / "stage1"
    )
    result = fit(2, 2, epochs=2, callbacks=[reshard])
    result["bytes_written"] = sum(r.bytes_written for r in reshard.report.ranks) if reshard.report else None
    save(out, "stage1", result)


def resume(out: Path) -> None:
    save(out, "resumed_dp1_tp2", fit(1, 2, epochs=4, ckpt_path=out / "resharded_dp1_tp2"))
    save(out, "resumed_dp2_tp1", fit(2, 1, epochs=4, ckpt_path=out / "resharded_dp2_tp1"))
    save(out, "resumed_single", fit(1, 2, epochs=4, ckpt_path=out / "resharded_single"))
    # sink mode: a one-device run stopped after 2 sinks of 4 batches (8 of 12 batches of the pass), one more sink
    save(out, "resumed_sink", fit(1, 2, epochs=3, ckpt_path=out / "resharded_sink", sink_size=4))


def fail(out: Path) -> None:
    """2 ranks whose ReshardCheckpoint target layout does not fit the model: each rank records what it raised.

    (Lightning's launcher kills the other ranks once rank 0's fit raises, so rank 1 may not get to record.)"""
    import os

    reshard = ReshardCheckpoint(out / "bad_layout.json", out / "bad_dst", src_dir=out / "bad_src")
    try:
        fit(1, 2, epochs=1, callbacks=[reshard])
    except Exception as error:  # the test checks the type and message
        rank = int(os.environ.get("LOCAL_RANK", "0"))  # (the process group may be gone by now)
        torch.save({"type": type(error).__name__, "message": str(error)}, out / f"fail_{rank}.pt")
        sys.exit(0)
    sys.exit(3)  # fit did not raise


if __name__ == "__main__":
    {"train": train, "resume": resume, "fail": fail}[sys.argv[2]](Path(sys.argv[1]))
    leave_the_group_and_exit()  # (tests/distributed.py: the group torn down before the process ends)
