"""How often one window-ending micro-batch crosses between Lightning, lightning-sink and torch, and how many of
lightning-sink's files it passes through in compiled sink mode.

    python benchmarks/package_crossings.py [--steps 4] [--no-compiled]

One fit of a tiny MLP (batch 8, N=``--steps``), stock Lightning (``accumulate_grad_batches=N``) and
``SinkStrategy(accumulation_steps=N)``. For the first batch that ends a window, ``sys.setprofile`` records every
call made between the start of the batch (``on_train_batch_start``) and its end (``on_train_batch_end``). Each
function belongs to a package by its file: ``lightning`` (``lightning/``), ``lightning_sink`` or ``torch``; other
code (the LightningModule, the standard library) belongs to whoever called it. A *crossing* is a call of a Python
function of one package from a function of another:

- ``crossings``: all of them, between any two of the three packages;
- ``entries``: the calls from Lightning into lightning-sink (how many times Lightning's loop hands the micro-batch
  to the strategy), listed by function under ``entered``;
- ``package_to_torch``: the calls from lightning-sink into torch.

C functions (tensor operations) are not counted: they are the work itself, the same in every configuration.

Compiled sink mode (``SinkStrategy(sink_size=4N, accumulation_steps=N, graph_mode="compile")``): a Lightning batch
is a whole sink, so the micro-batch is followed inside the loop. ``sys.setprofile`` runs over the second sink (the
first builds the programs); each entry into ``SinkLoop._next_call`` (where the loop reads the next call's
micro-batches) starts a new call, and every lightning-sink file with a Python function called until the next entry
belongs to that call's route. ``compiled_files`` lists the files of the call that ends the sink's first window, with
one micro-batch per call (``micro_steps_per_call=1``) and with the default (several per call for this small step);
the segment's setup and end (choosing the programs, handing the logged values to Lightning) are once per segment
and listed apart as ``segment_files``. ``own_files`` (``micro_step_files`` of them) are the files of the
window-ending micro-batch's own host effects: those entered inside its ``SinkLoop._micro_step`` (the window's
counts, the update's counters and schedulers, the logged values, the data position), which with one micro-batch per
call also runs the program; with several per call the call's route is shared by its micro-batches.

The numbers are counts, not timings: one run each, deterministic. The last line printed is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import Counter
from types import FrameType
from typing import Any

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from lightning.pytorch.callbacks import Callback
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

PACKAGES = (("/lightning_sink/", "lightning_sink"), ("/lightning/", "lightning"), ("/torch/", "torch"))


def package_of(frame: FrameType | None) -> str | None:
    """The package of the nearest frame that belongs to one (user and standard-library code is transparent)."""
    while frame is not None:
        filename = frame.f_code.co_filename
        for marker, package in PACKAGES:
            if marker in filename:
                return package
        frame = frame.f_back
    return None


class CrossingTracer(Callback):
    def __init__(self, steps: int) -> None:
        self.steps = steps
        self.crossings: Counter[tuple[str, str]] = Counter()
        self.entered: Counter[str] = Counter()
        self.done = False

    def _profile(self, frame: FrameType, event: str, arg: Any) -> None:
        if event != "call":
            return
        callee = package_of(frame)
        if callee is None or package_of(frame.f_back) in (None, callee):
            return
        caller = package_of(frame.f_back)
        assert caller is not None
        self.crossings[(caller, callee)] += 1
        if (caller, callee) == ("lightning", "lightning_sink"):
            self.entered[frame.f_code.co_qualname] += 1

    def on_train_batch_start(self, trainer: pl.Trainer, module: pl.LightningModule, batch: Any, idx: int) -> None:
        if not self.done and (idx + 1) % self.steps == 0:
            sys.setprofile(self._profile)

    def on_train_batch_end(self, trainer: pl.Trainer, module: pl.LightningModule, *args: Any) -> None:
        if sys.getprofile() is not None:
            sys.setprofile(None)
            self.done = True


class Tiny(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return F.cross_entropy(self.net(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def fit(strategy: Any, tracer: Callback, samples: int, **trainer_kwargs: Any) -> None:
    """One quiet fit of ``Tiny`` on the CPU over ``samples`` random samples in batches of 8, traced."""
    trainer = pl.Trainer(
        strategy=strategy,
        accelerator="cpu",
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[tracer],
        **trainer_kwargs,
    )
    data = TensorDataset(torch.randn(samples, 8), torch.randint(0, 4, (samples,)))
    trainer.fit(Tiny(), DataLoader(data, batch_size=8))


class CallRouteTracer(Callback):
    """The lightning-sink files each call of the second sink passes through (see the module's docstring)."""

    def __init__(self) -> None:
        self.calls: list[set[str]] = []
        self.segment: set[str] = set()
        self.micro_steps: list[set[str]] = []  # per micro-batch: the files of its own host effects (_micro_step)
        self._micro_step_frame: FrameType | None = None
        self.sinks = 0

    def _profile(self, frame: FrameType, event: str, arg: Any) -> None:
        if event == "return" and frame is self._micro_step_frame:
            self._micro_step_frame = None
        if event != "call":
            return
        filename = frame.f_code.co_filename
        if "/lightning_sink/" not in filename:
            return
        name = filename[filename.rindex("/lightning_sink/") + 1 :]
        if name == "lightning_sink/sink/loop.py" and frame.f_code.co_name == "_next_call":
            self.calls.append(set())
        if name == "lightning_sink/sink/loop.py" and frame.f_code.co_name == "_micro_step":
            self.micro_steps.append(set())
            self._micro_step_frame = frame
        (self.calls[-1] if self.calls else self.segment).add(name)
        if self._micro_step_frame is not None:
            self.micro_steps[-1].add(name)

    def on_train_batch_start(self, trainer: pl.Trainer, module: pl.LightningModule, batch: Any, idx: int) -> None:
        self.sinks += 1
        if self.sinks == 2:
            sys.setprofile(self._profile)

    def on_train_batch_end(self, trainer: pl.Trainer, module: pl.LightningModule, *args: Any) -> None:
        sys.setprofile(None)


def compiled_route(steps: int, micro_steps_per_call: int | None) -> dict[str, Any]:
    """The files of the call that ends the first window of the second sink, compiled sink mode."""
    from lightning_sink import SinkStrategy

    tracer = CallRouteTracer()
    strategy = SinkStrategy(
        sink_size=4 * steps, accumulation_steps=steps, graph_mode="compile", micro_steps_per_call=micro_steps_per_call
    )
    fit(strategy, tracer, 8 * steps * 8, max_steps=8)
    per_call = (4 * steps) // len(tracer.calls)
    # the call holding the window's last micro-batch: the window's N micro-batches end in call ceil(N / per call)
    window_end = tracer.calls[(steps - 1) // per_call]
    own = tracer.micro_steps[steps - 1]  # the window-ending micro-batch's own host effects, after its call
    return {
        "micro_batches_per_call": per_call,
        "calls_in_sink": len(tracer.calls),
        "files": len(window_end),
        "compiled_files": sorted(window_end),
        "micro_step_files": len(own),
        "own_files": sorted(own),
        "segment_files": sorted(tracer.segment - window_end),
    }


def count(strategy: Any, steps: int) -> dict[str, Any]:
    tracer = CrossingTracer(steps)
    kwargs: dict[str, Any] = {"accumulate_grad_batches": steps} if strategy == "auto" else {}
    fit(strategy, tracer, 8 * steps * 2, max_epochs=1, **kwargs)
    crossings = tracer.crossings
    return {
        "crossings": sum(crossings.values()),
        "entries": crossings[("lightning", "lightning_sink")],
        "package_to_torch": crossings[("lightning_sink", "torch")],
        "by_direction": {f"{caller}->{callee}": n for (caller, callee), n in sorted(crossings.items())},
        "entered": dict(sorted(tracer.entered.items())),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=4, help="micro-batches per window (N)")
    parser.add_argument("--no-compiled", action="store_true", help="skip compiled sink mode (it compiles twice)")
    args = parser.parse_args()
    from lightning_sink import SinkStrategy

    result: dict[str, Any] = {
        "benchmark": "package_crossings",
        "steps": args.steps,
        "stock": count("auto", args.steps),
        "sink": count(SinkStrategy(accumulation_steps=args.steps), args.steps),
    }
    if not args.no_compiled:
        result["compiled_sink_one_per_call"] = compiled_route(args.steps, 1)
        result["compiled_sink_default"] = compiled_route(args.steps, None)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
