"""The step programs on a CPU built with the library's Inductor settings (``inductor_options``: layout optimization
off, the C++ wrapper on) against the same programs built with Inductor's defaults, per micro-step.

    python benchmarks/inductor_options.py [--repeats 11] [--steps 400] [--models tiny_mlp lenet5]
                                          [--optimizers sgd adamw] [--calls 1 8]

Each configuration (model x optimizer x micro-steps per call M) builds two copies of the same seeded model and
optimizer, one with each setting, and trains both on the same pre-built batches (windows of 1: each micro-step an
update; with M > 1, M of them unrolled into one call). The two alternate within each repeat (order swapped every
repeat) in one process; figures are medians over repeats, the ratio (Inductor's defaults' time over the library's
settings': above 1.0 the library's are faster) also per repeat (median, min, max). ``build_seconds`` is each
build (both programs, and the unrolled one with M > 1) as it ran here: Inductor's on-disk cache may hold either
variant's graphs from an earlier run. Tiny MLP 64-64-10 and LeNet-5 (1x32x32), batch 32, one intra-op thread
(``--threads``). The last line is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
import warnings
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from compiled_step import BATCH, MODELS, OPTIMIZERS, build_with_inductor_options, make_data, spread

from lightning_sink.compiled import StepPrograms


def build(model_name: str, optimizer_name: str, example: Any, calls: int, library_settings: bool) -> StepPrograms:
    """The programs with the library's settings, or with Inductor's defaults."""
    defaults = None if library_settings else (lambda device: None)
    return build_with_inductor_options(model_name, optimizer_name, example, calls, defaults)


def run(programs: StepPrograms, batches: list[tuple[torch.Tensor, torch.Tensor]], calls: int) -> None:
    if calls == 1:
        for batch in batches:
            programs.update(batch)
        return
    for start in range(0, len(batches), calls):
        programs.run_several(batches[start : start + calls])


def measure(model_name: str, optimizer_name: str, calls: int, steps: int, repeats: int) -> dict[str, Any]:
    data = make_data(model_name, steps)
    batches = list(zip(data.tensors[0].split(BATCH), data.tensors[1].split(BATCH)))
    programs: dict[str, StepPrograms] = {}
    build_seconds: dict[str, float] = {}
    for name, library_settings in (("library", True), ("inductor_defaults", False)):
        started = time.perf_counter()
        programs[name] = build(model_name, optimizer_name, batches[0], calls, library_settings)
        build_seconds[name] = round(time.perf_counter() - started, 1)
    for variant in programs.values():
        run(variant, batches, calls)  # warm-up: first calls after the build
    times: dict[str, list[float]] = {name: [] for name in programs}
    for repeat in range(repeats):
        order = list(programs) if repeat % 2 == 0 else list(programs)[::-1]
        for name in order:
            started = time.perf_counter()
            run(programs[name], batches, calls)
            times[name].append((time.perf_counter() - started) / steps * 1e6)
    ratios = [default / library for library, default in zip(times["library"], times["inductor_defaults"])]
    return {
        "us_per_step": {name: round(statistics.median(values), 1) for name, values in times.items()},
        "defaults_over_library": spread(ratios),
        "build_seconds": build_seconds,
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=11)
    parser.add_argument("--steps", type=int, default=400, help="micro-batches per timed run (a multiple of each M)")
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    parser.add_argument("--models", nargs="+", choices=MODELS, default=list(MODELS))
    parser.add_argument("--optimizers", nargs="+", choices=OPTIMIZERS, default=list(OPTIMIZERS))
    parser.add_argument("--calls", nargs="+", type=int, default=[1, 8], help="micro-steps per compiled call")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    warnings.filterwarnings("ignore")
    result: dict[str, Any] = {
        "benchmark": "inductor_options",
        "machine": f"{platform.machine()}, {torch.get_num_threads()} thread(s), torch {torch.__version__}, CPU",
        "batch": BATCH,
        "steps": args.steps,
        "repeats": args.repeats,
    }
    for model_name in args.models:
        for optimizer_name in args.optimizers:
            for calls in args.calls:
                key = f"{model_name}_{optimizer_name}_m{calls}"
                result[key] = measure(model_name, optimizer_name, calls, args.steps, args.repeats)
                print(key, json.dumps(result[key]), flush=True)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
