"""``SinkDDPStrategy(sink_size=K)`` on 2 gloo processes: the eager step programs against the whole-step compiled
programs with each route of the window's sum across the processes, per micro-step, each anchored on a plain DDP loop.

    python benchmarks/compiled_ddp.py [--repeats 5] [--sink 200] [--optimizers adamw] [--accumulation 1 4]

Lightning's own launcher re-runs this script for rank 1; rank 0 prints. Tiny MLP 64-64-10, batch 32 per rank, one
intra-op thread per process, CPU, gloo. Per configuration (optimizer x accumulation), four fits:

- **eager sink**: ``graph_mode="eager"``, the eager step programs and the reducer's one all-reduce per window;
- **compile, eager sum**: ``graph_mode="compile"``, the update program compiled as two parts with the reducer's
  eager all-reduce of the flat bucket between them (``DDP_SUM_ROUTE = "eager"``);
- **compile, traced sum**: ``graph_mode="compile"``, a functional all-reduce traced inside the one update program
  (``DDP_SUM_ROUTE = "traced"``);
- **compile, default**: ``graph_mode="compile"`` with the call's length left to the build (several micro-steps per
  call for this small step, the all-reduce traced inside the loop). The two before it run ``micro_steps_per_call=1``.

Each fit runs ``1 + repeats`` sinks of ``--sink`` micro-batches (one sink per epoch), each timed from its
``on_train_batch_start`` to its ``on_train_batch_end``; the first (which builds the programs) is not counted. After
each timed sink, outside its timing, both ranks run the **DDP hand loop** (``DistributedDataParallel``, ``no_sync``
inside a window, ``loss / N``) over ``--sink`` pre-built batches of their own, timed: each figure has a hand-loop
figure measured next to it in the same processes, alternating; ratios to it are per pair (median, min, max over the
repeats); ratios between fits are ratios of their medians. Each figure twice: wall clock, and the CPU time of rank
0's process (``*_cpu_*``: its threads' time per micro-step, gloo's polling while it waits for the other rank
included). The last line is one
JSON object.

Then the two routes head to head, without Lightning: the update program alone (a window of one micro-batch), built
by each route with Inductor in the same two processes, called alternately ``--update-samples`` times each; medians,
and the ratio's spread over ten blocks of consecutive calls.
"""

from __future__ import annotations

import argparse
import contextlib
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
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, TensorDataset

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from compiled_fit import Classifier, CompileReport, make_optimizer, spread

import lightning_sink.sink.programs.compiled_choice as compiled_choice
from lightning_sink import SinkDDPStrategy
from lightning_sink.compiled import ProgramSettings, RankSum, StepPrograms, build_step_programs
from lightning_sink.window import FlatAllReduce

from common import make_model, plain_torch_cuda_check, quiet_trainer

BATCH, WORLD = 32, 2
OPTIMIZERS = ("sgd", "adamw")
# name: (graph_mode, the route of the sum for one micro-step per call, micro_steps_per_call)
FITS = {
    "eager_sink": ("eager", None, None),
    "compile_eager_sum": ("compile", "eager", 1),
    "compile_traced_sum": ("compile", "traced", 1),
    "compile_default": ("compile", None, None),
}


class DDPHandLoop:
    """The plain DDP loop over this rank's pre-built batches; built at its first run (the process group exists by
    then); ``run()`` trains ``len(batches)`` micro-batches and returns the seconds per micro-step."""

    def __init__(self, optimizer: str, accumulation: int, batches: list) -> None:
        self.optimizer_name, self.accumulation, self.batches = optimizer, accumulation, batches
        self.model: DistributedDataParallel | None = None

    @plain_torch_cuda_check()
    def run(self) -> tuple[float, float]:
        """Seconds per micro-step: (wall clock, this process's CPU time)."""
        if self.model is None:
            self.model = DistributedDataParallel(make_model("tiny_mlp"))
            self.optimizer = make_optimizer(self.optimizer_name, self.model.parameters())
        model, optimizer, n = self.model, self.optimizer, self.accumulation
        start, cpu_start = time.perf_counter(), time.process_time()
        for i, (x, y) in enumerate(self.batches):
            with model.no_sync() if (i + 1) % n else contextlib.nullcontext():
                (F.cross_entropy(model(x), y) / n).backward()
            if (i + 1) % n == 0:
                optimizer.step()
                optimizer.zero_grad()
        steps = len(self.batches)
        return (time.perf_counter() - start) / steps, (time.process_time() - cpu_start) / steps


class Paired(pl.Callback):
    """Times each sink (one Lightning batch) and runs a timed hand loop after each, outside the timing."""

    def __init__(self, micro_steps: int, hand: DDPHandLoop) -> None:
        self.micro_steps, self.hand = micro_steps, hand
        self.lightning: list[tuple[float, float]] = []  # per sink: (wall, CPU) seconds per micro-step
        self.paired_hand: list[tuple[float, float]] = []
        self._start = (0.0, 0.0)

    def on_train_batch_start(self, *args: Any) -> None:
        self._start = (time.perf_counter(), time.process_time())

    def on_train_batch_end(self, *args: Any) -> None:
        wall, cpu = time.perf_counter() - self._start[0], time.process_time() - self._start[1]
        self.lightning.append((wall / self.micro_steps, cpu / self.micro_steps))
        self.paired_hand.append(self.hand.run())


def fit(name: str, optimizer: str, accumulation: int, sink: int, repeats: int, data: TensorDataset, hand: DDPHandLoop):
    graph_mode, route, micro_steps_per_call = FITS[name]
    compiled_choice.DDP_SUM_ROUTE = route or "eager"
    paired = Paired(sink, hand)
    report = CompileReport()
    rank_zero_logger = logging.getLogger("lightning.pytorch.utilities.rank_zero")
    rank_zero_logger.addHandler(report)
    rank_zero_logger.setLevel(logging.INFO)  # (Lightning's other lines are silenced in main)
    strategy = SinkDDPStrategy(
        accumulation_steps=accumulation,
        sink_size=sink,
        graph_mode=graph_mode,
        micro_steps_per_call=micro_steps_per_call,
        process_group_backend="gloo",
    )
    try:
        trainer = quiet_trainer(strategy=strategy, devices=WORLD, max_epochs=1 + repeats, callbacks=[paired])
        trainer.fit(Classifier(optimizer), DataLoader(data, batch_size=BATCH, shuffle=False))
    finally:
        rank_zero_logger.removeHandler(report)
    compile_seconds = None
    if graph_mode == "compile" and trainer.global_rank == 0:
        lines = [line for line in report.lines if "compiled whole" in line]
        if len(lines) != 1:
            raise RuntimeError(f"the fit did not report its compiled programs (fallback?): {report.lines}")
        compile_seconds = float(re.findall(r"in ([0-9.]+) s\b", lines[0])[0])
    return paired, compile_seconds


def measure(optimizer: str, accumulation: int, sink: int, repeats: int, data: TensorDataset) -> dict[str, Any]:
    rank = int(os.environ.get("LOCAL_RANK", "0"))
    x, y = data.tensors
    batches = [(x[i : i + BATCH], y[i : i + BATCH]) for i in range(rank * BATCH, len(x), WORLD * BATCH)][:sink]
    hand = DDPHandLoop(optimizer, accumulation, batches)
    figures: dict[str, Any] = {}
    runs = {}
    for name in FITS:
        paired, compile_seconds = fit(name, optimizer, accumulation, sink, repeats, data, hand)
        runs[name] = (paired.lightning[1:], paired.paired_hand[1:])
        if compile_seconds is not None:
            figures[f"{name}_compile_seconds"] = compile_seconds
    for clock, index in (("", 0), ("cpu_", 1)):
        hand_all = [pair[index] for _, paired_hand in runs.values() for pair in paired_hand]
        figures[f"hand_loop_{clock}us_per_step"] = round(1e6 * statistics.median(hand_all), 1)
        medians = {}
        for name, (lightning, paired_hand) in runs.items():
            ours, hands = [pair[index] for pair in lightning], [pair[index] for pair in paired_hand]
            medians[name] = statistics.median(ours)
            figures[f"{name}_{clock}us_per_step"] = round(1e6 * medians[name], 1)
            figures[f"{name}_{clock}vs_hand_loop"] = spread([h / s for h, s in zip(hands, ours)])
        for name in ("compile_eager_sum", "compile_traced_sum", "compile_default"):
            figures[f"{name}_{clock}vs_eager_sink"] = round(medians["eager_sink"] / medians[name], 3)
        figures[f"default_{clock}vs_one_per_call"] = round(medians["compile_eager_sum"] / medians["compile_default"], 3)
        figures[f"traced_sum_{clock}vs_eager_sum"] = round(
            medians["compile_eager_sum"] / medians["compile_traced_sum"], 3
        )
    return figures


def route_programs(route: str, optimizer: str, batch: Any) -> StepPrograms:
    """The compiled programs (Inductor) of a fresh model with the window's sum across the processes by ``route``."""
    module = Classifier(optimizer)
    if route == "traced":
        rank_sum = RankSum(WORLD, group=dist.group.WORLD)
    else:
        rank_sum = RankSum(WORLD, all_reduce=FlatAllReduce.sum_flat)
    programs = build_step_programs(
        module, make_optimizer(optimizer, module.parameters()), batch, ProgramSettings(rank_sum=rank_sum)
    )
    if not isinstance(programs, StepPrograms):
        raise RuntimeError(f"the {route} route's programs were not built: {programs.reason}")
    return programs


def measure_routes(optimizer: str, samples: int, data: TensorDataset) -> dict[str, Any]:
    """The update program alone, by each route, alternating call by call in the same two processes: before each
    timed call a barrier (untimed) starts both ranks together; the call's wall clock includes its all-reduce."""
    x, y = data.tensors
    rank = dist.get_rank()
    batch = (x[rank * BATCH : (rank + 1) * BATCH], y[rank * BATCH : (rank + 1) * BATCH])
    routes = ("eager", "traced")
    programs = {route: route_programs(route, optimizer, batch) for route in routes}
    seconds: dict[str, list[float]] = {route: [] for route in routes}
    for sample in range(samples + 5):  # the first 5 of each warm up
        for route in routes if sample % 2 else routes[::-1]:
            dist.barrier()
            start = time.perf_counter()
            programs[route].update(batch)
            if sample >= 5:
                seconds[route].append(time.perf_counter() - start)
    block = max(1, samples // 10)  # ratios per block of consecutive calls: their spread
    ratios = [
        statistics.median(seconds["eager"][i : i + block]) / statistics.median(seconds["traced"][i : i + block])
        for i in range(0, samples - block + 1, block)
    ]
    return {
        "eager_sum_update_us": round(1e6 * statistics.median(seconds["eager"]), 1),
        "traced_sum_update_us": round(1e6 * statistics.median(seconds["traced"]), 1),
        "traced_sum_vs_eager_sum": spread(ratios),
        "eager_sum_compile_seconds": round(sum(programs["eager"].compile_seconds.values()), 1),
        "traced_sum_compile_seconds": round(sum(programs["traced"].compile_seconds.values()), 1),
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=5, help="timed sinks per fit")
    parser.add_argument("--sink", type=int, default=200, help="micro-batches per sink (per rank)")
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads per process")
    parser.add_argument("--optimizers", nargs="+", choices=OPTIMIZERS, default=["adamw"])
    parser.add_argument("--accumulation", nargs="+", type=int, default=[1, 4])
    parser.add_argument("--update-samples", type=int, default=300, help="timed update calls per route")
    args = parser.parse_args(argv)
    for name in ("repeats", "sink", "threads", "update_samples"):
        if getattr(args, name) < 1:
            parser.error(f"--{name} must be >= 1; got {getattr(args, name)}")
    if any(n < 1 or args.sink % n for n in args.accumulation):
        parser.error(f"--accumulation values must be >= 1 and divide --sink={args.sink}; got {args.accumulation}")
    torch.set_num_threads(args.threads)
    warnings.filterwarnings("ignore")
    logging.getLogger("lightning.pytorch").setLevel(logging.WARNING)
    generator = torch.Generator().manual_seed(0)
    samples = WORLD * BATCH * args.sink  # one data pass: one sink per rank
    data = TensorDataset(
        torch.randn(samples, 64, generator=generator), torch.randint(0, 10, (samples,), generator=generator)
    )
    result: dict[str, Any] = {
        "benchmark": "compiled_ddp",
        "machine": f"{platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}, CPU, gloo,"
        f" {WORLD} processes x {args.threads} thread(s)",
        "model": "tiny_mlp 64-64-10",
        "batch_per_rank": BATCH,
        "sink_size": args.sink,
        "repeats": args.repeats,
    }
    for optimizer in args.optimizers:
        for accumulation in args.accumulation:
            figures = measure(optimizer, accumulation, args.sink, args.repeats, data)
            name = f"tiny_mlp_{optimizer}_acc{accumulation}"
            result[name] = figures
            if dist.get_rank() == 0:
                print(json.dumps({name: figures}), file=sys.stderr)
    for optimizer in args.optimizers:
        figures = measure_routes(optimizer, args.update_samples, data)
        result[f"update_program_{optimizer}"] = figures
        if dist.get_rank() == 0:
            print(json.dumps({f"update_program_{optimizer}": figures}), file=sys.stderr)
    if dist.get_rank() == 0:
        print(json.dumps(result))


if __name__ == "__main__":
    main()
