"""4-process SinkModelParallelStrategy runs on gloo (data_parallel=2 x tensor_parallel=2), launched by Lightning.

Run as ``python -m tests.strategies.model_parallel_worker OUT_DIR SCENARIO [SCENARIO ...]``; rank 0 writes what the
test compares with its single-process reference into ``OUT_DIR/<scenario>.pt``.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import Callback, ModelCheckpoint

from lightning_sink import DynamicLossScale, LossScalePrecision, SinkModelParallelStrategy
from tests.distributed import CollectiveCounter, leave_the_group_and_exit
from tests.helpers import loader, make_dataset, quiet_trainer
from tests.strategies.mp_models import InjectingTPClassifier, TPClassifier, full_parameters

DP, TP, MICRO_BATCH, STEPS, SAMPLES, EPOCHS = 2, 2, 4, 3, 48, 2
# FSDP2 reduce-scatters gradients through dist.reduce_scatter_single.
COUNTED = ("reduce_scatter_single", "reduce_scatter_tensor", "all_reduce")


class SaveAfterBatch(Callback):
    """Saves a checkpoint after a chosen global batch and records the full parameters at that point."""

    def __init__(self, path: Path, at_batch: int) -> None:
        self.path, self.at_batch, self.params = path, at_batch, None

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if trainer.fit_loop.total_batch_idx == self.at_batch:
            trainer.save_checkpoint(self.path)
            self.params = full_parameters(pl_module)


def fit(model, callbacks=(), plugins=(), ckpt_path=None, **strategy_kwargs):
    strategy = SinkModelParallelStrategy(
        data_parallel_size=DP,
        tensor_parallel_size=TP,
        accumulation_steps=STEPS,
        process_group_backend="gloo",
        **strategy_kwargs,
    )
    checkpointing = any(isinstance(callback, ModelCheckpoint) for callback in callbacks)
    trainer = quiet_trainer(
        strategy=strategy,
        devices=DP * TP,
        max_epochs=EPOCHS,
        callbacks=list(callbacks),
        plugins=list(plugins),
        enable_checkpointing=checkpointing,
    )
    trainer.fit(model, loader(make_dataset(num_samples=SAMPLES), MICRO_BATCH), ckpt_path=ckpt_path)
    return trainer


def save(out_dir: Path, name: str, payload: dict) -> None:
    if dist.get_rank() == 0:
        torch.save(payload, out_dir / f"{name}.pt")


def train_scenario(out_dir: Path) -> None:
    """Exactness and reduction counts; a checkpoint after the first window; a resume from it to the same end."""
    counter, saver = CollectiveCounter(COUNTED), SaveAfterBatch(out_dir / "ckpt", at_batch=STEPS - 1)
    inside_window = SaveAfterBatch(out_dir / "mid", at_batch=STEPS + 1)  # micro-step 2 of window 2
    every_two_updates = ModelCheckpoint(dirpath=out_dir / "model_checkpoint", every_n_train_steps=2, save_top_k=-1)
    model = TPClassifier(optimizer="adamw", lr=0.01, step_lr_gamma=0.95)
    trainer = fit(model, callbacks=[counter, saver, inside_window, every_two_updates])
    final = full_parameters(model)
    resumed_model = TPClassifier(optimizer="adamw", lr=0.01, step_lr_gamma=0.95, seed=7)
    resumed = fit(resumed_model, ckpt_path=out_dir / "ckpt")
    resumed_inside_model = TPClassifier(optimizer="adamw", lr=0.01, step_lr_gamma=0.95, seed=8)
    resumed_inside = fit(resumed_inside_model, ckpt_path=out_dir / "mid")
    save(
        out_dir,
        "train",
        {
            "params": final,
            "at_checkpoint": saver.params,
            "resumed": full_parameters(resumed_model),
            "resumed_inside_window": full_parameters(resumed_inside_model),
            "resumed_inside_window_global_step": resumed_inside.global_step,
            "global_step": trainer.global_step,
            "resumed_global_step": resumed.global_step,
            "per_batch": counter.per_batch,
            "lrs": model.seen_lrs,
            "local_shapes": {name: tuple(p.to_local().shape) for name, p in model.named_parameters()},
        },
    )


def loss_scale_scenario(out_dir: Path) -> None:
    """An inf loss in one micro-step of window 1 on rank 1 only: every rank skips that window, the scale halves."""
    counter = CollectiveCounter(COUNTED)
    model = InjectingTPClassifier(inf_at=(STEPS + 1,), inf_rank=1, optimizer="adamw", lr=0.01)
    plugin = LossScalePrecision("32-true", DynamicLossScale(init_scale=2.0**10))
    trainer = fit(model, callbacks=[counter], plugins=[plugin])
    save(
        out_dir,
        "loss_scale",
        {
            "params": full_parameters(model),
            "global_step": trainer.global_step,
            "scale": plugin.scale,
            "skipped": plugin.skipped_updates,
            "per_batch": counter.per_batch,
        },
    )


def sink_scenario(out_dir: Path) -> None:
    """Sinks of 5 micro-batches with windows of 3, continuous over data passes."""
    model = TPClassifier(optimizer="adamw", lr=0.01, step_lr_gamma=0.95)
    trainer = fit(model, sink_size=5)
    save(out_dir, "sink", {"params": full_parameters(model), "global_step": trainer.global_step, "lrs": model.seen_lrs})


def crash_scenario(out_dir: Path) -> None:
    """Checkpoint after window 1, then every rank is killed while DCP writes the checkpoint after window 2."""
    from torch.distributed.checkpoint import FileSystemWriter

    path = out_dir / "ckpt"

    class KillDuringSecondSave(Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            if trainer.fit_loop.total_batch_idx == STEPS - 1:
                trainer.save_checkpoint(path)
                save(out_dir, "crash", {"params": full_parameters(pl_module), "global_step": trainer.global_step})
            elif trainer.fit_loop.total_batch_idx == 2 * STEPS - 1:
                real_write = FileSystemWriter.write_data

                def write_then_die(self, plan, planner):
                    future = real_write(self, plan, planner)
                    future.wait()  # this rank's shard files are on disk; DCP's .metadata is not
                    dist.barrier()
                    os._exit(17)

                FileSystemWriter.write_data = write_then_die
                trainer.save_checkpoint(path)

    fit(TPClassifier(optimizer="adamw", lr=0.01), callbacks=[KillDuringSecondSave()])


SCENARIOS = {"train": train_scenario, "loss_scale": loss_scale_scenario, "sink": sink_scenario, "crash": crash_scenario}

if __name__ == "__main__":
    for scenario in sys.argv[2:]:
        SCENARIOS[scenario](Path(sys.argv[1]))
    leave_the_group_and_exit()  # (tests/distributed.py: the group torn down before the process ends)
