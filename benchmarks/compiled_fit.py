"""A Lightning fit with ``SinkStrategy(sink_size=K, graph_mode="compile")`` (the whole-step compiled programs)
against the eager hand-written loop and stock Lightning, per micro-step.

    python benchmarks/compiled_fit.py [--repeats 5] [--sink 200] [--optimizers sgd adamw] [--accumulation 1 4]
                                      [--calls 1 4] [--data loader|staged] [--model tiny_mlp|lenet5]

Tiny MLP 64-64-10 (``--model lenet5``: LeNet-5 on 1x32x32), batch 32, one intra-op thread (``--threads``), CPU.
SGD is ``lr=0.01, momentum=0.9``; AdamW ``lr=1e-3``. Per configuration (optimizer x accumulation):

- **sink + compile**: one fit of ``1 + repeats`` sinks of ``--sink`` micro-batches (one sink per epoch); each sink
  is timed from its ``on_train_batch_start`` to its ``on_train_batch_end``; the first (which builds the programs)
  is not counted. ``compile_seconds`` is the programs' build as the fit reports it.
- **sink + compile, M per call** (each ``--calls`` value M > 1, a multiple of the accumulation): the same fit with
  ``micro_steps_per_call=M`` (M micro-batches unrolled into one compiled program); ``compile_seconds_mM`` includes
  that program's compilation.
- **stock Lightning**: ``Trainer(accumulate_grad_batches=N)``, one fit of ``1 + repeats`` epochs of ``--sink``
  batches; each epoch timed from its start to its end, the first not counted.
- **hand loop**: the plain PyTorch loop (``loss / N``, ``backward``, ``step`` and ``zero_grad`` at each window's
  end) over the same batches, pre-built in memory. A hand-loop run of ``--sink`` micro-batches is timed right after
  each timed sink or epoch (inside its end hook, outside its timing), so each Lightning figure has a hand-loop figure
  measured next to it in the same process, alternating; ratios are per pair (median, min, max over repeats).

On a shared machine wall time includes the time the training thread waited for a core; the ``cpu_*`` figures are
the training thread's own CPU time (``time.thread_time``) over the same spans, paired the same way: less sensitive
to the load (not to its cache effects).

The Lightning fits read the same in-memory ``TensorDataset`` through a ``DataLoader`` (sink mode reads it by
indexing; stock Lightning collates each batch). The last line is one JSON object.

``--data staged`` runs the fits with the data staged for the programs (``device_data_budget=None``, the default
of ``SinkStrategy``) instead of the loader path (``device_data_budget=0``, this option's default, as the earlier
tables were measured).

``--staged`` measures instead the data staged for the programs (``device_data_budget=None``: on the CPU each batch
is gathered inside the compiled program from the sampler's indices, uploaded once per sink) against the loader path
(``device_data_budget=0``: each batch read by Python indexing, then handed to the program), a shuffled loader,
``--rounds`` alternating pairs of fits, each timed sink paired with a hand-loop run (``staged_vs_loader_path``:
sink by sink, loader-path time over staged time).

"""

from __future__ import annotations

import argparse
import json
import logging
import os
import platform
import re
import statistics
import sys
import time
import warnings
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from lightning_sink import SinkStrategy

from common import make_model, plain_torch_cuda_check, quiet_trainer

BATCH = 32
OPTIMIZERS = ("sgd", "adamw")


def make_optimizer(name: str, params: Any) -> torch.optim.Optimizer:
    if name == "sgd":
        return torch.optim.SGD(params, lr=0.01, momentum=0.9)
    return torch.optim.AdamW(params, lr=1e-3)


class Classifier(pl.LightningModule):
    def __init__(self, optimizer: str, model: str = "tiny_mlp") -> None:
        super().__init__()
        self.net, self.optimizer_name = make_model(model), optimizer

    def training_step(self, batch: Any, batch_idx: Any) -> torch.Tensor:
        x, y = batch
        return F.cross_entropy(self.net(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return make_optimizer(self.optimizer_name, self.parameters())


class HandLoop:
    """The plain loop over pre-built batches; ``run()`` trains ``len(batches)`` micro-batches and returns the
    seconds per micro-step."""

    def __init__(self, optimizer: str, accumulation: int, batches: list, model: str = "tiny_mlp") -> None:
        self.model = make_model(model)
        self.optimizer = make_optimizer(optimizer, self.model.parameters())
        self.accumulation, self.batches = accumulation, batches

    @plain_torch_cuda_check()
    def run(self) -> float:
        model, optimizer, n = self.model, self.optimizer, self.accumulation
        start, cpu_start = time.perf_counter(), time.thread_time()
        for i, (x, y) in enumerate(self.batches):
            (F.cross_entropy(model(x), y) / n).backward()
            if (i + 1) % n == 0:
                optimizer.step()
                optimizer.zero_grad()
        self.cpu_seconds = (time.thread_time() - cpu_start) / len(self.batches)
        return (time.perf_counter() - start) / len(self.batches)


class Paired(pl.Callback):
    """Times each Lightning batch (``per="batch"``: a sink) or epoch (``per="epoch"``), and runs a timed hand loop
    after each, outside the timing."""

    def __init__(self, per: str, micro_steps: int, hand: HandLoop) -> None:
        self.per, self.micro_steps, self.hand = per, micro_steps, hand
        self.lightning: list[float] = []
        self.paired_hand: list[float] = []
        self.lightning_cpu: list[float] = []  # the training thread's CPU time (time.thread_time), per micro-step
        self.paired_hand_cpu: list[float] = []
        self._start = self._cpu_start = 0.0

    def _begin(self) -> None:
        self._start, self._cpu_start = time.perf_counter(), time.thread_time()

    def _end(self) -> None:
        self.lightning.append((time.perf_counter() - self._start) / self.micro_steps)
        self.lightning_cpu.append((time.thread_time() - self._cpu_start) / self.micro_steps)
        self.paired_hand.append(self.hand.run())
        self.paired_hand_cpu.append(self.hand.cpu_seconds)

    def on_train_batch_start(self, *args: Any) -> None:
        if self.per == "batch":
            self._begin()

    def on_train_batch_end(self, *args: Any) -> None:
        if self.per == "batch":
            self._end()

    def on_train_epoch_start(self, *args: Any) -> None:
        if self.per == "epoch":
            self._begin()

    def on_train_epoch_end(self, *args: Any) -> None:
        if self.per == "epoch":
            self._end()


class CompileReport(logging.Handler):
    """The fit's one line saying the programs were compiled, and in how many seconds."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def spread(values: list[float]) -> dict[str, float]:
    return {"median": round(statistics.median(values), 3), "min": round(min(values), 3), "max": round(max(values), 3)}


def compiled_fit(
    optimizer: str,
    accumulation: int,
    sink: int,
    repeats: int,
    loader: DataLoader,
    hand: HandLoop,
    budget: int | None,
    per_call: int = 1,
    model: str = "tiny_mlp",
) -> tuple[Paired, float, str]:
    """One sink + compile fit (``device_data_budget=budget``, ``micro_steps_per_call=per_call``): its timings, the programs' build seconds and the
    fit's line on them."""
    report = CompileReport()
    rank_zero_logger = logging.getLogger("lightning.pytorch.utilities.rank_zero")
    rank_zero_logger.addHandler(report)
    rank_zero_logger.setLevel(logging.INFO)  # (Lightning's other lines are silenced in main)
    try:
        compiled = Paired("batch", sink, hand)
        strategy = SinkStrategy(
            accumulation_steps=accumulation,
            sink_size=sink,
            graph_mode="compile",
            device_data_budget=budget,
            micro_steps_per_call=per_call,
        )
        trainer = quiet_trainer(strategy=strategy, max_epochs=1 + repeats, callbacks=[compiled])
        trainer.fit(Classifier(optimizer, model), loader)
    finally:
        rank_zero_logger.removeHandler(report)
    lines = [line for line in report.lines if "compiled whole" in line]
    if len(lines) != 1:
        raise RuntimeError(f"the fit did not report its compiled programs (fallback?): {report.lines}")
    return compiled, float(re.findall(r"in ([0-9.]+) s\b", lines[0])[0]), lines[0]


def measure(
    optimizer: str,
    accumulation: int,
    sink: int,
    repeats: int,
    data: TensorDataset,
    calls: list[int],
    budget: int | None = 0,
    model: str = "tiny_mlp",
) -> dict[str, Any]:
    batches = [(x, y) for x, y in zip(data.tensors[0].split(BATCH), data.tensors[1].split(BATCH))][:sink]
    hand = HandLoop(optimizer, accumulation, batches, model)
    hand.run()  # warm: allocator and caches
    loader = DataLoader(data, batch_size=BATCH, shuffle=False)
    runs: dict[int, tuple[Paired, float]] = {}
    for per_call in calls:  # the loader path (budget 0) or the staged dataset (budget None), as --data says
        compiled, seconds, line = compiled_fit(
            optimizer, accumulation, sink, repeats, loader, hand, budget, per_call, model
        )
        if ("gathered on the device" in line) != (budget is None):
            raise RuntimeError(f"the fit did not read its data as --data asked: {line}")
        runs[per_call] = (compiled, seconds)
    compiled, compile_seconds = runs[1]
    stock = Paired("epoch", sink, hand)
    stock_trainer = quiet_trainer(
        max_epochs=1 + repeats, limit_train_batches=sink, accumulate_grad_batches=accumulation, callbacks=[stock]
    )
    stock_trainer.fit(Classifier(optimizer, model), loader)
    sink_us, sink_hand = compiled.lightning[1:], compiled.paired_hand[1:]
    stock_us, stock_hand = stock.lightning[1:], stock.paired_hand[1:]
    several: dict[str, Any] = {}
    for per_call, (run, seconds) in runs.items():
        if per_call == 1:
            continue
        us, paired = run.lightning[1:], run.paired_hand[1:]
        several[f"sink_compile_m{per_call}_us_per_step"] = round(1e6 * statistics.median(us), 1)
        several[f"sink_compile_m{per_call}_vs_hand_loop"] = spread([h / c for h, c in zip(paired, us)])
        several[f"compile_seconds_m{per_call}"] = seconds
    for per_call, (run, _) in runs.items():
        name = "sink_compile" if per_call == 1 else f"sink_compile_m{per_call}"
        cpu, paired = run.lightning_cpu[1:], run.paired_hand_cpu[1:]
        several[f"cpu_{name}_us_per_step"] = round(1e6 * statistics.median(cpu), 1)
        several[f"cpu_{name}_vs_hand_loop"] = spread([h / c for h, c in zip(paired, cpu)])
    return {
        "hand_loop_us_per_step": round(1e6 * statistics.median(sink_hand + stock_hand), 1),
        "cpu_hand_loop_us_per_step": round(1e6 * statistics.median(compiled.paired_hand_cpu[1:]), 1),
        "sink_compile_us_per_step": round(1e6 * statistics.median(sink_us), 1),
        "stock_lightning_us_per_step": round(1e6 * statistics.median(stock_us), 1),
        "sink_compile_vs_hand_loop": spread([h / c for h, c in zip(sink_hand, sink_us)]),
        "sink_compile_vs_stock_lightning": round(statistics.median(stock_us) / statistics.median(sink_us), 3),
        "stock_lightning_vs_hand_loop": spread([h / s for h, s in zip(stock_hand, stock_us)]),
        "compile_seconds": compile_seconds,
        "first_sink_seconds": round(compiled.lightning[0] * sink, 1),
        **several,
    }


def measure_staged(
    optimizer: str, accumulation: int, sink: int, repeats: int, rounds: int, data: TensorDataset
) -> dict[str, Any]:
    """Sink + compile with the data staged (the programs gather each batch; ``device_data_budget=None``) against
    the same fit on the loader path (``device_data_budget=0``: each batch read by Python indexing), in alternating
    fits, each timed sink paired with a hand-loop run; a shuffled loader."""
    batches = [(x, y) for x, y in zip(data.tensors[0].split(BATCH), data.tensors[1].split(BATCH))][:sink]
    hand = HandLoop(optimizer, accumulation, batches)
    hand.run()
    timings: dict[str, list[float]] = {"loader": [], "staged": []}
    hands: dict[str, list[float]] = {"loader": [], "staged": []}
    compile_seconds: dict[str, list[float]] = {"loader": [], "staged": []}
    for _ in range(rounds):
        for path, budget in (("loader", 0), ("staged", None)):
            torch._dynamo.reset()
            loader = DataLoader(data, batch_size=BATCH, shuffle=True, generator=torch.Generator().manual_seed(1))
            fit, seconds, line = compiled_fit(optimizer, accumulation, sink, repeats, loader, hand, budget)
            if ("gathered on the device" in line) != (path == "staged"):
                raise RuntimeError(f"the {path} fit did not read its data as intended: {line}")
            timings[path] += fit.lightning[1:]
            hands[path] += fit.paired_hand[1:]
            compile_seconds[path].append(seconds)
    loader_us, staged_us = timings["loader"], timings["staged"]
    return {
        "loader_path_us_per_step": round(1e6 * statistics.median(loader_us), 1),
        "staged_us_per_step": round(1e6 * statistics.median(staged_us), 1),
        "hand_loop_us_per_step": round(1e6 * statistics.median(hands["loader"] + hands["staged"]), 1),
        # sink i of round r of one path against the same sink of the other: the pairs nearest in time
        "staged_vs_loader_path": spread([lo / st for lo, st in zip(loader_us, staged_us)]),
        "staged_vs_hand_loop": spread([h / st for h, st in zip(hands["staged"], staged_us)]),
        "loader_path_vs_hand_loop": spread([h / lo for h, lo in zip(hands["loader"], loader_us)]),
        # each path against the hand-loop runs timed right after its own sinks, then one against the other: on a
        # loaded machine steadier than the sink-by-sink ratio, whose two sinks are a whole fit apart in time
        "staged_vs_loader_path_through_hand_loop": round(
            statistics.median([h / st for h, st in zip(hands["staged"], staged_us)])
            / statistics.median([h / lo for h, lo in zip(hands["loader"], loader_us)]),
            3,
        ),
        "compile_seconds": {path: [round(value, 1) for value in values] for path, values in compile_seconds.items()},
        "load_average": [round(value, 2) for value in os.getloadavg()],
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=5, help="timed sinks (and stock epochs) per configuration")
    parser.add_argument("--sink", type=int, default=200, help="micro-batches per sink (and per stock epoch)")
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    parser.add_argument("--model", choices=("tiny_mlp", "lenet5"), default="tiny_mlp", help="without --staged")
    parser.add_argument("--optimizers", nargs="+", choices=OPTIMIZERS, default=list(OPTIMIZERS))
    parser.add_argument("--accumulation", nargs="+", type=int, default=[1, 4])
    parser.add_argument(
        "--calls", nargs="+", type=int, default=[1, 4], help="micro_steps_per_call values (1 is always measured)"
    )
    parser.add_argument(
        "--staged",
        action="store_true",
        help="instead: the data staged for the programs (device_data_budget=None) against the loader path (=0)",
    )
    parser.add_argument("--rounds", type=int, default=2, help="with --staged: alternating pairs of fits")
    parser.add_argument(
        "--data",
        choices=("loader", "staged"),
        default="loader",
        help="without --staged: the fits' data path (loader: device_data_budget=0; staged: None, the default)",
    )
    args = parser.parse_args(argv)
    for name in ("repeats", "sink", "threads"):
        if getattr(args, name) < 1:
            parser.error(f"--{name} must be >= 1; got {getattr(args, name)}")
    if any(n < 1 or args.sink % n for n in args.accumulation):
        parser.error(f"--accumulation values must be >= 1 and divide --sink={args.sink}; got {args.accumulation}")
    if any(m < 1 or (m > 1 and m % n) for m in args.calls for n in args.accumulation) or any(
        args.sink % m for m in args.calls
    ):
        parser.error(f"--calls values must be multiples of every --accumulation and divide --sink; got {args.calls}")
    if args.staged and args.model != "tiny_mlp":
        parser.error(f"--staged measures the tiny MLP only; got --model {args.model}")
    calls = sorted(set(args.calls) | {1})
    torch.set_num_threads(args.threads)
    warnings.filterwarnings("ignore")
    logging.getLogger("lightning.pytorch").setLevel(logging.WARNING)
    generator = torch.Generator().manual_seed(0)
    samples = BATCH * args.sink
    shape = (64,) if args.model == "tiny_mlp" else (1, 32, 32)
    data = TensorDataset(
        torch.randn(samples, *shape, generator=generator), torch.randint(0, 10, (samples,), generator=generator)
    )
    result: dict[str, Any] = {
        "benchmark": "compiled_fit",
        "machine": f"{platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}, CPU,"
        f" {args.threads} thread(s)",
        "model": "tiny_mlp 64-64-10" if args.model == "tiny_mlp" else "LeNet-5 1x32x32",
        "batch": BATCH,
        "sink_size": args.sink,
        "repeats": args.repeats,
    }
    for optimizer in args.optimizers:
        for accumulation in args.accumulation:
            if args.staged:
                figures = measure_staged(optimizer, accumulation, args.sink, args.repeats, args.rounds, data)
                name = f"tiny_mlp_{optimizer}_acc{accumulation}_staged"
            else:
                budget = None if args.data == "staged" else 0
                figures = measure(optimizer, accumulation, args.sink, args.repeats, data, calls, budget, args.model)
                name = f"{args.model}_{optimizer}_acc{accumulation}" + ("_staged_data" if budget is None else "")
            result[name] = figures
            print(json.dumps({name: figures}), file=sys.stderr)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
