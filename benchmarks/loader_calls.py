"""From a loader (a dataset that is not staged), the default's call as long as the sink against calls of 8.

    python benchmarks/loader_calls.py [--model tiny_mlp|lenet5] [--sink 500] [--rounds 3]

A map-style dataset that is not a ``TensorDataset`` (what most Lightning users train from: the library stages only
a ``TensorDataset``) is read by the loader path: each batch read and collated on the host, then handed to the
compiled programs. ``SinkStrategy(sink_size=K, graph_mode="compile")`` with its defaults stacks a sink's batches into
one call (``call_length.loader_call``) beside the calls of 8; with ``device_data_budget=0`` it runs the calls of 8
alone, as the default did before. The module is ``loop_sinking.py``'s, with its warm-up + cosine ``LambdaLR``
stepped every update; AdamW, batch 32, one thread. ``--rounds`` alternating pairs of fits in this process, each of
``1 + 4`` sinks, the first (the build) not counted; per fit the median of its steady sinks, in us a micro-step; the
ratio is per round (calls of 8 over the default: above 1.0 the default is faster). The last line is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import DataLoader, Dataset

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from loop_sinking import ScheduledClassifier, make_data

from lightning_sink import SinkStrategy

from common import SinkClock, quiet_trainer

CONFIGS = {"calls_of_8": {"device_data_budget": 0}, "default": {}}


class Samples(Dataset):
    """A map-style dataset that is not a ``TensorDataset``: read by the loader, never staged."""

    def __init__(self, data: Any) -> None:
        self.data = data

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, index: int) -> Any:
        return self.data[index]


def steady_us(model: str, sink: int, data: Samples, options: dict[str, Any]) -> float:
    """One fit of 5 sinks; the median of its last 4 sinks, in us a micro-step."""
    clock = SinkClock()
    strategy = SinkStrategy(sink_size=sink, graph_mode="compile", **options)
    trainer = quiet_trainer(accelerator="cpu", devices=1, strategy=strategy, max_epochs=5, callbacks=[clock])
    trainer.fit(ScheduledClassifier("adamw", model), DataLoader(data, batch_size=32))
    return 1e6 * statistics.median(clock.seconds[1:]) / sink


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=("tiny_mlp", "lenet5"), default="tiny_mlp")
    parser.add_argument("--sink", type=int, default=500)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(1)
    data = Samples(make_data(args.model, args.sink))
    figures: dict[str, list[float]] = {name: [] for name in CONFIGS}
    for _ in range(args.rounds):
        for name, options in CONFIGS.items():
            figures[name].append(steady_us(args.model, args.sink, data, options))
    ratios = [eight / default for eight, default in zip(figures["calls_of_8"], figures["default"])]
    result = {
        "benchmark": "loader_calls",
        "model": args.model,
        "sink_size": args.sink,
        "us_per_step": {name: [round(value, 1) for value in values] for name, values in figures.items()},
        "median_us_per_step": {name: round(statistics.median(values), 1) for name, values in figures.items()},
        "calls_of_8_over_default": {
            "median": round(statistics.median(ratios), 3),
            "min": round(min(ratios), 3),
            "max": round(max(ratios), 3),
        },
    }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
