"""What the monitoring callbacks cost per training step, on CPU, one process, configurations alternating.

    python benchmarks/monitor_overhead.py [--repeats 5] [--steps 2000]

A tiny MLP 64-64-10, batch 32, SGD (the model where per-step overhead shows most), trained for ``--steps`` steps
with ``SinkStrategy``: outside sink mode (one Lightning batch per step) and in sink mode (``sink_size=500``,
``prefetch_depth=0``). Each mode runs without callbacks (the anchor) and with ``LossMonitor`` + ``TimeMonitor``
(per-batch: ``per_print_times=100`` and ``1``; sink mode: ``per_print_times=1``, one line per sink). Time is the
whole ``fit`` (identical setup in every configuration); the time spent inside the callbacks' hooks is also measured
directly, per step. Figures are medians of the repeats. Printing goes to /dev/null. The last line is one JSON object.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from lightning_sink import SinkStrategy
from lightning_sink.callbacks import LossMonitor, TimeMonitor

from common import NetClassifier, quiet_trainer

BATCH, SINK = 32, 500
CONFIGS = {  # name: (sink_size, callbacks factory)
    "per_batch_anchor": (None, lambda: []),
    "per_batch_monitors_print_100": (None, lambda: [LossMonitor(100), TimeMonitor()]),
    "per_batch_monitors_print_1": (None, lambda: [LossMonitor(1), TimeMonitor()]),
    "sink_anchor": (SINK, lambda: []),
    "sink_monitors": (SINK, lambda: [LossMonitor(1), TimeMonitor()]),
}


class HookClock:
    """Time spent inside the callbacks' own hooks (measured directly, so it does not drown in run-to-run noise)."""

    HOOKS = ("on_train_epoch_start", "on_train_batch_end", "on_train_epoch_end")

    def __init__(self, callbacks: list) -> None:
        self.seconds = 0.0
        for callback in callbacks:
            for hook in self.HOOKS:
                original = getattr(callback, hook)

                def timed(*args, _original=original, **kwargs):
                    started = time.perf_counter()
                    try:
                        return _original(*args, **kwargs)
                    finally:
                        self.seconds += time.perf_counter() - started

                setattr(callback, hook, timed)  # Lightning looks hooks up on the instance


def run(name: str, steps: int) -> tuple[float, float]:
    """Milliseconds per step of one fit, and microseconds per step inside the callbacks' hooks."""
    sink_size, make_callbacks = CONFIGS[name]
    torch.manual_seed(0)
    model = NetClassifier(nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 10)))
    generator = torch.Generator().manual_seed(0)
    data = TensorDataset(
        torch.randn(BATCH * 250, 64, generator=generator), torch.randint(0, 10, (BATCH * 250,), generator=generator)
    )
    loader = DataLoader(data, batch_size=BATCH, shuffle=True, drop_last=True)
    strategy = SinkStrategy(accumulation_steps=1, sink_size=sink_size, prefetch_depth=0)
    limits = {"max_epochs": steps // SINK} if sink_size else {"max_steps": steps}
    callbacks = make_callbacks()
    clock = HookClock(callbacks)
    trainer = quiet_trainer(strategy=strategy, callbacks=callbacks, **limits)
    with open(os.devnull, "w") as sink, contextlib.redirect_stdout(sink):
        started = time.perf_counter()
        trainer.fit(model, loader)
        seconds = time.perf_counter() - started
    assert trainer.global_step == steps, (name, trainer.global_step)
    return seconds * 1e3 / steps, clock.seconds * 1e6 / steps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--steps", type=int, default=2000)
    args = parser.parse_args()
    torch.set_num_threads(1)
    times: dict[str, list[float]] = {name: [] for name in CONFIGS}
    hook_times: dict[str, list[float]] = {name: [] for name in CONFIGS}
    names = list(CONFIGS)
    for repeat in range(args.repeats):
        for name in names if repeat % 2 == 0 else reversed(names):  # alternate the order
            ms, hook_us = run(name, args.steps)
            times[name].append(ms)
            hook_times[name].append(hook_us)
    medians = {name: statistics.median(values) for name, values in times.items()}
    hook_medians = {name: statistics.median(values) for name, values in hook_times.items()}
    ratios = {
        name: medians[name] / medians["sink_anchor" if name.startswith("sink") else "per_batch_anchor"]
        for name in medians
    }
    for name, value in medians.items():
        print(
            f"{name:30s} {value:.4f} ms/step ({ratios[name]:.3f}x its anchor); in the callbacks' hooks"
            f" {hook_medians[name]:.1f} us/step"
        )
    print(
        json.dumps(
            {
                "benchmark": "monitor_overhead",
                "ms_per_step": medians,
                "ratio_to_anchor": ratios,
                "hook_us_per_step": hook_medians,
                "steps": args.steps,
                "repeats": args.repeats,
                "torch": torch.__version__,
                "machine": platform.machine(),
                "cpus": os.cpu_count(),
            }
        )
    )


if __name__ == "__main__":
    main()
