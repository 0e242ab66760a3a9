"""Sink throughput: training steps per second, one process, configurations alternating.

    python benchmarks/sink_throughput.py [--repeats 3] [--steps 1500] [--device auto|cpu|cuda] [--models lenet5]

Models: (a) a tiny MLP 64-64-10, batch 32; (b) LeNet-5 on 1x32x32, batch 32. Configurations: a hand-written
PyTorch loop (the anchor); stock Lightning, quiet (no logger, no progress bar) and with its defaults (TensorBoard
logger, progress bar, the module logging its loss with ``prog_bar=True``); ``SinkStrategy(sink_size=K)`` in eager
mode as it comes (on CPU it reads in the training thread), with a prefetch thread (``prefetch_depth=2``), with
``graph_mode="compile"``, and with the same defaults as stock; on CUDA also ``graph_mode="cuda_graph"`` (there the
default already prefetches). All read the same ``DataLoader`` over in-memory tensors with SGD. Each run trains
``--steps`` optimizer steps after a warm-up (sink runs: after the first sink, which includes compilation); figures
are medians of the repeats, and each ratio to the hand-written loop is also given per repeat (median, interquartile
range, min-max). The last line is one JSON object.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))


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

BATCH, SINK, WARMUP = 32, 500, 50
CPU_CONFIGS = (
    "hand_written",
    "stock_lightning",
    "sink_eager",
    "sink_eager_prefetch_thread",
    "sink_compile",
    "stock_lightning_defaults",
    "sink_eager_defaults",
)
CUDA_CONFIGS = CPU_CONFIGS + ("sink_cuda_graph",)
SINK_CONFIGS = {  # name: (SinkStrategy keyword arguments, Trainer defaults)
    "sink_eager": ({}, False),
    "sink_eager_prefetch_thread": ({"prefetch_depth": 2}, False),  # a background thread reads ahead
    "sink_compile": ({"graph_mode": "compile"}, False),
    "sink_cuda_graph": ({"graph_mode": "cuda_graph"}, False),
    "sink_eager_defaults": ({}, True),
}


@plain_torch_cuda_check()
def hand_written(model_name: str, steps: int, device: torch.device) -> float:
    model, loader = make_model(model_name).to(device), make_loader(model_name)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    done, start = 0, None
    while done < steps + WARMUP:
        for x, y in loader:
            if done == WARMUP:
                start = time.perf_counter()
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            optimizer.zero_grad()
            F.cross_entropy(model(x), y).backward()
            optimizer.step()
            done += 1
            if done == steps + WARMUP:
                break
    synchronize(device)
    return steps / (time.perf_counter() - start)


def lightning(model_name: str, steps: int, device: torch.device, strategy, defaults: bool) -> float:
    sink = strategy is not None
    timer = StepTimer(warmup_steps=SINK if sink else WARMUP)  # sinks are timed from the second sink on
    settings = dict(
        strategy=strategy or "auto",
        accelerator="gpu" if device.type == "cuda" else "cpu",
        devices=1,
        max_steps=steps + timer.warmup_steps,
        max_epochs=-1,
        callbacks=[timer],
    )
    with (
        tempfile.TemporaryDirectory() as root,
        open(os.devnull, "w") as quiet,
        contextlib.redirect_stdout(quiet),
        contextlib.redirect_stderr(quiet),
    ):  # the progress bar's output
        trainer = default_trainer(root, **settings) if defaults else quiet_trainer(**settings)
        trainer.fit(NetClassifier(make_model(model_name), log_loss=defaults), make_loader(model_name))
    return timer.steps / timer.seconds


def spread(ratios: list[float]) -> dict[str, object]:
    """Median, interquartile range and min-max of per-repeat ratios."""
    quartiles = statistics.quantiles(ratios, n=4, method="inclusive") if len(ratios) > 1 else [ratios[0]] * 3
    return {
        "median": round(statistics.median(ratios), 3),
        "iqr": [round(quartiles[0], 3), round(quartiles[2], 3)],
        "min": round(min(ratios), 3),
        "max": round(max(ratios), 3),
    }


def run(config: str, model_name: str, steps: int, device: torch.device) -> float:
    if config == "hand_written":
        return hand_written(model_name, steps, device)
    if config.startswith("stock_lightning"):
        return lightning(model_name, steps, device, None, defaults=config.endswith("defaults"))
    options, defaults = SINK_CONFIGS[config]
    return lightning(model_name, steps, device, SinkStrategy(sink_size=SINK, **options), defaults)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--steps", type=int, default=1500)
    parser.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    parser.add_argument("--models", nargs="+", choices=MODELS, default=list(MODELS))
    args = parser.parse_args()
    use_cuda = args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available())
    device = torch.device("cuda", 0) if use_cuda else torch.device("cpu")
    configs = CUDA_CONFIGS if use_cuda else CPU_CONFIGS
    torch.set_num_threads(min(2, os.cpu_count() or 1))
    machine = torch.cuda.get_device_name(0) if use_cuda else "CPU"
    result = {
        "benchmark": "sink_throughput",
        "machine": f"{platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}, {machine}",
        "batch": BATCH,
        "sink_size": SINK,
        "repeats": args.repeats,
    }
    for model_name in args.models:
        rates: dict[str, list[float]] = {config: [] for config in configs}
        for repeat in range(args.repeats):
            order = configs[repeat % len(configs) :] + configs[: repeat % len(configs)]
            for config in order:
                rates[config].append(run(config, model_name, args.steps, device))
        medians = {config: statistics.median(values) for config, values in rates.items()}
        sinks = [config for config in configs if config.startswith("sink")]
        result[model_name] = {
            **{f"{config}_ms_per_step": round(1000 / medians[config], 3) for config in configs},
            **{f"{sink}_vs_hand_written": round(medians[sink] / medians["hand_written"], 3) for sink in sinks},
            **{
                f"{sink}_vs_stock_lightning": round(medians[sink] / medians["stock_lightning"], 3)
                for sink in sinks
                if not sink.endswith("defaults")
            },
            "sink_eager_defaults_vs_stock_lightning_defaults": round(
                medians["sink_eager_defaults"] / medians["stock_lightning_defaults"], 3
            ),
            # the same ratios within each repeat (configurations minutes apart at most): how far to trust them
            "per_repeat_vs_hand_written": {
                sink: spread([own / hand for own, hand in zip(rates[sink], rates["hand_written"])]) for sink in sinks
            },
        }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
