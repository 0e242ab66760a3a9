"""A 2-process SinkDDPStrategy run on gloo, launched by Lightning's own subprocess launcher.

Run as ``python -m tests.strategies.ddp_worker OUT_DIR STEPS MODE SAMPLES EPOCHS SCENARIO``; rank 0 writes the final parameters and the
per-batch reduction counts to ``OUT_DIR`` for the test to compare with its single-process reference.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

from lightning_sink import SinkDDPStrategy
from tests.distributed import CollectiveCounter, leave_the_group_and_exit
from tests.helpers import TinyClassifier, loader, make_dataset, quiet_trainer

MICRO_BATCH = 4


def resume_scenario(out_dir: Path, steps: int, partial_window: str, num_samples: int, epochs: int) -> None:
    """Save inside a window (every rank's buffer differs), resume in a new Trainer, compare with no interruption."""
    from tests.strategies.test_sink_strategy import SaveAtBatch

    def fit(model, **kwargs):
        strategy = SinkDDPStrategy(
            accumulation_steps=steps, partial_window=partial_window, process_group_backend="gloo"
        )
        trainer = quiet_trainer(strategy=strategy, devices=2, max_epochs=epochs, callbacks=kwargs.pop("callbacks", []))
        trainer.fit(model, loader(make_dataset(num_samples=num_samples), MICRO_BATCH), **kwargs)
        return trainer

    ckpt = out_dir / "mid.ckpt"
    saver = SaveAtBatch(ckpt, at_batch=steps + 1)  # the second micro-step of the second window
    uninterrupted = TinyClassifier(optimizer="adamw", lr=0.01)
    trainer = fit(uninterrupted, callbacks=[saver])
    resumed = TinyClassifier(optimizer="adamw", lr=0.01, seed=7)
    fit(resumed, ckpt_path=ckpt)
    if trainer.global_rank == 0:
        torch.save(
            {
                "uninterrupted": torch.cat([p.detach().reshape(-1) for p in uninterrupted.parameters()]),
                "resumed": torch.cat([p.detach().reshape(-1) for p in resumed.parameters()]),
                "window_position": saver.window_position,
            },
            out_dir / "resume.pt",
        )


class DropoutPerRank(TinyClassifier):
    """Dropout between the layers; each rank seeds its own generator at train start, so the ranks' masks differ."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.dropout = torch.nn.Dropout(0.5)

    def on_train_start(self) -> None:
        torch.manual_seed(100 + self.global_rank)  # (a resumed run's strategy restores the checkpoint's after this)

    def training_step(self, batch, batch_idx):
        x, y = batch
        hidden = self.dropout(self.net[1](self.net[0](x)))
        return torch.nn.functional.cross_entropy(self.net[2](hidden), y)


def random_resume_scenario(out_dir: Path, steps: int, partial_window: str, num_samples: int, epochs: int) -> None:
    """Dropout with each rank's own generator: save mid-window, resume, compare with no interruption."""
    from tests.strategies.test_sink_strategy import SaveAtBatch

    def fit(model, **kwargs):
        strategy = SinkDDPStrategy(
            accumulation_steps=steps, partial_window=partial_window, process_group_backend="gloo"
        )
        trainer = quiet_trainer(strategy=strategy, devices=2, max_epochs=epochs, callbacks=kwargs.pop("callbacks", []))
        trainer.fit(model, loader(make_dataset(num_samples=num_samples), MICRO_BATCH), **kwargs)
        return trainer

    ckpt = out_dir / "mid.ckpt"
    uninterrupted = DropoutPerRank(optimizer="adamw", lr=0.01)
    trainer = fit(uninterrupted, callbacks=[SaveAtBatch(ckpt, at_batch=steps + 1)])
    resumed = DropoutPerRank(optimizer="adamw", lr=0.01, seed=7)
    fit(resumed, ckpt_path=ckpt)
    if trainer.global_rank == 0:
        saved = torch.load(ckpt, weights_only=True)["lightning_sink"]["random"]
        torch.save(
            {
                "uninterrupted": torch.cat([p.detach().reshape(-1) for p in uninterrupted.parameters()]),
                "resumed": torch.cat([p.detach().reshape(-1) for p in resumed.parameters()]),
                "saved_torch_states": [rank_state["torch"] for rank_state in saved],
            },
            out_dir / "random_resume.pt",
        )


def overflow_scenario(out_dir: Path, steps: int, partial_window: str, num_samples: int, epochs: int) -> None:
    """An inf loss in one micro-step of window 1, on rank 1 only: both ranks must skip that window together."""
    from lightning_sink import DynamicLossScale, LossScalePrecision
    from tests.helpers import InjectingClassifier

    model = InjectingClassifier(inf_at=(steps + 1,), inf_rank=1, optimizer="adamw_fused", lr=0.01)
    plugin = LossScalePrecision("32-true", DynamicLossScale(init_scale=2.0**10))
    strategy = SinkDDPStrategy(accumulation_steps=steps, partial_window=partial_window, process_group_backend="gloo")
    trainer = quiet_trainer(strategy=strategy, plugins=[plugin], devices=2, max_epochs=epochs)
    trainer.fit(model, loader(make_dataset(num_samples=num_samples), MICRO_BATCH))
    state = torch.cat(
        [p.detach().reshape(-1) for p in model.parameters()]
        + [plugin.scaler.scale.reshape(1), plugin.scaler.skipped.float().reshape(1)]
    )
    gathered = [torch.empty_like(state) for _ in range(2)]
    dist.all_gather(gathered, state)
    if trainer.global_rank == 0:
        torch.save(
            {"rank0": gathered[0], "rank1": gathered[1], "global_step": trainer.global_step}, out_dir / "overflow.pt"
        )


def sink_scenario(out_dir: Path, steps: int, partial_window: str, num_samples: int, epochs: int) -> None:
    """Sinks of 5 micro-batches with windows of ``steps``, continuous over data passes, on 2 ranks."""
    model = TinyClassifier(optimizer="adamw", lr=0.01, step_lr_gamma=0.95)
    strategy = SinkDDPStrategy(accumulation_steps=steps, sink_size=5, process_group_backend="gloo")
    trainer = quiet_trainer(strategy=strategy, devices=2, max_epochs=epochs)
    trainer.fit(model, loader(make_dataset(num_samples=num_samples), MICRO_BATCH))
    params = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    gathered = [torch.empty_like(params) for _ in range(2)]
    dist.all_gather(gathered, params)
    if trainer.global_rank == 0:
        torch.save(
            {"rank0": gathered[0], "rank1": gathered[1], "global_step": trainer.global_step, "lrs": model.seen_lrs},
            out_dir / "sink.pt",
        )


class LogsPerRank(TinyClassifier):
    """Logs values that differ per rank and per update, synced across ranks or not."""

    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        value = torch.tensor(float(self.global_rank + 10 * self.trainer.global_step))
        self.log("synced_mean", value, sync_dist=True)
        self.log("synced_max", value, sync_dist=True, reduce_fx="max")
        self.log("local", value)
        return loss


def logging_scenario(out_dir: Path, steps: int, partial_window: str, num_samples: int, epochs: int) -> None:
    """Sinks of 4 micro-batches, windows of ``steps``: every update's self.log values reach rank 0's logger."""
    from lightning.pytorch.loggers import CSVLogger

    strategy = SinkDDPStrategy(accumulation_steps=steps, sink_size=4, process_group_backend="gloo")
    logger = CSVLogger(out_dir, name="run", version=0)
    trainer = quiet_trainer(strategy=strategy, devices=2, max_epochs=epochs, logger=logger, log_every_n_steps=1)
    trainer.fit(LogsPerRank(), loader(make_dataset(num_samples=num_samples), MICRO_BATCH))


class SlowOnRankZero(TinyClassifier):
    """Rank 0's micro-batches take longer, so the ranks' clocks disagree about when a time limit passes."""

    def __init__(self) -> None:
        super().__init__(optimizer="sgd", lr=0.05)
        self.micro_batches = 0

    def training_step(self, batch, batch_idx):
        self.micro_batches += 1
        time.sleep(0.02 if self.global_rank == 0 else 0.002)
        return super().training_step(batch, batch_idx)


def max_time_scenario(out_dir: Path, steps: int, partial_window: str, num_samples: int, epochs: int) -> None:
    """A time limit passed inside a sink far longer than it: both ranks stop after the same micro-batch."""
    from datetime import timedelta

    strategy = SinkDDPStrategy(accumulation_steps=steps, sink_size=400, process_group_backend="gloo")
    trainer = quiet_trainer(strategy=strategy, devices=2, max_time=timedelta(seconds=1), limit_val_batches=0)
    model = SlowOnRankZero()
    started = time.monotonic()
    trainer.fit(model, loader(make_dataset(num_samples=num_samples), MICRO_BATCH))
    seconds = time.monotonic() - started
    counts = [torch.zeros(1) for _ in range(2)]
    dist.all_gather(counts, torch.tensor([float(model.micro_batches)]))
    if trainer.global_rank == 0:
        torch.save({"micro_batches": [int(c.item()) for c in counts], "seconds": seconds}, out_dir / "max_time.pt")


def main(out_dir: Path, steps: int, partial_window: str, num_samples: int, epochs: int) -> None:
    dataset = make_dataset(num_samples=num_samples)
    model = TinyClassifier(optimizer="adamw", lr=0.01, step_lr_gamma=0.95)
    counter = CollectiveCounter(["all_reduce"], ddp_comm_hook=True)
    strategy = SinkDDPStrategy(accumulation_steps=steps, partial_window=partial_window, process_group_backend="gloo")
    trainer = quiet_trainer(strategy=strategy, devices=2, max_epochs=epochs, callbacks=[counter])
    trainer.fit(model, loader(dataset, MICRO_BATCH))
    params = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    gathered = [torch.empty_like(params) for _ in range(2)]
    dist.all_gather(gathered, params)
    if trainer.global_rank == 0:
        out_dir.mkdir(parents=True, exist_ok=True)
        torch.save({"params": params, "other_rank_params": gathered[1]}, out_dir / "result.pt")
        summary = {"global_step": trainer.global_step, "per_batch": counter.per_batch, "lrs": model.seen_lrs}
        (out_dir / "summary.json").write_text(json.dumps(summary))


if __name__ == "__main__":
    scenario = {
        "exactness": main,
        "resume": resume_scenario,
        "random_resume": random_resume_scenario,
        "overflow": overflow_scenario,
        "sink": sink_scenario,
        "logging": logging_scenario,
        "max_time": max_time_scenario,
    }[sys.argv[6]]
    scenario(Path(sys.argv[1]), int(sys.argv[2]), sys.argv[3], int(sys.argv[4]), int(sys.argv[5]))
    leave_the_group_and_exit()  # (tests/distributed.py: the group torn down before the process ends)
