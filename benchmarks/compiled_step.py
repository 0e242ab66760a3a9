"""Whole-step compiled programs (lightning_sink.compiled) against the eager hand-written loop, per micro-step.

    python benchmarks/compiled_step.py [--repeats 7] [--steps 400] [--device cpu|cuda]
        [--models tiny_mlp lenet5] [--optimizers sgd adamw] [--accumulation 1 4] [--unroll 8]

Each configuration (model x optimizer x accumulation) trains two copies of the same seeded model on the same
pre-built batches: (a) the plain PyTorch loop (``loss / N``, ``backward``, ``optimizer.step`` and ``zero_grad`` at
each window's end), (b) the accumulate/update programs, one compiled call per micro-batch, and (c) ``--unroll``
micro-steps (whole windows) unrolled into one compiled call (a third copy). On CUDA (b) is the
programs captured as CUDA graphs over the dataset staged on the GPU, each sink of ``--steps`` micro-batches one
index upload; (a) reads batches already on the GPU. The two alternate within each repeat (order swapped every
repeat) in one process; figures are medians over repeats, the ratio also per repeat (median, min, max). Compile
time is the programs' build (both compiled, plus capture on CUDA). ``params_max_rel_diff`` compares the two copies
after all repeats (same batches, same number of updates): a sanity check, not a timing. On CUDA the host
synchronizations inside one timed sink are counted with torch's sync debug mode. The last line is one JSON object.

Models: tiny MLP 64-64-10 and LeNet-5 (1x32x32), batch 32. SGD is ``lr=0.01, momentum=0.9``; AdamW ``lr=1e-3``.
CPU runs use one intra-op thread (``--threads``).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import TensorDataset

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from lightning_sink.compiled import ProgramSettings, StepPrograms, Unavailable, build_step_programs, program_compile
from lightning_sink.compiled.device_dataset import DeviceDataset, SinkIndices

from common import MODELS, make_model, plain_torch_cuda_check

BATCH = 32
OPTIMIZERS = ("sgd", "adamw")


class Classifier(nn.Module):
    """Cross-entropy on ``net``'s logits: the ``training_step`` the programs compile."""

    def __init__(self, net: nn.Module) -> None:
        super().__init__()
        self.net = net

    def training_step(self, batch: Any, batch_idx: Any) -> torch.Tensor:
        x, y = batch
        return F.cross_entropy(self.net(x), y)


def make_optimizer(name: str, params: Any) -> torch.optim.Optimizer:
    if name == "sgd":
        return torch.optim.SGD(params, lr=0.01, momentum=0.9)
    return torch.optim.AdamW(params, lr=1e-3)


def build_with_inductor_options(
    model_name: str,
    optimizer_name: str,
    example: Any,
    calls: int,
    options: Callable[[torch.device], dict[str, Any] | None] | None = None,
) -> StepPrograms:
    """A seeded model and optimizer's programs (``calls`` micro-steps per call, windows of 1), built with
    ``options`` in place of the library's ``inductor_options`` for this build only (None: the library's own)."""
    module = Classifier(make_model(model_name))
    optimizer = make_optimizer(optimizer_name, module.parameters())
    chosen = program_compile.inductor_options
    if options is not None:  # the build reads the module's function: swapped for this build only
        program_compile.inductor_options = options
    try:
        programs = build_step_programs(
            module, optimizer, example, ProgramSettings(backend="inductor", micro_steps_per_call=calls)
        )
    finally:
        program_compile.inductor_options = chosen
    if not isinstance(programs, StepPrograms):
        raise SystemExit(f"{model_name}/{optimizer_name}: the programs did not build: {programs.reason}")
    return programs


def make_data(model_name: str, batches: int) -> TensorDataset:
    shape = (64,) if model_name == "tiny_mlp" else (1, 32, 32)
    generator = torch.Generator().manual_seed(0)
    samples = BATCH * batches
    return TensorDataset(
        torch.randn(samples, *shape, generator=generator), torch.randint(0, 10, (samples,), generator=generator)
    )


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def spread(values: list[float]) -> dict[str, float]:
    return {
        "median": round(statistics.median(values), 3),
        "min": round(min(values), 3),
        "max": round(max(values), 3),
    }


class Configuration:
    """One model x optimizer x accumulation: both copies, their batches, and the compiled programs."""

    def __init__(
        self, model_name: str, optimizer: str, accumulation: int, steps: int, device: torch.device, unroll: int
    ) -> None:
        self.name = f"{model_name}_{optimizer}_acc{accumulation}"
        self.accumulation, self.steps, self.device, self.unroll = accumulation, steps, device, unroll
        dataset = make_data(model_name, steps)
        self.batches = [
            (x.to(device), y.to(device))
            for x, y in zip(dataset.tensors[0].split(BATCH), dataset.tensors[1].split(BATCH))
        ]
        self.eager = Classifier(make_model(model_name)).to(device)
        self.eager_optimizer = make_optimizer(optimizer, self.eager.parameters())
        start = time.perf_counter()
        self.compiled, self.programs, self.sink = self.build(model_name, optimizer, dataset, {})
        self.compile_seconds = time.perf_counter() - start
        self.compile_parts = {name: round(seconds, 2) for name, seconds in self.programs.compile_seconds.items()}
        if unroll > 1:  # a third copy trains through the unrolled program (each copy as many micro-steps)
            start = time.perf_counter()
            several = {"micro_steps_per_call": unroll, "accumulation_steps": accumulation}
            self.unrolled, self.unrolled_programs, self.unrolled_sink = self.build(
                model_name, optimizer, dataset, several
            )
            self.unrolled_compile_seconds = time.perf_counter() - start
        self.sink_rows = [list(range(i * BATCH, (i + 1) * BATCH)) for i in range(steps)]  # a sampler's draw

    def build(self, model_name: str, optimizer: str, dataset: TensorDataset, several: dict) -> tuple:
        """A seeded copy of the model (the same start as the eager one) and its compiled programs."""
        model = Classifier(make_model(model_name)).to(self.device)
        model_optimizer = make_optimizer(optimizer, model.parameters())
        sink = None
        if self.device.type == "cuda":
            staged = DeviceDataset.stage(dataset, self.device, budget_bytes=1 << 30)
            assert not isinstance(staged, Unavailable), staged.reason
            sink = SinkIndices(self.steps, BATCH, self.device)
            programs = build_step_programs(
                model, model_optimizer, None, ProgramSettings(cuda_graph=True, data=(staged, sink), **several)
            )
        else:
            programs = build_step_programs(model, model_optimizer, self.batches[0], ProgramSettings(**several))
        if isinstance(programs, Unavailable):
            raise SystemExit(f"{self.name}: no compiled programs: {programs.reason}")
        return model, programs, sink

    @plain_torch_cuda_check()
    def run_eager(self) -> float:
        model, optimizer, n = self.eager, self.eager_optimizer, self.accumulation
        synchronize(self.device)
        start = time.perf_counter()
        for i, (x, y) in enumerate(self.batches):
            (F.cross_entropy(model.net(x), y) / n).backward()
            if (i + 1) % n == 0:
                optimizer.step()
                optimizer.zero_grad()
        synchronize(self.device)
        return (time.perf_counter() - start) / len(self.batches)

    def run_compiled(self, count_syncs: bool = False) -> tuple[float, int | None]:
        programs, n = self.programs, self.accumulation
        syncs = None
        synchronize(self.device)
        start = time.perf_counter()
        if self.sink is not None:  # CUDA: one upload of the sink's indices, then the captured programs
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                if count_syncs:
                    torch.cuda.set_sync_debug_mode("warn")
                try:
                    self.sink.load(self.sink_rows)
                    for i in range(self.steps):
                        if (i + 1) % n == 0:
                            programs.update()
                        else:
                            programs.accumulate()
                finally:
                    torch.cuda.set_sync_debug_mode("default")
            if count_syncs:
                syncs = sum("synchroniz" in str(w.message) for w in caught)
        else:
            for i, batch in enumerate(self.batches):
                if (i + 1) % n == 0:
                    programs.update(batch)
                else:
                    programs.accumulate(batch)
        synchronize(self.device)
        return (time.perf_counter() - start) / self.steps, syncs

    def run_several(self) -> float:
        """The same micro-batches, ``unroll`` of them (whole windows) per compiled call."""
        programs, unroll = self.unrolled_programs, self.unroll
        synchronize(self.device)
        start = time.perf_counter()
        if self.unrolled_sink is not None:
            self.unrolled_sink.load(self.sink_rows)
            for _ in range(self.steps // unroll):
                programs.run_several()
        else:
            for first in range(0, self.steps, unroll):
                programs.run_several(self.batches[first : first + unroll])
        synchronize(self.device)
        return (time.perf_counter() - start) / self.steps

    def max_relative_difference(self, model: nn.Module) -> float:
        return max(
            ((a - b).abs().max() / b.abs().max().clamp(min=1e-12)).item()
            for a, b in zip(model.parameters(), self.eager.parameters())
        )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--steps", type=int, default=400, help="micro-batches per timed run (one sink on CUDA)")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    parser.add_argument("--models", nargs="+", choices=MODELS, default=list(MODELS))
    parser.add_argument("--optimizers", nargs="+", choices=OPTIMIZERS, default=list(OPTIMIZERS))
    parser.add_argument("--accumulation", nargs="+", type=int, default=[1, 4])
    parser.add_argument(
        "--unroll", type=int, default=8, help="also time this many micro-steps per compiled call (1: not timed)"
    )
    args = parser.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: torch sees no CUDA device here")
    for name in ("repeats", "steps", "threads"):
        if getattr(args, name) < 1:
            parser.error(f"--{name} must be >= 1; got {getattr(args, name)}")
    if any(n < 1 or args.steps % n for n in args.accumulation):
        parser.error(f"--accumulation values must be >= 1 and divide --steps={args.steps}; got {args.accumulation}")
    if args.unroll < 1 or args.steps % args.unroll or any(args.unroll % n for n in args.accumulation):
        parser.error(
            f"--unroll must be >= 1, divide --steps={args.steps} and be a multiple of every --accumulation value;"
            f" got {args.unroll}"
        )
    torch.set_num_threads(args.threads)
    device = torch.device("cuda", 0) if args.device == "cuda" else torch.device("cpu")
    machine = torch.cuda.get_device_name(0) if device.type == "cuda" else f"CPU, {args.threads} thread(s)"
    result: dict[str, Any] = {
        "benchmark": "compiled_step",
        "machine": f"{platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}, {machine}",
        "batch": BATCH,
        "steps_per_run": args.steps,
        "repeats": args.repeats,
    }
    pairs = [(m, o) for m in args.models for o in args.optimizers if m == "tiny_mlp" or o == "sgd"]
    for model_name, optimizer in pairs:
        for accumulation in args.accumulation:
            if model_name == "lenet5" and accumulation != args.accumulation[0]:
                continue  # LeNet-5 is the no-regression check: one accumulation suffices
            config = Configuration(model_name, optimizer, accumulation, args.steps, device, args.unroll)
            several = args.unroll > 1
            config.run_eager()  # one untimed run each: allocator and caches warm
            config.run_compiled()
            if several:
                config.run_several()
            eager, compiled, unrolled, syncs = [], [], [], None
            for repeat in range(args.repeats):
                runs = ["eager", "compiled"] + (["several"] if several else [])
                for run in runs if repeat % 2 == 0 else runs[::-1]:
                    if run == "eager":
                        eager.append(config.run_eager())
                    elif run == "several":
                        unrolled.append(config.run_several())
                    else:
                        seconds, counted = config.run_compiled(count_syncs=repeat == 0)
                        compiled.append(seconds)
                        syncs = counted if repeat == 0 else syncs
            figures = {
                "eager_us_per_step": round(1e6 * statistics.median(eager), 1),
                "compiled_us_per_step": round(1e6 * statistics.median(compiled), 1),
                "speedup_vs_eager": round(statistics.median(eager) / statistics.median(compiled), 3),
                "speedup_per_repeat": spread([e / c for e, c in zip(eager, compiled)]),
                **(
                    {
                        f"unrolled{args.unroll}_us_per_step": round(1e6 * statistics.median(unrolled), 1),
                        f"unrolled{args.unroll}_speedup_vs_eager": round(
                            statistics.median(eager) / statistics.median(unrolled), 3
                        ),
                        f"unrolled{args.unroll}_speedup_per_repeat": spread([e / u for e, u in zip(eager, unrolled)]),
                        f"unrolled{args.unroll}_compile_seconds": round(config.unrolled_compile_seconds, 1),
                        f"unrolled{args.unroll}_program_compile_seconds": round(
                            config.unrolled_programs.compile_seconds["several"], 1
                        ),
                        f"unrolled{args.unroll}_params_max_rel_diff": float(
                            f"{config.max_relative_difference(config.unrolled):.3g}"
                        ),
                    }
                    if several
                    else {}
                ),
                "compile_seconds": round(config.compile_seconds, 1),
                "compile_parts_seconds": config.compile_parts,
                "params_max_rel_diff": float(f"{config.max_relative_difference(config.compiled):.3g}"),
            }
            if syncs is not None:
                figures["host_syncs_in_one_sink"] = syncs
            result[config.name] = figures
            print(json.dumps({config.name: figures}), file=sys.stderr)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
