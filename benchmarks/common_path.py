"""Common path: gradient accumulation without sinking, against stock Lightning and a hand-written loop.

    python benchmarks/common_path.py [--repeats 5] [--steps 1000] [--warmup 100] [--sink-size 500] [--threads 1]
                                     [--models tiny_mlp lenet5] [--configs NAME ...] [--device cpu|cuda]
    python benchmarks/common_path.py --mnist [--repeats 3] [--epochs 10] [--max-train-samples M] [--data-dir DIR]
                                     [--device cpu|cuda]
    python benchmarks/common_path.py --profile sink [--model tiny_mlp] [--steps 4000] [--top 30]

Default mode: time per micro-batch, one process, of (a) a hand-written accumulation loop, (b) stock Lightning with
``accumulate_grad_batches=N``, (c) ``SinkStrategy(accumulation_steps=N)`` (no sinking, one Lightning batch per
micro-batch) and (d) ``SinkStrategy(accumulation_steps=N, sink_size=K)``; (b)-(d) with a quiet Trainer (no logger,
no progress bar) and again with Lightning's defaults (TensorBoard logger, progress bar, the module logging its loss
with ``prog_bar=True``); and (d) with ``prefetch_depth=2`` (a thread reads ahead; by default, for these in-memory
loaders, the training thread reads, on the CPU and on CUDA). Models: a tiny MLP 64-64-10 and LeNet-5 on 1x32x32,
batch 32, N=4, SGD with momentum 0.9, all reading the same shuffled ``DataLoader`` over in-memory tensors. With
``--device cuda`` every configuration trains on the GPU; the hand-written loop copies each batch there as it comes.
``--configs`` runs only the configurations named (and the ratios between them): with fewer, the runs a ratio
compares are closer in time, which on a shared machine narrows its spread.
Every run first trains ``--warmup`` micro-batches untimed (sinking runs: their first sink), then ``--steps`` timed
ones (``--warmup`` and ``--sink-size`` are cut to at most ``--steps``, all to whole windows of N). Configurations
alternate (the order rotates every repeat); figures are medians over the repeats, and every ratio is also given per
repeat (configurations of one repeat ran minutes apart at most) as median, min, max and interquartile range. A
ratio is the baseline's time over the configuration's: above 1.0 the configuration is faster.

``--mnist``: the end-to-end recipe of ``examples/mnist_lenet_accumulation.py`` (LeNet-5, MNIST at 32x32, batch 32,
N=4, shuffled, 10 epochs), ``Trainer.fit`` time of its ``SinkStrategy`` trainer against its stock Lightning
trainer, alternating. ``--profile CONFIG``: one run of a Lightning configuration under cProfile (the timed part
only), the functions that take the most time, in microseconds per micro-batch.

The last line printed is one JSON object.
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import json
import logging
import os
import platform
import pstats
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import lightning.pytorch as pl

from lightning_sink import SinkStrategy

from common import (
    MODELS,
    NetClassifier,
    StepTimer,
    default_trainer,
    make_loader,
    make_model,
    plain_torch_cuda_check,
    quiet_trainer,
    synchronize,
)

BATCH, ACCUMULATION = 32, 4
LIGHTNING_CONFIGS = {  # name: (what accumulates: Lightning, the sink strategy, or it with sinking; Trainer defaults)
    "stock_lightning": ("stock", False),
    "sink": ("sink", False),
    "sink_sinking": ("sinking", False),
    "sink_sinking_prefetch": ("sinking_prefetch", False),  # prefetch_depth=2: a thread reads the loader ahead
    "sink_sinking_compile": ("sinking_compile", False),  # graph_mode="compile": the whole-step programs
    "sink_sinking_compile_m4": ("sinking_compile_m4", False),  # and micro_steps_per_call=4
    "stock_lightning_defaults": ("stock", True),
    "sink_defaults": ("sink", True),
    "sink_sinking_defaults": ("sinking", True),
}
CONFIGS = ("hand_written", *LIGHTNING_CONFIGS)
DEFAULT_CONFIGS = tuple(name for name in CONFIGS if "compile" not in name)  # (compiling takes a minute or more)
RATIOS = {  # name: (configuration, baseline)
    "sink_vs_stock_lightning": ("sink", "stock_lightning"),
    "sink_defaults_vs_stock_lightning_defaults": ("sink_defaults", "stock_lightning_defaults"),
    "sink_sinking_vs_hand_written": ("sink_sinking", "hand_written"),
    "sink_sinking_prefetch_vs_hand_written": ("sink_sinking_prefetch", "hand_written"),
    "sink_sinking_vs_stock_lightning": ("sink_sinking", "stock_lightning"),
    "sink_sinking_defaults_vs_stock_lightning_defaults": ("sink_sinking_defaults", "stock_lightning_defaults"),
    "stock_lightning_vs_hand_written": ("stock_lightning", "hand_written"),
    "sink_vs_hand_written": ("sink", "hand_written"),
    "sink_sinking_compile_vs_hand_written": ("sink_sinking_compile", "hand_written"),
    "sink_sinking_compile_m4_vs_hand_written": ("sink_sinking_compile_m4", "hand_written"),
}


# ---------------------------------------------------------------------------------------------- one run
@plain_torch_cuda_check()
def hand_written(
    model_name: str, warmup: int, steps: int, device: torch.device, on_timed_start: Callable[[], Any] | None = None
) -> float:
    """Seconds per micro-batch of the loop a user writes: loss / N backward, a step and zero_grad every N.
    ``on_timed_start`` is called as the first timed micro-batch starts (``instruction_counts.py`` counts from there)."""
    model, loader = make_model(model_name).to(device), make_loader(model_name, BATCH)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    done, start = 0, time.perf_counter()
    while done < warmup + steps:
        for x, y in loader:
            if done == warmup:
                synchronize(device)
                if on_timed_start is not None:
                    on_timed_start()
                start = time.perf_counter()
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            (F.cross_entropy(model(x), y) / ACCUMULATION).backward()
            done += 1
            if done % ACCUMULATION == 0:
                optimizer.step()
                optimizer.zero_grad()
            if done == warmup + steps:
                break
    synchronize(device)
    return (time.perf_counter() - start) / steps


@contextlib.contextmanager
def _silenced() -> Iterator[None]:
    """The progress bar's and Lightning's messages would interleave with the results."""
    with open(os.devnull, "w") as devnull, contextlib.redirect_stdout(devnull), contextlib.redirect_stderr(devnull):
        yield


def lightning(
    config: str,
    model_name: str,
    warmup: int,
    steps: int,
    sink_size: int,
    device: torch.device,
    timer: StepTimer | None = None,
) -> float:
    """Seconds per micro-batch of one Lightning configuration (timed from the first window after ``warmup``;
    with sinking, from the second sink)."""
    kind, defaults = LIGHTNING_CONFIGS[config]
    warmup = sink_size if kind.startswith("sinking") else warmup
    if kind == "stock":
        strategy, accumulate = "auto", ACCUMULATION
    else:
        sinking = {"sink_size": sink_size} if kind.startswith("sinking") else {}
        if kind == "sinking_prefetch":
            sinking["prefetch_depth"] = 2
        if kind.startswith("sinking_compile"):
            sinking["graph_mode"] = "compile"
            sinking["micro_steps_per_call"] = 4 if kind.endswith("_m4") else 1
        strategy, accumulate = SinkStrategy(accumulation_steps=ACCUMULATION, **sinking), 1
    timer = timer or StepTimer(warmup_steps=warmup // ACCUMULATION)
    settings = {
        "strategy": strategy,
        "accumulate_grad_batches": accumulate,
        "accelerator": "gpu" if device.type == "cuda" else "cpu",
        "devices": 1,
        "callbacks": [timer],
        "max_steps": (warmup + steps) // ACCUMULATION,
        "max_epochs": -1,
    }
    with tempfile.TemporaryDirectory() as root, _silenced():
        trainer = default_trainer(root, **settings) if defaults else quiet_trainer(**settings)
        trainer.fit(NetClassifier(make_model(model_name), log_loss=defaults), make_loader(model_name, BATCH))
    return timer.seconds / (timer.steps * ACCUMULATION)


def run(config: str, model_name: str, warmup: int, steps: int, sink_size: int, device: torch.device) -> float:
    if config == "hand_written":
        return hand_written(model_name, warmup, steps, device)
    return lightning(config, model_name, warmup, steps, sink_size, device)


# ---------------------------------------------------------------------------------------------- statistics
def spread(values: list[float]) -> dict[str, Any]:
    """Median, min, max and interquartile range of per-repeat ratios, rounded for the report."""
    quartiles = statistics.quantiles(values, n=4, method="inclusive") if len(values) > 1 else [values[0]] * 3
    return {
        "median": round(statistics.median(values), 3),
        "min": round(min(values), 3),
        "max": round(max(values), 3),
        "iqr": [round(quartiles[0], 3), round(quartiles[2], 3)],
    }


def rotations(names: tuple[str, ...], repeats: int) -> Iterator[tuple[str, ...]]:
    """The configurations in a new order each repeat, so none always runs first or after the same neighbour."""
    for repeat in range(repeats):
        shift = repeat % len(names)
        order = names[shift:] + names[:shift]
        yield order if repeat % 2 == 0 else order[::-1]


def sizes(args: argparse.Namespace) -> tuple[int, int, int]:
    """(timed micro-batches, warm-up, sink size) in whole windows; warm-up and sink at most the timed part."""

    def windows(count: int) -> int:
        return max(ACCUMULATION, count - count % ACCUMULATION)

    steps = windows(args.steps)
    return steps, windows(min(args.warmup, steps)), windows(min(args.sink_size, steps))


def machine(args: argparse.Namespace) -> str:
    gpu = f", {torch.cuda.get_device_name(args.device)}" if args.device.type == "cuda" else ", CPU only"
    return (
        f"{platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}, {args.threads} intra-op"
        f" thread(s){gpu}"
    )


# ---------------------------------------------------------------------------------------------- modes
def micro_batches(args: argparse.Namespace) -> dict[str, Any]:
    steps, warmup, sink = sizes(args)
    result: dict[str, Any] = {
        "benchmark": "common_path",
        "machine": machine(args),
        "load_average_at_start": os.getloadavg(),
        "batch": BATCH,
        "accumulation_steps": ACCUMULATION,
        "sink_size": sink,
        "warmup_micro_batches": warmup,
        "timed_micro_batches": steps,
        "repeats": args.repeats,
    }
    configs = tuple(dict.fromkeys(args.configs))  # each once, in the order given
    seconds = {model: {config: [] for config in configs} for model in args.models}
    for repeat, order in enumerate(rotations(configs, args.repeats), 1):
        for model in args.models:
            for config in order:
                seconds[model][config].append(run(config, model, warmup, steps, sink, args.device))
        print(f"repeat {repeat}/{args.repeats} done", file=sys.stderr, flush=True)
    for model in args.models:
        times = seconds[model]
        result[model] = {
            "ms_per_micro_batch": {config: round(1000 * statistics.median(times[config]), 4) for config in configs},
            "ratios": {
                name: spread([b / c for c, b in zip(times[config], times[baseline])])
                for name, (config, baseline) in RATIOS.items()
                if config in times and baseline in times
            },
        }
    result["load_average_at_end"] = os.getloadavg()
    return result


def mnist(args: argparse.Namespace) -> dict[str, Any]:
    """``Trainer.fit`` seconds of the example's recipe, its sink trainer against its stock one, alternating."""
    import mnist_lenet_accumulation as recipe  # examples/ is on the path (common.py)

    from digits import DigitsDataModule
    from lenet import LeNet5Classifier

    argv = ["--epochs", str(args.epochs), "--accelerator", "gpu" if args.device.type == "cuda" else "cpu"]
    argv += ["--data-dir", args.data_dir] if args.data_dir else []
    argv += ["--max-train-samples", str(args.max_train_samples)] if args.max_train_samples else []
    recipe_args = recipe.parse_args(argv)
    data = DigitsDataModule(
        recipe_args.data_dir,
        batch_size=recipe_args.batch_size,
        seed=recipe_args.seed,
        max_train_samples=recipe_args.max_train_samples,
        source="mnist",
    )
    data.setup()
    load_at_start = os.getloadavg()

    def fit_seconds(stock: bool) -> tuple[float, int]:
        pl.seed_everything(recipe_args.seed, verbose=False)  # as the example: same weights and data order
        model = LeNet5Classifier(lr=recipe_args.lr, momentum=recipe_args.momentum)
        trainer = recipe.trainer_for(recipe_args, stock)
        with _silenced():
            started = time.perf_counter()
            trainer.fit(model, datamodule=data)
            return time.perf_counter() - started, trainer.global_step

    names = ("stock_lightning", "lightning_sink")
    seconds: dict[str, list[float]] = {name: [] for name in names}
    updates: dict[str, int] = {}
    for order in rotations(names, args.repeats):
        for name in order:
            elapsed, updates[name] = fit_seconds(stock=name == "stock_lightning")
            seconds[name].append(elapsed)
    if updates["stock_lightning"] != updates["lightning_sink"]:
        raise RuntimeError(f"the two trainers made different numbers of updates: {updates}")
    return {
        "benchmark": "common_path_mnist",
        "machine": machine(args),
        "load_average_at_start": load_at_start,
        "load_average_at_end": os.getloadavg(),
        "recipe": f"examples/mnist_lenet_accumulation.py: LeNet-5, batch {recipe_args.batch_size}, N="
        f"{recipe_args.accumulation_steps}, {recipe_args.epochs} epochs, {len(data.train_set)} samples",
        "updates": updates["stock_lightning"],
        "repeats": args.repeats,
        "fit_seconds": {name: [round(value, 2) for value in values] for name, values in seconds.items()},
        "fit_seconds_median": {name: round(statistics.median(values), 2) for name, values in seconds.items()},
        "sink_vs_stock_lightning": spread(
            [s / k for s, k in zip(seconds["stock_lightning"], seconds["lightning_sink"])]
        ),
    }


class _ProfilingTimer(StepTimer):
    """Profiles exactly the part ``StepTimer`` times."""

    def __init__(self, warmup_steps: int, profile: cProfile.Profile) -> None:
        super().__init__(warmup_steps)
        self.profile = profile

    def on_train_batch_start(self, trainer, module, batch, batch_idx):
        started = self.start is not None
        super().on_train_batch_start(trainer, module, batch, batch_idx)
        if not started and self.start is not None:
            self.profile.enable()

    def on_train_end(self, trainer, module):
        self.profile.disable()
        super().on_train_end(trainer, module)


def profile(args: argparse.Namespace) -> dict[str, Any]:
    """The functions taking the most own time (tottime) and in all (cumtime), microseconds per micro-batch."""
    steps, warmup, sink = sizes(args)
    profiler = cProfile.Profile()
    first_timed = sink if LIGHTNING_CONFIGS[args.profile][0].startswith("sinking") else warmup
    timer = _ProfilingTimer(first_timed // ACCUMULATION, profiler)
    per_micro = lightning(args.profile, args.model, warmup, steps, sink, args.device, timer=timer)
    micro = timer.steps * ACCUMULATION
    stats = pstats.Stats(profiler).stats  # {(file, line, name): (primitive calls, calls, tottime, cumtime, callers)}

    def where(key: tuple[str, int, str]) -> str:
        file, line, name = key
        parts = Path(file).parts
        short = (
            "/".join(parts[parts.index("site-packages") + 1 :]) if "site-packages" in parts else "/".join(parts[-2:])
        )
        return f"{short}:{line}({name})"

    def top(column: int) -> list[dict[str, Any]]:
        ranked = sorted(stats.items(), key=lambda item: item[1][column], reverse=True)[: args.top]
        return [
            {
                "function": where(key),
                "calls_per_micro_batch": round(calls / micro, 2),
                "tottime_us": round(1e6 * tottime / micro, 1),
                "cumtime_us": round(1e6 * cumtime / micro, 1),
            }
            for key, (_, calls, tottime, cumtime, _) in ranked
        ]

    by_own, by_total = top(2), top(3)
    for title, rows in (("own time (tottime)", by_own), ("cumulative time (cumtime)", by_total)):
        print(f"--- {args.profile}, {args.model}: top {args.top} by {title}, us per micro-batch ---")
        for row in rows:
            print(
                f"{row['tottime_us']:9.1f} {row['cumtime_us']:9.1f} {row['calls_per_micro_batch']:7.2f}  "
                f"{row['function']}"
            )
    return {
        "benchmark": "common_path_profile",
        "config": args.profile,
        "model": args.model,
        "profiled_us_per_micro_batch": round(1e6 * per_micro, 1),
        "micro_batches": micro,
        "top_tottime": by_own,
        "top_cumtime": by_total,
    }


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=None, help="default: 5 (3 with --mnist)")
    parser.add_argument("--steps", type=int, default=1000, help="timed micro-batches per run")
    parser.add_argument("--warmup", type=int, default=100, help="untimed micro-batches first (not sinking)")
    parser.add_argument("--sink-size", type=int, default=500, help="K for (d); its first sink is untimed")
    parser.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch intra-op threads (1: the overhead measured is single-threaded Python, and one"
        " thread is steadier on a shared machine)",
    )
    parser.add_argument("--mnist", action="store_true", help="the end-to-end MNIST recipe instead")
    parser.add_argument("--epochs", type=int, default=10, help="--mnist: epochs (the recipe: 10)")
    parser.add_argument("--max-train-samples", type=int, default=None, help="--mnist: train on a prefix")
    parser.add_argument("--data-dir", default=None, help="--mnist: folder holding MNIST/raw (see examples/digits.py)")
    parser.add_argument(
        "--profile", choices=tuple(LIGHTNING_CONFIGS), default=None, help="profile one Lightning configuration instead"
    )
    parser.add_argument("--models", nargs="+", choices=MODELS, default=list(MODELS), help="the models timed")
    parser.add_argument(
        "--configs",
        nargs="+",
        choices=CONFIGS,
        default=list(DEFAULT_CONFIGS),
        help="the configurations timed (default: all but the sink_sinking_compile ones)",
    )
    parser.add_argument("--model", choices=MODELS, default="tiny_mlp", help="--profile: the model")
    parser.add_argument("--top", type=int, default=30, help="--profile: functions listed")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="where every configuration trains")
    args = parser.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: torch sees no CUDA device here")
    args.device = torch.device("cuda", 0) if args.device == "cuda" else torch.device("cpu")
    if args.repeats is None:
        args.repeats = 3 if args.mnist else 5
    for name in ("repeats", "steps", "warmup", "sink_size", "threads", "epochs", "top"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1; got {getattr(args, name)}")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    logging.getLogger("lightning.pytorch").setLevel(logging.WARNING)  # "max_steps reached", tips
    mode: Callable[[argparse.Namespace], dict[str, Any]] = (
        profile if args.profile else mnist if args.mnist else micro_batches
    )
    print(json.dumps(mode(args)))


if __name__ == "__main__":
    main()
