"""FSDP2 + tensor-parallel accumulation benchmark: gradient reductions and wall time per window.

    python benchmarks/model_parallel_accumulation.py [--repeats 3] [--windows 8]

Four gloo processes on CPU (data_parallel=2 x tensor_parallel=2; Lightning's launcher starts ranks 1-3) train an MLP
784-1024-1024-10 (first Linear column-wise, second row-wise, every Linear fully sharded over data parallel) with
windows of 4 micro-batches of 32 per data-parallel rank:

- ``sink_model_parallel``: SinkModelParallelStrategy(accumulation_steps=4): gradient sync off on accumulate steps.
- ``stock_model_parallel``: Lightning's ModelParallelStrategy with Trainer(accumulate_grad_batches=4), the anchor:
  FSDP2 reduce-scatters after every micro-batch.

The two alternate, each repeated; figures are medians. Time is measured from the second window to the end of
training (the first is warm-up), after a barrier, so it is the slowest rank's. Counts are of ``dist.reduce_scatter_single`` calls (FSDP2's
gradient reduce-scatter), per window. The last line printed (by rank 0) is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import Callback
from torch import nn

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

from common import NetClassifier, quiet_trainer  # noqa: E402

DP, TP, MICRO, STEPS = 2, 2, 32, 4
MODES = ("sink_model_parallel", "stock_model_parallel")


class ShardedMLP(NetClassifier):
    def __init__(self) -> None:
        torch.manual_seed(0)
        super().__init__(
            nn.Sequential(nn.Linear(784, 1024), nn.ReLU(), nn.Linear(1024, 1024), nn.ReLU(), nn.Linear(1024, 10))
        )

    def configure_model(self) -> None:
        from torch.distributed.fsdp import fully_shard
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

        mesh = self.device_mesh
        parallelize_module(self.net, mesh["tensor_parallel"], {"0": ColwiseParallel(), "2": RowwiseParallel()})
        for index in (0, 2, 4):
            fully_shard(self.net[index], mesh=mesh["data_parallel"])
        fully_shard(self.net, mesh=mesh["data_parallel"])


class WindowTimer(Callback):
    """Wall time of the training batches after the first window (warm-up), per window; the barrier makes it the
    slowest rank's time."""

    def __init__(self) -> None:
        self.start = self.end = 0.0

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if batch_idx == STEPS:
            dist.barrier()
            self.start = time.perf_counter()

    def on_train_end(self, trainer, pl_module):
        dist.barrier()
        self.end = time.perf_counter()


class ReduceScatterCounter:
    def __init__(self) -> None:
        self.calls, self._real = 0, dist.reduce_scatter_single

    def __enter__(self) -> ReduceScatterCounter:
        def counting(*args, **kwargs):
            self.calls += 1
            return self._real(*args, **kwargs)

        dist.reduce_scatter_single = counting
        return self

    def __exit__(self, *exc: object) -> None:
        dist.reduce_scatter_single = self._real


def run(mode: str, windows: int) -> dict[str, float]:
    from lightning.pytorch.strategies import ModelParallelStrategy
    from torch.utils.data import DataLoader, TensorDataset

    from lightning_sink import SinkModelParallelStrategy

    samples = MICRO * STEPS * windows * DP
    generator = torch.Generator().manual_seed(0)
    data = TensorDataset(
        torch.randn(samples, 784, generator=generator), torch.randint(0, 10, (samples,), generator=generator)
    )
    timer = WindowTimer()
    if mode == "sink_model_parallel":
        strategy = SinkModelParallelStrategy(DP, TP, accumulation_steps=STEPS, process_group_backend="gloo")
        trainer = quiet_trainer(strategy=strategy, devices=DP * TP, max_epochs=1, callbacks=[timer])
    else:
        strategy = ModelParallelStrategy(DP, TP, process_group_backend="gloo")
        trainer = quiet_trainer(
            strategy=strategy, devices=DP * TP, max_epochs=1, accumulate_grad_batches=STEPS, callbacks=[timer]
        )
    with ReduceScatterCounter() as counter:
        trainer.fit(ShardedMLP(), DataLoader(data, batch_size=MICRO))
    assert trainer.global_step == windows, (mode, trainer.global_step)
    return {
        "reduce_scatters_per_window": counter.calls / windows,
        "seconds_per_window": (timer.end - timer.start) / (windows - 1),
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--windows", type=int, default=8)
    args = parser.parse_args()
    results: dict[str, list[dict[str, float]]] = {mode: [] for mode in MODES}
    for repeat in range(args.repeats):
        order = MODES if repeat % 2 == 0 else tuple(reversed(MODES))
        for mode in order:
            results[mode].append(run(mode, args.windows))
    if dist.get_rank() != 0:
        return
    summary = {
        mode: {key: statistics.median(run_[key] for run_ in runs) for key in runs[0]} for mode, runs in results.items()
    }
    for mode, figures in summary.items():
        print(
            f"{mode:>22}: {figures['reduce_scatters_per_window']:.0f} reduce-scatters/window,"
            f" {1000 * figures['seconds_per_window']:.1f} ms/window"
        )
    ratio = summary["sink_model_parallel"]["seconds_per_window"] / summary["stock_model_parallel"]["seconds_per_window"]
    print(
        json.dumps(
            {
                "benchmark": "model_parallel_accumulation",
                "machine": platform.machine(),
                "torch": torch.__version__,
                "mesh": [DP, TP],
                "accumulation_steps": STEPS,
                "micro_batch": MICRO,
                "windows": args.windows,
                "repeats": args.repeats,
                **{mode: summary[mode] for mode in MODES},
                "time_ratio_sink_over_stock": ratio,
            }
        )
    )


if __name__ == "__main__":
    main()
