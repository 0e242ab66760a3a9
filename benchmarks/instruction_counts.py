"""Instructions per micro-batch of the common path, counted by valgrind's callgrind: repeatable where wall time on
a shared machine is not.

    python benchmarks/instruction_counts.py [--models tiny_mlp lenet5] [--configs NAME ...] [--steps 16 48]
                                            [--warmup 40] [--sink-size 16]

The configurations are ``common_path.py``'s (a hand-written accumulation loop, stock Lightning with
``accumulate_grad_batches=4``, ``SinkStrategy(accumulation_steps=4)`` without and with sinking; quiet Trainers, one
thread, CPU; on request, ``--configs sink_sinking_compile sink_sinking_compile_m4``: sinking with
``graph_mode="compile"``, one and four micro-batches per compiled call). Each run is a process of its own under ``valgrind --tool=callgrind --instr-atstart=no``: nothing is
counted until the first timed micro-batch starts, and counting stops when the run returns (client requests from a
small C library built here with the system's C compiler and valgrind's ``callgrind.h``). Each configuration runs
twice, with S1 and S2 timed micro-batches; instructions per micro-batch are (I(S2) - I(S1)) / (S2 - S1), so what
a run does once (the first timed batch's extra work, the end of fit) cancels. With sinking, S1 and S2 are whole
sinks of ``--sink-size`` micro-batches and the first sink is the warm-up.

A count repeats to a few hundredths of a percent for the same build, inputs and environment (``PYTHONHASHSEED=0``,
one thread), whatever else the machine runs. It counts instructions, not time: a cache miss or a slow
``memcpy`` costs one instruction. Every configuration runs the same model on the same batches, so the arithmetic
kernels' instructions are the same in all; what differs is the Python, the dispatch and the data reads around them.
A ratio is the baseline's count over the configuration's: above 1.0 the configuration executes fewer instructions.
Under callgrind a run is 50-100 times slower than natively: the defaults take about 10 minutes (LeNet-5's
convolutions dominate).

The last line printed is one JSON object.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

BENCHMARKS = Path(__file__).resolve().parent
ROOT = BENCHMARKS.parent
CONFIGS = ("hand_written", "stock_lightning", "sink", "sink_sinking", "sink_sinking_compile", "sink_sinking_compile_m4")
MODELS = ("tiny_mlp", "lenet5")
RATIOS = {  # name: (configuration, baseline)
    "sink_vs_stock_lightning": ("sink", "stock_lightning"),
    "sink_vs_hand_written": ("sink", "hand_written"),
    "stock_lightning_vs_hand_written": ("stock_lightning", "hand_written"),
    "sink_sinking_vs_hand_written": ("sink_sinking", "hand_written"),
    "sink_sinking_compile_vs_hand_written": ("sink_sinking_compile", "hand_written"),
    "sink_sinking_compile_m4_vs_hand_written": ("sink_sinking_compile_m4", "hand_written"),
}
_CONTROL_SOURCE = """
#include <valgrind/callgrind.h>
void count_start(void) { CALLGRIND_ZERO_STATS; CALLGRIND_START_INSTRUMENTATION; }
void count_stop(void) { CALLGRIND_STOP_INSTRUMENTATION; CALLGRIND_DUMP_STATS_AT("counted"); }
"""


# ---------------------------------------------------------------------------------------------- one counted run
def counted_run(config: str, model: str, warmup: int, steps: int, sink_size: int, control_library: str) -> None:
    """Runs inside valgrind: one configuration, counting from the first timed micro-batch to the run's return."""
    sys.path.insert(0, str(BENCHMARKS))
    import common_path
    import torch

    from common import StepTimer

    control = ctypes.CDLL(control_library)
    torch.set_num_threads(1)
    device = torch.device("cpu")
    if config == "hand_written":
        common_path.hand_written(model, warmup, steps, device, on_timed_start=control.count_start)
    else:

        class CountingTimer(StepTimer):
            def on_train_batch_start(self, trainer, module, batch, batch_idx):
                started = self.start is not None
                super().on_train_batch_start(trainer, module, batch, batch_idx)
                if not started and self.start is not None:
                    control.count_start()

        first_timed = sink_size if config.startswith("sink_sinking") else warmup
        timer = CountingTimer(warmup_steps=first_timed // common_path.ACCUMULATION)
        common_path.lightning(config, model, warmup, steps, sink_size, device, timer=timer)
    control.count_stop()


# ---------------------------------------------------------------------------------------------- the driver
def build_control_library(folder: Path) -> str:
    source, library = folder / "count_control.c", folder / "libcount_control.so"
    source.write_text(_CONTROL_SOURCE)
    compiler = shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        sys.exit("instruction_counts.py: no C compiler (cc or gcc) to build the callgrind client requests")
    built = subprocess.run([compiler, "-O1", "-shared", "-fPIC", "-o", str(library), str(source)], capture_output=True)
    if built.returncode != 0:
        sys.exit(f"instruction_counts.py: cannot build the callgrind client requests ({built.stderr.decode().strip()})")
    return str(library)


def instructions(args: argparse.Namespace, config: str, model: str, steps: int, folder: Path, library: str) -> int:
    """Instructions counted in one run under callgrind (its dump's ``totals:`` line)."""
    out = folder / f"{model}.{config}.{steps}.out"
    command = [
        "valgrind",
        "--tool=callgrind",
        "--instr-atstart=no",
        f"--callgrind-out-file={out}",
        sys.executable,
        __file__,
        "--count-one",
        config,
        model,
        str(args.warmup),
        str(steps),
        str(args.sink_size),
        library,
    ]
    environment = {**os.environ, "PYTHONHASHSEED": "0", "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    ran = subprocess.run(command, env=environment, capture_output=True, text=True)
    dumps = sorted(folder.glob(f"{out.name}.*"))
    if ran.returncode != 0 or not dumps:
        sys.exit(f"instruction_counts.py: {config} on {model} failed under valgrind:\n{ran.stderr[-3000:]}")
    for line in dumps[-1].read_text().splitlines():
        if line.startswith("totals:"):
            return int(line.split()[1])
    sys.exit(f"instruction_counts.py: no totals line in {dumps[-1]}")


def measure(args: argparse.Namespace) -> dict[str, Any]:
    short, long = args.steps
    result: dict[str, Any] = {
        "benchmark": "instruction_counts",
        "machine": f"{platform.machine()}, valgrind callgrind, Python {platform.python_version()}, 1 thread, CPU",
        "accumulation_steps": 4,
        "warmup_micro_batches": args.warmup,
        "sink_size": args.sink_size,
        "timed_micro_batches": [short, long],
    }
    with tempfile.TemporaryDirectory() as directory:
        folder = Path(directory)
        library = build_control_library(folder)
        for model in args.models:
            per_micro_batch = {}
            for config in args.configs:
                counts = [instructions(args, config, model, steps, folder, library) for steps in (short, long)]
                per_micro_batch[config] = round((counts[1] - counts[0]) / (long - short))
                print(f"{model} {config}: {per_micro_batch[config]:,} instructions per micro-batch", file=sys.stderr)
            result[model] = {
                "instructions_per_micro_batch": per_micro_batch,
                "ratios": {
                    name: round(per_micro_batch[baseline] / per_micro_batch[config], 4)
                    for name, (config, baseline) in RATIOS.items()
                    if config in per_micro_batch and baseline in per_micro_batch
                },
            }
    return result


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", choices=MODELS, default=list(MODELS))
    parser.add_argument("--configs", nargs="+", choices=CONFIGS, default=list(CONFIGS[:4]))  # compile: on request
    parser.add_argument(
        "--steps", nargs=2, type=int, default=[16, 48], metavar=("S1", "S2"), help="timed micro-batches"
    )
    parser.add_argument("--warmup", type=int, default=40, help="untimed micro-batches first (not sinking)")
    parser.add_argument(
        "--sink-size", type=int, default=16, help="K with sinking (S1, S2 and the warm-up: whole sinks)"
    )
    parser.add_argument("--count-one", nargs=6, default=None, help=argparse.SUPPRESS)  # a run inside valgrind
    args = parser.parse_args(argv)
    if args.count_one is not None:
        return args
    short, long = args.steps
    multiple = max(4, args.sink_size) if "sink_sinking" in args.configs else 4
    if not 0 < short < long or short % multiple or long % multiple or args.warmup % 4 or args.sink_size % 4:
        parser.error(
            f"--steps {short} {long}: need 0 < S1 < S2, both multiples of {multiple} (whole windows of 4"
            f" micro-batches, and whole sinks with sink_sinking); --warmup and --sink-size multiples of 4"
        )
    if shutil.which("valgrind") is None:
        parser.error("valgrind is not installed (Debian: apt-get install valgrind)")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.count_one is not None:
        config, model, warmup, steps, sink_size, library = args.count_one
        counted_run(config, model, int(warmup), int(steps), int(sink_size), library)
        return
    print(json.dumps(measure(args)))


if __name__ == "__main__":
    main()
